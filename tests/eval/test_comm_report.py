# SPDX-License-Identifier: Apache-2.0
"""`make comm-report` says which end gather the last stage took, and with
--mtp how the MTP layer ran, from what its ledger recorded; it keeps the
ranks' start-up output in a log it names and leaves no shared memory behind."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import torch

from eval import comm_report
from eval.comm_report import end_gather_path, mtp_path
from tests.sppp_testbed.accounting import CommLedger
from tests.sppp_testbed.launcher import RankPool, printing_to
from tests.sppp_testbed.stages import StageResult, run_step

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


def test_processes_started_meanwhile_print_to_the_log(tmp_path, capfd):
    log = tmp_path / "ranks.log"
    with printing_to(str(log)):
        subprocess.run(["sh", "-c", "echo rank noise >&2; echo rank line"])
    subprocess.run(["sh", "-c", "echo restored"])
    assert log.read_text() == "rank noise\nrank line\n"
    assert capfd.readouterr() == ("restored\n", "")


def tp_broadcaster_shm() -> str | None:
    """Run in every rank: the shared memory its TP group's broadcaster made."""
    from vllm.distributed import get_tp_group

    buffer = getattr(get_tp_group().mq_broadcaster, "buffer", None)
    return buffer.shared_memory.name if buffer and buffer.is_creator else None


def test_the_report_ends_with_the_end_gather_and_frees_shared_memory(
    tmp_path, monkeypatch, capfd
):
    made: list[str] = []
    run = RankPool.run

    def noting_shared_memory(pool, func, *args, **kwargs):
        results = run(pool, func, *args, **kwargs)
        if func is run_step:  # what the step's groups hold, before any release
            made.extend(name for name in run(pool, tp_broadcaster_shm) if name)
        return results

    monkeypatch.setattr(RankPool, "run", noting_shared_memory)
    log = tmp_path / "comm-report.log"
    assert comm_report.main(["--tp", "2", "--pp", "2", "--log", str(log)]) == 0
    out, err = capfd.readouterr()
    assert out.splitlines()[-1].startswith("End gather: packed, one all-gather")
    assert err == (
        f"comm-report: TP2×PP2 ranks on the CPU; their start-up output goes to {log}\n"
    )
    assert len(made) == 2  # one per stage's TP group
    assert [name for name in made if Path("/dev/shm", name).exists()] == []


def mtp_stage(sequence_parallel: bool) -> StageResult:
    """A last stage whose MTP layer recorded what TP2, N=17 records."""
    ledger = CommLedger(phase="drafter")
    ops = [("all_reduce", 17), ("sp_shard", 17), ("all_gather", 9)]
    if not sequence_parallel:
        ops = [("all_reduce", 17), ("all_reduce", 17)]
    for op, rows in ops:
        ledger.add(op, torch.zeros(rows, 64, dtype=torch.float64))
    return StageResult(
        sequence_parallel=True,
        layers=(2, 4),
        ledger=ledger,
        drafter_sequence_parallel=sequence_parallel,
    )


@pytest.mark.parametrize(
    ("sequence_parallel", "said"),
    [
        (
            True,
            "MTP layer: sequence parallel, 1 shard of 17 rows, 2 TP collectives, "
            "the last an all_gather of the 9-row shard (4,608 B).",
        ),
        (False, "MTP layer: replicated, 2 TP collectives, no shard and no gather."),
    ],
)
def test_the_report_says_how_the_mtp_layer_ran(sequence_parallel, said):
    assert mtp_path(mtp_stage(sequence_parallel)) == said


def test_mtp_option_reports_a_step_with_the_mtp_layer(monkeypatch, capsys, tmp_path):
    """--mtp runs the step with vLLM's MTP layer on the last stage and says
    how it ran; without it, the report has no MTP line."""
    asked = []

    def run_ranks(tp: int, pp: int, scenario):
        asked.append(scenario)
        return [mtp_stage(True)] * (tp * pp)

    monkeypatch.setattr(comm_report, "run_ranks", run_ranks)
    log = ["--log", str(tmp_path / "ranks.log")]
    comm_report.main(["--tp", "2", "--pp", "2", "--aux", "", "--mtp", *log])
    assert asked[-1].drafter == "mtp"
    out = capsys.readouterr().out
    assert "\nMTP layer: sequence parallel, 1 shard of 17 rows" in out
    comm_report.main(["--tp", "2", "--pp", "2", "--aux", "", *log])
    assert asked[-1].drafter == ""
    assert "MTP layer" not in capsys.readouterr().out
