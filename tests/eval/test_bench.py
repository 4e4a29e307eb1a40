# SPDX-License-Identifier: Apache-2.0
"""The sweeps: the pull request's command for every point, its two tables
reproduced from result files in ``vllm bench serve``'s schema, resume and
failure handling, and the decode sweep at its own sizes with a stand-in
client. The real client runs against real servers in
tests/serving/test_serve_evaluate.py."""

from __future__ import annotations

import json
import signal
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from eval import bench, openai_server
from tests.eval.fake_openai import serving
from tests.eval.test_serve import SERVED_ENV

DATA = Path(__file__).parent / "data"
ARM_COLUMNS = {"fi-noep": 2, "fi-ep": 3, "mega-sp": 4}
# The keys `vllm bench serve --save-result` writes (vllm/benchmarks/serve.py,
# without --save-detailed); tests/serving checks them against a real run.
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


def fake_vllm(
    tmp_path: Path, fail: str = "", interrupt: str = "", saved: bool = True
) -> Path:
    """A `vllm bench serve` that logs its point and saves a result (a decode
    point's with TPOT, ITL and one latency per request); the point ``fail``
    (e.g. "128x8") gets one failed request; at the point ``interrupt`` the
    user presses Ctrl-C, after the client saved its result or
    (``saved=False``) before."""
    log = tmp_path / "calls.log"
    script = tmp_path / "vllm"
    script.write_text(
        f"#!{sys.executable}\n"
        "import json, sys\n"
        "sys.path.insert(0, " + repr(str(Path(__file__).parents[2])) + ")\n"
        "from tests.eval.test_bench import decode_result, result_file\n"
        "from eval.bench import Point\n"
        "a = sys.argv\n"
        "v = lambda flag: a[a.index(flag) + 1]\n"
        "n = lambda flag: int(v(flag))\n"
        "p = Point(n('--random-input-len'), n('--max-concurrency'), "
        "n('--random-output-len'))\n"
        f"open({str(log)!r}, 'a').write(str(p) + '\\n')\n"
        "import os\n"
        f"open({str(tmp_path / 'client-env.log')!r}, 'a')"
        ".write(os.environ.get('VLLM_USE_RUST_BENCH', '-') + '\\n')\n"
        f"failed = int(str(p) == {fail!r})\n"
        "if p.output_len > 1:\n"
        "    r = decode_result(p, 2.0 + p.concurrency)\n"
        "    r['latencies'] = [1.0 + i % 3 for i in range(p.num_prompts)]\n"
        "else:\n"
        "    r = result_file(p, 1000.0 + p.concurrency, 100.0)\n"
        "r.update(completed=p.num_prompts - failed, failed=failed)\n"
        f"stop = str(p) == {interrupt!r}\n"
        f"if not stop or {saved!r}:\n"
        "    open(v('--result-dir') + '/' + v('--result-filename'), 'w')"
        ".write(json.dumps(r))\n"
        "if stop:\n"
        "    import os, signal, time\n"
        "    os.kill(os.getppid(), signal.SIGINT)\n"
        "    time.sleep(30)\n"
    )
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return script


def sweep(
    results: Path, url: str, vllm: Path, *extra: str, points="128x1,128x8,8192x1"
):
    # A shell's background job ignores SIGINT, and so would the sweep.
    return subprocess.run(
        [sys.executable, "-m", "eval.bench", "--results", str(results), "run",
         "--arm", "mega-sp", "--base-url", url, "--served-model-name", "Kimi-K3",
         "--tokenizer", "/models/Kimi-K3", "--vllm", str(vllm),
         "--points", points, *extra],
        cwd=bench.PROJECT_DIR,
        capture_output=True,
        text=True,
        timeout=120,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
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


@pytest.mark.parametrize("frontend", ["python", "rust"])
@pytest.mark.parametrize(
    ("caching", "message", "recorded"),
    [
        # The allowed run probes again: both prompts now hit.
        (True, "has prefix caching on: /metrics counted 720 prefix-cache "
         "queries and 359 hits for the 720 prompt tokens sent",
         "/metrics counted 720 prefix-cache queries and 718 hits"),
        (None, "does not say if it caches: /metrics has no "
         "vllm:prefix_cache_queries", "/metrics has no vllm:prefix_cache_queries"),
    ],
)  # fmt: skip
def test_prefix_caching_is_refused_unless_allowed(
    tmp_path, frontend, caching, message, recorded
):
    vllm = fake_vllm(tmp_path)
    with serving("Kimi-K3", prefix_caching=caching, frontend=frontend) as url:
        refused = sweep(tmp_path / "results", url, vllm)
        assert refused.returncode == 1
        assert message in refused.stderr
        assert "ALLOW_PREFIX_CACHING=1" in refused.stderr
        assert not (tmp_path / "calls.log").exists()
        allowed = sweep(tmp_path / "results", url, vllm, "--allow-prefix-caching")
        assert allowed.returncode == 0, allowed.stderr
    manifest = json.loads((tmp_path / "results/mega-sp/manifest.json").read_text())
    assert manifest["runs"][0]["prefix_caching"]["observed"].startswith(recorded)


@pytest.mark.parametrize("frontend", ["python", "rust"])
def test_prefix_caching_off_is_established_from_the_counters(tmp_path, frontend):
    """Without ``cache_config_info`` (the Rust frontend) the counters decide:
    none of the probe's prompt tokens was a prefix-cache query."""
    results = tmp_path / "results"
    with serving("Kimi-K3", frontend=frontend) as url:
        proc = sweep(results, url, fake_vllm(tmp_path), points="128x1")
    assert proc.returncode == 0, proc.stderr
    manifest = json.loads((results / "mega-sp" / "manifest.json").read_text())
    assert manifest["runs"][0]["prefix_caching"] == {
        "probe": "the same prompt twice, one output token each",
        "prompt_tokens_sent": 720,
        "queries": 0,
        "hits": 0,
        "prompt_tokens": 720,
        "observed": "/metrics counted 0 prefix-cache queries and 0 hits for the "
        "720 prompt tokens sent (vllm:prefix_cache_queries, vllm:prefix_cache_hits)",
    }


def test_prefix_caching_probe_that_the_counters_miss_is_not_an_answer(
    tmp_path, monkeypatch
):
    """Counters that never count the probe's prompt say nothing: no verdict
    of off from a stale /metrics."""
    monkeypatch.setattr(openai_server, "PROBE_WAIT_S", 0.5)
    with serving("Kimi-K3") as url:
        sent = openai_server.complete_once
        monkeypatch.setattr(openai_server, "complete_once", lambda *a: sent(*a) + 1)
        caching, evidence = openai_server.prefix_caching(url, "Kimi-K3")
    assert caching is None
    assert evidence["observed"] == (
        "vllm:prompt_tokens counted 720 of the 722 prompt tokens sent in 0.5 s"
    )


@pytest.mark.parametrize("rust_bench", [None, "1"])
def test_every_point_is_measured_by_the_python_client(
    tmp_path, monkeypatch, rust_bench
):
    """`vllm bench serve` would hand itself to vLLM's Rust client, whose
    results lack the per-request latencies, where VLLM_USE_RUST_BENCH=1."""
    if rust_bench:
        monkeypatch.setenv("VLLM_USE_RUST_BENCH", rust_bench)
    else:
        monkeypatch.delenv("VLLM_USE_RUST_BENCH", raising=False)
    results = tmp_path / "results"
    with serving("Kimi-K3") as url:
        proc = sweep(results, url, fake_vllm(tmp_path), points="128x1,128x8")
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "client-env.log").read_text().split() == ["0", "0"]
    note = "VLLM_USE_RUST_BENCH is set; the sweep measures with vLLM's Python client"
    assert (note in proc.stderr) == bool(rust_bench)
    manifest = json.loads((results / "mega-sp" / "manifest.json").read_text())
    assert manifest["runs"][0]["client_env"] == {"VLLM_USE_RUST_BENCH": "0"}


def test_repeats_run_every_point_once_then_again_run_k_in_its_own_file(tmp_path):
    results = tmp_path / "results"
    with serving("Kimi-K3") as url:
        proc = sweep(results, url, fake_vllm(tmp_path), "--repeat", "2",
                     points="128x1,128x8")  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "calls.log").read_text().split() == ["128x1", "128x8"] * 2
    assert "[3/4] mega-sp run 2/2, input 128, concurrency 1: running" in proc.stdout
    assert sorted(path.name for path in (results / "mega-sp").iterdir()) == [
        "in128-c1.json",
        "in128-c1.run2.json",
        "in128-c8.json",
        "in128-c8.run2.json",
        "manifest.json",
    ]
    manifest = json.loads((results / "mega-sp" / "manifest.json").read_text())
    assert manifest["runs"][0]["repeat"] == 2


def test_a_failed_second_run_keeps_the_first_and_a_rerun_resumes_run_two(tmp_path):
    """Results saved before repeats existed are run 1: with --repeat 2 they
    are skipped and only run 2 is measured, a failure set aside per run."""
    results = tmp_path / "results"
    (results / "mega-sp").mkdir(parents=True)
    for point in bench.parse_points("128x1,128x8"):
        saved = json.dumps(result_file(point, 900.0, 100.0))
        (results / "mega-sp" / point.filename).write_text(saved)
    with serving("Kimi-K3") as url:
        first = sweep(results, url, fake_vllm(tmp_path, fail="128x8"),
                      "--repeat", "2", points="128x1,128x8")  # fmt: skip
        assert first.returncode == 1
        assert "[1/4] mega-sp run 1/2, input 128, concurrency 1: done before" in (
            first.stdout
        )
        assert "(result kept as in128-c8.run2.failed.json)" in first.stderr
        second = sweep(results, url, fake_vllm(tmp_path), "--repeat", "2",
                       points="128x1,128x8")  # fmt: skip
        assert second.returncode == 0, second.stderr
    assert "[3/4] mega-sp run 2/2, input 128, concurrency 1: done before" in (
        second.stdout
    )
    assert (tmp_path / "calls.log").read_text().split() == ["128x1", "128x8", "128x8"]
    kept = sorted(path.name for path in (results / "mega-sp").iterdir())
    assert kept == [
        "in128-c1.json",
        "in128-c1.run2.json",
        "in128-c8.json",
        "in128-c8.run2.failed.json",
        "in128-c8.run2.json",
        "manifest.json",
    ]
    run_one = json.loads((results / "mega-sp" / "in128-c8.json").read_text())
    assert run_one["total_token_throughput"] == 900.0


def test_an_interrupted_second_run_is_set_aside_and_the_first_kept(tmp_path):
    results = tmp_path / "results"
    (results / "mega-sp").mkdir(parents=True)
    point = bench.Point(128, 1)
    saved = json.dumps(result_file(point, 900.0, 100.0))
    (results / "mega-sp" / point.filename).write_text(saved)
    with serving("Kimi-K3") as url:
        stopping = fake_vllm(tmp_path, interrupt="128x1")
        proc = sweep(results, url, stopping, "--repeat", "2", points="128x1")
    assert proc.returncode == 130, proc.stderr
    assert "in128-c1.run2.interrupted.json" in proc.stderr
    assert sorted(path.name for path in (results / "mega-sp").iterdir()) == [
        "in128-c1.json",
        "in128-c1.run2.interrupted.json",
        "manifest.json",
    ]
    assert (results / "mega-sp" / point.filename).read_text() == saved


def test_points_outside_the_sweep_are_refused():
    with pytest.raises(bench.BenchError, match="128x2 is not in the sweep"):
        bench.parse_points("128x1,128x2")


# -- the decode and mixed sweeps -----------------------------------------

DECODE_AND_MIXED = bench.SWEEPS["decode"].points + bench.SWEEPS["mixed"].points


def flags(command: list[str]) -> dict[str, str | None]:
    """Each ``--flag`` of a command with its value (None for a switch)."""
    out: dict[str, str | None] = {}
    for i, word in enumerate(command):
        if word.startswith("--"):
            nxt = command[i + 1] if i + 1 < len(command) else "--"
            out[word] = None if nxt.startswith("--") else nxt
    return out


@pytest.mark.parametrize("point", DECODE_AND_MIXED, ids=lambda p: p.filename)
def test_decode_and_mixed_commands_are_the_prefill_flags_with_their_output(
    point, tmp_path
):
    """The client, flags and warm-up rule of the seed's points; only the
    output length, the percentiles asked for and the file differ."""
    args = ("http://127.0.0.1:8691", "Kimi-K3", "/models/Kimi-K3", tmp_path)
    got = flags(bench.bench_command(point, *args))
    prefill = bench.Point(point.input_len, point.concurrency)
    seed = flags(bench.bench_command(prefill, *args))
    assert got.keys() == seed.keys()
    assert {key for key in seed if got[key] != seed[key]} == {
        "--random-output-len",
        "--percentile-metrics",
        "--result-filename",
    }
    assert got["--random-output-len"] == str(point.output_len)
    assert got["--percentile-metrics"] == "ttft,tpot,itl,e2el"
    assert got["--result-filename"] == point.filename
    assert "--ignore-eos" in got


def test_sweeps_are_the_issues_points_each_in_its_own_file():
    decode, mixed = bench.SWEEPS["decode"], bench.SWEEPS["mixed"]
    assert [(p.input_len, p.output_len, p.concurrency) for p in decode.points] == [
        (1024, 512, c) for c in (1, 8, 32, 64, 128)
    ]
    assert [(p.input_len, p.output_len, p.concurrency) for p in mixed.points] == [
        (8192, 256, c) for c in (1, 4, 8)
    ]
    assert bench.SWEEPS["prefill"].points == bench.POINTS
    every = [p for sweep in bench.SWEEPS.values() for p in sweep.points]
    assert len({p.filename for p in every}) == len(every)


def test_points_choose_within_the_chosen_sweep():
    decode = bench.SWEEPS["decode"]
    assert bench.parse_points("1024x8,1024x1", decode) == [
        bench.Point(1024, 8, 512),
        bench.Point(1024, 1, 512),
    ]
    with pytest.raises(bench.BenchError, match=r"128x1 is not in the sweep \(decode"):
        bench.parse_points("128x1", decode)


def run_args(*extra: str) -> list[str]:
    return [
        "run", "--arm", "fi-ep", "--base-url", "http://127.0.0.1:9",
        "--served-model-name", "Kimi-K3", *extra,
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--tokenizer", ""], "no tokenizer: set CHECKPOINT="),
        (
            ["--tokenizer", "/models/Kimi-K3", "--sweep", "all", "--points", "128x1"],
            "POINTS picks points of one sweep",
        ),
        (
            ["--tokenizer", "/models/Kimi-K3", "--repeat", "0"],
            "REPEAT=0 (--repeat): each point runs at least once",
        ),
    ],
    ids=["no tokenizer", "points with all sweeps", "no run"],
)
def test_refused_before_the_server_is_contacted(monkeypatch, capsys, extra, message):
    def contacted(*args):
        raise AssertionError("the server was contacted")

    monkeypatch.setattr(bench, "check_server", contacted)
    assert bench.main(run_args(*extra)) == 1
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    ("make_vars", "message"),
    [
        ([], "bench: no tokenizer: set CHECKPOINT="),
        (["TOKENIZER=/models/Kimi-K3", "SWEEP=all", "POINTS=128x1"], "bench: POINTS"),
        (["TOKENIZER=/models/Kimi-K3", "REPEAT=0"], "bench: REPEAT=0"),
        (["MODEL=Kimi-K3"], "(SERVED_MODEL=Kimi-K3) instead"),
    ],
    ids=["no tokenizer", "points with all sweeps", "no run", "model a name"],
)
def test_make_bench_says_what_is_wrong_before_contacting_the_server(make_vars, message):
    """Nothing listens on port 9: a contacted server would fail otherwise."""
    proc = subprocess.run(
        ["make", "-s", "bench", "ARM=fi-ep", "BASE_URL=http://127.0.0.1:9",
         "SERVED_MODEL=Kimi-K3", *make_vars],
        cwd=bench.PROJECT_DIR, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode != 0
    assert message in proc.stderr, proc.stderr
    assert "127.0.0.1:9" not in proc.stderr


def decode_result(point: bench.Point, per_token_ms: float) -> dict:
    """A decode point's saved result: RESULT_KEYS plus what TPOT and ITL
    percentiles add."""
    result = result_file(point, 3000.0, 50.0)
    result.update(
        total_output_tokens=point.num_prompts * point.output_len,
        output_throughput=1000.0,
        p99_ttft_ms=80.0,
        **{
            f"{stat}_{metric}_ms": per_token_ms
            for stat in ("mean", "median", "std", "p50", "p90", "p95", "p99")
            for metric in ("tpot", "itl")
        },
    )
    return result


def lacks_the_key(result: dict) -> None:
    del result["mean_tpot_ms"]


def one_token_each(result: dict) -> None:
    # What vllm bench serve saves when no request got a second token.
    result.update(total_output_tokens=result["completed"], mean_tpot_ms=0.0)


@pytest.mark.parametrize("fault", [lacks_the_key, one_token_each])
def test_a_metric_the_client_did_not_measure_is_missing_not_zero(
    tmp_path, capsys, fault
):
    point = bench.Point(1024, 8, 512)
    for arm, per_token in (("fi-ep", 2.0), ("mega-sp", 3.0)):
        result = decode_result(point, per_token)
        if arm == "mega-sp":
            fault(result)
        (tmp_path / arm).mkdir()
        (tmp_path / arm / point.filename).write_text(json.dumps(result))
    assert bench.main(["--results", str(tmp_path), "report"]) == 0
    report = capsys.readouterr().out.split("### decode sweep")[1]
    row = markdown_rows(report, "Mean TPOT")[2]
    assert row == ["1024", "8", "missing", "2.0 ms", "missing", "missing", "missing"]
    summary = json.loads((tmp_path / "report.json").read_text())
    measured = next(p for p in summary["points"] if p["concurrency"] == 8)
    assert measured["mega-sp"]["mean_tpot_ms"] is None
    assert measured["fi-ep"]["mean_tpot_ms"] == 2.0


def with_latencies(result: dict, point: bench.Point, waves: list[float]) -> dict:
    """``result`` whose requests took ``waves[w]`` seconds in wave ``w``."""
    c = point.concurrency
    result["latencies"] = [waves[i // c] for i in range(point.num_prompts)]
    return result


def test_wave_spread_is_the_range_of_the_wave_mean_latencies_over_their_mean():
    point = bench.Point(1024, 2, 512)
    result = decode_result(point, 2.0)
    result["latencies"] = [1.0, 3.0, 2.5, 3.5, 2.0, 4.0]  # wave means 2, 3, 3
    assert bench.wave_spread(result, point) == pytest.approx(100 * (3 - 2) / (8 / 3))
    result["latencies"] = result["latencies"][:-1]  # not every request
    assert bench.wave_spread(result, point) is None


@pytest.mark.parametrize(
    ("mega_waves", "fi_waves", "beyond"),
    [
        ([1.00, 1.03, 1.00], [1.00, 1.00, 1.04], True),  # 10% lead, spreads 3 + 4
        ([1.00, 1.06, 1.00], [1.00, 1.00, 1.05], False),  # spreads 6 + 5
    ],
)
def test_verdict_is_beyond_the_spread_only_when_the_lead_exceeds_both_spreads(
    mega_waves, fi_waves, beyond
):
    sweep = bench.SWEEPS["decode"]
    point = bench.Point(1024, 8, 512)
    found = {"fi-ep": {}, "mega-sp": {}, "fi-noep": {}}
    for arm, tput, waves in (
        ("mega-sp", 1100.0, mega_waves),
        ("fi-ep", 1000.0, fi_waves),
        ("fi-noep", 900.0, [1.0, 1.0, 1.0]),
    ):
        result = with_latencies(decode_result(point, 2.0), point, waves)
        result["output_throughput"] = tput
        found[arm][point] = [result]
    verdict = bench.verdict(sweep, point, found)
    assert (verdict["ahead"], verdict["next"]) == ("mega-sp", "fi-ep")
    assert verdict["lead_percent"] == pytest.approx(10.0)
    assert verdict["beyond_spread"] is beyond


# -- repeats: means over runs and the run spread --------------------------


def decode_runs(point: bench.Point, throughputs: list[float], waves: list[float]):
    """One saved result per throughput, each with the same waves."""
    runs = []
    for tput in throughputs:
        result = with_latencies(decode_result(point, 2.0), point, waves)
        result["output_throughput"] = tput
        runs.append(result)
    return runs


def test_run_spread_is_the_range_of_the_runs_throughput_over_their_mean():
    point = bench.Point(1024, 8, 512)
    runs = decode_runs(point, [100.0, 120.0], [1.0, 1.0, 1.0])
    spread = bench.run_spread(runs, "output_throughput")
    assert spread == pytest.approx(100 * 20 / 110)
    assert round(spread, 1) == 18.2
    assert bench.run_spread(runs[:1], "output_throughput") is None


@pytest.mark.parametrize(
    ("mega_runs", "beyond"),
    [
        ([1035.0, 1265.0], False),  # run spread 20%: 15% lead within
        ([1140.0, 1160.0], True),  # run spread 1.7%: beyond
    ],
)
def test_a_lead_must_also_clear_the_run_spread(mega_runs, beyond):
    """A 15% lead is beyond two wave spreads of about 1%, and within the
    spread when the leading arm's two runs differ by 20%."""
    sweep, point = bench.SWEEPS["decode"], bench.Point(1024, 8, 512)
    found = {
        "mega-sp": {point: decode_runs(point, mega_runs, [1.0, 1.01, 1.0])},
        "fi-ep": {point: decode_runs(point, [1000.0, 1000.0], [1.0, 1.0, 1.01])},
    }
    verdict = bench.verdict(sweep, point, found)
    assert verdict["lead_percent"] == pytest.approx(15.0)
    assert verdict["wave_spread_percent"]["mega-sp"] < 1.1
    spread = 100 * (mega_runs[1] - mega_runs[0]) / 1150
    assert verdict["spread_percent"]["mega-sp"] == pytest.approx(spread)
    assert verdict["beyond_spread"] is beyond
    assert verdict["run_to_run_measured"] is True


@pytest.mark.parametrize(
    ("fi_ep_runs", "words", "fi_ep_spread"),
    [
        (1, "beyond the wave spread; 1 run", "1.0% / 1 run"),
        (2, "beyond the spread; 1 run of MegaMoE+SP", "1.0% / 0.0%"),
    ],
)
def test_one_run_says_the_run_to_run_variation_is_unmeasured(
    fi_ep_runs, words, fi_ep_spread
):
    sweep, point = bench.SWEEPS["decode"], bench.Point(1024, 8, 512)
    found = {
        "mega-sp": {point: decode_runs(point, [1150.0], [1.0, 1.0, 1.0])},
        "fi-ep": {point: decode_runs(point, [1000.0] * fi_ep_runs, [1.0, 1.0, 1.01])},
    }
    rendered = "\n".join(bench.render_verdicts(sweep, found))
    row = markdown_rows(rendered, "Verdict on output token throughput")[1]
    assert row[2:] == [
        "MegaMoE+SP", "+15.0% over FI+EP", words, "missing", fi_ep_spread,
        "0.0% / 1 run",
    ]  # fmt: skip
    assert bench.verdict(sweep, point, found)["run_to_run_measured"] is False


def test_plot_shows_the_mean_with_a_bar_from_the_smallest_to_the_largest_run():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    point = bench.Point(1024, 8, 512)
    found = {"fi-ep": {point: decode_runs(point, [100.0, 120.0, 140.0], [1.0] * 3)}}
    figure, ax = plt.subplots()
    bench.draw(ax, bench.serve.load_arms()[1], found, [point], "output_throughput")
    (drawn,) = ax.containers
    line, _, (bars,) = drawn.lines
    assert list(line.get_ydata()) == [120.0]
    assert bars.get_segments()[0].tolist() == [[8.0, 100.0], [8.0, 140.0]]
    plt.close(figure)


def test_report_figures_are_means_over_each_arms_runs(tmp_path, capsys):
    point = bench.Point(1024, 8, 512)
    fi_ep = decode_runs(point, [100.0, 120.0], [1.0, 1.0, 1.0])
    fi_ep[1]["mean_tpot_ms"] = 3.0  # 2.0 in the first run
    saved = {
        "fi-ep": fi_ep,
        "mega-sp": decode_runs(point, [90.0], [1.0, 1.0, 1.0]),
    }
    for arm, runs in saved.items():
        (tmp_path / arm).mkdir()
        for run, result in enumerate(runs, 1):
            path = tmp_path / arm / point.run_filename(run)
            path.write_text(json.dumps(result))
    (tmp_path / "fi-ep" / "in1024-out512-c8.run3.failed.json").write_text(
        json.dumps(decode_runs(point, [1.0], [1.0, 1.0, 1.0])[0])
    )
    assert bench.main(["--results", str(tmp_path), "report"]) == 0
    report = capsys.readouterr().out.split("### decode sweep")[1]
    assert "(runs: FI+EP 2, MegaMoE+SP 1;" in report.split("####")[0]
    throughput = markdown_rows(report, "Output token throughput")[2]
    assert throughput[2:5] == ["missing", "110", "90"]
    assert markdown_rows(report, "Mean TPOT")[2][3] == "2.5 ms"
    assert markdown_rows(report, "Requests")[2][3] == "48 of 48, 0 failed"
    summary = json.loads((tmp_path / "report.json").read_text())
    measured = next(p for p in summary["points"] if p["concurrency"] == 8)
    assert measured["fi-ep"]["output_throughput"] == pytest.approx(110.0)
    assert measured["fi-ep"]["runs"] == 2
    assert measured["fi-ep"]["run_spread_percent"] == pytest.approx(100 * 20 / 110)
    assert measured["mega-sp"]["run_spread_percent"] is None
    assert measured["verdict"]["ahead"] == "fi-ep"
    assert (tmp_path / "decode.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# -- the decode sweep at its own sizes --------------------------------------


@pytest.fixture(scope="module")
def decode_sweep(tmp_path_factory):
    """Two points of the decode sweep through ``make bench``'s code, the
    client a stand-in: (results, what it printed)."""
    tmp = tmp_path_factory.mktemp("decode")
    results = tmp / "results"
    with serving("Kimi-K3") as url:
        run = subprocess.run(
            [sys.executable, "-m", "eval.bench", "--results", str(results), "run",
             "--arm", "fi-ep", "--base-url", url, "--served-model-name", "Kimi-K3",
             "--tokenizer", "/models/Kimi-K3", "--vllm", str(fake_vllm(tmp)),
             "--sweep", "decode", "--points", "1024x1,1024x8"],
            cwd=bench.PROJECT_DIR, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    return results, run.stdout


def test_decode_sweep_says_its_size_and_writes_a_file_per_point(decode_sweep):
    results, output = decode_sweep
    assert output.startswith(
        "decode sweep: 2 points, 27 measured and 12 warm-up requests, 11 waves "
        "one after another (5,621 decode steps in sequence)"
    )
    assert "[2/2] fi-ep input 1024, output 512, concurrency 8: running" in output
    assert sorted(path.name for path in (results / "fi-ep").iterdir()) == [
        "in1024-out512-c1.json",
        "in1024-out512-c8.json",
        "manifest.json",
    ]
    manifest = json.loads((results / "fi-ep" / "manifest.json").read_text())
    assert [(r["sweep"], r["points"]) for r in manifest["runs"]] == [
        ("decode", ["1024x1", "1024x8"])
    ]


@pytest.mark.parametrize("saved", [False, True], ids=["before", "after-save"])
def test_an_interrupted_decode_sweep_resumes_where_it_stopped(tmp_path, saved):
    """Ctrl-C during the second point (a real SIGINT, from the stand-in
    client, before or after it saved its result): exit 130, the finished
    point kept, the stopped one run again by the next run."""
    results = tmp_path / "results"
    decode = {"points": "1024x1,1024x8"}
    with serving("Kimi-K3") as url:
        stopping = fake_vllm(tmp_path, interrupt="1024x8", saved=saved)
        first = sweep(results, url, stopping, "--sweep", "decode", **decode)
        assert first.returncode == 130, first.stderr
        assert (
            "[2/2] mega-sp input 1024, output 512, concurrency 8: interrupted"
            in first.stderr
        )
        kept = sorted(path.name for path in (results / "mega-sp").iterdir())
        partial = ["in1024-out512-c8.interrupted.json"] if saved else []
        assert kept == ["in1024-out512-c1.json", *partial, "manifest.json"]
        second = sweep(results, url, fake_vllm(tmp_path), "--sweep", "decode", **decode)
        assert second.returncode == 0, second.stderr
    assert (
        "[1/2] mega-sp input 1024, output 512, concurrency 1: done before, skipped"
        in second.stdout
    )
    calls = (tmp_path / "calls.log").read_text().split()
    assert calls == ["1024x1", "1024x8", "1024x8"]


def test_report_renders_the_decode_tables_verdict_and_plot(decode_sweep, capsys):
    results = decode_sweep[0]
    assert bench.main(["--results", str(results), "report"]) == 0
    report = capsys.readouterr().out
    assert "Sweeps not run: prefill, mixed" in report
    saved = json.loads((results / "fi-ep" / "in1024-out512-c8.json").read_text())
    for metric in ("output_throughput", "mean_tpot_ms", "p99_itl_ms"):
        rows = markdown_rows(report, bench.METRICS[metric][0])
        assert rows[2][:2] == ["1024", "8"]
        assert rows[2][3] == bench.fmt(metric, saved[metric]), metric
        assert rows[2][2] == rows[2][4] == "missing"
        assert [row[1] for row in rows[1:]] == ["1", "8", "32", "64", "128"]
    verdicts = markdown_rows(report, "Verdict on output token throughput")
    spread = bench.wave_spread(saved, bench.Point(1024, 8, 512))
    assert verdicts[2] == [
        "1024", "8", "FI+EP", "missing", "only FI+EP measured",
        "missing", f"{spread:.1f}% / 1 run", "missing",
    ]  # fmt: skip
    assert (results / "decode.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
