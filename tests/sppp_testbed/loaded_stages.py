# SPDX-License-Identifier: Apache-2.0
"""The class a user's checkpoint loads, across PP stages, started as vLLM
starts it.

Each rank builds the ``VllmConfig`` of ``vllm serve CHECKPOINT`` with the
layout's options (``EngineArgs.create_engine_config``, the serving CLI's
path), constructs vLLM's own worker and Model Runner V2 (``CPUWorker``
with ``GPUWorker.__init__``, as ``tests/serving/worker.py`` does, and
``CPUModelRunner``) and runs the worker's ``load_model``: vLLM's loader
builds the checkpoint's architecture (``KimiK3ForConditionalGeneration``)
through the model registry, the runner takes its PP declaration and sets
EAGLE-3's aux layers in its own order, and the worker takes the transport
overrides that ``Worker.execute_model`` passes to every PP send and
receive. Stand-ins sit below the model class only: ``tiny_k3.stand_ins``
(KDA, MLA and DSA attention, MoE, ``attn_res``; the drafters' attention)
and the V2 runner's Triton kernels (``v2_kernel_standins``). The drafter
is loaded on the last stage by the runner from ``--speculative-config``
and drafts there after the step, fed as vLLM's speculator feeds it (K3's
MTP layer, EAGLE-3, K3's DSpark).

One step then crosses the stage boundaries with vLLM's
``isend_tensor_dict`` / ``irecv_tensor_dict`` and the worker's overrides,
as ``Worker.execute_model`` moves them (a middle stage relaying the aux
states it received through the runner's own PP handler), and the last
stage runs to its gathered outputs.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field
from unittest import mock

import torch

# vLLM 0.34.0's loader imports this on its first load; imported here, before
# tiny_k3.stand_ins replaces torch.cuda.Stream, which its annotations read
# (a release without online quantization has no such module).
with contextlib.suppress(ImportError):
    import vllm.model_executor.layers.quantization.online.base  # noqa: F401
from tests.sppp_testbed import tiny_k3, v2_kernel_standins
from tests.sppp_testbed.bases import HAS_LEGACY_RUNNER
from tests.sppp_testbed.stages import token_ids
from vllm.config import set_current_vllm_config
from vllm.distributed.parallel_state import get_pp_group, get_tp_group
from vllm.engine.arg_utils import EngineArgs
from vllm.model_executor.models import registry
from vllm.sequence import IntermediateTensors
from vllm.v1.worker.gpu_worker import AsyncIntermediateTensors

NUM_SPECULATIVE_TOKENS = 2
# K3's own MTP layer (the checkpoint's num_nextn_predict_layers) as the
# drafter, as --speculative-config '{"method": "mtp", ...}' loads it.
MTP = {"method": "mtp", "num_speculative_tokens": 1}


def eagle3(draft: str) -> dict:
    """``--speculative-config`` of the EAGLE-3 drafter in ``draft``."""
    return {
        "method": "eagle3",
        "model": draft,
        "num_speculative_tokens": NUM_SPECULATIVE_TOKENS,
    }


def dspark(draft: str) -> dict:
    """``--speculative-config`` of K3's DSpark drafter in ``draft`` (its
    block size is the number of speculative tokens)."""
    return {"method": "dspark", "model": draft}


def engine_config(
    checkpoint: str, speculative: dict | None, tp: int, pp: int, sp: bool
):
    """``vllm serve CHECKPOINT`` with the layout's options, as the serving
    CLI turns them into a ``VllmConfig``; the model then computes in
    float64 and the step budget is the test bed's."""
    args = EngineArgs(
        model=checkpoint,
        tensor_parallel_size=tp,
        pipeline_parallel_size=pp,
        enable_expert_parallel=sp,
        kernel_config={"moe_backend": "deep_gemm_mega_moe" if sp else "auto"},
        load_format="dummy",
        enforce_eager=True,
        max_model_len=tiny_k3.MAX_MODEL_LEN,
        max_num_seqs=8,
        # The CPU platform turns prefix caching off for MLA models after the
        # hybrid-model hook sized the KDA blocks for it: off from the start.
        enable_prefix_caching=False,
        compilation_config={"custom_ops": ["none"]},
        speculative_config=speculative,
    )
    # vLLM inspects a model class it has not cached (a new series revision
    # is a new hash) in a fresh interpreter, so as not to initialise CUDA;
    # a CPU rank has no CUDA and has imported the class already.
    with mock.patch.object(registry, "_run_in_subprocess", lambda inspect: inspect()):
        config = args.create_engine_config()
    # The CPU platform raises the budget to max_model_len for MLA models;
    # MegaMoE's buffer and the DSA top-k buffer are sized by the test bed's.
    config.scheduler_config.max_num_batched_tokens = tiny_k3.MAX_NUM_BATCHED_TOKENS
    config.model_config.dtype = tiny_k3.DTYPE
    if config.speculative_config is not None:
        config.speculative_config.draft_model_config.dtype = tiny_k3.DTYPE
    return config


def start_worker(config):
    """vLLM's worker with vLLM's V2 runner, the model loaded by the worker's
    own ``load_model``. The rank's distributed state stands for the
    worker's ``init_device``."""
    # vLLM's CPU worker module puts its CUDA placeholders (streams, events,
    # pinned memory) in place for the V2 runner on import.
    from vllm.v1.worker import cpu_worker, gpu_worker
    from vllm.v1.worker.cpu.model_runner import CPUModelRunner

    v2_kernel_standins.install()
    worker = object.__new__(cpu_worker.CPUWorker)
    # As tests/serving/worker.py starts it: GPUWorker.__init__ (CPUWorker's
    # binds NUMA memory through vllm._C, which the CUDA wheel lacks), with
    # its Triton check answered for the constructor only.
    with mock.patch.object(gpu_worker, "HAS_TRITON", True):
        gpu_worker.Worker.__init__(
            worker,
            config,
            local_rank=0,
            rank=torch.distributed.get_rank(),
            distributed_init_method="tcp://unused",
            is_driver_worker=get_tp_group().rank_in_group == 0,
        )
    worker.device = torch.device("cpu")
    worker.model_runner = CPUModelRunner(config, worker.device)
    worker.load_model()
    return worker


@dataclass
class LoadedStageResult:
    """What one rank loaded and moved."""

    architecture: str
    # The class of its vision tower (vLLM's MoonViT where this rank has it).
    vision_tower: str
    sequence_parallel: bool
    # What Worker.execute_model passes to every PP send and receive.
    worker_overrides: dict[str, bool] | None
    # What this stage sent (non-last) and received (non-first), by key.
    sent: dict[str, torch.Tensor] = field(default_factory=dict)
    received: dict[str, torch.Tensor] = field(default_factory=dict)
    # The last stage's gathered outputs (N rows).
    hidden_states: torch.Tensor | None = None
    aux_hidden_states: list[torch.Tensor] | None = None
    # With MTP and EAGLE-3, the last stage's draft logits and draft tokens
    # (N rows); with DSpark, those of its draft block (block-size rows). With
    # EAGLE-3 and DSpark, the context the drafter combined from the aux
    # states (N rows).
    draft_context: torch.Tensor | None = None
    draft_logits: torch.Tensor | None = None
    draft_tokens: torch.Tensor | None = None
    # Whether the loaded MTP layer ran its block sequence parallel.
    drafter_sequence_parallel: bool | None = None


def run_loaded_step(
    checkpoint: str,
    speculative: dict | None,
    sp: bool,
    num_tokens: int,
    seed: int = 0,
) -> LoadedStageResult:
    """Run in every rank: start the worker on ``checkpoint`` (with the
    drafter of ``speculative``, a ``--speculative-config``), then one
    prefill of ``num_tokens`` tokens across the stages."""
    tp_group, pp_group = get_tp_group(), get_pp_group()
    if HAS_LEGACY_RUNNER:
        # 0.33.0 starts its legacy runner unless asked; the V2 runner is the
        # one that sets aux layers on every stage (and the one started here).
        os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1"
    config = engine_config(
        checkpoint, speculative, tp_group.world_size, pp_group.world_size, sp
    )
    with set_current_vllm_config(config), tiny_k3.stand_ins(), torch.no_grad():
        torch.set_default_dtype(tiny_k3.DTYPE)
        worker = start_worker(config)
        model = worker.model_runner.get_model()
        # Dummy weights differ per rank: each its shard of one seeded model.
        # The drafter first: where it shares the target's embedding and LM
        # head (one stage), the target's values are loaded last.
        drafter = worker.model_runner.get_draft_model()
        if drafter is not None:
            tiny_k3.load_seeded_weights(drafter, seed, draft_weight)
        tiny_k3.load_seeded_weights(model, seed)
        overrides = worker._pp_all_gather_tensors
        result = LoadedStageResult(
            type(model).__name__,
            type(model.vision_tower).__name__,
            model.language_model.model.use_sequence_parallel,
            overrides,
        )
        intermediate = None
        if not pp_group.is_first_rank:
            tensors, handles, postprocess = pp_group.irecv_tensor_dict(
                all_gather_group=tp_group, all_gather_tensors=overrides
            )
            intermediate = AsyncIntermediateTensors(
                tensors, comm_handles=handles, comm_postprocess=postprocess
            )
            intermediate.wait_for_comm()
            result.received = {k: v.clone() for k, v in intermediate.tensors.items()}
        ids = token_ids(num_tokens, seed)
        output = model(ids, torch.arange(num_tokens), intermediate)
        if not pp_group.is_last_rank:
            assert isinstance(output, IntermediateTensors)
            if intermediate is not None:
                # A middle stage hands on the aux states it received beside
                # its own, as the runner's execute_model does.
                output = worker.model_runner.pp_handler.relay_aux_hidden_states(
                    intermediate, output
                )
            result.sent = {k: v.clone() for k, v in output.tensors.items()}
            for handle in pp_group.isend_tensor_dict(
                output.tensors, all_gather_group=tp_group, all_gather_tensors=overrides
            ):
                if handle is not None:
                    handle.wait()
            return result
        if isinstance(output, tuple):
            result.hidden_states, result.aux_hidden_states = output
        else:
            result.hidden_states = output
        method = (speculative or {}).get("method")
        if method == "mtp":
            run_mtp(drafter, model, result, num_tokens, seed)
        elif method == "eagle3":
            run_eagle3(drafter, result, num_tokens, seed)
        elif method == "dspark":
            run_dspark(drafter, result, num_tokens, seed)
    return result


# The drafter's embedding as a K3 checkpoint holds it: the target's, which
# the runner shares with the drafter at PP1 and the drafter loads from the
# checkpoint at PP > 1.
DRAFT_WEIGHT_NAMES = {
    "model.embed_tokens.weight": "language_model.model.embed_tokens.weight"
}


def draft_weight(name: str, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    return tiny_k3.full_weight(DRAFT_WEIGHT_NAMES.get(name, name), shape, seed)


def run_mtp(
    drafter: torch.nn.Module,
    model: torch.nn.Module,
    result: LoadedStageResult,
    num_tokens: int,
    seed: int,
) -> None:
    """The loaded MTP layer's first draft of every position, fed as the V2
    runner feeds it: the target's gathered states through
    ``get_drafter_hidden_states``."""
    from vllm.v1.worker.gpu.spec_decode.utils import get_drafter_hidden_states

    (layer,) = drafter.model.layers.values()
    result.drafter_sequence_parallel = layer.mtp_block.use_sequence_parallel
    hidden_states = get_drafter_hidden_states(model, result.hidden_states)
    draft_every_position(drafter, hidden_states, result, num_tokens, seed)


def run_eagle3(
    drafter: torch.nn.Module, result: LoadedStageResult, num_tokens: int, seed: int
) -> None:
    """The loaded EAGLE-3 drafter's first draft of every position, fed as
    vLLM's speculator feeds it: the target's gathered aux states in slot
    order, combined by the drafter (its ``fc``)."""
    result.draft_context = drafter.combine_hidden_states(
        torch.cat(result.aux_hidden_states, dim=-1)
    )
    draft_every_position(drafter, result.draft_context, result, num_tokens, seed)


def draft_every_position(
    drafter: torch.nn.Module,
    hidden_states: torch.Tensor,
    result: LoadedStageResult,
    num_tokens: int,
    seed: int,
) -> None:
    """A next-token drafter's logits and greedy draft at every position of
    the prefill, from ``hidden_states`` and the next tokens' ids."""
    ids = token_ids(num_tokens, seed + 1)
    output = drafter(ids, torch.arange(num_tokens), hidden_states)
    # MTP returns (logits input, recurrent state), EAGLE-3 (output, residual).
    logits_input = output[0] if isinstance(output, tuple) else output
    result.draft_logits = drafter.compute_logits(logits_input)
    result.draft_tokens = result.draft_logits.argmax(dim=-1)


def run_dspark(
    drafter: torch.nn.Module, result: LoadedStageResult, num_tokens: int, seed: int
) -> None:
    """The loaded DSpark drafter's block after this prefill, fed as vLLM's
    DSpark speculator feeds it: its context is the target's gathered aux
    states in slot order, combined by the drafter
    (``_store_hidden_states``) and projected to each draft layer's latents
    (``precompute_and_store_context_kv``, whose cache the attention
    stand-in reads); the block is the anchor (the token the target sampled)
    and noise tokens after it; each position's draft is its base logits
    plus the Markov bias of the draft before it, greedily."""
    from vllm.v1.worker.gpu.spec_decode.utils import get_parallel_drafting_token_id

    inner = drafter.model
    result.draft_context = drafter.combine_hidden_states(
        torch.cat(result.aux_hidden_states, dim=-1)
    )
    latents = inner.context_kv_proj(result.draft_context)
    latents = latents.view(num_tokens, len(inner.layers), -1)
    for index, layer in enumerate(inner.layers):
        layer.self_attn.context = latents[:, index]
    block = inner.config.block_size
    anchor = token_ids(1, seed + 1)
    ids = torch.full((block,), get_parallel_drafting_token_id(inner.config))
    ids[0] = anchor[0]
    hidden_states = drafter(ids, num_tokens + torch.arange(block))
    result.draft_logits = drafter.compute_draft_logits(hidden_states)
    drafts, previous = [], anchor
    for logits in result.draft_logits:
        bias = drafter.markov_bias(drafter.markov_embed(previous))
        previous = (logits + bias).argmax(dim=-1)
        drafts.append(previous)
    result.draft_tokens = torch.cat(drafts)
