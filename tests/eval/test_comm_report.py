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
from tests.sppp_testbed.accounting import CommLedger, CommRecord
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
    argv = ["--tp", "2", "--pp", "2", "--sweep", "", "--log", str(log)]
    assert comm_report.main(argv) == 0
    out, err = capfd.readouterr()
    assert out.splitlines()[-1].startswith("End gather: packed, one all-gather")
    assert err.splitlines() == [
        f"comm-report: TP2×PP2 ranks on the CPU; their start-up output goes to {log}",
        "comm-report: step 1/2 (N=17, SP, aux=[0, 2, 3]) done",
        "comm-report: step 2/2 (N=17, SP, aux=[0, 2, 3], replicated hand-off) done",
    ]
    assert len(set(made)) == 2  # one per stage's TP group, kept by the pool
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

    def run_ranks(tp: int, pp: int, scenarios, progress):
        asked.append(scenarios[0])
        return [[mtp_stage(True)] * (tp * pp) for _ in scenarios]

    monkeypatch.setattr(comm_report, "run_ranks", run_ranks)
    log = ["--log", str(tmp_path / "ranks.log")]
    comm_report.main(["--tp", "2", "--pp", "2", "--aux", "", "--no-sp", "--mtp", *log])
    assert asked[-1].drafter == "mtp"
    out = capsys.readouterr().out
    assert "\nMTP layer: sequence parallel, 1 shard of 17 rows" in out
    comm_report.main(["--tp", "2", "--pp", "2", "--aux", "", "--no-sp", *log])
    assert asked[-1].drafter == ""
    assert "MTP layer" not in capsys.readouterr().out


# --- the two hand-off layouts, side by side -----------------------------------


def stage(records: list[tuple[str, str, tuple[int, ...]]]) -> StageResult:
    """A rank whose ledger recorded ``(phase, op, shape)`` float64 tensors."""
    ledger = CommLedger()
    for phase, op, shape in records:
        with ledger.in_phase(phase):
            if op == "sp_shard":
                ledger.records.append(CommRecord(phase, op, shape, 0))
            else:
                ledger.add(op, torch.zeros(shape, dtype=torch.float64))
    return StageResult(sequence_parallel=True, layers=(0, 2), ledger=ledger)


def tp2_pp2_step(layout: str) -> list[StageResult]:
    """What TP2×PP2 records at N=17 with two 64-wide keys, by layout."""
    end = [("stage output", "all_gather", (9, 64))]
    if layout == "sharded":
        send = [("PP send", "pp_send", (9, 64))] * 2
        recv = [("PP recv", "pp_recv", (9, 64))] * 2
    else:
        send = [("PP send", "all_gather", (9, 128))]
        send += [("PP send", "pp_send", (544,))] * 2
        recv = [("PP recv", "pp_recv", (544,)), ("PP recv", "all_gather", (544,))] * 2
        recv += [("PP recv", "sp_shard", (17, 64))] * 2
    return [stage(send), stage(send), stage(recv + end), stage(recv + end)]


def test_side_by_side_puts_each_layout_in_its_own_columns():
    runs = {name: tp2_pp2_step(name) for name in comm_report.LAYOUTS}
    rows = [line for line in comm_report.side_by_side(runs, 2) if line[:3] == "| 0"]
    rows += [line for line in comm_report.side_by_side(runs, 2) if line[:3] == "| 2"]
    assert rows == [
        "| 0 | send 0→1 | 0 | 0 | 9,216 | 1 | 9,216 | 8,704 | 0 |",
        "| 2 | receive 0→1 | 0 | 0 | 9,216 | 2 | 8,704 | 8,704 | 2 |",
        "| 2 | end of the last stage | 1 | 4,608 | 0 | 1 | 4,608 | 0 | 0 |",
    ]
    total = comm_report.side_by_side(runs, 2)[-1]
    assert total == (
        "| all | step, all ranks (PP bytes as sent) | 2 | 9,216 | 18,432 "
        "| 8 | 45,056 | 17,408 | 4 |"
    )


def test_a_point_the_rule_misses_stops_every_derived_row():
    shape = comm_report.StepShape((64, 64), 1, 64, 8, LIMIT)
    exact = [comm_report.rule(shape, n, 2) for n in (1, 3)]
    table = comm_report.per_n_table(exact, shape, 2, [1024])
    assert "The rule gives every measured point exactly" in table[0]
    assert [line[:7] for line in table if "| **derived** |" in line] == ["| 1024 "]
    one_off = comm_report.Cost(2, 1024, 512, 2)  # a receiver that gathered one key
    missed = exact[:1] + [
        comm_report.Point(
            3, exact[1].boundary | {"replicated": one_off}, exact[1].end, True
        )
    ]
    table = comm_report.per_n_table(missed, shape, 2, [1024])
    assert "The rule misses the measured points at N=3: nothing is derived." in table[0]
    assert not any("| **derived** |" in line for line in table)


def test_the_report_measures_both_layouts_per_n_and_marks_what_it_derives(
    tmp_path, capsys
):
    """Real TP2×PP2 ranks, hidden_states and residual (64 float64 each) at
    N = 1 and 3, and N = 1024 derived. The figures are worked out by hand:
    the series sends the c-row shards; the replicated arm all-gathers them
    packed (c·128·8 B), sends N·64/2 elements per key, all-gathers those on
    the receiver and shards both keys."""
    argv = ["--tp", "2", "--pp", "2", "--aux", "", "--sweep", "1,3"]
    argv += ["--derive", "1024", "--log", str(tmp_path / "ranks.log")]
    assert comm_report.main(argv) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| ") and "|" in line]
    per_n = [
        line for line in rows if line.split(" | ")[2] in ("measured", "**derived**")
    ]
    assert per_n == [
        "| 1 | 1 | measured | 0 | 0 | 1,024 | 3 | 1,536 | 512 | 2.00× | 1 | 512 "
        "| 1 | 512 |",
        "| 3 | 2 | measured | 0 | 0 | 2,048 | 3 | 3,584 | 1,536 | 2.50× | 1 | 1,024 "
        "| 1 | 1,024 |",
        "| 1024 | 512 | **derived** | 0 | 0 | 524,288 | 3 | 1,048,576 | 524,288 "
        "| 3.00× | 1 | 262,144 | 1 | 262,144 |",
    ]
    assert "The rule gives every measured point exactly" in out
    # The step itself (N=17), rank 2: two keys received, gathered, re-sharded.
    assert "| 2 | receive 0→1 | 0 | 0 | 9,216 | 2 | 8,704 | 8,704 | 2 |" in rows
