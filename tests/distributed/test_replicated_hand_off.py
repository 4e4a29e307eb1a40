# SPDX-License-Identifier: Apache-2.0
"""The comparison arm: vLLM 0.34.0's replicated hand-off applied to Kimi K3.

0.34.0 runs SP across PP stages for DeepSeek V4.1 and MiniMax-M3 by gathering
each non-last stage's shards before the send, keeping the transport's
replicated default and sharding again on the next stage. The test bed runs
that layout around the same SP model (``Scenario(handoff="replicated")``) so
``make comm-report`` and ``make nccl-bench`` can set it beside the series'
shard-to-shard hand-off. Here: both layouts give the single-process
reference's outputs, bit for bit the same as each other, at N = 1, N < TP and
N not divisible by TP; and the arm moves what 0.34.0's pattern moves.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.distributed.conftest import topologies
from tests.distributed.test_kimi_k3_stages import (
    HIDDEN,
    aux_taps,
    boundary_keys,
    mismatches,
)
from tests.sppp_testbed.launcher import RankFailure
from tests.sppp_testbed.stages import Scenario, run_step
from tests.sppp_testbed.tiny_k3 import DTYPE

try:
    from vllm.models.common.ops.sequence_parallel import sp_shard_rows
except ImportError:  # pristine vLLM: the non-regression ranks import this module
    sp_shard_rows = None

ITEMSIZE = torch.empty((), dtype=DTYPE).element_size()


def edge_counts(tp: int) -> list[int]:
    """N = 1, below TP, not divisible by TP, a multiple of TP, and 17."""
    return sorted({1, max(tp - 1, 1), tp, tp + 1, 17})


def scenarios(tp: int, pp: int) -> list[Scenario]:
    """Every edge count plain; AttnRes with aux taps (one at a boundary)."""
    chosen = [Scenario(True, n) for n in edge_counts(tp)]
    chosen += [
        Scenario(True, n, attn_res=True, aux_layers=aux_taps(pp))
        for n in sorted({1, tp + 1, 17})
    ]
    return chosen


def outputs(result) -> list[torch.Tensor]:
    """A last-stage rank's final and aux hidden states."""
    return [result.hidden_states, *(result.aux_hidden_states or [])]


@topologies((2, 2), (2, 3), (4, 2))
def test_both_hand_offs_match_the_reference_and_each_other(pool, reference):
    problems = []
    for sharded in scenarios(pool.tp, pool.pp):
        replicated = dataclasses.replace(sharded, handoff="replicated")
        runs = {s: pool.run(run_step, s) for s in (sharded, replicated)}
        for scenario, results in runs.items():
            if not all(r.sequence_parallel for r in results):
                problems.append(f"{scenario}: not SP on every rank")
            problems += [
                f"{scenario}: {p}"
                for p in mismatches(results, reference(scenario), pool.tp)
            ]
        # The same shards meet the same layers: the arms agree exactly.
        for rank in range(pool.world - pool.tp, pool.world):
            ours, theirs = (outputs(run[rank]) for run in runs.values())
            if len(ours) != len(theirs) or not all(map(torch.equal, ours, theirs)):
                problems.append(f"{sharded}: the layouts differ on rank {rank}")
    assert not problems, "\n".join(problems)


@topologies((2, 2), (2, 3))
def test_replicated_hand_off_gathers_before_the_send_and_shards_after(pool):
    """At each boundary the sender runs one packed all-gather of its shards
    and sends a 1/TP slice of the N-row result per key; the receiver
    all-gathers each key (vLLM's transport) and shards it, locally. The end
    of the last stage gathers as the series does."""
    problems = []
    for n in edge_counts(pool.tp):
        for attn_res, taps in [(False, ()), (True, aux_taps(pool.pp))]:
            scenario = Scenario(
                True, n, attn_res=attn_res, aux_layers=taps, handoff="replicated"
            )
            rows = sp_shard_rows(n, pool.tp)
            series = pool.run(
                run_step, dataclasses.replace(scenario, handoff="sharded")
            )
            for rank, result in enumerate(pool.run(run_step, scenario)):
                records, where = result.ledger.records, f"{scenario}, rank {rank}"
                stage, (start, end) = rank // pool.tp, result.layers
                sent = {r.key: r for r in records if r.op == "pp_send"}
                shards = {
                    r.key: r for r in series[rank].ledger.records if r.op == "pp_send"
                }
                if stage < pool.pp - 1:
                    if set(sent) != boundary_keys(taps, end):
                        problems.append(f"{where}: sent {sorted(sent)}")
                    width = sum(r.nbytes for r in shards.values()) // (rows * ITEMSIZE)
                    got = [(r.op, r.shape) for r in records if r.phase == "PP send"]
                    want = [("all_gather", (rows, width))]
                    want += [
                        ("pp_send", (n * r.nbytes // (ITEMSIZE * rows) // pool.tp,))
                        for r in shards.values()
                    ]
                    if got != want:
                        problems.append(f"{where}: PP send {got} != {want}")
                if stage > 0:
                    keys = boundary_keys(taps, start)
                    got = sorted((r.op, r.key) for r in records if r.phase == "PP recv")
                    ops = [r.op for r in records if r.phase == "PP recv"]
                    if sorted(set(ops)) != ["all_gather", "pp_recv", "sp_shard"] or (
                        [ops.count(op) for op in ("all_gather", "pp_recv", "sp_shard")]
                        != [len(keys)] * 3
                    ):
                        problems.append(f"{where}: PP recv {got}")
                    for r in records:
                        if r.op == "sp_shard" and r.shape[0] != n:
                            problems.append(f"{where}: shard of {r.shape}")
                end_gathers = [
                    (r.op, r.shape) for r in records if r.phase == "stage output"
                ]
                series_end = [
                    (r.op, r.shape)
                    for r in series[rank].ledger.records
                    if r.phase == "stage output"
                ]
                if end_gathers != series_end:
                    problems.append(f"{where}: end {end_gathers} != {series_end}")
                if stage == pool.pp - 1 and end_gathers[0][1] != (
                    rows,
                    HIDDEN * (1 + len(taps)),
                ):
                    problems.append(f"{where}: end gather {end_gathers}")
    assert not problems, "\n".join(problems)


@topologies((2, 2))
def test_a_replicated_arm_that_skips_its_reshard_is_caught(pool, reference):
    """Handed the N received rows instead of its shard, every later-stage
    rank refuses them: the model takes only the shard it declares."""
    faulty = Scenario(True, 17, handoff="replicated", fault="skip_reshard")
    with pytest.raises(RankFailure) as failure:
        pool.run(run_step, faulty)
    message = str(failure.value)
    refused = (
        "ValueError: Received hidden_states with 17 rows for a batch of N=17 "
        "tokens at TP=2: a sequence-parallel hand-off has ceil(N/TP)=9 rows"
    )
    assert message.count(refused) == pool.tp, message
