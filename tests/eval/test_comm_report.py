# SPDX-License-Identifier: Apache-2.0
"""`make comm-report` says which end gather the last stage took, from what
its ledger recorded."""

from __future__ import annotations

import pytest
import torch

from eval.comm_report import end_gather_path
from tests.sppp_testbed.accounting import CommLedger
from tests.sppp_testbed.stages import StageResult

LIMIT = 41_943_040


def last_stage(gather_widths: list[int], num_aux: int, sp: bool = True):
    ledger = CommLedger(phase="stage output")
    for width in gather_widths:
        ledger.add("all_gather", torch.zeros(9, width, dtype=torch.float64))
    return StageResult(
        sequence_parallel=sp,
        layers=(2, 4),
        ledger=ledger,
        aux_hidden_states=[torch.zeros(17, 64)] * num_aux,
        packed_gather_max_bytes=LIMIT,
    )


@pytest.mark.parametrize(
    ("widths", "num_aux", "said"),
    [
        (
            [256],
            3,
            "End gather: packed, one all-gather of the 18,432-byte shard of final "
            "and aux states (PACKED_GATHER_MAX_BYTES = 41,943,040 B).",
        ),
        (
            [64] * 4,
            3,
            "End gather: 4 separate all-gathers, the 18,432-byte shard being "
            "above PACKED_GATHER_MAX_BYTES = 41,943,040 B.",
        ),
        ([64], 0, "End gather: one all-gather of the final states (4,608 B)."),
    ],
)
def test_the_report_names_the_end_gather_the_step_took(widths, num_aux, said):
    assert end_gather_path(last_stage(widths, num_aux)) == said


def test_without_sp_there_is_no_end_gather():
    said = end_gather_path(last_stage([], 3, sp=False))
    assert said == "End of the model: no SP, nothing to gather."
