# SPDX-License-Identifier: Apache-2.0
"""Kimi K3.1's DSA layers (vLLM 0.34.0) built by the real
``KimiLinearModel.__init__``, in a one-rank world: the model-level top-k
buffer is sized from the parallel config and the scheduler's budget, every
layer ``dsa_config`` names gets the DSA attention (the test bed's stand-in,
which reads that buffer), and a step of the whole budget runs.

A series that dropped ``parallel_config = vllm_config.parallel_config`` from
``KimiLinearModel.__init__`` (0.33.0's hunk of patch 0003, which applies to
0.34.0 cleanly) fails here with a ``NameError`` as the model is built."""

from __future__ import annotations

import pytest
import torch

from tests.sppp_testbed.bases import only_from_0_34
from tests.sppp_testbed.tiny_k3 import (
    DSA_INDEX_TOPK,
    HIDDEN,
    MAX_NUM_BATCHED_TOKENS,
    NUM_LAYERS,
    build_model,
    scenario_config,
    stand_ins,
)

pytestmark = only_from_0_34("Kimi K3's DSA layers (dsa_config) are new in 0.34.0")


@pytest.fixture
def dsa_model(single_rank_world):
    config = scenario_config(1, 1, sp=False, dsa=True)
    with stand_ins(), torch.no_grad():
        yield config, build_model(config)


def test_dsa_layers_share_one_top_k_buffer_sized_by_the_budget(dsa_model):
    config, model = dsa_model
    hf_config = config.model_config.hf_text_config
    buffer = model.topk_indices_buffer
    assert buffer is not None
    # No decode context parallelism: no slack rows.
    assert buffer.shape == (MAX_NUM_BATCHED_TOKENS, DSA_INDEX_TOPK)
    assert buffer.dtype == torch.int32
    kinds = [type(layer.self_attn).__name__ for layer in model.layers]
    assert kinds == [
        "SparseSequenceMixer" if hf_config.is_dsa_layer(i) else "SequenceMixer"
        for i in range(NUM_LAYERS)
    ]
    assert kinds.count("SparseSequenceMixer") == NUM_LAYERS // 2
    for layer in model.layers:
        if hf_config.is_dsa_layer(layer.layer_idx):
            assert layer.self_attn.topk_indices_buffer is buffer


@pytest.mark.parametrize("num_tokens", [1, 3, MAX_NUM_BATCHED_TOKENS])
def test_a_step_up_to_the_budget_runs_through_the_buffer(dsa_model, num_tokens):
    _, model = dsa_model
    ids = torch.arange(num_tokens) % 100
    with stand_ins(), torch.no_grad():
        out = model(ids, torch.arange(num_tokens), None)
    assert out.shape == (num_tokens, HIDDEN)
    assert torch.isfinite(out).all()
    written = model.topk_indices_buffer[:num_tokens]
    # Token i attends to at most i + 1 earlier tokens, itself included.
    assert (written < torch.arange(num_tokens)[:, None] + 1).all()
    assert (
        (written >= 0).sum(dim=1)
        == torch.arange(num_tokens).clamp(max=DSA_INDEX_TOPK - 1) + 1
    ).all()


def test_a_step_above_the_budget_is_refused(dsa_model):
    _, model = dsa_model
    num_tokens = MAX_NUM_BATCHED_TOKENS + 1
    with (
        stand_ins(),
        torch.no_grad(),
        pytest.raises(ValueError, match=f"DSA got {num_tokens} tokens"),
    ):
        model(torch.zeros(num_tokens, dtype=torch.long), torch.arange(num_tokens), None)
