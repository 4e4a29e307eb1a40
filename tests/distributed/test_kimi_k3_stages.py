# SPDX-License-Identifier: Apache-2.0
"""The tiny Kimi K3 across real TP×PP ranks against the single-process reference.

Configurations vLLM supports without the series (SP with PP=1, PP without SP,
TP without SP) and SP across stages must match the TP1×PP1 reference. The
tolerance is float64 summation order across TP shards (all-reduce,
reduce-scatter); a wrong row, a missing gather or a double shard moves results
by O(1e-2) or more. On vLLM 0.34.0 the same holds with Kimi K3.1's DSA layers,
and at the scheduler's whole budget, where MegaMoE's shard-sized buffer is
full.
"""

from __future__ import annotations

import itertools

import torch

from tests.distributed.conftest import topologies
from tests.sppp_testbed.bases import VLLM_VERSION, only_from_0_34, only_on_0_33
from tests.sppp_testbed.stages import Scenario, StageResult, run_step
from tests.sppp_testbed.tiny_k3 import (
    DTYPE,
    HAS_DSA,
    MAX_NUM_BATCHED_TOKENS,
    tiny_config,
)
from vllm.utils.math_utils import cdiv

try:
    from vllm.models.common.ops.sequence_parallel import sp_shard_rows
except ImportError:  # pristine vLLM: the non-regression ranks import this module
    sp_shard_rows = None

TOLERANCE = 1e-12
# The tiny model's sizes, as its config sets them.
TINY = tiny_config(attn_res=True)
HIDDEN = TINY.hidden_size


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
            elif not (error := (got - want).abs().max().item()) <= TOLERANCE:  # NaN too
                problems.append(f"rank {rank} {name}: max error {error:.3g}")
    return problems


def scenarios(tp: int, pp: int, sp: bool) -> list[Scenario]:
    """Every token count plain; AttnRes and aux taps, alone and together, at
    the counts where padding and boundaries bite (1, TP+1) and at 17."""
    pp_taps = aux_taps(pp)
    chosen = [Scenario(sp, n) for n in token_counts(tp)]
    for n in sorted({1, tp + 1, 17}):
        chosen.append(Scenario(sp, n, attn_res=True, aux_layers=pp_taps))
    chosen.append(Scenario(sp, 17, attn_res=True))
    chosen.append(Scenario(sp, 17, aux_layers=pp_taps))
    return chosen


def supported_scenarios(tp: int, pp: int) -> list[Scenario]:
    """What vLLM runs without the series: no SP, and SP only without PP."""
    chosen = scenarios(tp, pp, sp=False)
    if pp == 1 and tp > 1:
        chosen += scenarios(tp, pp, sp=True)
    return chosen


def sp_across_stages_scenarios(tp: int, pp: int) -> list[Scenario]:
    """What the patch set adds: SP with PP > 1."""
    return scenarios(tp, pp, sp=True) if tp > 1 and pp > 1 else []


def failures(pool, chosen: list[Scenario], reference) -> list[str]:
    found = []
    for scenario in chosen:
        results = pool.run(run_step, scenario)
        if [r.sequence_parallel for r in results] != [scenario.sp] * pool.world:
            found.append(
                f"{scenario}: SP flags {[r.sequence_parallel for r in results]}"
            )
        found += [
            f"{scenario}: {p}"
            for p in mismatches(results, reference(scenario), pool.tp)
        ]
    return found


@topologies((2, 3), (1, 2), (2, 1), (2, 2))
def test_supported_configurations_match_the_reference(pool, reference):
    found = failures(pool, supported_scenarios(pool.tp, pool.pp), reference)
    assert not found, "\n".join(found)


@topologies((2, 3), (2, 2))
def test_sp_across_stages_matches_the_reference(pool, reference):
    chosen = sp_across_stages_scenarios(pool.tp, pool.pp)
    found = failures(pool, chosen, reference)
    assert not found, "\n".join(found)


@topologies((2, 1))
def test_sp_end_of_stage_is_one_packed_gather(pool, reference):
    for n, aux in itertools.product(token_counts(2), [(), (0, 2, 3)]):
        results = pool.run(run_step, Scenario(True, n, aux_layers=aux))
        rows = sp_shard_rows(n, pool.tp)
        for result in results:
            gathers = [r for r in result.ledger.records if r.phase == "stage output"]
            assert [(r.op, r.shape) for r in gathers] == [
                ("all_gather", (rows, HIDDEN * (1 + len(aux))))
            ], (n, aux, gathers)


@only_on_0_33("the legacy model runner's buffers (gpu_model_runner.py)")
@topologies((2, 2))
def test_sp_across_stages_through_the_legacy_runner_buffers(pool, reference):
    """The receiving stage takes the hand-off through the legacy runner's
    shard-sized buffers, copied by its own (patched) code, which the V2
    runner shares (hand_over_intermediate_tensors): the model gets exactly
    the sender's shard."""
    chosen = [Scenario(True, n, runner="legacy") for n in (1, 3, 8, 17, 64)]
    chosen += [
        Scenario(sp, 17, attn_res=True, aux_layers=aux_taps(pool.pp), runner="legacy")
        for sp in (True, False)
    ]
    found = failures(pool, chosen, reference)
    assert not found, "\n".join(found)


@topologies((2, 2))
def test_sp_end_gather_on_both_sides_of_the_packed_limit(pool, reference):
    """The last stage packs final and aux states into one all-gather while
    its shard fits PACKED_GATHER_MAX_BYTES, and gathers each state alone
    above it; both give the reference's rows."""
    taps = aux_taps(pool.pp)
    problems = []
    for n in (1, 3, 17):
        rows = sp_shard_rows(n, pool.tp)
        shard_bytes = rows * HIDDEN * (1 + len(taps)) * DTYPE.itemsize
        for limit, want in [
            (shard_bytes, [(rows, HIDDEN * (1 + len(taps)))]),
            (shard_bytes - 1, [(rows, HIDDEN)] * (1 + len(taps))),
        ]:
            scenario = Scenario(True, n, aux_layers=taps, packed_gather_max_bytes=limit)
            results = pool.run(run_step, scenario)
            problems += [
                f"{scenario}: {p}"
                for p in mismatches(results, reference(scenario), pool.tp)
            ]
            for rank, result in enumerate(results[-pool.tp :], start=pool.tp):
                gathers = [
                    r.shape
                    for r in result.ledger.records
                    if r.phase == "stage output" and r.op == "all_gather"
                ]
                if gathers != want:
                    problems.append(f"{scenario}, rank {rank}: gathers {gathers}")
    assert not problems, "\n".join(problems)


def production_flag_scenarios(tp: int, pp: int) -> list[Scenario]:
    """The seed's serving flags at the counts where padding bites."""
    chosen = [Scenario(True, n, production_flags=True) for n in sorted({1, tp + 1, 17})]
    chosen.append(
        Scenario(
            True, 17, attn_res=True, aux_layers=aux_taps(pp), production_flags=True
        )
    )
    return chosen


def local_hidden_rows(result: StageResult) -> list[int]:
    """Rows of this rank's hidden states as the stage ends: what it sends on,
    or what the last stage gathers."""
    return [
        r.shape[0]
        for r in result.ledger.records
        if (r.op == "pp_send" and r.key == "hidden_states") or r.phase == "stage output"
    ]


@topologies((2, 3), (2, 2))
def test_sp_across_stages_with_the_production_flags(pool, reference):
    """VLLM_KIMI_K3_SHARD_SP_SHARED_EXPERT=1: every layer's MLP (dense on the
    first stage, the MoE's shared expert on later ones) runs TP-sharded with
    a gather before and a reduce-scatter after. VLLM_MOE_SKIP_PADDING=1: each
    rank's padding mask is its own rows of the runner's mask, on every stage,
    as many rows as its hidden states. Results still match the reference."""
    problems = failures(pool, production_flag_scenarios(pool.tp, pool.pp), reference)
    for scenario in production_flag_scenarios(pool.tp, pool.pp):
        n, rows = scenario.num_tokens, sp_shard_rows(scenario.num_tokens, pool.tp)
        for rank, result in enumerate(pool.run(run_step, scenario)):
            where = f"{scenario}, rank {rank}"
            start, end = result.layers
            scatters = [
                r
                for r in result.ledger.records
                if r.op == "reduce_scatter" and r.phase == "layers"
            ]
            # One reduce-scatter per attention block and one per sharded MLP.
            if result.sharded_mlps != end - start or len(scatters) != 2 * (end - start):
                problems.append(
                    f"{where}: {result.sharded_mlps} sharded MLPs, "
                    f"{len(scatters)} reduce-scatters for layers [{start}, {end})"
                )
            padded = torch.cat(
                [result.dispatched_padding, torch.ones(rows * pool.tp - n, dtype=bool)]
            )
            tp_rank = rank % pool.tp
            want = padded[tp_rank * rows : (tp_rank + 1) * rows]
            if not torch.equal(result.padding_mask, want):
                problems.append(f"{where}: mask {result.padding_mask} != {want}")
            if local_hidden_rows(result) != [rows]:
                problems.append(
                    f"{where}: hidden rows {local_hidden_rows(result)}, mask rows "
                    f"{result.padding_mask.shape[0]}"
                )
    assert not problems, "\n".join(problems)


def boundary_keys(taps: tuple[int, ...], end_layer: int) -> set[str]:
    """Keys a stage ending at ``end_layer`` hands on: its own and relayed taps."""
    sent = [tap for tap in taps if tap <= end_layer]
    return {"hidden_states", "residual"} | {
        f"aux_hidden_states_{slot}" for slot in range(len(sent))
    }


@topologies((2, 3), (2, 2))
def test_sp_across_stages_moves_the_minimum(pool, reference):
    """Each boundary moves every key once as this rank's ``c``-row shard,
    with no TP collective on either side; only the last stage gathers, once,
    everything packed along the hidden dimension."""
    problems = []
    for n in token_counts(pool.tp):
        for attn_res, taps in [(False, ()), (True, aux_taps(pool.pp))]:
            scenario = Scenario(True, n, attn_res=attn_res, aux_layers=taps)
            rows = sp_shard_rows(n, pool.tp)
            for rank, result in enumerate(pool.run(run_step, scenario)):
                records = result.ledger.records
                where = f"{scenario}, rank {rank}"
                start, end = result.layers
                problems += [
                    f"{where}: TP {r.op} in {r.phase}"
                    for r in records
                    if r.phase.startswith("PP") and not r.op.startswith("pp_")
                ]
                stage = rank // pool.tp
                for op, boundary, crosses in (
                    ("pp_send", end, stage < pool.pp - 1),
                    ("pp_recv", start, stage > 0),
                ):
                    moved = {r.key: r.shape for r in records if r.op == op}
                    want_keys = boundary_keys(taps, boundary) if crosses else set()
                    if set(moved) != want_keys:
                        problems.append(f"{where}: {op} keys {sorted(moved)}")
                    # The AttnRes residual is the bank of completed blocks.
                    blocks = cdiv(boundary, TINY.attn_res_block_size)
                    bank = [blocks] if attn_res else []
                    for key, shape in moved.items():
                        want = (rows, *(bank if key == "residual" else []), HIDDEN)
                        if shape != want:
                            problems.append(f"{where}: {op} {key} {shape} != {want}")
                gathers = [
                    (r.op, r.shape) for r in records if r.phase == "stage output"
                ]
                want = (
                    [("all_gather", (rows, HIDDEN * (1 + len(taps))))]
                    if stage == pool.pp - 1
                    else []
                )
                if gathers != want:
                    problems.append(f"{where}: stage output {gathers} != {want}")
    assert not problems, "\n".join(problems)


def dsa_scenarios(tp: int, pp: int) -> list[Scenario]:
    """DSA on every full-attention layer, SP across stages: N = 1 (below
    TP), TP + 1 (not divisible by TP), 17 and the whole budget; AttnRes with
    aux taps where padding bites; replicated (no SP) beside them."""
    counts = sorted({1, tp + 1, 17, MAX_NUM_BATCHED_TOKENS})
    chosen = [Scenario(True, n, dsa=True) for n in counts]
    chosen += [
        Scenario(True, n, dsa=True, attn_res=True, aux_layers=aux_taps(pp))
        for n in (1, tp + 1)
    ]
    chosen.append(Scenario(True, tp + 1, dsa=True, production_flags=True))
    chosen.append(Scenario(False, 17, dsa=True))
    return chosen


@only_from_0_34("Kimi K3.1's DSA layers (dsa_config) are new in vLLM 0.34.0")
@topologies((2, 3), (2, 2))
def test_dsa_layers_across_stages_match_the_reference(pool, reference):
    """Every stage builds its DSA layers (the model-level top-k buffer sized
    from its parallel config and budget) and runs them on the gathered
    sequence; the last stage's outputs equal the single-process model's."""
    chosen = dsa_scenarios(pool.tp, pool.pp)
    found = failures(pool, chosen, reference)
    config = tiny_config(dsa=True)
    for rank, result in enumerate(pool.run(run_step, chosen[0])):
        start, end = result.layers
        want = tuple(
            "SparseSequenceMixer" if config.is_dsa_layer(i) else "SequenceMixer"
            for i in range(start, end)
        )
        if result.attention != want:
            found.append(f"rank {rank}: attention {result.attention} != {want}")
    assert not found, "\n".join(found)


def budget_scenarios() -> list[Scenario]:
    """A real step and a dummy run (profiling, capture) of the scheduler's
    whole budget; with DSA where vLLM builds it."""
    n = MAX_NUM_BATCHED_TOKENS
    chosen = [Scenario(True, n), Scenario(True, n, dummy_run=True)]
    if HAS_DSA:
        chosen.append(Scenario(True, n, dummy_run=True, dsa=True))
    chosen.append(Scenario(True, n, dummy_run=True, attn_res=True))
    return chosen


@topologies((2, 3), (2, 2))
def test_the_whole_budget_fits_the_moe_buffer_on_every_stage(pool, reference):
    """At N = max_num_batched_tokens every MoE layer of every stage gets its
    shard, ceil(N/TP) rows: in a real step, and in a dummy run, where later
    stages get the leading rows of the runner's shard-sized receive buffers.
    From vLLM 0.34.0 that is exactly what MegaMoE's buffer holds under SP
    (sized ceil(N/TP), and refusing more), so a stage handed more rows, or
    that narrowed twice, fails here; 0.33.0 sized it for N."""
    n = MAX_NUM_BATCHED_TOKENS
    rows = sp_shard_rows(n, pool.tp)
    found = failures(pool, budget_scenarios()[:1], reference)
    for scenario in budget_scenarios():
        for rank, result in enumerate(pool.run(run_step, scenario)):
            where = f"{scenario}, rank {rank}"
            if result.moe_max_num_tokens is not None:  # a stage with MoE layers
                bound = rows if VLLM_VERSION >= (0, 34, 0) else n
                if (result.moe_tokens, result.moe_max_num_tokens) != (rows, bound):
                    found.append(
                        f"{where}: MoE ran {result.moe_tokens} tokens with a "
                        f"buffer of {result.moe_max_num_tokens}, want {rows} of "
                        f"{bound}"
                    )
            if rank // pool.tp < pool.pp - 1:
                if result.output_rows != rows:
                    found.append(f"{where}: hands on {result.output_rows} rows")
            elif result.hidden_states.shape != (n, HIDDEN):
                found.append(f"{where}: output {tuple(result.hidden_states.shape)}")
    assert not found, "\n".join(found)
