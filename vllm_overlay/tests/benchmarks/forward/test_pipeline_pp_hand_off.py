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

import types

import pytest
import torch

from vllm.benchmarks.forward import pipeline
from vllm.model_executor.models.interfaces import get_pp_hand_off_declaration
from vllm.models.common.ops.sequence_parallel import sp_shard_rows
from vllm.sequence import IntermediateTensors

CAPACITY = 128  # max_num_tokens rows of the runner's persistent buffers
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
        {key: torch.zeros(CAPACITY, HIDDEN) for key in OVERRIDES}
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
    inputs = {"input_ids": None, "intermediate_tensors": buffers[:num_tokens]}
    pipeline.PipelineBench._prepare_stage(bench, **inputs)

    assert pp_group.calls == [("recv", OVERRIDES), ("send", OVERRIDES)]
    (model_input,) = handed
    assert model_input is bench.input_tensors
    for key, tensor in received.items():
        torch.testing.assert_close(model_input[key], tensor, rtol=0, atol=0)
        # In the runner's persistent buffers, where the stream copies later.
        assert model_input[key].data_ptr() == buffers[key].data_ptr()
