# SPDX-License-Identifier: Apache-2.0
"""A stand-in worker that runs the tiny Kimi K3 inside ``vllm serve``.

``vllm serve DIR --worker-cls tests.serving.worker.Worker`` keeps vLLM's
API server, EngineCore, scheduler, KV cache manager and multiproc executor,
and vLLM's own worker (``CPUWorker``, a subclass of the GPU ``Worker``): the
patched ``Worker.execute_model`` receives and sends the PP hand-off and the
GPU worker's ``compile_or_warm_up_model`` runs the start-up agreement. Only
the model runner is a stand-in (:class:`StandInModelRunner`).

Decode without a KV cache: attention is :class:`RequestMixer`, a causal
prefix mean whose state per request (the weighted sum of the hidden states
of every earlier position) is what a KV cache holds for it. Each dispatched
step runs exactly the tokens the scheduler scheduled, so the hand-offs carry
the scheduler's own token counts, and a token's output depends on its whole
sequence: a wrong row, a missing gather or a double shard in any step
changes every later token. States are kept at block boundaries, keyed by the
tokens before them, so a prefix-cache hit resumes as a KV cache would.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from unittest import mock

import torch
from torch import nn

from tests.sppp_testbed import tiny_k3
from tests.sppp_testbed.bases import HAS_LEGACY_RUNNER
from vllm.config import VllmConfig, replace
from vllm.distributed import get_tensor_model_parallel_rank
from vllm.distributed.parallel_state import get_pp_group
from vllm.logger import init_logger
from vllm.model_executor.layers.linear import RowParallelLinear
from vllm.model_executor.models.interfaces import get_pp_hand_off_declaration
from vllm.sequence import IntermediateTensors
from vllm.v1.kv_cache_interface import FullAttentionSpec
from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT, ModelRunnerOutput
from vllm.v1.worker import cpu_worker, gpu_worker
from vllm.v1.worker.gpu.eplb_utils import EPLBController
from vllm.v1.worker.gpu_worker import Worker as GPUWorker
from vllm.v1.worker.pp_intermediate_tensors import (
    hand_off_rows,
    hand_over_intermediate_tensors,
)

logger = init_logger(__name__)

# Read by this stand-in only: stage 1 builds its model with this MoE backend,
# as a node started with another --kernel-config would.
STAGE1_MOE_BACKEND = "K3_SPPP_TEST_STAGE1_MOE_BACKEND"
# Read by the V2 runner (tests/serving/v2_runner.py) only: set, the first PP
# stage hands on one row more than its output in every step that runs a
# request whose prompt begins with EXTRA_ROW_MARK, as a sender that padded
# the batch another way would; the receiving runner must refuse it.
STAGE0_EXTRA_ROW = "K3_SPPP_TEST_STAGE0_EXTRA_ROW"
EXTRA_ROW_MARK = "\x02"
SEED = 0
OUTPUT_FIELDS = {f.name for f in dataclasses.fields(ModelRunnerOutput)}


class Batch:
    """The requests of the step being run, in row order."""

    def __init__(self) -> None:
        # (req_id, token ids of the whole sequence, first position, rows)
        self.segments: list[tuple[str, list[int], int, int]] = []


CURRENT: Batch | None = None


class RequestMixer(nn.Module):
    """Attention stand-in with per-request state: the token at position
    ``p`` mixes the hidden states of positions ``0..p`` of its own request,
    weighted ``1 + 0.01 q``, averaged, then a real ``RowParallelLinear``."""

    def __init__(self, config, *args, prefix: str = "", **kwargs):
        super().__init__()
        hidden = config.hidden_size
        self.value = nn.Parameter(torch.empty(hidden, hidden))
        self.o_proj = RowParallelLinear(
            hidden, hidden, bias=False, prefix=f"{prefix}.o_proj"
        )
        self.block_size = int(os.environ.get("K3_SPPP_TEST_BLOCK_SIZE", "16"))
        self.states: dict[str, tuple[int, torch.Tensor]] = {}
        self.snapshots: dict[tuple[int, ...], torch.Tensor] = {}

    def state_before(self, req_id: str, tokens: list[int], start: int):
        if start == 0:
            return None
        position, state = self.states.get(req_id, (-1, None))
        if position == start:
            return state
        snapshot = self.snapshots.get(tuple(tokens[:start]))
        if snapshot is None:
            raise RuntimeError(f"no state for {req_id} before position {start}")
        return snapshot

    def mix(self, hidden: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        weight = 1.0 + 0.01 * positions.to(hidden.dtype)
        count = positions.to(hidden.dtype) + 1
        if CURRENT is None:  # dummy runs: one sequence, nothing kept
            return torch.cumsum(hidden * weight[:, None], dim=0) / count[:, None]
        out, row = [], 0
        for req_id, tokens, start, rows in CURRENT.segments:
            sums = torch.cumsum(
                hidden[row : row + rows] * weight[row : row + rows, None], 0
            )
            state = self.state_before(req_id, tokens, start)
            if state is not None:
                sums = sums + state
            for i in range(rows):
                if (start + i + 1) % self.block_size == 0:
                    self.snapshots[tuple(tokens[: start + i + 1])] = sums[i].clone()
            self.states[req_id] = (start + rows, sums[-1].clone())
            out.append(sums / count[row : row + rows, None])
            row += rows
        return torch.cat(out)

    def forward(self, hidden_states: torch.Tensor, positions: torch.Tensor):
        assert positions.shape[0] == hidden_states.shape[0]
        mixed = self.mix(hidden_states, positions) @ self.value
        tp_size = self.o_proj.tp_size
        width = mixed.shape[1] // tp_size
        start = get_tensor_model_parallel_rank() * width
        output, _ = self.o_proj(mixed[:, start : start + width].contiguous())
        return output


def served_tiny_k3_config(vllm_config: VllmConfig) -> VllmConfig:
    """The tiny K3's config with the served options: parallel sizes, EP, MoE
    backend (stage 1's from ``STAGE1_MOE_BACKEND`` where set: the refused
    start-up), the token budget MegaMoE's buffer is sized for, and the
    compilation mode (``--enforce-eager`` compiles nothing)."""
    backend = os.environ.get(STAGE1_MOE_BACKEND)
    if backend and get_pp_group().rank_in_group == 1:
        vllm_config.kernel_config.moe_backend = backend
    config = tiny_k3.scenario_config(1, 1, sp=False)
    for served in ("parallel_config", "kernel_config", "scheduler_config"):
        object.__setattr__(config, served, getattr(vllm_config, served))
    served_mode = vllm_config.compilation_config.mode
    compilation = replace(config.compilation_config, mode=served_mode)
    object.__setattr__(config, "compilation_config", compilation)
    return config


class StandInModelRunner:
    """Runs the tiny K3 for the scheduler's steps and samples greedily."""

    def __init__(self, vllm_config, device: torch.device) -> None:
        self.vllm_config = vllm_config
        self.device = device
        self.lora_config = None
        self.is_pooling_model = False
        self.kv_caches: list[torch.Tensor] = []
        self.requests: dict[str, list[int]] = {}
        self.pending: ModelRunnerOutput | None = None
        self.stack = contextlib.ExitStack()
        self.max_num_tokens = vllm_config.scheduler_config.max_num_batched_tokens
        # The GPU worker warms up inside ``eplb.suppress()`` (vLLM 0.34.0; on
        # 0.33.0 with the V2 runner): vLLM's own controller, with no EPLB state.
        self.eplb = EPLBController(vllm_config.parallel_config, device)

    def load_model(self, load_dummy_weights: bool = False) -> None:
        pp = get_pp_group()
        config = served_tiny_k3_config(self.vllm_config)
        self.stack.enter_context(tiny_k3.stand_ins())
        for name in (
            "KimiK3DeltaAttention",
            "KimiLinearGatedDeltaNetAttention",
            "MultiHeadLatentAttention",
        ):
            setattr(tiny_k3.k3, name, RequestMixer)
        self.stack.enter_context(torch.no_grad())
        self.model = tiny_k3.build_model(config, SEED)
        self.hand_off = get_pp_hand_off_declaration(self.model)
        self.lm_head = tiny_k3.full_weight(
            "lm_head.weight", (tiny_k3.VOCAB, tiny_k3.HIDDEN), SEED
        )
        logger.info(
            "Stand-in runner: PP stage %d, layers [%d, %d), sequence parallel: %s",
            pp.rank_in_group,
            self.model.start_layer,
            self.model.end_layer,
            self.model.use_sequence_parallel,
        )
        self.buffers = None
        if not pp.is_first_rank:
            # Sized as the runners size theirs: the model's rows for the budget.
            self.buffers = self.model.make_empty_intermediate_tensors(
                hand_off_rows(self.max_num_tokens, self.hand_off),
                tiny_k3.DTYPE,
                self.device,
            )

    def get_model(self) -> nn.Module:
        return self.model

    def get_supported_tasks(self) -> tuple[str, ...]:
        return ("generate",)

    def get_kv_cache_spec(self) -> dict[str, FullAttentionSpec]:
        block_size = self.vllm_config.cache_config.block_size
        return {
            f"model.layers.{i}.self_attn": FullAttentionSpec(
                block_size=block_size,
                num_kv_heads=1,
                head_size=16,
                dtype=torch.float32,
            )
            for i in range(self.model.start_layer, self.model.end_layer)
        }

    def initialize_kv_cache(self, kv_cache_config, **kwargs) -> None:
        self.kv_cache_config = kv_cache_config

    def update_max_model_len(self, max_model_len: int) -> None:
        pass

    def maybe_remove_all_loras(self, lora_config) -> None:
        pass

    def reset_mm_cache(self) -> None:
        pass

    def reset_encoder_cache(self) -> None:
        pass

    def warming_up_model(self) -> None:
        self._dummy_run(min(8, self.max_num_tokens))

    def _dummy_run(self, num_tokens: int, **kwargs):
        ids = torch.zeros(num_tokens, dtype=torch.long)
        output = self.forward(ids, torch.arange(num_tokens), None, num_tokens)
        return output, output

    def _dummy_sampler_run(self, hidden_states) -> None:
        pass

    def forward(self, ids, positions, received, num_tokens):
        intermediate = None
        if self.buffers is not None:
            intermediate = hand_over_intermediate_tensors(
                self.buffers, received, num_tokens, self.hand_off
            )
        return self.model(ids, positions, intermediate)

    def execute_model(self, scheduler_output, intermediate_tensors=None):
        global CURRENT
        for req_id in scheduler_output.finished_req_ids:
            self.requests.pop(req_id, None)
        for new in scheduler_output.scheduled_new_reqs:
            self.requests[new.req_id] = list(new.prompt_token_ids)
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            if cached.new_token_ids:  # PP: the scheduler sends the tokens
                start = cached.num_computed_tokens[i]
                tokens = self.requests[req_id][:start] + cached.new_token_ids[i]
                self.requests[req_id] = tokens
        num_tokens = scheduler_output.total_num_scheduled_tokens
        if num_tokens == 0:  # nothing to sample
            return EMPTY_MODEL_RUNNER_OUTPUT
        batch, ids, positions = Batch(), [], []
        computed = {
            n.req_id: n.num_computed_tokens for n in scheduler_output.scheduled_new_reqs
        }
        computed.update(zip(cached.req_ids, cached.num_computed_tokens, strict=False))
        for req_id, rows in scheduler_output.num_scheduled_tokens.items():
            tokens, start = self.requests[req_id], computed[req_id]
            batch.segments.append((req_id, tokens, start, rows))
            ids += tokens[start : start + rows]
            positions += range(start, start + rows)
        CURRENT = batch
        try:
            output = self.forward(
                torch.tensor(ids),
                torch.tensor(positions),
                intermediate_tensors,
                num_tokens,
            )
        finally:
            CURRENT = None
        if isinstance(output, IntermediateTensors):
            return output
        sampled, row = [], 0
        for _, tokens, start, rows in batch.segments:
            row += rows
            if start + rows < len(tokens):  # a prefill chunk: nothing sampled
                sampled.append([])
                continue
            token = int(torch.argmax(self.lm_head @ output[row - 1]))
            tokens.append(token)
            sampled.append([token])
        req_ids = [segment[0] for segment in batch.segments]
        output = {"req_ids": req_ids, "sampled_token_ids": sampled}
        if "req_id_to_index" in OUTPUT_FIELDS:  # vLLM 0.33.0; gone in 0.34.0
            output["req_id_to_index"] = {r: i for i, r in enumerate(req_ids)}
        self.pending = ModelRunnerOutput(**output)
        return None

    def sample_tokens(self, grammar_output):
        output, self.pending = self.pending, None
        return output if output is not None else EMPTY_MODEL_RUNNER_OUTPUT

    def take_draft_token_ids(self):
        return None

    def shutdown(self) -> None:
        self.stack.close()


def runner_class() -> type:
    """vLLM's own Model Runner V2 (``CPUModelRunner``) on vLLM 0.34.0, whose
    loader builds the checkpoint's Kimi K3 class (:mod:`tests.serving.v2_runner`);
    on 0.33.0, whose servers run the legacy runner path, the stand-in runner,
    which builds the tiny K3 itself."""
    if HAS_LEGACY_RUNNER:
        return StandInModelRunner
    from tests.serving.v2_runner import V2Runner

    return V2Runner


class Worker(cpu_worker.CPUWorker):
    """vLLM's CPU worker with the stand-in runner, warming up as the GPU
    worker does (``CPUWorker`` overrides ``compile_or_warm_up_model`` with
    one that skips the GPU worker's, where the series checks its stages)."""

    def __init__(
        self,
        vllm_config,
        local_rank: int,
        rank: int,
        distributed_init_method: str,
        is_driver_worker: bool = False,
    ):
        # CPUWorker.__init__ binds NUMA memory through vLLM's CPU extension
        # (vllm._C), which the CUDA wheel lacks: initialise as the GPU
        # worker does and keep the rest of CPUWorker. vLLM 0.34.0's GPU
        # worker refuses to start without Triton ("vLLM's model runner
        # requires Triton."), for the Triton kernels of its V2 runner; the
        # stand-in runner launches none, and the CUDA wheel's Triton has no
        # CPU backend. So that one check reads Triton as present, while the
        # constructor runs and nowhere else (0.33.0 asks only for the V2
        # runner, which these servers do not select).
        with mock.patch.object(gpu_worker, "HAS_TRITON", True):
            GPUWorker.__init__(
                self,
                vllm_config,
                local_rank,
                rank,
                distributed_init_method,
                is_driver_worker,
            )
        self.parallel_config.disable_custom_all_reduce = True

    def init_device(self) -> None:
        with mock.patch.object(cpu_worker, "CPUModelRunner", runner_class()):
            super().init_device()
        if not HAS_LEGACY_RUNNER:
            # As the GPU worker's init_device does (CPUWorker's does not):
            # DSpark's context precompute takes its scratch from it.
            from vllm.v1.worker.workspace import init_workspace_manager

            init_workspace_manager(
                self.device,
                num_lanes=gpu_worker._num_workspace_lanes(self.vllm_config),
            )

    def determine_available_memory(self) -> int:
        # The GPU worker profiles before it sizes the KV cache: a dummy run
        # of the whole token budget (later stages hand the model the leading
        # rows of their receive buffers, its shard under SP), then a dummy sampler
        # run. CPUWorker skips it with --enforce-eager and an explicit KV
        # cache size; the V2 runner runs it here as on a GPU node.
        if not HAS_LEGACY_RUNNER:
            self.model_runner.profile_run()
        return super().determine_available_memory()

    def compile_or_warm_up_model(self):
        # GPU kernels' JIT warm-ups import Triton CUDA code: nothing to warm.
        with mock.patch.object(gpu_worker, "kernel_warmup", lambda worker: None):
            return GPUWorker.compile_or_warm_up_model(self)
