# SPDX-License-Identifier: Apache-2.0
"""Drafters on the last stage under SP×PP, against the single-process reference.

The drafter lives on the last PP stage and reads what the target gathers
there. MTP: vLLM's own ``KimiK3MultiTokenPredictor`` (its embedding and one
``KimiK3MultiTokenPredictorLayer``), built from the target's ``VllmConfig``
as ``load_eagle_model`` builds it, fed the target's gathered hidden states.
DSpark and EAGLE-3: the drafter's input, the aux states in slot order
concatenated and projected, built by vLLM's own
``DFlashSpeculator._store_hidden_states`` and
``K3DSparkModel.combine_hidden_states``.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.distributed.conftest import topologies
from tests.distributed.test_kimi_k3_stages import TOLERANCE, mismatches
from tests.sppp_testbed.stages import Scenario, StageResult, run_step
from tests.sppp_testbed.tiny_k3 import DTYPE, HIDDEN
from vllm.distributed.utils import get_pp_indices

try:
    from vllm.models.common.ops.sequence_parallel import sp_shard_rows
except ImportError:  # pristine vLLM: its ranks import this module too
    sp_shard_rows = None

# A K3-like tap layout scaled to a 6-layer target: the embeddings (0), taps
# inside every stage, one on a stage boundary (3 at PP2, 2 at PP3) and one
# after the last layer (6 = num_hidden_layers).
DRAFTER_LAYERS = 6
DRAFTER_TAPS = (0, 1, 2, 3, 5, 6)
# Replicated, the MTP layer ends in vLLM's native fused add-RMSNorm, which
# adds in float32; under SP it adds in the model's dtype, then norms. Against
# the single-process (replicated) reference its states agree to float32
# rounding of values of order 1; against the release's own SP at PP = 1 (0.33.0
# or 0.34.0, a linked pristine tree of the vLLM installed), to TOLERANCE.
FLOAT32_TOLERANCE = 1e-6


def drafter_mismatches(
    results: list[StageResult],
    expected: StageResult,
    tp: int,
    mtp_tolerance: float = TOLERANCE,
) -> list[str]:
    """The target's mismatches, and every way the drafter's outputs on the
    last stage's ranks differ from ``expected``'s."""
    problems = mismatches(results, expected, tp)
    if expected.mtp_states is None and expected.drafter_input is None:
        problems.append("the reference ran no drafter")
    for rank, result in enumerate(results[-tp:], start=len(results) - tp):
        got_mtp = result.mtp_states or (None, None)
        want_mtp = expected.mtp_states or (None, None)
        pairs = [
            ("drafter input", result.drafter_input, expected.drafter_input, TOLERANCE),
            ("MTP logits input", got_mtp[0], want_mtp[0], mtp_tolerance),
            ("MTP hidden state", got_mtp[1], want_mtp[1], mtp_tolerance),
        ]
        for name, got, want, tolerance in pairs:
            if (got is None) != (want is None):
                problems.append(f"rank {rank} {name}: {got} != {want}")
            elif got is None:
                continue
            elif got.shape != want.shape:
                problems.append(
                    f"rank {rank} {name}: shape {tuple(got.shape)}, "
                    f"want {tuple(want.shape)}"
                )
            elif not (error := (got - want).abs().max().item()) <= tolerance:
                problems.append(f"rank {rank} {name}: max error {error:.3g}")
    return problems


def mtp_scenarios(tp: int) -> list[Scenario]:
    """The seed's production flags, the counts where padding bites, and a
    decode batch: five requests of 1 + k = 3 tokens each."""
    chosen = [
        Scenario(True, n, drafter="mtp", production_flags=True)
        for n in sorted({1, tp + 1, 17})
    ]
    chosen.append(Scenario(True, 15, drafter="mtp", production_flags=True, query_len=3))
    return chosen


@pytest.fixture(scope="module")
def sp_at_pp1(pools, pristine_vllm):
    """The installed vLLM release itself (a linked pristine tree) with SP at
    TP2×PP1, where its MTP block already ran sequence parallel; memoised per
    scenario."""
    results: dict[Scenario, StageResult] = {}

    def result(scenario: Scenario) -> StageResult:
        key = dataclasses.replace(scenario, fault="")
        if key not in results:
            results[key] = pools(2, 1, vllm_root=pristine_vllm).run(run_step, key)[-1]
        return results[key]

    return result


@topologies((2, 3), (2, 2))
def test_mtp_on_the_last_stage_matches_the_reference(pool, reference, sp_at_pp1):
    """The MTP block, built from the target's PP > 1 MegaMoE config, runs
    sequence parallel on the last stage: its states are the single-process
    reference's (to float32 rounding, FLOAT32_TOLERANCE) and the release's
    own SP at PP = 1 (to TOLERANCE)."""
    problems = []
    for scenario in mtp_scenarios(pool.tp):
        results = pool.run(run_step, scenario)
        expected = reference(scenario)
        problems += [
            f"{scenario}: {p}"
            for p in drafter_mismatches(results, expected, pool.tp, FLOAT32_TOLERANCE)
        ]
        problems += [
            f"{scenario}, against SP at PP=1: {p}"
            for p in drafter_mismatches(results, sp_at_pp1(scenario), pool.tp)
        ]
        # The replicated recurrent state is the float32 sum, cast back.
        recurrent = expected.mtp_states[1]
        if not torch.equal(recurrent, recurrent.float().to(DTYPE)):
            problems.append(f"{scenario}: reference state not float32-rounded")
        flags = [r.drafter_sequence_parallel for r in results[-pool.tp :]]
        if flags != [True] * pool.tp:
            problems.append(f"{scenario}: MTP block SP flags {flags}")
    assert not problems, "\n".join(problems)


def drafter_collectives(result: StageResult) -> list[tuple[str, tuple[int, ...]]]:
    return [(r.op, r.shape) for r in result.ledger.records if r.phase == "drafter"]


@topologies((2, 3), (2, 2))
def test_mtp_block_shards_once_and_gathers_once(pool):
    """Inside the MTP layer: one shard of eh_proj's N rows, the decoder
    layer's own SP collectives (with the production flags the shared expert
    runs TP-sharded too), one all-gather of the block's c-row output at the
    end. Before it only the embedding's all-reduce; nothing crosses a stage.
    The block's padding mask is this rank's rows of the runner's."""
    problems = []
    for scenario in mtp_scenarios(pool.tp):
        n, rows = scenario.num_tokens, sp_shard_rows(scenario.num_tokens, pool.tp)
        padded = (rows * pool.tp, HIDDEN)
        want = [
            ("all_reduce", (n, HIDDEN)),  # the drafter's vocab-parallel embedding
            ("sp_shard", (n, HIDDEN)),
            ("all_gather", (rows, HIDDEN)),  # attention sees the whole sequence
            ("reduce_scatter", padded),
            ("all_gather", (rows, HIDDEN)),  # the TP-sharded shared expert
            ("reduce_scatter", padded),
            ("all_gather", (rows, HIDDEN)),  # the block's end
        ]
        results = pool.run(run_step, scenario)
        for rank, result in enumerate(results):
            got = drafter_collectives(result)
            # Earlier stages run no drafter.
            want_here = want if rank >= len(results) - pool.tp else []
            if got != want_here:
                problems.append(f"{scenario}, rank {rank}: {got} != {want_here}")
            if rank < len(results) - pool.tp:
                continue
            mask = (torch.arange(rows * pool.tp) >= n - n // 4).tolist()
            tp_rank = rank % pool.tp
            want_mask = mask[tp_rank * rows : (tp_rank + 1) * rows]
            if result.drafter_padding_mask.tolist() != want_mask:
                problems.append(
                    f"{scenario}, rank {rank}: MTP mask "
                    f"{result.drafter_padding_mask.tolist()} != {want_mask}"
                )
    assert not problems, "\n".join(problems)


@topologies((2, 2))
def test_mtp_with_the_draft_moe_backend_overridden_stays_replicated(pool, reference):
    """--speculative-config's moe_backend replaces the target's MegaMoE in
    the drafter's config: the MTP block then keeps 0.33.0's replicated
    layout at PP > 1 (no shard, no gather) while the target runs SP."""
    problems = []
    for n in (3, 17):
        scenario = Scenario(True, n, drafter="mtp", draft_moe_backend="triton")
        results = pool.run(run_step, scenario)
        problems += [
            f"{scenario}: {p}"
            for p in drafter_mismatches(results, reference(scenario), pool.tp)
        ]
        for rank, result in enumerate(results[-pool.tp :], start=pool.tp):
            ops = {op for op, _ in drafter_collectives(result)}
            if result.drafter_sequence_parallel or ops & {"sp_shard", "all_gather"}:
                problems.append(
                    f"{scenario}, rank {rank}: SP {result.drafter_sequence_parallel}"
                    f", drafter ops {sorted(ops)}"
                )
            if not result.sequence_parallel:
                problems.append(f"{scenario}, rank {rank}: target without SP")
    assert not problems, "\n".join(problems)


@topologies((2, 2))
def test_an_mtp_block_that_skips_its_gather_is_caught(pool, reference):
    """An MTP layer handing the drafter its block's shard fails the
    comparison on every last-stage rank."""
    scenario = Scenario(True, 17, drafter="mtp", fault="mtp_skips_gather")
    problems = drafter_mismatches(
        pool.run(run_step, scenario), reference(scenario), pool.tp
    )
    for rank in (2, 3):
        want = f"rank {rank} MTP hidden state: shape (9, {HIDDEN}), want (17, {HIDDEN})"
        assert want in problems, problems


def stage_boundaries(pp: int) -> set[int]:
    return {get_pp_indices(DRAFTER_LAYERS, rank, pp)[1] for rank in range(pp - 1)}


def dspark_scenarios(tp: int, pp: int) -> list[Scenario]:
    """AttnRes at the counts where padding bites and at 17, without AttnRes
    at 17, and the AttnRes aux stream (which refuses boundary taps)."""
    common = dict(drafter="dspark", num_layers=DRAFTER_LAYERS)
    chosen = [
        Scenario(True, n, attn_res=True, aux_layers=DRAFTER_TAPS, **common)
        for n in sorted({1, tp + 1, 17})
    ]
    chosen.append(Scenario(True, 17, aux_layers=DRAFTER_TAPS, **common))
    no_boundary = tuple(t for t in DRAFTER_TAPS if t not in stage_boundaries(pp))
    chosen.append(
        Scenario(
            True,
            17,
            attn_res=True,
            aux_layers=no_boundary,
            aux_attn_res_stream=True,
            **common,
        )
    )
    return chosen


def end_gathers(result: StageResult) -> list[tuple[int, ...]]:
    return [
        r.shape
        for r in result.ledger.records
        if r.phase == "stage output" and r.op == "all_gather"
    ]


@topologies((2, 3), (2, 2))
def test_dspark_input_matches_the_reference_on_both_sides_of_the_packed_limit(
    pool, reference
):
    """The drafter's input (the aux states in slot order, concatenated and
    projected) equals the reference's with taps at the embeddings, inside
    every stage, on a stage boundary and after the last layer, whether the
    last stage gathers them packed (split views, not contiguous) or one by
    one (contiguous)."""
    problems = []
    for base in dspark_scenarios(pool.tp, pool.pp):
        states = 1 + len(base.aux_layers)
        rows = sp_shard_rows(base.num_tokens, pool.tp)
        shard_bytes = rows * HIDDEN * states * DTYPE.itemsize
        for limit, gathers, contiguous in [
            # A split view of one row is contiguous all the same.
            (shard_bytes, [(rows, HIDDEN * states)], base.num_tokens == 1),
            (shard_bytes - 1, [(rows, HIDDEN)] * states, True),
        ]:
            scenario = dataclasses.replace(base, packed_gather_max_bytes=limit)
            results = pool.run(run_step, scenario)
            problems += [
                f"{scenario}: {p}"
                for p in drafter_mismatches(results, reference(scenario), pool.tp)
            ]
            for rank, result in enumerate(results[-pool.tp :], start=pool.tp):
                where = f"{scenario}, rank {rank}"
                if end_gathers(result) != gathers:
                    problems.append(f"{where}: gathers {end_gathers(result)}")
                if result.aux_contiguous != [contiguous] * len(base.aux_layers):
                    problems.append(f"{where}: contiguous {result.aux_contiguous}")
    assert not problems, "\n".join(problems)


@pytest.fixture(scope="module")
def pristine_reference(pools, pristine_vllm):
    """The installed vLLM release itself at TP1×PP1 (a linked pristine
    tree)."""
    return pools(1, 1, vllm_root=pristine_vllm)


def test_drafter_taps_at_pp1_are_the_releases_own(pristine_reference, reference):
    """The reference the tests above compare with is what vLLM gives at
    PP = 1, bit for bit, for every tap, the one after the last AttnRes
    layer included (whichever state that is, SP×PP must give the same)."""
    problems = []
    chosen = dspark_scenarios(2, 2)
    for scenario in [chosen[0], *chosen[-2:]]:
        (pristine,) = pristine_reference.run(run_step, scenario)
        patched = reference(scenario)
        pairs = [("drafter input", pristine.drafter_input, patched.drafter_input)]
        pairs += [
            (f"aux[{slot}]", got, want)
            for slot, (got, want) in enumerate(
                zip(pristine.aux_hidden_states, patched.aux_hidden_states, strict=True)
            )
        ]
        problems += [
            f"{scenario}: {name} differs"
            for name, got, want in pairs
            if not torch.equal(got, want)
        ]
    assert not problems, "\n".join(problems)
