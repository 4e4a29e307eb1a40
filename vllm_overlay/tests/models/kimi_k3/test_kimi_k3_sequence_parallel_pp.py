# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Kimi K3 sequence parallelism (SP) with pipeline parallelism (PP): the one
SP decision and the per-key PP transport overrides the model declares."""

import logging
import types

import pytest
import torch

from vllm.model_executor.models.interfaces import (
    get_pp_all_gather_overrides,
    get_pp_num_rows,
    supports_pp_all_gather_overrides,
)
from vllm.models.kimi_k3.nvidia import model as k3
from vllm.models.kimi_k3.nvidia import sequence_parallel as k3_sp


def vllm_config(
    tp: int = 8,
    pp: int = 2,
    ep: bool = True,
    dp: int = 1,
    backend: str = "deep_gemm_mega_moe",
    ubatching: bool = False,
) -> types.SimpleNamespace:
    return types.SimpleNamespace(
        parallel_config=types.SimpleNamespace(
            tensor_parallel_size=tp,
            pipeline_parallel_size=pp,
            enable_expert_parallel=ep,
            data_parallel_size=dp,
            use_ubatching=ubatching,
        ),
        kernel_config=types.SimpleNamespace(moe_backend=backend),
    )


@pytest.mark.parametrize(
    ("options", "expected"),
    [
        ({}, True),  # production: TP8 / PP2 / EP8, MegaMoE
        ({"pp": 1}, True),
        ({"pp": 4}, True),
        ({"tp": 2, "pp": 3}, True),
        ({"pp": 1, "ubatching": True}, True),  # DBO at PP = 1: 0.33.0's rule
        ({"ubatching": True}, False),  # DBO across stages: 0.33.0's layout
        ({"backend": "auto", "dp": 2, "pp": 1}, True),  # DP attention, no PP
        # Across PP stages only MegaMoE runs SP; other backends keep 0.33.0's
        # replicated layout, DP attention included.
        ({"backend": "auto", "dp": 2}, False),
        ({"backend": "flashinfer_cutlass", "dp": 4, "pp": 3}, False),
        ({"backend": "auto"}, False),
        ({"backend": "flashinfer_cutlass", "pp": 1}, False),
        ({"ep": False}, False),
        ({"ep": False, "dp": 2}, False),
        ({"tp": 1}, False),
        ({"tp": 1, "dp": 2}, False),
    ],
)
def test_decision_table(options, expected):
    assert k3_sp.use_kimi_k3_sequence_parallel(vllm_config(**options)) is expected


def logged(*configs: types.SimpleNamespace) -> list[str]:
    """What deciding for each config logs (each message once per process)."""
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    level = k3_sp.logger.level
    k3_sp.logger.setLevel(logging.INFO)
    k3_sp.logger.addHandler(handler)
    try:
        for config in configs:
            k3_sp.use_kimi_k3_sequence_parallel(config)
    finally:
        k3_sp.logger.removeHandler(handler)
        k3_sp.logger.setLevel(level)
    return [r.getMessage() for r in records]


def test_decision_is_logged_once_with_tp_pp_and_backend():
    # Three times, as every decoder layer asks; then a config without SP.
    configs = [vllm_config(tp=3, pp=5)] * 3 + [vllm_config(tp=3, pp=5, ep=False)]
    assert logged(*configs) == [
        "Kimi-K3 sequence parallelism enabled "
        "(TP=3, PP=5, MoE backend=deep_gemm_mega_moe)."
    ]


def test_dp_attention_across_stages_says_why_sp_stays_off():
    config = vllm_config(tp=5, pp=7, dp=2, backend="flashinfer_cutlass")
    assert logged(config, config) == [
        "Kimi-K3 sequence parallelism off at PP=7 with MoE backend "
        "flashinfer_cutlass: across pipeline stages only deep_gemm_mega_moe "
        "runs it."
    ]


# PP sizes no other test logs: each message is logged once per process.
@pytest.mark.parametrize(
    "options",
    [{"backend": "auto", "pp": 11}, {"ep": False, "dp": 2, "pp": 13}],
)
def test_sp_off_without_dp_attention_or_ep_logs_nothing(options):
    """The DP-attention message is for deployments that would run SP at
    PP = 1; another backend without DP, or DP without EP, never would."""
    assert logged(vllm_config(**options)) == []


# PP sizes no other test logs: each message is logged once per process.
@pytest.mark.parametrize("pp", [3, 5])
def test_micro_batches_across_stages_keep_the_replicated_layout(pp):
    """0.33.0 runs MegaMoE with DBO at PP > 1 replicated; so does the series,
    saying why SP is off, instead of refusing it."""
    config = vllm_config(pp=pp, ubatching=True)
    assert logged(config, config) == [
        f"Kimi-K3 sequence parallelism off at PP={pp} with micro-batches "
        "(--enable-dbo, --ubatch-size): they slice stage hand-offs by token "
        "position, which sequence-parallel shards do not follow."
    ]
    assert k3_sp.use_kimi_k3_sequence_parallel(config) is False


# -- the end-of-model gather ----------------------------------------------


@pytest.mark.parametrize("num_tokens", [1, 3, 17])
@pytest.mark.parametrize("num_aux", [0, 1, 3])
def test_end_gather_packs_below_the_limit_and_gathers_each_state_above(
    num_tokens, num_aux, monkeypatch
):
    """Two TP ranks: this rank's shard of every state, then the other's.
    Packed or not, each state comes back whole and trimmed to N."""
    tp, hidden = 2, 4
    rows = -(-num_tokens // tp)
    generator = torch.Generator().manual_seed(num_tokens)
    full = [
        torch.randn(rows * tp, hidden, generator=generator) for _ in range(1 + num_aux)
    ]
    gathered: list[tuple[int, ...]] = []

    def all_gather(shard: torch.Tensor) -> torch.Tensor:
        """The other rank holds the other rows of the same states."""
        gathered.append(tuple(shard.shape))
        other = [
            next(s[rows:] for s in full if torch.equal(s[:rows], chunk))
            for chunk in shard.split(hidden, dim=-1)
        ]
        return torch.cat([shard, torch.cat(other, dim=-1)])

    monkeypatch.setattr(k3_sp, "sp_all_gather", all_gather)
    shard_bytes = sum(state[:rows].nbytes for state in full)
    for limit, want in [
        (shard_bytes, [(rows, hidden * (1 + num_aux))]),
        (shard_bytes - 1, [(rows, hidden)] * (1 + num_aux)),
    ]:
        monkeypatch.setattr(k3_sp, "PACKED_GATHER_MAX_BYTES", limit)
        gathered.clear()
        states = k3_sp.sp_all_gather_hidden_states(
            [state[:rows] for state in full], num_tokens
        )
        assert gathered == ([(rows, hidden)] if num_aux == 0 else want)
        assert len(states) == 1 + num_aux
        for got, state in zip(states, full, strict=True):
            torch.testing.assert_close(got, state[:num_tokens], rtol=0, atol=0)


def test_end_gather_packs_shards_of_up_to_40_mib_per_rank(monkeypatch):
    """The shipped limit, where packing stopped paying on 2 x H200 (TP2,
    bf16): states whose shards hold 40 MiB together share one all-gather,
    a byte more gathers them one by one."""
    gathered: list[int] = []

    def all_gather(shard: torch.Tensor) -> torch.Tensor:
        gathered.append(shard.shape[-1])
        return shard

    monkeypatch.setattr(k3_sp, "sp_all_gather", all_gather)
    half = 20 * 1024 * 1024
    for extra, want in [(0, [2 * half]), (1, [half, half + 1])]:
        gathered.clear()
        states = [
            torch.zeros(1, half, dtype=torch.uint8),
            torch.zeros(1, half + extra, dtype=torch.uint8),
        ]
        k3_sp.sp_all_gather_hidden_states(states, num_tokens=1)
        assert gathered == want, (extra, gathered)


# -- transport overrides -------------------------------------------------


def test_overrides_mark_every_sp_key_and_aux_slot_as_not_replicated():
    model = types.SimpleNamespace(
        use_sequence_parallel=True, aux_hidden_state_layers=(0, 2, 3)
    )
    overrides = k3.KimiLinearModel.get_pp_intermediate_tensor_all_gather_overrides(
        model
    )
    assert overrides == {
        "hidden_states": False,
        "residual": False,
        "aux_hidden_states_0": False,
        "aux_hidden_states_1": False,
        "aux_hidden_states_2": False,
    }


def test_overrides_are_empty_without_sp():
    model = types.SimpleNamespace(
        use_sequence_parallel=False, aux_hidden_state_layers=(0, 2)
    )
    assert (
        k3.KimiLinearModel.get_pp_intermediate_tensor_all_gather_overrides(model) == {}
    )


@pytest.mark.parametrize(("sp", "tp"), [(True, 2), (True, 8), (False, 8)])
def test_model_declares_its_shard_rows_under_sp_and_nothing_without(
    sp, tp, monkeypatch
):
    monkeypatch.setattr(k3, "get_tensor_model_parallel_world_size", lambda: tp)
    model = types.SimpleNamespace(use_sequence_parallel=sp)
    get = k3.KimiLinearModel.get_pp_intermediate_tensor_num_rows
    for num_tokens in (1, tp - 1, tp, tp + 1, 17, 64):
        want = -(-num_tokens // tp) if sp else None
        assert get(model, num_tokens) == want, num_tokens


@pytest.mark.parametrize(
    ("wrapper", "inner"),
    [
        (k3.KimiLinearForCausalLM, "model"),
        (k3.KimiK3ForConditionalGeneration, "language_model"),
    ],
)
def test_wrappers_delegate_the_overrides_and_the_rows(wrapper, inner):
    declared = {"hidden_states": False, "aux_hidden_states_0": False}
    inner_model = types.SimpleNamespace(
        get_pp_intermediate_tensor_all_gather_overrides=lambda: declared,
        get_pp_intermediate_tensor_num_rows=lambda num_tokens: num_tokens + 100,
    )
    outer = object.__new__(wrapper)
    torch.nn.Module.__init__(outer)
    setattr(outer, inner, inner_model)
    assert wrapper.get_pp_intermediate_tensor_all_gather_overrides(outer) is declared
    assert wrapper.get_pp_intermediate_tensor_num_rows(outer, 17) == 117


METHODS = (
    "get_pp_intermediate_tensor_all_gather_overrides",
    "get_pp_intermediate_tensor_num_rows",
)


def test_multimodal_wrapper_reaches_the_text_model(monkeypatch):
    """The wrapper asks its text model each time: a drafter's aux layers,
    set after the model is loaded (and after a first question), add keys."""
    monkeypatch.setattr(k3, "get_tensor_model_parallel_world_size", lambda: 8)
    text_model = types.SimpleNamespace(
        use_sequence_parallel=True, aux_hidden_state_layers=()
    )
    causal_lm = types.SimpleNamespace(model=text_model)
    for name in METHODS:
        for obj, cls in (
            (text_model, k3.KimiLinearModel),
            (causal_lm, k3.KimiLinearForCausalLM),
        ):
            setattr(obj, name, types.MethodType(getattr(cls, name), obj))
    wrapper = object.__new__(k3.KimiK3ForConditionalGeneration)
    torch.nn.Module.__init__(wrapper)
    wrapper.language_model = causal_lm
    assert get_pp_all_gather_overrides(wrapper) == {
        "hidden_states": False,
        "residual": False,
    }
    assert get_pp_num_rows(wrapper, 17) == 3
    text_model.aux_hidden_state_layers = (3,)
    assert get_pp_all_gather_overrides(wrapper) == {
        "hidden_states": False,
        "residual": False,
        "aux_hidden_states_0": False,
    }
    assert get_pp_num_rows(wrapper, 17) == 3


def test_multimodal_wrapper_over_a_text_model_that_declares_nothing():
    """On XPU, vllm/models/kimi_k3/__init__.py pairs this wrapper with
    amd.linear.KimiLinearForCausalLM, which declares no overrides: the pair
    declares nothing either, as any model, instead of raising at every
    hand-off."""
    from vllm.models.kimi_k3.amd.linear import KimiLinearForCausalLM

    text_model = object.__new__(KimiLinearForCausalLM)
    torch.nn.Module.__init__(text_model)
    assert not supports_pp_all_gather_overrides(text_model)
    wrapper = object.__new__(k3.KimiK3ForConditionalGeneration)
    torch.nn.Module.__init__(wrapper)
    wrapper.language_model = text_model
    assert get_pp_all_gather_overrides(wrapper) == {}
    assert get_pp_num_rows(wrapper, 17) is None


def test_transport_helpers_ask_the_model_or_keep_the_default():
    declared = {"hidden_states": False}
    model = types.SimpleNamespace(
        get_pp_intermediate_tensor_all_gather_overrides=lambda: declared,
        get_pp_intermediate_tensor_num_rows=lambda num_tokens: num_tokens // 2,
    )
    assert get_pp_all_gather_overrides(model) is declared
    assert get_pp_num_rows(model, 17) == 8
    assert get_pp_all_gather_overrides(torch.nn.Linear(2, 2)) is None
    assert get_pp_num_rows(torch.nn.Linear(2, 2), 17) is None
    # Every Kimi K3 entry point declares the interface the runners ask.
    for cls in (
        k3.KimiLinearModel,
        k3.KimiLinearForCausalLM,
        k3.KimiK3ForConditionalGeneration,
    ):
        assert supports_pp_all_gather_overrides(cls), cls
    assert not supports_pp_all_gather_overrides(torch.nn.Linear)
