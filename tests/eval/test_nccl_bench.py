# SPDX-License-Identifier: Apache-2.0
"""eval/nccl_bench.py at tiny sizes over gloo, so it cannot rot without a GPU."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "eval" / "nccl_bench.py"


@pytest.fixture(autouse=True)
def cpu_only(monkeypatch):
    """The gloo path, even on a machine with a GPU."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")


def bench(tmp_path: Path, nproc: int, *args: str) -> subprocess.CompletedProcess[str]:
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        str(nproc),
        str(SCRIPT),
        "--hidden",
        "64",
        "--iters",
        "3",
        "--warmup",
        "1",
        "--out",
        str(tmp_path),
        *args,
    ]
    return subprocess.run(command, capture_output=True, text=True, timeout=180)


def test_handoff_checks_rows_and_reports_both_paths(tmp_path):
    proc = bench(
        tmp_path,
        4,
        "--part",
        "handoff",
        "--tp",
        "2",
        "--dtype",
        "fp32",
        "--tokens",
        "1,17",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((tmp_path / "handoff-TP2xPP2-fp32.json").read_text())
    assert [(p["N"], p["rows_per_rank"]) for p in report["points"]] == [(1, 1), (17, 9)]
    for point in report["points"]:
        assert point["sp"]["median_us"] > 0 and point["replicated"]["median_us"] > 0
    table = (tmp_path / "handoff-TP2xPP2-fp32.md").read_text()
    assert "| 17 | 9 |" in table and "gloo" in report["setup"]


def test_gather_checks_packing_and_reports_speedups(tmp_path):
    proc = bench(
        tmp_path,
        2,
        "--part",
        "gather",
        "--dtype",
        "bf16",
        "--tokens",
        "8,17",
        "--aux",
        "1,3",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((tmp_path / "gather-TP2-bf16.json").read_text())
    assert [(p["N"], p["k"]) for p in report["points"]] == [
        (8, 1),
        (8, 3),
        (17, 1),
        (17, 3),
    ]
    assert all(p["speedup"] > 0 for p in report["points"])
    assert report["command"].endswith("--aux 1,3")


def test_handoff_refuses_the_wrong_world_size(tmp_path):
    proc = bench(tmp_path, 2, "--part", "handoff", "--tp", "2")
    assert proc.returncode != 0
    assert "handoff runs TP2×PP2: start 4 ranks, not 2" in proc.stderr
