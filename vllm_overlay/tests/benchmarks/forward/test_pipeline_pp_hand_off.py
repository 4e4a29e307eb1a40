# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""``vllm bench forward`` with PP hands intermediate tensors over as the
model runners do: with the model's ``all_gather_tensors`` and through
``hand_over_intermediate_tensors``, so a model that keeps stage outputs
sequence parallel gets exactly the shard it was sent.

``PipelineBench._prepare_stage`` runs unbound on a fake that holds only the
state it touches; the PP group is a fake that records what it is asked.
"""

from __future__ import annotations

import contextlib
import functools
import types

import pytest
import torch

from vllm.benchmarks.forward import pipeline
from vllm.distributed.parallel_state import GroupCoordinator
from vllm.model_executor.models.interfaces import get_pp_hand_off_declaration
from vllm.models.common.ops.sequence_parallel import sp_shard_rows
from vllm.sequence import IntermediateTensors
from vllm.v1.worker.pp_intermediate_tensors import (
    hand_off_rows,
    hand_over_intermediate_tensors,
)

CAPACITY = 128  # max_num_tokens: the runner's buffers hold its declared rows
HIDDEN = 8
OVERRIDES = {"hidden_states": False, "residual": False}


class ShardedModel:
    """Declares its hand-off as TP shards of ``ceil(N / TP)`` rows."""

    def __init__(self, tp: int) -> None:
        self.tp = tp

    def get_pp_intermediate_tensor_all_gather_overrides(self) -> dict[str, bool]:
        return OVERRIDES

    def get_pp_intermediate_tensor_num_rows(self, num_tokens: int) -> int:
        return sp_shard_rows(num_tokens, self.tp)


class FakePPGroup:
    is_first_rank = False
    is_last_rank = False

    def __init__(self, received: dict[str, torch.Tensor]) -> None:
        self.received = received
        self.calls: list[tuple[str, dict[str, bool] | None]] = []

    def recv_tensor_dict(self, all_gather_group, all_gather_tensors=None):
        self.calls.append(("recv", all_gather_tensors))
        return self.received

    def send_tensor_dict(self, tensors, all_gather_group, all_gather_tensors=None):
        self.calls.append(("send", all_gather_tensors))


@pytest.mark.parametrize(("num_tokens", "tp"), [(1, 2), (17, 2), (64, 8), (9, 4)])
def test_later_stage_gets_exactly_the_shard_it_was_sent(num_tokens, tp, monkeypatch):
    rows = sp_shard_rows(num_tokens, tp)
    generator = torch.Generator().manual_seed(num_tokens)
    received = {
        key: torch.randn(rows, HIDDEN, generator=generator) for key in OVERRIDES
    }
    pp_group = FakePPGroup(received)
    monkeypatch.setattr(pipeline, "get_pp_group", lambda: pp_group)
    monkeypatch.setattr(pipeline, "get_tp_group", lambda: None)
    monkeypatch.setattr(pipeline, "write_input_ids", lambda *args: None)
    buffers = IntermediateTensors(
        {key: torch.zeros(sp_shard_rows(CAPACITY, tp), HIDDEN) for key in OVERRIDES}
    )
    handed = []

    def make_forward(inputs):
        def run_model():
            handed.append(inputs["intermediate_tensors"])
            return inputs["intermediate_tensors"]  # a stage that passes rows on

        return run_model

    bench = types.SimpleNamespace(
        all_gather_tensors=OVERRIDES,
        hand_off=get_pp_hand_off_declaration(ShardedModel(tp)),
        batch=None,
        _input_batch=types.SimpleNamespace(num_tokens_after_padding=num_tokens),
        _make_forward=make_forward,
        state_views=[],
        drafter=None,
    )
    inputs = {"input_ids": None, "intermediate_tensors": buffers[:rows]}
    pipeline.PipelineBench._prepare_stage(bench, **inputs)

    assert pp_group.calls == [("recv", OVERRIDES), ("send", OVERRIDES)]
    (model_input,) = handed
    assert model_input is bench.input_tensors
    for key, tensor in received.items():
        torch.testing.assert_close(model_input[key], tensor, rtol=0, atol=0)
        # In the runner's persistent buffers, where the stream copies later.
        assert model_input[key].data_ptr() == buffers[key].data_ptr()


class StreamingPPGroup(FakePPGroup):
    """A middle stage's PP group as ``run`` and ``_stream`` use it; whether a
    tensor is sliced for an all-gather is the transport's own decision."""

    rank_in_group = 1
    ranks = [0, 1, 2]
    world_size = 3
    device_group = None
    _should_use_all_gather = GroupCoordinator._should_use_all_gather


class StageModel(ShardedModel):
    def forward(self, **inputs):
        raise AssertionError("run() swaps in _prepare_stage")


class Runner:
    """What of Model Runner V2 ``PipelineBench.run`` drives: its
    ``execute_model`` prepares the batch, hands the given tensors over as the
    runner's own ``execute_model`` does (``hand_over_intermediate_tensors``
    with the declaration ``load_model`` kept), then calls the model."""

    pcp_manager = None
    execute_model_state = None

    def __init__(self, model: StageModel, num_tokens: int) -> None:
        self.model, self.num_tokens = model, num_tokens
        self._pp_hand_off = get_pp_hand_off_declaration(model)
        rows = hand_off_rows(CAPACITY, self._pp_hand_off)
        self.intermediate_tensors = IntermediateTensors(
            {key: torch.zeros(rows, HIDDEN) for key in OVERRIDES}
        )

    def prepare_inputs(self):
        n = self.num_tokens
        return types.SimpleNamespace(
            num_tokens=n, num_tokens_after_padding=n, req_ids=["r"]
        )

    def execute_model(self, scheduler_output, intermediate_tensors):
        batch = self.prepare_inputs()
        handed = hand_over_intermediate_tensors(
            self.intermediate_tensors,
            intermediate_tensors,
            batch.num_tokens_after_padding,
            self._pp_hand_off,
        )
        return self.model.forward(input_ids=None, intermediate_tensors=handed)


@pytest.mark.parametrize(("num_tokens", "tp"), [(5, 2), (17, 4)])
def test_a_middle_stage_streams_whole_shards_both_ways(num_tokens, tp, monkeypatch):
    """``PipelineBench.run`` on a middle stage, through ``_stream``: the
    placeholder the runner checks has the shard's rows, and every streamed
    receive and send moves the whole shard (no 1/TP slice, no all-gather)."""
    rows = sp_shard_rows(num_tokens, tp)
    generator = torch.Generator().manual_seed(num_tokens)

    def shard() -> dict[str, torch.Tensor]:
        return {k: torch.randn(rows, HIDDEN, generator=generator) for k in OVERRIDES}

    pp_group = StreamingPPGroup(shard())
    received: list[torch.Tensor] = []  # each streamed receive's last data
    sent: list[torch.Tensor] = []

    def irecv(buffer, src, group):
        # The previous stage streams its whole shard: a buffer of another
        # size cannot take it.
        buffer.copy_(torch.randn(rows, HIDDEN, generator=generator))
        received.append(buffer)
        return types.SimpleNamespace(wait=lambda: None)

    def isend(tensor, dst, group):
        sent.append(tensor)
        return types.SimpleNamespace(wait=lambda: None)

    tp_group = types.SimpleNamespace(world_size=tp, rank_in_group=0)
    monkeypatch.setattr(pipeline, "get_pp_group", lambda: pp_group)
    monkeypatch.setattr(pipeline, "get_tp_group", lambda: tp_group)
    monkeypatch.setattr(
        pipeline, "get_world_group", lambda: types.SimpleNamespace(cpu_group=None)
    )
    monkeypatch.setattr(pipeline, "write_input_ids", lambda *args: None)
    monkeypatch.setattr(pipeline.dist, "barrier", lambda group: None)
    monkeypatch.setattr(pipeline.dist, "irecv", irecv)
    monkeypatch.setattr(pipeline.dist, "isend", isend)
    monkeypatch.setattr(torch.cuda.profiler, "start", lambda: None)
    monkeypatch.setattr(torch.cuda.profiler, "stop", lambda: None)
    monkeypatch.setattr(torch.cuda.nvtx, "range", lambda name: contextlib.nullcontext())
    monkeypatch.setattr(torch.accelerator, "synchronize", lambda: None)

    def make_forward(inputs):
        # A stage that adds one to every row it was handed.
        return lambda: IntermediateTensors(
            {k: v + 1 for k, v in inputs["intermediate_tensors"].items()}
        )

    replay = types.SimpleNamespace(replay=lambda: None)
    bench = types.SimpleNamespace(
        runner=Runner(StageModel(tp), num_tokens),
        batch=types.SimpleNamespace(scheduler_output=None),
        result={},
        _check_batch=lambda batch: None,
        _make_forward=make_forward,
        state_views=[],
        drafter=None,
        iters=1,
        samples=1,
        name="stage",
        profile_prefix=None,
        graph=replay,
        reset_graph=replay,
    )
    bench._prepare_stage = functools.partial(
        pipeline.PipelineBench._prepare_stage, bench
    )
    bench._capture_stage = lambda: setattr(bench, "output", bench._run_model())
    # Both streams in profile mode: the timed one needs CUDA events.
    bench._stream = lambda profile=False: pipeline.PipelineBench._stream(
        bench, profile=True
    )
    pipeline.PipelineBench.run(bench)

    assert pp_group.calls == [("recv", OVERRIDES), ("send", OVERRIDES)]
    inputs = bench.input_tensors
    assert received and sent
    for tensor in received:  # straight into the model's input rows
        assert any(tensor.data_ptr() == v.data_ptr() for v in inputs.tensors.values())
        assert tensor.shape == (rows, HIDDEN)
    outputs = {v.data_ptr(): v for v in bench.output.tensors.values()}
    for tensor in sent:  # the stage's whole output shard
        assert outputs[tensor.data_ptr()].shape == tensor.shape == (rows, HIDDEN)
    for key, tensor in inputs.tensors.items():
        assert tensor.data_ptr() == bench.runner.intermediate_tensors[key].data_ptr()
