# SPDX-License-Identifier: Apache-2.0
"""The tiny Kimi K3 across real TP×PP ranks against a single-process reference.

These are the configurations vLLM 0.33.0 supports (SP with PP=1, PP without
SP, TP without SP); they must match the TP1×PP1 reference. The tolerance is
float64 summation order across TP shards (all-reduce, reduce-scatter), far
below any row-order or padding error, which moves results by O(1).
"""

from __future__ import annotations

import pytest
import torch

from tests.sppp_testbed.launcher import RankPool
from tests.sppp_testbed.stages import forward_stages

TOLERANCE = 1e-12
TOPOLOGIES = [(2, 1), (1, 2), (2, 2)]


def token_counts(tp: int) -> list[int]:
    return sorted({1, max(tp - 1, 1), tp, tp + 1, 17, 64})


@pytest.fixture(scope="module")
def reference():
    pool = RankPool(tp=1, pp=1)
    outputs: dict[int, torch.Tensor] = {}

    def output(num_tokens: int) -> torch.Tensor:
        if num_tokens not in outputs:
            (result,) = pool.run(forward_stages, False, num_tokens)
            outputs[num_tokens] = result["output"]
        return outputs[num_tokens]

    yield output
    pool.close()


@pytest.fixture(scope="module")
def pool(request):
    pool = RankPool(*request.param)
    yield pool
    pool.close()


def topologies(*shapes: tuple[int, int]):
    ids = [f"TP{tp}xPP{pp}" for tp, pp in shapes]
    return pytest.mark.parametrize("pool", shapes, ids=ids, indirect=True)


@topologies(*TOPOLOGIES)
def test_supported_configurations_match_the_reference(pool, reference):
    sp_choices = [False, True] if pool.pp == 1 and pool.tp > 1 else [False]
    for sp in sp_choices:
        for num_tokens in token_counts(pool.tp):
            results = pool.run(forward_stages, sp, num_tokens)
            assert [r["sequence_parallel"] for r in results] == [sp] * pool.world
            for rank in range(pool.world - pool.tp, pool.world):
                output = results[rank]["output"]
                expected = reference(num_tokens)
                assert output.shape == expected.shape, (sp, num_tokens, rank)
                error = (output - expected).abs().max().item()
                assert error < TOLERANCE, (sp, num_tokens, rank, error)


@topologies((2, 2))
def test_sp_with_pp_is_silently_off_in_unpatched_vllm(pool, reference):
    """What 0.33.0 does today; the model patch is expected to change this."""
    results = pool.run(forward_stages, True, 17)
    assert [r["sequence_parallel"] for r in results] == [False] * pool.world
    output = results[-1]["output"]
    assert (output - reference(17)).abs().max().item() < TOLERANCE
