# SPDX-License-Identifier: Apache-2.0
"""Kimi K3 sequence parallelism (SP) across pipeline stages, at stage level.

The real ``KimiLinearModel.forward`` of the test bed's tiny model runs in a
one-rank world, with the SP collectives replaced by fakes that behave like TP
rank 0 of ``TP_SIZE`` ranks and a fake PP group that places the model on the
first, a middle or the last stage. The decision and the transport overrides
are tested without a model, in the upstream-bound
``vllm_overlay/tests/models/kimi_k3/test_kimi_k3_sequence_parallel_pp.py``.
"""

from __future__ import annotations

import types
from dataclasses import dataclass, field

import pytest
import torch

from tests.sppp_testbed.tiny_k3 import (
    HIDDEN,
    NUM_LAYERS,
    build_model,
    scenario_config,
    stand_ins,
)
from vllm.distributed import parallel_state
from vllm.models.common.ops.sequence_parallel import sp_shard_rows
from vllm.models.kimi_k3.nvidia import model as k3
from vllm.models.kimi_k3.nvidia import sequence_parallel as k3_sp
from vllm.sequence import IntermediateTensors

TP_SIZE = 2
TOKEN_COUNTS = [1, 3, 8, 17, 64]


# -- stage behaviour -----------------------------------------------------


@dataclass
class FakeSPCollectives:
    """``sp_shard``/``sp_all_gather``/``sp_reduce_scatter`` as TP rank 0 of
    ``TP_SIZE`` ranks sees them (the gather repeats the local shard), each
    call recorded with the input's shape."""

    calls: list[tuple[str, tuple[int, ...]]] = field(default_factory=list)

    def shard(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.append(("shard", tuple(x.shape)))
        return x[: rows(x.shape[0])]  # rank 0's rows lie within the sequence

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.append(("all_gather", tuple(x.shape)))
        return torch.cat([x] * TP_SIZE)

    def reduce_scatter(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.append(("reduce_scatter", tuple(x.shape)))
        return x[: rows(x.shape[0])]

    def count(self, op: str) -> int:
        return sum(name == op for name, _ in self.calls)


@pytest.fixture
def collectives(monkeypatch) -> FakeSPCollectives:
    fake = FakeSPCollectives()
    monkeypatch.setattr(k3, "sp_shard", fake.shard)
    monkeypatch.setattr(k3, "sp_all_gather", fake.all_gather)
    monkeypatch.setattr(k3_sp, "sp_all_gather", fake.all_gather)  # the end gather
    monkeypatch.setattr(k3, "sp_reduce_scatter", fake.reduce_scatter)
    monkeypatch.setattr(k3_sp, "get_tensor_model_parallel_world_size", lambda: TP_SIZE)
    return fake


@pytest.fixture
def make_stage(single_rank_world, monkeypatch):
    """``make_stage(first, last, layers, aux)``: the tiny model with SP on,
    placed on a PP stage of two or more that runs ``layers``."""
    exit_stack = stand_ins()
    exit_stack.__enter__()
    asked = []

    def decide(vllm_config) -> bool:
        asked.append(vllm_config)
        return True

    monkeypatch.setattr(k3, "use_kimi_k3_sequence_parallel", decide)
    real_groups = k3.get_pp_group, parallel_state.get_pp_group

    def make(
        first: bool,
        last: bool,
        layers: range,
        aux: tuple[int, ...] = (),
        attn_res: bool = False,
    ):
        # Built whole in the one-rank world, then placed on its stage.
        monkeypatch.setattr(k3, "get_pp_group", real_groups[0])
        monkeypatch.setattr(parallel_state, "get_pp_group", real_groups[1])
        model = build_model(scenario_config(1, 1, sp=False, attn_res=attn_res))
        group = types.SimpleNamespace(
            world_size=2, is_first_rank=first, is_last_rank=last
        )
        monkeypatch.setattr(k3, "get_pp_group", lambda: group)
        monkeypatch.setattr(parallel_state, "get_pp_group", lambda: group)
        model.start_layer, model.end_layer = layers.start, layers.stop
        if attn_res:  # the blocks a stage ending there keeps, as __init__ counts
            model.num_attn_res_blocks = -(-layers.stop // model.attn_res_block_size)
        model._set_aux_hidden_state_layers(aux)
        model.asked = asked
        return model

    yield make
    exit_stack.__exit__(None, None, None)


def rows(num_tokens: int) -> int:
    return sp_shard_rows(num_tokens, TP_SIZE)


def incoming(
    num_tokens: int, capacity: int | None = None, aux: int = 0, hand: int | None = None
):
    """What an earlier stage sends: this rank's rows; with ``capacity``, what
    a runner hands instead on a dummy run (profiling, capture): the leading
    ``hand`` rows (by default this rank's shard) of a persistent buffer of
    ``capacity`` rows, this rank's rows at its head."""
    generator = torch.Generator().manual_seed(num_tokens)
    local = {
        key: torch.randn(rows(num_tokens), HIDDEN, generator=generator)
        for key in ["hidden_states", "residual"]
        + [f"aux_hidden_states_{i}" for i in range(aux)]
    }
    if capacity is None:
        return IntermediateTensors(local)
    full = {k: torch.full((capacity, HIDDEN), 1e6) for k in local}
    for key, tensor in local.items():
        full[key][: tensor.shape[0]] = tensor
    return IntermediateTensors(full)[: rows(num_tokens) if hand is None else hand]


def test_model_and_every_layer_ask_the_one_decision(make_stage):
    model = make_stage(first=True, last=True, layers=range(NUM_LAYERS))
    assert len(model.asked) == 1 + NUM_LAYERS
    assert model.use_sequence_parallel
    assert all(layer.use_sequence_parallel for layer in model.layers)


@pytest.mark.parametrize("num_tokens", TOKEN_COUNTS)
def test_first_stage_shards_once_and_hands_on_local_rows(
    make_stage, collectives, num_tokens
):
    model = make_stage(first=True, last=False, layers=range(2), aux=(0, 2))
    ids = torch.arange(num_tokens) % 100
    output = model(ids, torch.arange(num_tokens), None)
    assert collectives.calls[0] == ("shard", (num_tokens, HIDDEN))
    assert collectives.count("shard") == 1
    assert isinstance(output, IntermediateTensors)
    assert {k: tuple(v.shape) for k, v in output.tensors.items()} == {
        "hidden_states": (rows(num_tokens), HIDDEN),
        "residual": (rows(num_tokens), HIDDEN),
        "aux_hidden_states_0": (rows(num_tokens), HIDDEN),
        "aux_hidden_states_1": (rows(num_tokens), HIDDEN),
    }
    # No gather outside the layers: one per layer's attention, none at the end.
    assert collectives.count("all_gather") == 2


@pytest.mark.parametrize("num_tokens", TOKEN_COUNTS)
def test_later_stage_never_shards_and_takes_its_shard_as_it_is(
    make_stage, collectives, num_tokens
):
    """What a dummy run hands (the leading shard rows of shard-sized
    buffers) runs as the received shard does."""
    model = make_stage(first=False, last=False, layers=range(2, 3))
    positions = torch.arange(num_tokens)
    local = model(None, positions, incoming(num_tokens))
    buffered = model(None, positions, incoming(num_tokens, capacity=64))
    assert collectives.count("shard") == 0
    for key in ("hidden_states", "residual"):
        assert local[key].shape == (rows(num_tokens), HIDDEN)
        torch.testing.assert_close(buffered[key], local[key], rtol=0, atol=0)


@pytest.mark.parametrize("num_tokens", [3, 8, 17, 64])
def test_later_stage_refuses_the_batchs_rows(make_stage, collectives, num_tokens):
    """A runner that skipped the row rule hands N rows of full-capacity
    buffers; the model takes only its shard and names what arrived."""
    model = make_stage(first=False, last=False, layers=range(2, 3))
    full = incoming(num_tokens, capacity=64 * TP_SIZE, hand=num_tokens)
    with pytest.raises(ValueError) as refused:
        model(None, torch.arange(num_tokens), full)
    assert str(refused.value).startswith(
        f"Received hidden_states with {num_tokens} rows for a batch of "
        f"N={num_tokens} tokens at TP={TP_SIZE}: a sequence-parallel hand-off "
        f"has ceil(N/TP)={rows(num_tokens)} rows."
    )


@pytest.mark.parametrize("num_tokens", [3, 8, 17, 64])
def test_later_stage_refuses_another_stages_shard(make_stage, collectives, num_tokens):
    """A sender that padded the batch to other N sends another shard size;
    slicing it would mix rows, so the model names what arrived instead."""
    model = make_stage(first=False, last=False, layers=range(2, 3))
    sender_rows = rows(num_tokens + 2 * TP_SIZE)
    received = incoming(num_tokens + 2 * TP_SIZE)
    with pytest.raises(ValueError) as refused:
        model(None, torch.arange(num_tokens), received)
    assert str(refused.value).startswith(
        f"Received hidden_states with {sender_rows} rows for a batch of "
        f"N={num_tokens} tokens at TP={TP_SIZE}: a sequence-parallel hand-off "
        f"has ceil(N/TP)={rows(num_tokens)} rows."
    )


@pytest.mark.parametrize("num_tokens", TOKEN_COUNTS)
def test_last_stage_gathers_once_with_relayed_aux(make_stage, collectives, num_tokens):
    """Aux layers 0 and 2 were captured upstream, 3 is local: one gather of
    [final | aux 0 | aux 1 | aux 2], trimmed to N and split in slot order."""
    model = make_stage(first=False, last=True, layers=range(2, 4), aux=(0, 2, 3))
    received = incoming(num_tokens, aux=2)
    hidden_states, aux = model(None, torch.arange(num_tokens), received)
    layer_gathers = 2
    assert collectives.count("shard") == 0
    assert collectives.count("all_gather") == layer_gathers + 1
    assert collectives.calls[-1] == ("all_gather", (rows(num_tokens), 4 * HIDDEN))
    assert hidden_states.shape == (num_tokens, HIDDEN)
    assert [tuple(t.shape) for t in aux] == [(num_tokens, HIDDEN)] * 3
    for slot in range(2):  # relayed shards come back in place, in order
        local_rows = min(rows(num_tokens), num_tokens)
        torch.testing.assert_close(
            aux[slot][:local_rows],
            received[f"aux_hidden_states_{slot}"][:local_rows],
            rtol=0,
            atol=0,
        )


@pytest.mark.parametrize("num_tokens", TOKEN_COUNTS)
def test_later_stage_with_an_empty_attn_res_bank_runs_as_the_first(
    make_stage, collectives, num_tokens
):
    """A later stage that starts at layer 0 (VLLM_PP_LAYER_PARTITION gave the
    first stage no layers) receives the embedding shard and a bank of zero
    AttnRes blocks; it must compute what the first stage would."""
    ids = torch.arange(num_tokens) % 100
    positions = torch.arange(num_tokens)
    first = make_stage(first=True, last=False, layers=range(2), attn_res=True)
    expected = first(ids, positions, None)
    embedded = collectives.shard(first.embed_input_ids(ids))
    later = make_stage(first=False, last=False, layers=range(2), attn_res=True)
    received = IntermediateTensors(
        {
            "hidden_states": embedded,
            "residual": embedded.new_zeros(embedded.shape[0], 0, HIDDEN),
        }
    )
    got = later(None, positions, received)
    for key in ("hidden_states", "residual"):
        assert got[key].shape == expected[key].shape
        torch.testing.assert_close(got[key], expected[key], rtol=0, atol=0)


# -- start-up checks -----------------------------------------------------


@pytest.mark.parametrize("layers", [(0, NUM_LAYERS + 1), (-1,)])
def test_aux_layers_outside_the_model_are_refused(make_stage, layers):
    model = make_stage(first=True, last=True, layers=range(NUM_LAYERS))
    with pytest.raises(ValueError, match="eagle_aux_hidden_state_layer_ids"):
        model._set_aux_hidden_state_layers(layers)


def test_attn_res_stream_tap_at_a_stage_boundary_is_refused(make_stage, monkeypatch):
    monkeypatch.setattr(k3.envs, "VLLM_KIMI_K3_AUX_ATTN_RES_STREAM", True)
    model = make_stage(first=True, last=False, layers=range(2))
    model.use_attn_res = True
    with pytest.raises(ValueError, match="VLLM_PP_LAYER_PARTITION") as error:
        model._set_aux_hidden_state_layers((1, 2))
    assert "VLLM_KIMI_K3_AUX_ATTN_RES_STREAM" in str(error.value)
    model._set_aux_hidden_state_layers((1, 3))  # inside a stage: fine
