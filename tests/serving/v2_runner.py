# SPDX-License-Identifier: Apache-2.0
"""vLLM's own Model Runner V2 serving the tiny Kimi K3 checkpoint on the CPU.

:class:`V2Runner` is vLLM's ``CPUModelRunner`` (a subclass of the V2
``GPUModelRunner``, patched by the series). It builds no model: its
``load_model`` is vLLM's, whose registry and loader build the class the
checkpoint's ``config.json`` names (``KimiK3ForConditionalGeneration``, or
the same class by K3.1's name), with the stand-ins below the model class of
:mod:`tests.serving.k3_standins` in place while it loads and runs. Everything
else is vLLM's: the PP hand-off declaration, Kimi K3's hybrid model state,
the sampler, the persistent receive buffers, the dummy and profile runs, the
KV cache spec, its allocation and binding, the input batch, block tables and
slot mappings, ``execute_model`` with the series' hand-over,
``sample_tokens``, the PP handler's token broadcast; with
``--speculative-config`` (the drafter layouts), vLLM's speculator, its
aux-layer set-up and relay across PP stages, the rejection sampler and the
drafts' broadcast.

What the class adds, for the tests only: each request's prompt (by which the
drafts are logged, ``tests/serving/eagle3.py``), the planted extra row of
``STAGE0_EXTRA_ROW``, stage 1's MoE backend of ``STAGE1_MOE_BACKEND`` (the
refused start-up), and a log line per rank naming the class vLLM built.
"""

from __future__ import annotations

import os

import torch

from tests.serving import eagle3
from tests.serving.k3_standins import SEED, install_kernels, serving_stand_ins
from tests.serving.worker import EXTRA_ROW_MARK, STAGE0_EXTRA_ROW, STAGE1_MOE_BACKEND
from tests.sppp_testbed import tiny_k3
from vllm.distributed.parallel_state import get_pp_group
from vllm.logger import init_logger
from vllm.sequence import IntermediateTensors
from vllm.v1.worker.cpu.model_runner import CPUModelRunner

# Under the "vllm" logger, whose handlers print in the servers.
logger = init_logger(f"vllm.{__name__}")


class V2Runner(CPUModelRunner):
    """vLLM's CPU model runner (Model Runner V2), as it serves the tiny K3
    checkpoint."""

    def __init__(self, vllm_config, device: torch.device) -> None:
        install_kernels()
        # The tiny K3 computes in float64; the runner's buffers (the PP
        # receive buffers among them) take the served model's dtype.
        vllm_config.model_config.dtype = tiny_k3.DTYPE
        # So does the drafter (tests/serving/eagle3.py).
        if vllm_config.speculative_config is not None:
            draft = vllm_config.speculative_config.draft_model_config
            if draft is not None:
                draft.dtype = tiny_k3.DTYPE
        super().__init__(vllm_config, device)

    def execute_model(self, scheduler_output, *args, **kwargs):
        # Each request's prompt, by which the drafts are logged.
        prompts = self.__dict__.setdefault("prompts", {})
        for new in scheduler_output.scheduled_new_reqs:
            prompts[new.req_id] = "".join(map(chr, new.prompt_token_ids or ()))
        output = super().execute_model(scheduler_output, *args, **kwargs)
        if os.environ.get(STAGE0_EXTRA_ROW) and isinstance(output, IntermediateTensors):
            output = self.planted_extra_row(scheduler_output, output)
        return output

    def planted_extra_row(self, scheduler_output, output):
        """The first stage's output with its last row once more, in steps
        that run a request whose prompt begins with ``EXTRA_ROW_MARK``."""
        marked = self.__dict__.setdefault("marked_requests", set())
        mark = ord(EXTRA_ROW_MARK)
        for new in scheduler_output.scheduled_new_reqs:
            if new.prompt_token_ids and new.prompt_token_ids[0] == mark:
                marked.add(new.req_id)
        if not get_pp_group().is_first_rank or not marked.intersection(
            scheduler_output.num_scheduled_tokens
        ):
            return output
        return IntermediateTensors(
            {k: torch.cat([v, v[-1:]]) for k, v in output.tensors.items()}
        )

    def load_model(self, *args, **kwargs):
        pp = get_pp_group()
        backend = os.environ.get(STAGE1_MOE_BACKEND)
        if backend and pp.rank_in_group == 1:
            # As a node started with another --kernel-config would.
            self.vllm_config.kernel_config.moe_backend = backend
        # Open for the process's life: the forward runs on the stand-ins too.
        self._stand_ins = serving_stand_ins()
        self._stand_ins.__enter__()
        with eagle3.drafter_loader(SEED):
            loaded = super().load_model(*args, **kwargs)
        model = self.get_model()
        text_model = model.get_language_model().model
        logger.info(
            "V2 runner: PP stage %d, %s built by vLLM, layers [%d, %d), "
            "sequence parallel: %s",
            pp.rank_in_group,
            type(model).__name__,
            text_model.start_layer,
            text_model.end_layer,
            text_model.use_sequence_parallel,
        )
        if self.vllm_config.speculative_config is not None:
            eagle3.log_drafts_and_relay(self)
        return loaded
