# SPDX-License-Identifier: Apache-2.0
"""``make buffer-report``: the hand-off buffers per rank, measured on real
ranks, and the production figures derived from the formula it prints."""

from __future__ import annotations

from eval import buffer_report
from vllm.distributed.utils import get_pp_indices


def test_the_derived_split_is_vllms_default_split():
    for layers, pp in ((93, 2), (93, 3), (4, 2), (61, 4)):
        starts = buffer_report.stage_starts(layers, pp)
        assert [(starts[i], starts[i + 1]) for i in range(pp)] == [
            get_pp_indices(layers, rank, pp) for rank in range(pp)
        ]


def test_the_production_figures_follow_the_formula_worked_by_hand():
    """B = 8: 47 layers before stage 1 leave ceil(47/8) = 6 blocks, so a
    row is 7 states of 7168 bf16 values; 32768 rows before, 4096 after."""
    lines = buffer_report.derived_table([8], mla_layers=12)
    row = 7 * 7168 * 2
    gib = 1024**3
    before, after = 32768 * row / gib, 4096 * row / gib
    gained = 32768 * row - 4096 * row
    blocks = gained // (64 * 656 * 12)
    assert lines[-1] == (
        f"| 8 | 6 | {before:.3f} → {after:.3f} "
        f"| {128 * row / 2**20:.1f} → {16 * row / 2**20:.1f} "
        f"| {gained / gib:.3f} | {blocks:,} |"
    )
    assert (round(before, 3), round(after, 3), blocks) == (3.062, 0.383, 5711)


def test_the_ranks_keep_the_shard_of_the_capacity(monkeypatch):
    """TP2×PP2 real ranks, AttnRes: stage 1's receive buffers hold 64 of
    the 127-token capacity (hidden and a one-block residual bank, 64 float64
    values each: 1,024 B a row); stage 0's capture outputs 32 of the widest
    graph's 64 rows. Without SP both keep the capacity."""
    sharded, replicated = buffer_report.measure(
        2,
        2,
        buffer_report.Request(sp=True, attn_res=True, aux_layers=(), widest_graph=64),
        buffer_report.Request(sp=False, attn_res=True, aux_layers=(), widest_graph=64),
    )
    assert [r.receive for r in sharded] == [(0, 0)] * 2 + [(127 * 1024, 64 * 1024)] * 2
    assert [r.capture for r in sharded] == [(64 * 1024, 32 * 1024)] * 2 + [(0, 0)] * 2
    assert {r.receive for r in replicated[2:]} == {(127 * 1024, 127 * 1024)}
    assert {r.capture for r in replicated[:2]} == {(64 * 1024, 64 * 1024)}
