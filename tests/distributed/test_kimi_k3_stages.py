# SPDX-License-Identifier: Apache-2.0
"""The tiny Kimi K3 across real TP×PP ranks against the single-process reference.

Configurations vLLM 0.33.0 supports (SP with PP=1, PP without SP, TP without
SP) must match the TP1×PP1 reference. The tolerance is float64 summation order
across TP shards (all-reduce, reduce-scatter); a wrong row, a missing gather or
a double shard moves results by O(1e-2) or more.
"""

from __future__ import annotations

import itertools

import pytest

from tests.distributed.conftest import topologies
from tests.sppp_testbed.stages import Scenario, StageResult, run_step

TOLERANCE = 1e-12


def token_counts(tp: int) -> list[int]:
    return sorted({1, max(tp - 1, 1), tp, tp + 1, 17, 64})


def aux_taps(pp: int) -> tuple[int, ...]:
    """Embedding tap, one at the first stage boundary, one inside the last."""
    return (0, 2, 3) if pp <= 2 else (0, 1, 2, 3)


def mismatches(results: list[StageResult], expected: StageResult, tp: int) -> list[str]:
    """Every way the last stage's ranks differ from the reference."""
    problems = []
    for rank, result in enumerate(results[-tp:], start=len(results) - tp):
        pairs = [("hidden_states", result.hidden_states, expected.hidden_states)]
        got_aux = result.aux_hidden_states or []
        want_aux = expected.aux_hidden_states or []
        if len(got_aux) != len(want_aux):
            problems.append(
                f"rank {rank}: {len(got_aux)} aux states, want {len(want_aux)}"
            )
        pairs += [
            (f"aux[{i}]", g, w)
            for i, (g, w) in enumerate(zip(got_aux, want_aux, strict=False))
        ]
        for name, got, want in pairs:
            if got.shape != want.shape:
                problems.append(
                    f"rank {rank} {name}: shape {tuple(got.shape)}, "
                    f"want {tuple(want.shape)}"
                )
            elif (error := (got - want).abs().max().item()) > TOLERANCE:
                problems.append(f"rank {rank} {name}: max error {error:.3g}")
    return problems


def supported_scenarios(tp: int, pp: int) -> list[Scenario]:
    """Every token count plain; AttnRes and aux taps, alone and together, at
    the counts where padding and boundaries bite (1, TP+1) and at 17."""
    scenarios = []
    for sp in [False, True] if pp == 1 and tp > 1 else [False]:
        scenarios += [Scenario(sp, n) for n in token_counts(tp)]
        for n in sorted({1, tp + 1, 17}):
            scenarios.append(Scenario(sp, n, attn_res=True, aux_layers=aux_taps(pp)))
        scenarios.append(Scenario(sp, 17, attn_res=True))
        scenarios.append(Scenario(sp, 17, aux_layers=aux_taps(pp)))
    return scenarios


@topologies((2, 3), (1, 2), (2, 1), (2, 2))
def test_supported_configurations_match_the_reference(pool, reference):
    failures = []
    for scenario in supported_scenarios(pool.tp, pool.pp):
        results = pool.run(run_step, scenario)
        if [r.sequence_parallel for r in results] != [scenario.sp] * pool.world:
            failures.append(
                f"{scenario}: SP flags {[r.sequence_parallel for r in results]}"
            )
        failures += [
            f"{scenario}: {p}"
            for p in mismatches(results, reference(scenario), pool.tp)
        ]
    assert not failures, "\n".join(failures)


@topologies((2, 1))
def test_sp_end_of_stage_is_one_packed_gather(pool, reference):
    for n, aux in itertools.product(token_counts(2), [(), (0, 2, 3)]):
        results = pool.run(run_step, Scenario(True, n, aux_layers=aux))
        rows = -(-n // pool.tp)
        for result in results:
            gathers = [r for r in result.ledger.records if r.phase == "stage output"]
            assert [(r.op, r.shape) for r in gathers] == [
                ("all_gather", (rows, 64 * (1 + len(aux))))
            ], (n, aux, gathers)


@pytest.mark.changes_with_patch
@topologies((2, 3), (2, 2))
def test_sp_with_pp_is_silently_off_in_unpatched_vllm(pool, reference):
    """What 0.33.0 does today; the model patch is expected to change this."""
    scenario = Scenario(True, 17, aux_layers=aux_taps(pool.pp))
    results = pool.run(run_step, scenario)
    assert [r.sequence_parallel for r in results] == [False] * pool.world
    assert not mismatches(results, reference(scenario), pool.tp)
    # Without SP each boundary moves full-sequence, TP-replicated tensors:
    # a 1/TP slice per rank, re-assembled by one TP all-gather per key.
    records = results[pool.tp].ledger.records  # TP rank 0 of stage 1
    received = {r.key: r.shape for r in records if r.op == "pp_recv"}
    gathers = [r for r in records if r.phase == "PP recv" and r.op == "all_gather"]
    assert received["hidden_states"] == (17 * 64 // pool.tp,)
    assert len(gathers) == len(received)
