# SPDX-License-Identifier: Apache-2.0
"""What vLLM already supports gives bit-identical results with the patch set
applied (the interpreter's own venv: ``.venv`` for 0.34.0, ``.venv-0.33.0``
for 0.33.0) and without it (a linked pristine tree of the same release).
"""

from __future__ import annotations

import pytest
import torch

import vllm
from tests.distributed.conftest import topologies
from tests.distributed.test_kimi_k3_stages import supported_scenarios
from tests.sppp_testbed.launcher import RankPool
from tests.sppp_testbed.stages import run_step


def vllm_location() -> str:
    return vllm.__file__


@pytest.fixture(scope="module")
def pristine_pool(pool, pools, pristine_vllm) -> RankPool:
    return pools(pool.tp, pool.pp, vllm_root=pristine_vllm)


@topologies((2, 1), (1, 2))
def test_supported_configurations_are_bit_identical_patched_and_pristine(
    pool, pristine_pool
):
    locations = pristine_pool.run(vllm_location)
    assert all(loc.startswith(pristine_pool.vllm_root) for loc in locations)
    assert not pool.run(vllm_location)[0].startswith(pristine_pool.vllm_root)
    for scenario in supported_scenarios(pool.tp, pool.pp):
        patched = pool.run(run_step, scenario)[-pool.tp :]
        pristine = pristine_pool.run(run_step, scenario)[-pool.tp :]
        for got, want in zip(patched, pristine, strict=True):
            assert torch.equal(got.hidden_states, want.hidden_states), scenario
            for a, b in zip(
                got.aux_hidden_states or [], want.aux_hidden_states or [], strict=True
            ):
                assert torch.equal(a, b), scenario
