# SPDX-License-Identifier: Apache-2.0
"""eval/nccl_bench.py on the CPU: the row checks against planted faults (two
TP ranks as threads), the crossover rule, and one gloo launch of every part
whose JSON the tables are rebuilt from."""

from __future__ import annotations

import copy
import datetime
import json
import os
import platform
import re
import signal
import statistics
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from eval import nccl_bench
from eval.nccl_bench import RowsDiffer, check_gather, crossover, markdown

SCRIPT = Path(nccl_bench.__file__)
HIDDEN, REPS = 8, 3


class ThreadGather:
    """``sp_all_gather`` for TP ranks that are threads of this process."""

    def __init__(self, tp: int) -> None:
        self.slots: list[torch.Tensor | None] = [None] * tp
        self.barrier = threading.Barrier(tp, timeout=20)

    def for_rank(self, rank: int):
        def gather(x: torch.Tensor) -> torch.Tensor:
            self.slots[rank] = x
            self.barrier.wait()
            out = torch.cat(self.slots)
            self.barrier.wait()
            return out

        return gather


def run_check(
    n: int, k: int, tp: int = 2, producer: bool = False
) -> list[BaseException | None]:
    """``check_gather`` on every rank; what each rank raised, if anything."""
    return on_thread_ranks(
        tp,
        lambda rank, gather: check_gather(
            n, k, HIDDEN, tp, rank, gather, producer=producer
        ),
    )


def on_thread_ranks(
    tp: int, check: Callable[[int, Callable], None]
) -> list[BaseException | None]:
    """``check(rank, gather)`` on ``tp`` thread ranks sharing one fake
    all-gather; what each raised."""
    fake, raised = ThreadGather(tp), [None] * tp

    def rank_main(rank: int) -> None:
        try:
            check(rank, fake.for_rank(rank))
        except BaseException as error:  # noqa: BLE001 - reported to the test
            raised[rank] = error

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(tp)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    return raised


@pytest.mark.parametrize("n", [1, 2, 17, 64])
@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("producer", [False, True], ids=["states", "producer"])
def test_every_variant_delivers_the_model_rows(n, k, producer):
    assert run_check(n, k, producer=producer) == [None, None]


PACKED = nccl_bench.packed_gather
SEPARATE = nccl_bench.separate_gather
NOCOPY = nccl_bench.packed_nocopy_gather


def untrimmed_packed(parts, n, gather):
    hidden = parts[0].shape[-1]
    return list(gather(torch.cat(parts, dim=-1)).split(hidden, dim=-1))


def reversed_split(parts, n, gather):
    return PACKED(parts, n, gather)[::-1]


def swapped_ranks(parts, n, gather):
    def swapped(x):
        out = gather(x)
        return torch.cat([out[x.shape[0] :], out[: x.shape[0]]])

    return SEPARATE(parts, n, swapped)


def nocopy_missing_aux(packed, n, hidden, gather):
    return NOCOPY(packed, n, hidden, gather)[:-1]


@pytest.mark.parametrize("producer", [False, True], ids=["states", "producer"])
@pytest.mark.parametrize(
    ("name", "fault", "label"),
    [
        ("packed_gather", untrimmed_packed, "packed gather (N=17, k=3): tensor 0 has"),
        (
            "packed_gather",
            reversed_split,
            "packed gather (N=17, k=3): tensor 0 differs",
        ),
        ("separate_gather", swapped_ranks, "separate gathers (N=17, k=3): tensor 0"),
        ("packed_nocopy_gather", nocopy_missing_aux, "copy (N=17, k=3): 3 tensors"),
    ],
    ids=["no-trim", "split-order", "rank-order", "aux-dropped"],
)
def test_a_planted_fault_in_one_variant_is_caught(
    monkeypatch, name, fault, label, producer
):
    monkeypatch.setattr(nccl_bench, name, fault)
    raised = run_check(17, 3, producer=producer)
    for error in raised:
        assert isinstance(error, RowsDiffer), error
        assert label in str(error)


def test_a_producer_writing_the_wrong_slice_is_caught(monkeypatch):
    real_add = torch.add

    def add(x, r, out=None):
        if out is not None:  # every sum lands in the first slice
            out = out.as_strided(out.shape, out.stride(), 0)
        return real_add(x, r, out=out)

    monkeypatch.setattr(nccl_bench.torch, "add", add)
    for error in run_check(17, 1, producer=True):
        assert isinstance(error, RowsDiffer), error
        assert "packed gather without copy (N=17, k=1): tensor 0 differs" in str(error)


def run_handoff_check(
    n: int, tp: int = 2, hidden: int = HIDDEN
) -> list[BaseException | None]:
    """``check_handoff`` on every TP rank (threads); what each raised."""
    return on_thread_ranks(
        tp,
        lambda rank, gather: nccl_bench.check_handoff(n, hidden, tp, rank, gather),
    )


@pytest.mark.parametrize("n", [1, 2, 3, 17, 64])
@pytest.mark.parametrize("tp", [2, 4])
def test_the_replicated_hand_off_gives_each_rank_its_shards(n, tp):
    assert run_handoff_check(n, tp) == [None] * tp


@pytest.mark.parametrize("n", [1, 3])
def test_keys_tp_does_not_divide_travel_whole_and_still_arrive_as_shards(n):
    """hidden 3 at TP2 and odd N: vLLM's transport sends such a key whole."""
    full = torch.zeros(n, 3)
    assert nccl_bench.transport_slice(full, 2, 1) is full
    assert run_handoff_check(n, 2, hidden=3) == [None, None]


def unsharded(received, n, tp, rank, gather):
    return [t[: -(-n // tp)] for t in RESHARD(received, n, 1, 0, gather)]


def first_slice(full, tp, rank):
    return SLICE(full, tp, 0)


def untrimmed(shards, n, gather):
    return untrimmed_packed(shards, n, gather)


RESHARD = nccl_bench.reshard_after_recv
SLICE = nccl_bench.transport_slice


@pytest.mark.parametrize(
    ("name", "fault", "label"),
    [
        ("reshard_after_recv", unsharded, "tensor 0 differs"),
        ("transport_slice", first_slice, "tensor 0 differs"),
        ("gather_before_send", untrimmed, ""),
    ],
    ids=["no-reshard", "rank-0-slice", "no-trim"],
)
def test_a_planted_fault_in_the_replicated_hand_off_is_caught(
    monkeypatch, name, fault, label
):
    monkeypatch.setattr(nccl_bench, name, fault)
    raised = run_handoff_check(17, 2)
    assert any(error is not None for error in raised), raised
    for error in raised:
        if error is not None and label:
            assert isinstance(error, RowsDiffer), error
            assert "replicated hand-off (N=17, TP=2)" in str(error)
            assert label in str(error)


def ratio_points(ratios: dict[int, float], k: int = 1) -> list[dict]:
    return [
        {
            "N": n,
            "k": k,
            "tp": 2,
            "rows_per_rank": -(-n // 2),
            "packed_bytes_per_rank": (k + 1) * -(-n // 2) * 7168 * 2,
            "packed_over_separate": r,
        }
        for n, r in ratios.items()
    ]


def test_crossover_interpolates_where_packing_turns_slower():
    points = ratio_points({256: 0.6, 1024: 0.9, 4096: 1.1, 16384: 1.3})
    c = crossover(points, 1)
    assert (c["last_not_slower_N"], c["first_slower_N"]) == (1024, 4096)
    assert c["threshold_N"] == pytest.approx(2048)  # halfway in log N
    assert c["threshold_packed_bytes_per_rank"] == pytest.approx(2 * 1024 * 7168 * 2)
    assert c["slower_at_N"] == [4096, 16384]


def test_crossover_ignores_a_slower_point_followed_by_faster_ones():
    c = crossover(ratio_points({64: 1.05, 256: 0.9, 1024: 0.8}), 1)
    assert c["first_slower_N"] is None and c["threshold_N"] is None
    assert c["slower_at_N"] == [64]


def test_layout_problem_names_the_ranks_a_part_needs():
    assert nccl_bench.layout_problem(["handoff"], 2, 2) == (
        "handoff runs TP2×PP2: start 4 ranks, not 2"
    )
    assert nccl_bench.layout_problem(["gather"], 2, 3).startswith("start TP or 2·TP")
    assert nccl_bench.layout_problem(["handoff", "gather"], 2, 4) is None
    assert nccl_bench.layout_problem(["peak", "gather", "components"], 2, 2) is None


@pytest.fixture(scope="module")
def launch(tmp_path_factory):
    """One gloo launch of every part: TP2×PP2, the gather on stage 1, the
    components and the peak on ranks 0 and 1."""
    out = tmp_path_factory.mktemp("nccl")
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "4",
        str(SCRIPT),
        "--part",
        "peak,gather,components,handoff",
        "--tp",
        "2",
        "--hidden",
        str(HIDDEN),
        "--tokens",
        "1,17",
        "--aux",
        "1,3",
        "--reps",
        str(REPS),
        "--target-ms",
        "1",
        "--warmup",
        "2",
        "--min-iters",
        "2",
        "--max-iters",
        "4",
        "--peak-mib",
        "1",
        "--name",
        "run",
        "--out",
        str(out),
    ]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run(command, capture_output=True, text=True, timeout=240, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    (out / "stdout.txt").write_text(proc.stdout)
    return out


BF16 = 2  # bytes per element: the launch runs the default --dtype bf16


def measurements(report: dict):
    """Every measurement, with the bytes it moves and its bus factor as
    nccl-tests defines them: an all-gather of ``n`` ranks counts its whole
    output and ``(n-1)/n``, a send its payload and 1."""
    for pt in report["gather"]["points"]:
        gathered = (pt["k"] + 1) * 2 * pt["rows_per_rank"] * HIDDEN * BF16
        for name in ("packed", "separate", "packed_nocopy"):
            yield pt[name], gathered, 1 / 2
    for pt in report["components"]["points"]:
        pair = 2 * pt["rows_per_rank"] * HIDDEN * BF16  # hidden states + residual
        yield pt["send"], pair, 1
        yield pt["all_gather"], 2 * pair, 1 / 2
    for pt in report["handoff"]["points"]:
        pair = 2 * pt["rows_per_rank"] * HIDDEN * BF16
        yield pt["sp"], pair, 1
        yield pt["replicated"], pair, 1
    yield report["peak"]["nccl_send"], 2**20, 1
    yield report["peak"]["all_gather"], 2**20, 1 / 2


def test_the_json_keeps_every_repetition_and_its_summary(launch):
    report = json.loads((launch / "run.json").read_text())
    for m, nbytes, bus_factor in measurements(report):
        assert len(m["per_rank_us"][0]) == REPS and len(m["reps_us"]) == REPS
        assert m["reps_us"] == [max(col) for col in zip(*m["per_rank_us"], strict=True)]
        assert m["median_us"] == statistics.median(m["reps_us"])
        assert (m["min_us"], m["max_us"]) == (min(m["reps_us"]), max(m["reps_us"]))
        assert m["min_us"] > 0
        assert (m["bytes"], m["bus_factor"]) == (nbytes, bus_factor)
        assert m["algbw_GBps"] == pytest.approx(nbytes / m["median_us"] / 1e3)
        assert m["busbw_GBps"] == pytest.approx(m["algbw_GBps"] * bus_factor)
        assert 2 <= m["iters"] <= 4
    assert [len(m["per_rank_us"]) for m, _, _ in measurements(report)] == (
        [2] * 12 + [2] * 4 + [4] * 4 + [2] * 2
    )


def test_the_json_carries_what_the_tables_read(launch):
    written = launch / "run.json"
    report = json.loads(written.read_text())
    assert report["setup"] == {
        "world": 4,
        "tp": 2,
        "pp": 2,
        "dtype": "bf16",
        "hidden": HIDDEN,
        "backend": "gloo",
        "timing": "host clock",
        "reps": REPS,
        "target_ms": 1.0,
        "warmup": 2,
        "min_iters": 2,
        "max_iters": 4,
        "tokens": [1, 17],
        "aux": [1, 3],
        "producer": False,
    }
    assert report["command"].endswith("--name run --out " + str(launch))
    assert "NCCL_NVLS_ENABLE=0" in report["command"]
    assert report["versions"]["torch"] == torch.__version__
    assert report["device"] == {
        "name": platform.processor() or platform.machine() or "cpu"
    }
    # Written in UTC, at whole seconds, during the launch (at most its 240 s).
    date = datetime.datetime.fromisoformat(report["date"])
    assert date.utcoffset() == datetime.timedelta(0)
    assert 0 <= written.stat().st_mtime - date.timestamp() < 240
    assert report["link_peak_source"] == "nccl_send"
    assert report["link_peak_GBps"] == report["peak"]["nccl_send"]["busbw_GBps"]
    gather = report["gather"]
    assert [(p["N"], p["k"], p["rows_per_rank"]) for p in gather["points"]] == [
        (1, 1, 1),
        (1, 3, 1),
        (17, 1, 9),
        (17, 3, 9),
    ]
    for p in gather["points"]:
        assert p["packed_bytes_per_rank"] == (p["k"] + 1) * p["rows_per_rank"] * 16
        assert p["gathered_bytes"] == 2 * p["packed_bytes_per_rank"]
        assert p["packed_over_separate"] == (
            p["packed"]["median_us"] / p["separate"]["median_us"]
        )
        assert p["nocopy_over_separate"] == (
            p["packed_nocopy"]["median_us"] / p["separate"]["median_us"]
        )
    assert gather["crossover"] == [crossover(gather["points"], k) for k in (1, 3)]
    for p in report["components"]["points"]:
        send, ag = p["send"]["median_us"], p["all_gather"]["median_us"]
        assert p["derived_handoff_ratio"] == (send + 2 * ag) / send
        assert p["bytes_per_tensor"] == p["rows_per_rank"] * HIDDEN * 2
    assert [p["rows_per_rank"] for p in report["handoff"]["points"]] == [1, 9]
    for p in report["handoff"]["points"]:
        assert p["replicated_over_sp"] == (
            p["replicated"]["median_us"] / p["sp"]["median_us"]
        )


def test_the_table_is_built_from_the_json_alone(launch, tmp_path):
    report = json.loads((launch / "run.json").read_text())
    assert (launch / "run.md").read_text() == markdown(report)
    edited = copy.deepcopy(report)
    point = edited["gather"]["points"][2]
    point["packed"] |= {"median_us": 1234.5, "min_us": 1000.0, "max_us": 1500.5}
    point["packed_over_separate"] = 0.125
    edited["components"]["points"][1]["derived_handoff_ratio"] = 6.5
    copy_path = tmp_path / "edited.json"
    copy_path.write_text(json.dumps(edited))
    assert nccl_bench.main(["--table-from", str(copy_path)]) == 0
    table = copy_path.with_suffix(".md").read_text()
    assert "| 17 | 1 | 288 B | 1,234.5 [1,000.0–1,500.5] |" in table
    assert "| 0.125" in table and "| 6.50× |" in table
    assert table != markdown(report)


def test_the_table_states_the_derived_ratio_and_the_crossover(launch):
    table = (launch / "run.md").read_text()
    assert "(send + 2·all-gather) / send, derived |" in table
    assert "**derived**" in table
    assert "Hand-off at TP2×PP2 (measured)" in table
    crossings = [line for line in table.splitlines() if line.startswith("- k=")]
    assert [line[:5] for line in crossings] == ["- k=1", "- k=3"]


def test_the_hand_off_table_sets_sp_beside_replicated_with_their_ratio(launch):
    """One row per N: the series' hand-off, 0.34.0's replicated one, and the
    ratio of their medians, from the JSON."""
    report = json.loads((launch / "run.json").read_text())
    table = (launch / "run.md").read_text().split("## Hand-off at TP2×PP2")[1]
    rows = [
        line for line in table.splitlines() if line.startswith("| ") and "×" in line
    ]
    want = []
    for p in report["handoff"]["points"]:
        sp, rep = p["sp"], p["replicated"]
        ratio = rep["median_us"] / sp["median_us"]
        want.append(
            f"| {p['N']} | {p['rows_per_rank']} | {sp['median_us']:,.1f} "
            f"[{sp['min_us']:,.1f}–{sp['max_us']:,.1f}] | {rep['median_us']:,.1f} "
            f"[{rep['min_us']:,.1f}–{rep['max_us']:,.1f}] | {ratio:.2f}× |"
        )
    assert rows == want
    assert "| N | rows/rank | sp µs | replicated µs | replicated / sp |" in table


@pytest.mark.parametrize(
    ("tokens", "cuda", "grid", "said"),
    [
        (None, True, nccl_bench.DEFAULT_TOKENS, ""),
        (None, False, "8,64,256,1024", "; the small CPU grid N=8,64,256,1024 (the"),
        ("1,17", False, "1,17", "no CUDA device: gloo on the CPU, timed by the "),
        ("1,17", True, "1,17", ""),
    ],
    ids=["gpu", "cpu-default", "cpu-given", "gpu-given"],
)
def test_the_cpu_runs_a_small_grid_and_says_so(tokens, cuda, grid, said):
    got, note = nccl_bench.token_grid(tokens, cuda)
    assert got == [int(n) for n in grid.split(",")]
    assert said in note and bool(note) == (not cuda)
    assert ("small CPU grid" in note) == (tokens is None and not cuda)


def test_progress_estimates_the_time_left_from_the_points_so_far(monkeypatch, capsys):
    clock = iter([100.0, 105.0, 130.0, 150.0])
    monkeypatch.setattr(nccl_bench.time, "monotonic", lambda: next(clock))
    progress = nccl_bench.Progress(total=3, rank=0)
    for name in ("a", "b", "c"):
        progress.point(name)
    assert capsys.readouterr().out.splitlines() == [
        "[   5.0s] a: done (1/3 points; about 10 s left at this pace)",
        "[  30.0s] b: done (2/3 points; about 15 s left at this pace)",
        "[  50.0s] c: done (3/3 points)",
    ]


def test_every_point_is_reported_as_it_finishes(launch):
    lines = (launch / "stdout.txt").read_text().splitlines()
    done = [line for line in lines if re.match(r"\[ *[0-9.]+s\] ", line)]
    # peak, gather N×k, components N, handoff N at N = 1, 17 and k = 1, 3
    names = ["peak"] + [f"gather N={n} k={k}" for n in (1, 17) for k in (1, 3)]
    names += [f"{part} N={n}" for part in ("components", "handoff") for n in (1, 17)]
    assert [line.split("] ", 1)[1].split(": done")[0] for line in done] == names
    assert all(f"({i}/9 points; about " in done[i - 1] for i in range(1, 9))
    assert done[-1].endswith("(9/9 points)")
    report = json.loads((launch / "run.json").read_text())
    assert report["complete"] is True
    assert "Incomplete" not in (launch / "run.md").read_text()


def test_a_stopped_run_keeps_the_points_it_finished(tmp_path):
    tokens = ",".join(str(n) for n in range(1, 201))
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        str(SCRIPT),
        "--part",
        "components",
        "--hidden",
        str(HIDDEN),
        "--tokens",
        tokens,
        "--reps",
        "2",
        "--target-ms",
        "1",
        "--warmup",
        "1",
        "--min-iters",
        "1",
        "--max-iters",
        "2",
        "--name",
        "stopped",
        "--out",
        str(tmp_path),
    ]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=env,
        start_new_session=True,
    )
    try:
        for line in proc.stdout:
            if "done (3/200 points" in line:
                break
        os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    report = json.loads((tmp_path / "stopped.json").read_text())
    measured = [p["N"] for p in report["components"]["points"]]
    assert report["complete"] is False
    assert 3 <= len(measured) < 200 and measured == list(range(1, len(measured) + 1))
    assert "**Incomplete**" in (tmp_path / "stopped.md").read_text()
