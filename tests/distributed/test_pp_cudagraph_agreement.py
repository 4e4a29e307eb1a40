# SPDX-License-Identifier: Apache-2.0
"""PP stages that would replay different CUDA graph shapes are refused at
start-up on every stage, with every stage's settings, instead of hanging at
the first hand-off. Real ranks, the real PP group, over gloo."""

from __future__ import annotations

import types

from tests.distributed.conftest import topologies
from vllm.distributed.parallel_state import get_pp_group
from vllm.v1.worker.pp_cudagraph_agreement import check_pp_cudagraph_agreement


def check(settings_by_stage: list[dict]) -> str | None:
    """Run the start-up check with this stage's settings; its error, if any."""
    settings = settings_by_stage[get_pp_group().rank_in_group]
    config = types.SimpleNamespace(
        model_config=types.SimpleNamespace(enforce_eager=settings["eager"]),
        compilation_config=types.SimpleNamespace(
            cudagraph_mode=settings["mode"],
            cudagraph_capture_sizes=settings["sizes"],
        ),
    )
    try:
        check_pp_cudagraph_agreement(config)
    except RuntimeError as error:
        return str(error)
    return None


PRODUCTION = {"eager": False, "mode": "FULL_DECODE_ONLY", "sizes": [1, 2, 4, 8]}


@topologies((2, 2))
def test_stages_that_agree_start(pool):
    assert pool.run(check, [PRODUCTION, dict(PRODUCTION)]) == [None] * pool.world


@topologies((2, 2))
def test_stages_that_disagree_fail_on_every_rank_showing_both_sides(pool):
    other = {**PRODUCTION, "sizes": [1, 2, 4]}
    errors = pool.run(check, [PRODUCTION, other])
    assert all(errors), errors
    for error in errors:
        assert "would hang at the first hand-off" in error
        assert "stage 0: enforce_eager=False, cudagraph_mode=FULL_DECODE_ONLY, " in (
            error
        )
        assert "cudagraph_capture_sizes=[1, 2, 4, 8]; stage 1:" in error
        assert error.endswith(
            "Start every node with the same --compilation-config, "
            "--max-cudagraph-capture-size and --enforce-eager."
        )
    eager = pool.run(check, [PRODUCTION, {**PRODUCTION, "eager": True}])
    assert all("stage 1: enforce_eager=True" in error for error in eager)
