# SPDX-License-Identifier: Apache-2.0
"""The warm-up steps a stage runs through the worker's ``execute_model``
before serving, as ``gpu_worker._compile_or_warm_up_model`` runs them on vLLM
0.34.0 (0.33.0: the first alone, with JIT warm-up): vLLM's own
``warmup_kernels`` (JIT warm-up or the extensible KV cache; a second, greedy
pass with spec decode) and
``run_kv_cache_sizing_warmup`` (the extensible KV cache), over a stand-in
runner. The KV-sizing steps are vLLM's, their caps by KV blocks left wide
open (vLLM takes them alike on every rank); the kernel warm-up's body,
which needs a GPU runner's state, is stood in by its shape: a prefill of
``_cap_num_warmup_reqs`` requests one token longer than a decode, then
decode steps of the runner's decode query length."""

from __future__ import annotations

import contextlib
import types
from collections.abc import Callable
from unittest import mock

import torch

from vllm.utils.math_utils import cdiv


def step(num_tokens: list[int], drafts: int = 0) -> types.SimpleNamespace:
    """What the check reads of a scheduler output."""
    req_ids = [f"r{i}" for i in range(len(num_tokens))]
    return types.SimpleNamespace(
        num_scheduled_tokens=dict(zip(req_ids, num_tokens, strict=True)),
        scheduled_spec_decode_tokens={r: [0] * drafts for r in req_ids if drafts},
        total_num_scheduled_tokens=sum(num_tokens),
    )


def stand_in_runner(config, decode_query_len: int) -> types.SimpleNamespace:
    """What vLLM's warm-up functions read of a V2 runner."""
    scheduler_config = config.scheduler_config
    speculative_config = config.speculative_config
    return types.SimpleNamespace(
        vllm_config=config,
        model_config=config.model_config,
        scheduler_config=scheduler_config,
        max_model_len=config.model_config.max_model_len,
        max_num_reqs=scheduler_config.max_num_seqs,
        max_num_tokens=scheduler_config.max_num_batched_tokens,
        is_encoder_decoder=False,
        is_pooling_model=False,
        num_speculative_steps=config.num_speculative_tokens,
        decode_query_len=decode_query_len,
        speculative_config=speculative_config,
        adaptive_verification=None,
        rejection_sampler=None,
        speculator=None,
        extensible_kv_cache=None,
        kv_cache_config=types.SimpleNamespace(
            kv_cache_groups=[types.SimpleNamespace(kv_cache_spec=None)]
        ),
        kv_connector=types.SimpleNamespace(set_disabled=lambda disabled: None),
    )


def run_warm_up(
    config, execute_model: Callable[[object], object], decode_query_len: int
) -> None:
    """Every warm-up step this stage's worker runs, through
    ``execute_model``."""
    from vllm.v1.worker.gpu import warmup

    def kernels(runner, execute, sample, greedy=False):
        prompt_len = runner.decode_query_len + 1
        num_reqs = runner.max_num_reqs
        if hasattr(warmup, "_cap_num_warmup_reqs"):  # vLLM 0.34.0
            num_reqs = warmup._cap_num_warmup_reqs(runner, num_reqs, prompt_len)
        execute(step([prompt_len] * num_reqs))
        drafts = runner.num_speculative_steps
        for _ in range(5 if drafts else 3):
            execute(step([runner.decode_query_len] * num_reqs, drafts))

    runner = stand_in_runner(config, decode_query_len)
    extensible = getattr(config.cache_config, "enable_extensible_kv_cache", False)
    with contextlib.ExitStack() as stack:
        for name, value in (
            ("_warmup_kernels", kernels),
            ("_fixed_draft_counts", lambda runner: contextlib.nullcontext()),
            ("_warmup_block_counter", lambda runner: lambda n, spec: cdiv(n, 16)),
            ("num_committable_kv_blocks", lambda runner: 1 << 40),
            ("ensure_kv_cache_blocks", lambda runner, n: None),
            ("_warmup_token_ids", lambda runner, n: [0] * n),
        ):
            if hasattr(warmup, name):  # 0.33.0 has fewer of them
                stack.enter_context(mock.patch.object(warmup, name, value))
        stack.enter_context(
            mock.patch.object(torch.accelerator, "synchronize", lambda *a: None)
        )
        if config.kernel_config.enable_jit_warmup or extensible:
            warmup.warmup_kernels(runner, execute_model, lambda grammar: None)
        if extensible:
            warmup.run_kv_cache_sizing_warmup(
                runner, execute_model, lambda grammar: None
            )
