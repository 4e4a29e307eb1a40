# SPDX-License-Identifier: Apache-2.0
"""The start-up check compares the warm-up steps each stage will run
(``warm_up_steps``), stated from the options rather than recorded from a run:
here vLLM's own KV-sizing warm-up (``gpu/warmup.py``) runs against a
recording worker, and runs exactly the steps ``warm_up_steps`` states, so
stages are refused exactly where their steps differ. Its caps by KV
blocks, taken alike on every rank, are left wide open."""

from __future__ import annotations

import contextlib
import itertools
import types

import pytest
import torch

from tests.sppp_testbed.bases import only_from_0_34
from tests.sppp_testbed.tiny_k3 import scenario_config
from vllm.utils.math_utils import cdiv
from vllm.v1.worker import pp_hand_off_runner
from vllm.v1.worker.gpu import warmup

pytestmark = only_from_0_34(
    "the extensible KV cache's sizing warm-up, and the agreement's statement of "
    "the warm-up steps"
)

# What warm_up_steps and vLLM's warm-up read of a --speculative-config: the
# KV slots each request keeps for its drafts.
SPEC = types.SimpleNamespace(max_num_new_slots_for_drafting=3)

# Around the budgets, the 3-token floor of a step, and model lengths whose
# context fills the MLA workspace in whole requests.
MAX_MODEL_LENS = (3, 4, 5, 64, 100, 128, 129, 200, 512, 514, 1024, 1026)
MAX_NUM_SEQS = (1, 2, 3, 8, 64, 128, 256)
BUDGETS = (127, 255)


@pytest.fixture(scope="module")
def config():
    return scenario_config(2, 2, sp=True)


@pytest.fixture
def recorded_steps(config, monkeypatch):
    """The tokens each request schedules, per step that schedules any, as
    vLLM's sizing warm-up hands them to the worker."""
    monkeypatch.setattr(warmup, "_warmup_block_counter", lambda runner: _blocks)
    monkeypatch.setattr(warmup, "num_committable_kv_blocks", lambda runner: 1 << 40)
    monkeypatch.setattr(warmup, "ensure_kv_cache_blocks", lambda runner, n: None)
    monkeypatch.setattr(warmup, "_warmup_token_ids", lambda r, n: [0] * n)
    monkeypatch.setattr(torch.accelerator, "synchronize", lambda *args: None)

    def run(decode_query_len: int, num_spec_steps: int = 0) -> list[tuple[int, ...]]:
        steps: list[tuple[int, ...]] = []

        def execute_model(scheduler_output) -> None:
            """Every step that moves tokens, but the prefill of a mixed
            step's decode request (two tokens, before its step)."""
            new = scheduler_output.scheduled_new_reqs
            if scheduler_output.total_num_scheduled_tokens and not (
                len(new) == 1 and new[0].req_id.endswith("_decode_")
            ):
                steps.append(tuple(scheduler_output.num_scheduled_tokens.values()))

        runner = _runner(config, decode_query_len)
        if num_spec_steps:
            runner.speculative_config = config.speculative_config
            runner.num_speculative_steps = num_spec_steps
            runner.adaptive_verification = runner.rejection_sampler = None
        warmup.run_kv_cache_sizing_warmup(
            runner,
            execute_model,
            lambda grammar_output: None,
        )
        return steps

    return run


def _blocks(num_tokens: int, spec: object) -> int:
    return cdiv(num_tokens, 16)


def _runner(config, decode_query_len: int) -> types.SimpleNamespace:
    """What the sizing warm-up reads of a V2 runner without spec decode
    (``decode_query_len``: tokens its model state samples per step, plus
    none drafted)."""
    scheduler_config = config.scheduler_config
    return types.SimpleNamespace(
        vllm_config=config,
        model_config=config.model_config,
        scheduler_config=scheduler_config,
        max_model_len=config.model_config.max_model_len,
        max_num_reqs=scheduler_config.max_num_seqs,
        max_num_tokens=scheduler_config.max_num_batched_tokens,
        is_encoder_decoder=False,
        is_pooling_model=False,
        num_speculative_steps=0,
        decode_query_len=decode_query_len,
        speculative_config=None,
        extensible_kv_cache=None,
        kv_cache_config=types.SimpleNamespace(
            kv_cache_groups=[types.SimpleNamespace(kv_cache_spec=None)]
        ),
        kv_connector=types.SimpleNamespace(set_disabled=lambda disabled: None),
    )


@pytest.mark.parametrize("decode_query_len", [1, 2])
@pytest.mark.parametrize("use_mla", [True, False], ids=["mla", "no-mla"])
@pytest.mark.parametrize("max_logprobs", [20, 0])
def test_sizing_steps_are_alike_exactly_where_warm_up_steps_says(
    config, recorded_steps, use_mla, max_logprobs, decode_query_len
):
    config.cache_config.enable_extensible_kv_cache = True
    config.kernel_config.enable_jit_warmup = False
    config.model_config.use_mla = use_mla
    config.model_config.max_logprobs = max_logprobs
    distinct = set()
    for max_model_len, max_num_seqs, budget in itertools.product(
        MAX_MODEL_LENS, MAX_NUM_SEQS, BUDGETS
    ):
        config.model_config.max_model_len = max_model_len
        config.scheduler_config.max_num_seqs = max_num_seqs
        config.scheduler_config.max_num_batched_tokens = budget
        predicted = pp_hand_off_runner.warm_up_steps(config, decode_query_len)[
            "kv_cache_sizing"
        ]
        steps = recorded_steps(decode_query_len)
        # A step too small to run is stated as no tokens at all.
        assert [step for step in predicted if step] == steps, (
            max_model_len,
            max_num_seqs,
            budget,
        )
        distinct.add(tuple(steps))
    assert len(distinct) > 20, len(distinct)


def test_kernel_warm_up_requests_are_vllms_own_cap(config):
    """The kernel warm-up's requests: ``_cap_num_warmup_reqs`` of the scheduler's
    --max-num-seqs, for prompts of one token more than a decode."""
    config.cache_config.enable_extensible_kv_cache = False
    config.kernel_config.enable_jit_warmup = True
    for max_num_seqs, budget, decode_query_len in itertools.product(
        MAX_NUM_SEQS, BUDGETS, (1, 2, 4)
    ):
        config.scheduler_config.max_num_seqs = max_num_seqs
        config.scheduler_config.max_num_batched_tokens = budget
        runner = types.SimpleNamespace(speculative_config=None, max_num_tokens=budget)
        want = warmup._cap_num_warmup_reqs(
            runner, max_num_seqs, max(decode_query_len + 1, decode_query_len)
        )
        assert pp_hand_off_runner.warm_up_steps(config, decode_query_len) == {
            "kernel_warm_up": (1, want, decode_query_len)
        }


@contextlib.contextmanager
def speculative(config, spec=SPEC):
    saved = config.speculative_config
    object.__setattr__(config, "speculative_config", spec)
    try:
        yield
    finally:
        object.__setattr__(config, "speculative_config", saved)


@pytest.mark.parametrize("use_mla", [True, False], ids=["mla", "no-mla"])
def test_sizing_steps_with_spec_decode_are_what_warm_up_steps_says(
    config, recorded_steps, use_mla
):
    """With spec decode the decode request verifies a full set of drafts
    (2 draft tokens: 3 tokens), and every request keeps its draft slots
    out of the budget."""
    config.cache_config.enable_extensible_kv_cache = True
    config.kernel_config.enable_jit_warmup = False
    config.model_config.use_mla = use_mla
    config.model_config.max_logprobs = 20
    with speculative(config):
        for max_model_len, max_num_seqs, budget in itertools.product(
            (4, 64, 129, 200, 1026), (1, 2, 8, 128), BUDGETS
        ):
            config.model_config.max_model_len = max_model_len
            config.scheduler_config.max_num_seqs = max_num_seqs
            config.scheduler_config.max_num_batched_tokens = budget
            predicted = pp_hand_off_runner.warm_up_steps(config, 3)["kv_cache_sizing"]
            steps = recorded_steps(3, num_spec_steps=2)
            assert [step for step in predicted if step] == steps, (
                max_model_len,
                max_num_seqs,
                budget,
            )


def test_kernel_warm_up_with_spec_decode_is_two_passes_of_vllms_cap(
    config, monkeypatch
):
    """With spec decode vLLM's kernel warm-up runs a second, greedy pass,
    and caps its requests by their draft slots too."""
    passes: list[bool] = []
    monkeypatch.setattr(
        warmup,
        "_warmup_kernels",
        lambda runner, execute, sample, greedy=False: passes.append(greedy),
    )
    monkeypatch.setattr(
        warmup, "_fixed_draft_counts", lambda runner: contextlib.nullcontext()
    )
    config.cache_config.enable_extensible_kv_cache = False
    config.kernel_config.enable_jit_warmup = True
    with speculative(config):
        for max_num_seqs, budget, decode_query_len in itertools.product(
            MAX_NUM_SEQS, BUDGETS, (2, 4)
        ):
            config.scheduler_config.max_num_seqs = max_num_seqs
            config.scheduler_config.max_num_batched_tokens = budget
            runner = types.SimpleNamespace(
                speculative_config=SPEC,
                max_num_tokens=budget,
                adaptive_verification=None,
                speculator=None,
            )
            passes.clear()
            warmup.warmup_kernels(runner, None, None)
            want = warmup._cap_num_warmup_reqs(
                runner, max_num_seqs, decode_query_len + 1
            )
            assert pp_hand_off_runner.warm_up_steps(config, decode_query_len) == {
                "kernel_warm_up": (len(passes), want, decode_query_len)
            }
    assert passes == [False, True]
