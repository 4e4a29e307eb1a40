# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""What this vLLM's model runner does that a stage's hand-offs depend on: how
it pads a batch, and the steps it runs through every PP boundary before
serving. The agreement (``pp_hand_off_agreement``) compares them across
stages; they follow the runner, so they change with it.
"""

from typing import Any

from vllm.config import VllmConfig
from vllm.utils.math_utils import cdiv
from vllm.v1.worker.gpu.cudagraph_utils import CudaGraphManager
from vllm.v1.worker.pp_hand_off_shapes import BatchShape, ShapeBounds

# The command-line options behind each runner setting, named in the error.
RUNNER_OPTIONS: dict[str, tuple[str, ...]] = {
    "warm_up": (
        "--kernel-config (enable_jit_warmup)",
        "--enable-extensible-kv-cache (--kv-cache-memory-bytes)",
        "--speculative-config",
        "--max-num-batched-tokens",
        "--max-num-seqs",
    ),
    "kv_cache_sizing": (
        "--enable-extensible-kv-cache (--kv-cache-memory-bytes)",
        "--max-model-len",
        "--max-logprobs",
    ),
    "warm_up_steps": ("--speculative-config",),
}


class RunnerPadding:
    """How this stage's runner pads a batch: its CUDA graph dispatch, as it
    resolved it (attention backends and a drafter may lower the requested
    mode), known before any graph is captured."""

    def __init__(self, vllm_config: VllmConfig, model_runner: object) -> None:
        compilation_config = vllm_config.compilation_config
        self.cudagraph_mode = compilation_config.cudagraph_mode
        self.decode_query_len = 1 + vllm_config.num_speculative_tokens
        self.manager: CudaGraphManager | None = None
        manager = getattr(model_runner, "cudagraph_manager", None)
        if isinstance(manager, CudaGraphManager):
            self.manager = manager
            self.cudagraph_mode = manager.cudagraph_mode
            self.decode_query_len = manager.decode_query_len
        scheduler_config = vllm_config.scheduler_config
        lora_config = vllm_config.lora_config
        self.bounds = ShapeBounds(
            max_num_tokens=(
                compilation_config.max_cudagraph_capture_size or 0
                if self.cudagraph_mode
                else 0
            ),
            max_query_len=self.decode_query_len,
            lora_counts=tuple(range(lora_config.max_loras + 1 if lora_config else 1)),
            max_num_reqs=scheduler_config.max_num_seqs,
            max_num_batched_tokens=scheduler_config.max_num_batched_tokens,
        )

    def padded_num_tokens(self, shape: BatchShape) -> int:
        if self.manager is not None:
            desc = self.manager.find_candidate(
                shape.num_reqs,
                shape.num_tokens,
                shape.uniform_token_count,
                shape.num_active_loras,
                shape.max_query_len,
            )
            return shape.num_tokens if desc is None else desc.num_tokens
        return shape.num_tokens


def runner_settings(
    vllm_config: VllmConfig, padding: RunnerPadding, aux_layers: tuple[int, ...]
) -> dict[str, Any]:
    """The runner's part of a stage's hand-off settings: what decides its
    warm-up steps (shown where the steps differ), the steps themselves
    (compared), and the aux layers it sets (shown)."""
    speculative_config = vllm_config.speculative_config
    scheduler_config = vllm_config.scheduler_config
    return {
        "warm_up": {
            "enable_jit_warmup": vllm_config.kernel_config.enable_jit_warmup,
            "enable_extensible_kv_cache": (
                vllm_config.cache_config.enable_extensible_kv_cache
            ),
            "speculative_decoding": speculative_config is not None,
            "num_speculative_tokens": vllm_config.num_speculative_tokens,
            "max_num_batched_tokens": scheduler_config.max_num_batched_tokens,
            "max_num_seqs": scheduler_config.max_num_seqs,
        },
        "kv_cache_sizing": {
            "max_model_len": vllm_config.model_config.max_model_len,
            "max_logprobs": vllm_config.model_config.max_logprobs,
        },
        "warm_up_steps": warm_up_steps(vllm_config, padding.decode_query_len),
        "aux_hidden_state_layers": aux_layers,
    }


def warm_up_steps(
    vllm_config: VllmConfig, decode_query_len: int
) -> dict[str, Any] | None:
    """The warm-up steps this stage runs through the worker, and so through
    every PP boundary, before serving (``gpu/warmup.py``): the kernel
    warm-up (JIT warm-up or the extensible KV cache; a second, greedy pass
    with spec decode) as its passes, requests and the runner's decode query
    length, which fix its steps, and the extensible KV cache's sizing steps
    as the tokens each request schedules. Stages that run other steps send
    what no neighbour receives. The caps by KV blocks are left out: vLLM
    takes them alike on every rank (the engine's block count,
    ``_min_across_ranks``)."""
    cache_config = vllm_config.cache_config
    extensible = cache_config.enable_extensible_kv_cache
    if not (vllm_config.kernel_config.enable_jit_warmup or extensible):
        return None
    scheduler_config = vllm_config.scheduler_config
    speculative_config = vllm_config.speculative_config
    budget = scheduler_config.max_num_batched_tokens
    max_num_reqs = scheduler_config.max_num_seqs
    draft_slots = (
        0
        if speculative_config is None
        else speculative_config.max_num_new_slots_for_drafting
    )
    steps: dict[str, Any] = {
        "kernel_warm_up": (
            1 + (speculative_config is not None),
            min(max_num_reqs, budget // (decode_query_len + 1 + draft_slots)),
            decode_query_len,
        )
    }
    if not extensible:
        return steps
    model_config = vllm_config.model_config
    max_model_len = model_config.max_model_len
    sizing = []
    max_prompt_len = min(budget, max_model_len)
    if model_config.max_logprobs != 0 and max_prompt_len < budget and max_num_reqs > 1:
        sizing.append(max_prompt_len)
    sizing.append(budget)
    steps["kv_cache_sizing"] = [
        _sizing_step(vllm_config, num_tokens, decode_query_len, draft_slots)
        for num_tokens in sizing
    ]
    if model_config.use_mla:
        steps["kv_cache_sizing"].append(
            _context_prefill_step(vllm_config, decode_query_len + 1, draft_slots)
        )
    return steps


def _sizing_step(
    vllm_config: VllmConfig, num_tokens: int, decode_query_len: int, draft_slots: int
) -> tuple[int, ...]:
    """The tokens each request schedules in a mixed prefill and decode
    sizing step of ``num_tokens`` (``run_mixed_prefill_decode_warmup``, with
    its prefill-only fallback): prompts of at most ``max_model_len - 1``,
    a decode beside them where a request slot is left."""
    max_num_reqs = vllm_config.scheduler_config.max_num_seqs
    max_prefill_len = vllm_config.model_config.max_model_len - 1
    if vllm_config.speculative_config is None:
        decode_query_len = 1
    with_decode = (
        max_num_reqs >= 2
        and cdiv(num_tokens - decode_query_len, max_prefill_len) < max_num_reqs
    )
    decode_tokens = decode_query_len if with_decode else 0
    num_prefills = min(
        cdiv(num_tokens - decode_tokens, max_prefill_len),
        max_num_reqs - with_decode,
    )
    num_tokens = min(num_tokens, decode_tokens + num_prefills * max_prefill_len)
    if vllm_config.speculative_config is not None:
        num_tokens = min(
            num_tokens,
            vllm_config.scheduler_config.max_num_batched_tokens
            - (with_decode + num_prefills) * draft_slots,
        )
    if num_tokens < 3:
        return ()
    prefill_tokens = num_tokens - decode_tokens
    return (decode_tokens,) * with_decode + tuple(
        min(max_prefill_len, prefill_tokens - start)
        for start in range(0, prefill_tokens, max_prefill_len)
    )


def _context_prefill_step(
    vllm_config: VllmConfig, query_len: int, draft_slots: int
) -> tuple[int, ...]:
    """MLA's context-prefill sizing step (``run_context_prefill_warmup``):
    requests of ``query_len`` tokens over one chunked-context workspace."""
    from vllm.model_executor.layers.attention.mla_attention import (
        MLACommonMetadataBuilder,
    )

    workspace = MLACommonMetadataBuilder.determine_chunked_prefill_workspace_size(
        vllm_config
    )
    context_len = min(vllm_config.model_config.max_model_len - query_len - 1, workspace)
    if context_len <= 0:
        return ()
    num_reqs = min(
        cdiv(workspace, context_len),
        vllm_config.scheduler_config.max_num_seqs,
        vllm_config.scheduler_config.max_num_batched_tokens
        // (query_len + draft_slots),
    )
    return (query_len,) * num_reqs
