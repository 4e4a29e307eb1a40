# SPDX-License-Identifier: Apache-2.0
"""The prefill sweep: the pull request's command for every point, its two
tables reproduced from result files in ``vllm bench serve``'s schema, resume
and failure handling, and one real ``vllm bench serve`` run against a local
streaming server."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from eval import bench
from tests.eval.fake_openai import serving
from tests.eval.test_serve import SERVED_ENV

DATA = Path(__file__).parent / "data"
ARM_COLUMNS = {"fi-noep": 2, "fi-ep": 3, "mega-sp": 4}
# The keys `vllm bench serve --save-result` writes (vllm/benchmarks/serve.py,
# without --save-detailed); the end-to-end test checks them against a real run.
RESULT_KEYS = [
    "backend",
    "burstiness",
    "completed",
    "date",
    "duration",
    "endpoint_type",
    "failed",
    "label",
    "latencies",
    "max_concurrency",
    "max_concurrent_requests",
    "max_output_tokens_per_s",
    "mean_e2el_ms",
    "mean_ttft_ms",
    "median_e2el_ms",
    "median_ttft_ms",
    "model_id",
    "num_prompts",
    "output_throughput",
    "p50_e2el_ms",
    "p50_ttft_ms",
    "p90_e2el_ms",
    "p90_ttft_ms",
    "p95_e2el_ms",
    "p95_ttft_ms",
    "p99_e2el_ms",
    "p99_ttft_ms",
    "queue_times",
    "request_goodput",
    "request_rate",
    "request_throughput",
    "rtfx",
    "std_e2el_ms",
    "std_ttft_ms",
    "tokenizer_id",
    "total_input_tokens",
    "total_output_tokens",
    "total_token_throughput",
]
# The pull request computed its deltas from unrounded measurements. Where the
# printed (rounded) figures give a different last digit, the fixture uses a
# value inside the printed figure's rounding interval that agrees with both
# printed deltas.
UNROUNDED = {
    ("fi-noep", bench.Point(128, 1)): 962.4,
    ("mega-sp", bench.Point(128, 1)): 1380.6,
    ("fi-noep", bench.Point(128, 8)): 3528.6,
    ("mega-sp", bench.Point(128, 8)): 4840.4,
}


def seed_tables() -> dict[str, list[list[str]]]:
    tables: dict[str, list[list[str]]] = {}
    current = None
    for line in (DATA / "seed_tables.tsv").read_text().splitlines():
        if line.startswith("#") or not line.strip():
            continue
        if "\t" not in line:
            current = tables.setdefault(line.strip(), [])
        else:
            current.append(line.split("\t"))
    return tables


def number(cell: str) -> float:
    return float(cell.replace(",", "").removesuffix(" ms"))


def result_file(point: bench.Point, tput: float, ttft: float, failed: int = 0):
    result = dict.fromkeys(RESULT_KEYS, 0.0)
    result.update(
        date="20261129-120000",
        backend="openai-chat",
        endpoint_type="openai-chat",
        label=None,
        model_id="Kimi-K3",
        tokenizer_id="/models/Kimi-K3",
        num_prompts=point.num_prompts,
        request_rate="inf",
        burstiness=1.0,
        max_concurrency=point.concurrency,
        completed=point.num_prompts - failed,
        failed=failed,
        total_input_tokens=point.input_len * point.num_prompts,
        total_output_tokens=point.num_prompts,
        total_token_throughput=tput,
        mean_ttft_ms=ttft,
        latencies=[],
        queue_times=[],
    )
    return result


def write_seed_results(root: Path, skip: set[tuple[str, bench.Point]] = frozenset()):
    tables = seed_tables()
    tput_rows = tables["Total token throughput"][1:]
    ttft_rows = tables["Mean TTFT"][1:]
    for tput_row, ttft_row in zip(tput_rows, ttft_rows, strict=True):
        point = bench.Point(int(tput_row[0]), int(tput_row[1]))
        for arm, column in ARM_COLUMNS.items():
            if (arm, point) in skip:
                continue
            tput = UNROUNDED.get((arm, point), number(tput_row[column]))
            ttft = number(ttft_row[column])
            (root / arm).mkdir(parents=True, exist_ok=True)
            (root / arm / point.filename).write_text(
                json.dumps(result_file(point, tput, ttft))
            )


def markdown_rows(report: str, title: str) -> list[list[str]]:
    section = report.split(f"#### {title}")[1].split("####")[0]
    rows = [line for line in section.splitlines() if line.startswith("|")]
    return [
        [cell.strip() for cell in row.strip("|").split("|")]
        for row in rows
        if "---" not in row
    ]


def test_report_reproduces_both_seed_tables(tmp_path, capsys):
    write_seed_results(tmp_path)
    assert bench.main(["--results", str(tmp_path), "report"]) == 0
    report = capsys.readouterr().out
    for title, rows in seed_tables().items():
        assert markdown_rows(report, title) == rows, title
    assert "missing" not in report
    summary = json.loads((tmp_path / "report.json").read_text())
    first = summary["points"][0]
    assert first["mega-sp"]["total_token_throughput"] == 1380.6
    assert round(first["deltas_percent"]["Mega vs FI+EP"]["mean_ttft_ms"], 1) == -25.8
    for name in ("total_token_throughput.png", "mean_ttft_ms.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_missing_points_and_arms_are_shown_as_missing(tmp_path, capsys):
    write_seed_results(
        tmp_path,
        skip={("mega-sp", bench.Point(8192, 4))}
        | {("fi-noep", point) for point in bench.POINTS},
    )
    assert bench.main(["--results", str(tmp_path), "report"]) == 0
    report = capsys.readouterr().out
    rows = markdown_rows(report, "Total token throughput")
    assert rows[8] == [
        "8192", "4", "missing", "32,564", "missing", "missing", "missing"
    ]  # fmt: skip
    assert rows[1] == ["128", "1", "missing", "1,025", "1,381", "+34.7%", "missing"]
    assert "Missing points: fi-noep 128x1," in report
    summary = json.loads((tmp_path / "report.json").read_text())
    assert "mega-sp" not in summary["points"][7]


def seed_command(point: bench.Point) -> list[str]:
    """What the seed's run_point passes to vllm, as bash expands it."""
    script = (DATA / "seed_bench.sh").read_text().split("\nfor c in")[0]
    shell = (
        f"{script}\nvllm() {{ printf '%s\\0' \"$@\"; }}\nMODEL=/models/Kimi-K3\n"
        f"run_point {point.input_len} {point.concurrency}\n"
    )
    output = subprocess.run(
        ["bash", "-c", shell], capture_output=True, text=True, check=True
    ).stdout
    return output.split("\0")[:-1]


def test_sweep_is_the_seeds_in_order():
    text = (DATA / "seed_bench.sh").read_text()
    loops = "for c in" + text.split("\nfor c in", 1)[1]
    points = subprocess.run(
        ["bash", "-c", 'run_point() { echo "$1x$2"; }\n' + loops],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    assert points == [str(p) for p in bench.POINTS]


@pytest.mark.parametrize("point", bench.POINTS, ids=str)
def test_command_is_the_seeds_run_point(point, tmp_path):
    command = bench.bench_command(
        point, "http://127.0.0.1:8691", "Kimi-K3", "/models/Kimi-K3", tmp_path
    )
    assert command[:-5] == ["vllm", *seed_command(point)]
    assert command[-5:] == [
        "--save-result", "--result-dir", str(tmp_path),
        "--result-filename", point.filename,
    ]  # fmt: skip


# -- running the sweep ---------------------------------------------------


def fake_vllm(tmp_path: Path, fail: str = "") -> Path:
    """A `vllm bench serve` that logs its point and saves a result; the point
    ``fail`` (e.g. "128x8") gets one failed request."""
    log = tmp_path / "calls.log"
    script = tmp_path / "vllm"
    script.write_text(
        f"#!{sys.executable}\n"
        "import json, sys\n"
        "sys.path.insert(0, " + repr(str(Path(__file__).parents[2])) + ")\n"
        "from tests.eval.test_bench import result_file\n"
        "from eval.bench import Point\n"
        "a = sys.argv\n"
        "v = lambda flag: a[a.index(flag) + 1]\n"
        "p = Point(int(v('--random-input-len')), int(v('--max-concurrency')))\n"
        f"open({str(log)!r}, 'a').write(str(p) + '\\n')\n"
        f"failed = int(str(p) == {fail!r})\n"
        "r = result_file(p, 1000.0 + p.concurrency, 100.0, failed=failed)\n"
        "open(v('--result-dir') + '/' + v('--result-filename'), 'w')"
        ".write(json.dumps(r))\n"
    )
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return script


def sweep(results: Path, url: str, vllm: Path, *extra: str):
    return subprocess.run(
        [sys.executable, "-m", "eval.bench", "--results", str(results), "run",
         "--arm", "mega-sp", "--base-url", url, "--model", "Kimi-K3",
         "--tokenizer", "/models/Kimi-K3", "--vllm", str(vllm),
         "--points", "128x1,128x8,8192x1", *extra],
        cwd=bench.PROJECT_DIR,
        capture_output=True,
        text=True,
        timeout=120,
    )  # fmt: skip


def test_failed_point_stops_the_sweep_and_a_rerun_resumes(tmp_path):
    results = tmp_path / "results"
    with serving("Kimi-K3") as url:
        first = sweep(results, url, fake_vllm(tmp_path, fail="128x8"))
        assert first.returncode == 1
        assert "[2/3] mega-sp input 128, concurrency 8: not every request" in (
            first.stderr
        )
        assert (results / "mega-sp" / "in128-c8.failed.json").is_file()
        assert not (results / "mega-sp" / "in128-c8.json").exists()
        assert (tmp_path / "calls.log").read_text().split() == ["128x1", "128x8"]

        second = sweep(results, url, fake_vllm(tmp_path))
        assert second.returncode == 0, second.stderr
    assert "[1/3] mega-sp input 128, concurrency 1: done before, skipped" in (
        second.stdout
    )
    assert "[3/3] mega-sp input 8192, concurrency 1: 1,001 tok/s" in second.stdout
    calls = (tmp_path / "calls.log").read_text().split()
    assert calls == ["128x1", "128x8", "128x8", "8192x1"]
    manifest = json.loads((results / "mega-sp" / "manifest.json").read_text())
    assert [run["points"] for run in manifest["runs"]] == [
        ["128x1", "128x8", "8192x1"]
    ] * 2
    assert manifest["runs"][0]["served_vllm_version"] == "0.33.0"
    assert "--kernel-config" in manifest["serve_command"]
    assert manifest["serve_env"] == SERVED_ENV


@pytest.mark.parametrize(
    ("caching", "message"),
    [(True, "has prefix caching on"), (None, "does not report")],
)
def test_prefix_caching_is_refused_unless_allowed(tmp_path, caching, message):
    vllm = fake_vllm(tmp_path)
    with serving("Kimi-K3", prefix_caching=caching) as url:
        refused = sweep(tmp_path / "results", url, vllm)
        assert refused.returncode == 1
        assert message in refused.stderr
        assert "ALLOW_PREFIX_CACHING=1" in refused.stderr
        assert not (tmp_path / "calls.log").exists()
        allowed = sweep(tmp_path / "results", url, vllm, "--allow-prefix-caching")
        assert allowed.returncode == 0, allowed.stderr


def test_points_outside_the_sweep_are_refused():
    with pytest.raises(bench.BenchError, match="128x2 is not in the sweep"):
        bench.parse_points("128x1,128x2")


# -- end to end ----------------------------------------------------------


def tiny_tokenizer(directory: Path) -> Path:
    """A word-level tokenizer written by the test: no download."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    directory.mkdir()
    vocab = {"[UNK]": 0, **{f"w{i}": i + 1 for i in range(511)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.decoder = decoders.WordPiece(prefix="##")
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "unk_token": "[UNK]",
                "model_max_length": 100000,
            }
        )
    )
    return directory


def test_real_vllm_bench_serve_result_feeds_the_report(tmp_path, capsys):
    tokenizer = tiny_tokenizer(tmp_path / "tokenizer")
    results = tmp_path / "results"
    with serving("Kimi-K3") as url:
        proc = subprocess.run(
            [sys.executable, "-m", "eval.bench", "--results", str(results), "run",
             "--arm", "fi-ep", "--base-url", url, "--model", "Kimi-K3",
             "--tokenizer", str(tokenizer), "--points", "128x1"],
            cwd=bench.PROJECT_DIR,
            env={**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_TARGET_DEVICE": "cpu"},
            capture_output=True,
            text=True,
            timeout=240,
        )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    saved = json.loads((results / "fi-ep" / "in128-c1.json").read_text())
    assert sorted(saved) == sorted(RESULT_KEYS)
    assert (saved["completed"], saved["failed"]) == (3, 0)
    assert saved["total_input_tokens"] == 3 * 128
    assert bench.main(["--results", str(results), "report"]) == 0
    rows = markdown_rows(capsys.readouterr().out, "Total token throughput")
    assert rows[1][:2] == ["128", "1"]
    assert rows[1][3] == f"{saved['total_token_throughput']:,.0f}"
    assert rows[1][2] == rows[1][4] == "missing"
