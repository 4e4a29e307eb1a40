# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The rows both model runners hand a model after a PP hand-off, and the rows
V2 CUDA graph replay returns, when the model keeps its stage outputs
sequence parallel: each TP rank receives ``c = ceil(N / TP)`` rows.

The runners' methods run unbound on fakes that hold only the persistent
buffers they touch, sized as the runners allocate them (``max_num_tokens``
rows, or their shard for a sequence-parallel model) and the model they ask
what it expects: ``ShardedModel`` declares its shard,
``REPLICATED`` stands for every model that declares nothing.
"""

from __future__ import annotations

import inspect
import types

import pytest
import torch

from vllm.config import CUDAGraphMode
from vllm.model_executor.models.interfaces import (
    PPHandOffDeclaration,
    get_pp_hand_off_declaration,
)
from vllm.models.common.ops.sequence_parallel import sp_shard_rows
from vllm.models.kimi_k3.nvidia import sequence_parallel as k3_sp
from vllm.sequence import IntermediateTensors
from vllm.v1.worker import pp_intermediate_tensors as pp_rows
from vllm.v1.worker.gpu.cudagraph_utils import (
    BatchExecutionDescriptor,
    CudaGraphManager,
    ModelCudaGraphManager,
)
from vllm.v1.worker.gpu.model_runner import GPUModelRunner as V2ModelRunner
from vllm.v1.worker.gpu.pp_utils import PPHandler
from vllm.v1.worker.gpu_model_runner import GPUModelRunner

TOKEN_COUNTS = [1, 3, 8, 17, 64]
TP_SIZES = [2, 4, 8]
CAPACITY = 128  # max_num_tokens
HIDDEN = 8
BANK = 2  # AttnRes blocks behind the stage: the residual is 3-D


def hand_off(rows: int, seed: int = 0) -> IntermediateTensors:
    generator = torch.Generator().manual_seed(seed)
    return IntermediateTensors(
        {
            "hidden_states": torch.randn(rows, HIDDEN, generator=generator),
            "residual": torch.randn(rows, BANK, HIDDEN, generator=generator),
            "aux_hidden_states_0": torch.randn(rows, HIDDEN, generator=generator),
        }
    )


def persistent_buffers(tp: int | None = None) -> IntermediateTensors:
    """The runner's receive buffers: ``max_num_tokens`` rows for a model that
    declares nothing, the shard of ``max_num_tokens`` for a TP-``tp`` one."""
    rows = CAPACITY if tp is None else sp_shard_rows(CAPACITY, tp)
    return IntermediateTensors(
        {k: torch.zeros(rows, *v.shape[1:]) for k, v in hand_off(1).items()}
    )


class ShardedModel:
    """Declares its hand-off as TP shards of ``ceil(N / TP)`` rows."""

    def __init__(self, tp: int) -> None:
        self.tp = tp

    def get_pp_intermediate_tensor_all_gather_overrides(self) -> dict[str, bool]:
        return {key: False for key in hand_off(1).tensors}

    def get_pp_intermediate_tensor_num_rows(self, num_tokens: int) -> int:
        return sp_shard_rows(num_tokens, self.tp)


REPLICATED = object()  # a model that declares nothing, as every other model


def legacy_runner(model: object, tp: int | None = None) -> types.SimpleNamespace:
    """The legacy runner's state after load_model took ``model``'s
    declaration and _dummy_run allocated its buffers (TP-``tp`` shards)."""
    return types.SimpleNamespace(
        intermediate_tensors=persistent_buffers(tp),
        _pp_hand_off=get_pp_hand_off_declaration(model),
    )


def row_rule(model: object) -> PPHandOffDeclaration:
    """The declaration a runner keeps from ``model``."""
    return get_pp_hand_off_declaration(model)


def test_row_count_is_the_one_every_tensor_shares():
    assert pp_rows.intermediate_tensors_num_rows(hand_off(9)) == 9
    mixed = IntermediateTensors(
        {"hidden_states": torch.zeros(9, HIDDEN), "residual": torch.zeros(64, 4)}
    )
    with pytest.raises(ValueError, match="hidden_states: 9, residual: 64"):
        pp_rows.intermediate_tensors_num_rows(mixed)
    with pytest.raises(ValueError, match="got none"):
        pp_rows.intermediate_tensors_num_rows(IntermediateTensors({}))


@pytest.mark.parametrize("tp", TP_SIZES)
@pytest.mark.parametrize("num_tokens", TOKEN_COUNTS)
def test_a_hand_off_is_accepted_as_the_model_declares_it(num_tokens, tp):
    """A sharded hand-off must be exactly the declared shard; a replicated
    one at least the batch, as 0.33.0's copy needs."""
    shard = sp_shard_rows(num_tokens, tp)
    accepted = {
        rows
        for rows in range(2 * CAPACITY)
        if pp_rows.accepts_hand_off(rows, num_tokens, shard)
    }
    assert accepted == {shard}
    replicated = {
        rows
        for rows in range(2 * CAPACITY)
        if pp_rows.accepts_hand_off(rows, num_tokens, None)
    }
    assert replicated == set(range(num_tokens, 2 * CAPACITY))


def test_hand_off_rows_are_the_declared_rows_or_the_tokens():
    """Buffers are sized with the model's own row rule: its shard of the
    capacity under SP, the capacity itself for every other model."""
    for tp in TP_SIZES:
        rule = row_rule(ShardedModel(tp))
        for num_tokens in (*TOKEN_COUNTS, CAPACITY):
            assert pp_rows.hand_off_rows(num_tokens, rule) == -(-num_tokens // tp)
    for num_tokens in (*TOKEN_COUNTS, CAPACITY):
        assert pp_rows.hand_off_rows(num_tokens, row_rule(REPLICATED)) == num_tokens


@pytest.mark.parametrize("tp", TP_SIZES)
@pytest.mark.parametrize("num_tokens", TOKEN_COUNTS)
def test_model_refuses_rows_other_than_its_shard(num_tokens, tp, monkeypatch):
    """Every run hands the model its shard. Stages that padded a batch
    differently send another shard size, and a runner that skipped the row
    rule hands the batch's rows; using either would mix rows silently."""
    monkeypatch.setattr(k3_sp, "get_tensor_model_parallel_world_size", lambda: tp)
    shard = sp_shard_rows(num_tokens, tp)
    received = hand_off(shard)
    assert k3_sp.check_sequence_parallel_rows(received, num_tokens) is received
    for rows in {shard - 1, shard + 1, num_tokens, num_tokens + 1} - {0, shard}:
        with pytest.raises(ValueError) as refused:
            k3_sp.check_sequence_parallel_rows(hand_off(rows), num_tokens)
        assert str(refused.value).startswith(
            f"Received hidden_states with {rows} rows for a batch of "
            f"N={num_tokens} tokens at TP={tp}: a sequence-parallel hand-off "
            f"has ceil(N/TP)={shard} rows."
        )


@pytest.mark.parametrize("tp", TP_SIZES)
@pytest.mark.parametrize("num_tokens", TOKEN_COUNTS)
def test_legacy_real_step_hands_exactly_the_received_shard(num_tokens, tp):
    runner = legacy_runner(ShardedModel(tp), tp)
    received = hand_off(sp_shard_rows(num_tokens, tp), seed=num_tokens)
    handed = GPUModelRunner.sync_and_gather_intermediate_tensors(
        runner, num_tokens, received, True
    )
    for key, tensor in handed.items():
        assert tensor.shape == received[key].shape, key
        # The leading rows of the persistent buffer: where capture reads.
        assert tensor.data_ptr() == runner.intermediate_tensors[key].data_ptr()
        torch.testing.assert_close(tensor, received[key], rtol=0, atol=0)


@pytest.mark.parametrize("tp", TP_SIZES)
@pytest.mark.parametrize("num_tokens", TOKEN_COUNTS)
def test_legacy_dummy_runs_hand_the_rows_a_real_step_hands(num_tokens, tp, monkeypatch):
    """Dummy runs, profiling and capture hand the leading shard rows of the
    shard-sized buffers: the rows and addresses a real step writes, which
    the model takes as they are."""
    monkeypatch.setattr(k3_sp, "get_tensor_model_parallel_world_size", lambda: tp)
    runner = legacy_runner(ShardedModel(tp), tp)
    handed = GPUModelRunner.sync_and_gather_intermediate_tensors(
        runner, num_tokens, None, False
    )
    assert k3_sp.check_sequence_parallel_rows(handed, num_tokens) is handed
    for key, tensor in handed.items():
        assert tensor.shape[0] == sp_shard_rows(num_tokens, tp)
        assert tensor.data_ptr() == runner.intermediate_tensors[key].data_ptr()


@pytest.mark.parametrize("num_tokens", TOKEN_COUNTS)
def test_legacy_real_step_without_sp_is_unchanged(num_tokens):
    runner = legacy_runner(REPLICATED)
    received = hand_off(num_tokens)
    handed = GPUModelRunner.sync_and_gather_intermediate_tensors(
        runner, num_tokens, received, True
    )
    assert {t.shape[0] for t in handed.tensors.values()} == {num_tokens}


@pytest.mark.parametrize("num_tokens", TOKEN_COUNTS)
def test_both_runners_cut_a_hand_off_longer_than_the_batch(num_tokens):
    """A sender's whole ``max_num_tokens``-row buffers (what ``vllm bench
    forward`` hands over) reach the model as their first ``num_tokens`` rows,
    through either runner, as 0.33.0 cut every hand-off."""
    received = hand_off(CAPACITY, seed=num_tokens)
    legacy = GPUModelRunner.sync_and_gather_intermediate_tensors(
        legacy_runner(REPLICATED), num_tokens, received, True
    )
    v2 = pp_rows.hand_over_intermediate_tensors(
        persistent_buffers(), received, num_tokens, row_rule(REPLICATED)
    )
    for handed in (legacy, v2):
        for key, tensor in handed.items():
            expected = received[key][:num_tokens]
            torch.testing.assert_close(tensor, expected, rtol=0, atol=0)


def graph_manager() -> ModelCudaGraphManager:
    """The V2 graph manager's output state only: no devices, no graphs."""
    manager = ModelCudaGraphManager.__new__(ModelCudaGraphManager)
    manager.is_last_pp_rank = False
    manager.intermediate_tensors = None
    manager.intermediate_rows = {}
    return manager


@pytest.mark.parametrize("tp", TP_SIZES)
def test_graphs_record_their_rows_and_replay_returns_them(tp, monkeypatch):
    replayed = []
    monkeypatch.setattr(
        CudaGraphManager, "run_fullgraph", lambda self, desc: replayed.append(desc)
    )
    manager = graph_manager()
    descs = {
        n: BatchExecutionDescriptor(CUDAGraphMode.FULL, num_tokens=n, num_reqs=n)
        for n in sorted(TOKEN_COUNTS, reverse=True)  # capture: largest first
    }
    outputs = {
        n: hand_off(sp_shard_rows(n, tp), seed=n) for n in descs
    }  # fmt: skip
    for n, desc in descs.items():
        manager.store_intermediate_tensors(desc, outputs[n])
    largest = sp_shard_rows(max(TOKEN_COUNTS), tp)
    # Later, smaller captures did not shrink the buffers the first allocated.
    assert {t.shape[0] for t in manager.intermediate_tensors.tensors.values()} == {
        largest
    }
    for n, desc in descs.items():
        assert manager.intermediate_rows[desc] == sp_shard_rows(n, tp)
        view = manager.run_fullgraph(desc)
        assert isinstance(view, IntermediateTensors)
        for key, tensor in view.items():
            assert tensor.shape == outputs[n][key].shape
            assert tensor.data_ptr() == manager.intermediate_tensors[key].data_ptr()
    assert replayed == list(descs.values())
    # What the last capture (the smallest) wrote is what its replay returns.
    smallest = min(TOKEN_COUNTS)
    torch.testing.assert_close(
        manager.run_fullgraph(descs[smallest])["hidden_states"],
        outputs[smallest]["hidden_states"],
        rtol=0,
        atol=0,
    )


@pytest.mark.parametrize("tp", TP_SIZES)
@pytest.mark.parametrize("num_tokens", TOKEN_COUNTS)
def test_v2_hand_over_copies_real_steps_and_passes_dummy_buffers(num_tokens, tp):
    """What the V2 runner's execute_model hands over, real step and dummy
    run (memory and graph profiling go through the dummy run)."""
    buffers = persistent_buffers(tp)
    received = hand_off(sp_shard_rows(num_tokens, tp), seed=tp)
    rule = row_rule(ShardedModel(tp))
    real = pp_rows.hand_over_intermediate_tensors(buffers, received, num_tokens, rule)
    dummy = pp_rows.hand_over_intermediate_tensors(buffers, None, num_tokens, rule)
    for key in received.tensors:
        torch.testing.assert_close(real[key], received[key], rtol=0, atol=0)
        assert dummy[key].shape == real[key].shape  # the same rows
        assert real[key].data_ptr() == dummy[key].data_ptr()  # at one address


def test_v2_relay_hands_on_as_many_rows_as_the_stage_outputs():
    """TP8, a 64-token step: the stage outputs its 8-row shard, while the
    relayed aux state came in as 64 rows (a runner that handed full buffers,
    as before they were shard-sized). Relayed rows must match the output's,
    or the hand-off mixes 64 and 8 rows."""
    handler = types.SimpleNamespace(
        aux_hidden_state_relay_keys=("aux_hidden_states_0",)
    )
    inputs = persistent_buffers()[:64]
    output = IntermediateTensors(
        {k: v for k, v in hand_off(8).items() if not k.startswith("aux")}
    )
    relayed = PPHandler.relay_aux_hidden_states(handler, inputs, output)
    assert pp_rows.intermediate_tensors_num_rows(relayed) == 8
    assert relayed["aux_hidden_states_0"].data_ptr() == (
        inputs["aux_hidden_states_0"].data_ptr()
    )


def test_buffers_keep_their_capacity_when_a_hand_over_raises():
    """Views are sliced per call, never narrowed in place: a hand-over that
    fails leaves the persistent buffers at the shard of ``max_num_tokens``."""
    buffers = persistent_buffers(8)
    capacity = sp_shard_rows(CAPACITY, 8)
    mixed = IntermediateTensors(
        {
            "hidden_states": torch.zeros(8, HIDDEN),
            "residual": torch.zeros(64, BANK, HIDDEN),
        }
    )
    model = row_rule(ShardedModel(8))
    with pytest.raises(ValueError, match="hidden_states: 8, residual: 64"):
        pp_rows.hand_over_intermediate_tensors(buffers, mixed, 64, model)
    assert {t.shape[0] for t in buffers.tensors.values()} == {capacity}
    with pytest.raises(ValueError, match="of 9 rows for a step of 64 tokens"):
        pp_rows.hand_over_intermediate_tensors(buffers, hand_off(9), 64, model)
    assert {t.shape[0] for t in buffers.tensors.values()} == {capacity}
    handed = pp_rows.hand_over_intermediate_tensors(buffers, hand_off(8), 64, model)
    assert {t.shape[0] for t in handed.tensors.values()} == {8}
    assert {t.shape[0] for t in buffers.tensors.values()} == {capacity}


@pytest.mark.parametrize("tp", TP_SIZES)
@pytest.mark.parametrize("num_tokens", TOKEN_COUNTS)
def test_runners_refuse_a_shard_of_other_rows_before_the_copy(num_tokens, tp):
    """Stages that padded a batch differently send another shard size. The
    runner refuses it before the copy, so a step replayed from a CUDA graph,
    where the model's own code does not run, is checked too."""
    shard = sp_shard_rows(num_tokens, tp)
    for rows in sorted({shard - 1, shard + 1, num_tokens, CAPACITY} - {0, shard}):
        runner = legacy_runner(ShardedModel(tp), tp)
        with pytest.raises(ValueError) as refused:
            GPUModelRunner.sync_and_gather_intermediate_tensors(
                runner, num_tokens, hand_off(rows, seed=1), True
            )
        assert str(refused.value).startswith(
            f"Received PP intermediate tensors of {rows} rows for a step of "
            f"{num_tokens} tokens where this stage expects {shard}: the stages "
            "padded the batch differently."
        )
        untouched = runner.intermediate_tensors
        assert all(not t.any() for t in untouched.tensors.values()), rows


@pytest.mark.parametrize("num_tokens", [3, 17, 64])
def test_runners_refuse_a_replicated_hand_off_shorter_than_the_batch(num_tokens):
    """0.33.0 failed on this copy's shapes; the message now names the rows."""
    with pytest.raises(ValueError, match=f"expects at least {num_tokens}:"):
        GPUModelRunner.sync_and_gather_intermediate_tensors(
            legacy_runner(REPLICATED), num_tokens, hand_off(num_tokens - 1), True
        )


def test_v2_hands_over_before_it_replays_a_graph():
    """The V2 runner's hand-over (and its row check) runs before the FULL
    graph replay reads the buffers it fills."""
    source = inspect.getsource(V2ModelRunner.execute_model)
    hand_over = source.index("hand_over_intermediate_tensors(")
    assert "self._pp_hand_off," in source[hand_over : hand_over + 400]
    assert hand_over < source.index("self.cudagraph_manager.run_fullgraph(")
