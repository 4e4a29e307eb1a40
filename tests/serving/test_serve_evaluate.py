# SPDX-License-Identifier: Apache-2.0
"""``make evaluate`` against real ``vllm serve`` servers, one per frontend:
GSM8K through lm-eval, then the prefill and decode sweeps through the real
``vllm bench serve`` client, each step through the code the Makefile runs
(eval/evaluate.py -> eval/gsm8k.py, eval/bench.py). Only the sweeps' point
tables and GSM8K's answer length are made tiny, and the client's imports are
done once for all its runs and the servers' (tests/serving/preloaded_vllm.py);
everything else is what a cluster run does."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import subprocess
from concurrent.futures import ThreadPoolExecutor, wait
from pathlib import Path

import pytest

import vllm
from eval import bench, evaluate, gsm8k
from tests.eval.test_bench import RESULT_KEYS
from tests.serving.conftest import LAYOUTS, REPLICATED, SP
from tests.serving.server import OFFLINE, SERVE_ARGS
from tests.sppp_testbed.bases import VLLM_VERSION

GSM8K_DATA = Path(__file__).resolve().parents[1] / "eval" / "data" / "gsm8k"
LIMIT = 2
# The tiny model never writes GSM8K's stop sequences: every answer runs to
# lm-eval's max_gen_toks, 512 decode steps through the ranks at the arms'.
MAX_GEN_TOKS = 16
PREFILL = bench.Point(128, 1)
DECODE = bench.Point(64, 2, 4)


EVALUATED = (SP, REPLICATED)


# The options shared with vllm bench serve, in its meanings: the served name
# as --model, the checkpoint as the seed's --tokenizer on one server and as
# make's CHECKPOINT= (--checkpoint) on the other.
CHECKPOINT_FLAG = {SP: "--tokenizer", REPLICATED: "--checkpoint"}


def evaluate_argv(layout: str, url: str, model_dir: Path, results: Path) -> list[str]:
    argv = [
        "--results", str(results),
        "--arm", LAYOUTS[layout].arm,
        "--base-url", url,
        "--model", "tiny-k3",
        CHECKPOINT_FLAG[layout], str(model_dir),
        "--served", str(results / "served"),
        "--sweeps", "prefill,decode",
        "--limit", str(LIMIT),
        "--data", str(GSM8K_DATA),
    ]  # fmt: skip
    if caching(layout):  # the bench refuses a caching server unless told
        argv.append("--allow-prefix-caching")
    return argv


def caching(layout: str) -> bool:
    """Whether the layout's server caches prefixes: on vLLM 0.34.0 no Kimi K3
    server does (SERVE_ARGS says why), on 0.33.0 the SP one does."""
    return "--no-enable-prefix-caching" not in [*SERVE_ARGS, *LAYOUTS[layout].args]


def point_row(section: str, title: str, point: bench.Point) -> list[str]:
    """The cells of ``point``'s row in the report's table ``title``."""
    table = section.split(f"#### {title}\n")[1].split("####")[0]
    rows = [
        [cell.strip() for cell in line.strip("|").split("|")]
        for line in table.splitlines()
        if line.startswith("|")
    ]
    return next(
        r for r in rows if r[:2] == [str(point.input_len), str(point.concurrency)]
    )


@pytest.fixture(scope="module")
def bench_cli(servers) -> Path:
    """``vllm`` for the sweeps: vLLM's CLI run in forks of the process that
    imported it once for the servers (tests/serving/preloaded_vllm.py)."""
    return servers.vllm


@pytest.fixture(scope="module")
def evaluations(servers, model_dir, bench_cli, tmp_path_factory):
    """``make evaluate``'s code against both servers at once (one per
    frontend: one's waits overlap the other's work), one point per sweep and
    GSM8K answers cut to MAX_GEN_TOKS: per layout, its results directory and
    the run's exit code (or what it raised), the report's and what it printed."""
    results = {name: tmp_path_factory.mktemp("evaluate") for name in EVALUATED}
    urls = {name: servers[name].url for name in EVALUATED}
    with pytest.MonkeyPatch.context() as patch:
        bench_main, cli = bench.main, ["--vllm", str(bench_cli)]
        patch.setattr(bench, "main", lambda argv: bench_main([*argv, *cli]))
        for name, point in (("prefill", PREFILL), ("decode", DECODE)):
            sweep = dataclasses.replace(bench.SWEEPS[name], points=(point,))
            patch.setitem(bench.SWEEPS, name, sweep)
        patch.setattr(gsm8k, "MAX_GEN_TOKS", MAX_GEN_TOKS)
        for key, value in OFFLINE.items():
            patch.setenv(key, value)
        # As a user of the Rust frontend may have it: the sweeps still run
        # vLLM's Python client (bench.CLIENT_ENV; its result keys below).
        patch.setenv("VLLM_USE_RUST_BENCH", "1")
        with ThreadPoolExecutor(len(EVALUATED)) as pool:
            runs = {
                name: pool.submit(
                    evaluate.main,
                    evaluate_argv(name, urls[name], model_dir, results[name]),
                )
                for name in EVALUATED
            }
            wait(runs.values())
        # make bench-report's code, while the sweeps are the tiny ones.
        reports = {}
        for name in EVALUATED:
            with contextlib.redirect_stdout(io.StringIO()) as out:
                code = bench_main(["--results", str(results[name] / "bench"), "report"])
            reports[name] = code, out.getvalue()
    return {name: (results[name], runs[name], reports[name]) for name in EVALUATED}


@pytest.mark.parametrize(
    "layout",
    [pytest.param(n, marks=pytest.mark.layouts(n), id=n) for n in EVALUATED],
)
def test_make_evaluate_against_the_real_server(evaluations, model_dir, capsys, layout):
    results, run, (report_code, report) = evaluations[layout]
    arm = LAYOUTS[layout].arm
    assert run.result() == 0

    manifest = json.loads((results / "evaluate" / f"{arm}.json").read_text())
    (entry,) = manifest["runs"]
    # The servers run this interpreter's vLLM (tests/serving/server.py).
    assert entry["served_vllm_version"] == vllm.__version__
    assert [(s["step"], s["state"]) for s in entry["steps"]] == [
        ("gsm8k", "finished"),
        ("bench prefill", "finished"),
        ("bench decode", "finished"),
    ]
    gsm8k_run = gsm8k.load_arm(results / "gsm8k" / arm)
    assert gsm8k_run.manifest["settings"]["max_gen_toks"] == MAX_GEN_TOKS
    accuracy = gsm8k.arm_summary(gsm8k_run)
    assert accuracy["n"] == LIMIT

    out = results / "bench" / arm
    prefill = json.loads((out / PREFILL.filename).read_text())
    decode = json.loads((out / DECODE.filename).read_text())
    assert (prefill["completed"], prefill["failed"]) == (PREFILL.num_prompts, 0)
    # The real client read --model as the served name, --tokenizer as the
    # checkpoint: what it saved of each.
    assert (prefill["model_id"], prefill["tokenizer_id"]) == ("tiny-k3", str(model_dir))
    # The stand-in client of tests/eval writes what the real (Python) one
    # writes (the Rust client, had it run, would have failed the step: it
    # replaces the preloaded fork, see preloaded_vllm).
    assert sorted(prefill) == sorted(RESULT_KEYS)
    # The client's prompts through the chat template, which adds one "\n".
    sent = PREFILL.num_prompts * (PREFILL.input_len + 1)
    assert prefill["total_input_tokens"] == sent
    assert (decode["completed"], decode["failed"]) == (DECODE.num_prompts, 0)
    assert decode["total_output_tokens"] == DECODE.num_prompts * DECODE.output_len
    # Every metric the report reads is a key the real client writes.
    assert set(bench.DECODE_METRICS) <= decode.keys()
    # A decode step through two stages of vLLM 0.34.0's V2 runner on CPU
    # ranks takes far longer than a millisecond (about 170 ms): a client that
    # saw the tokens in one chunk, or timed chunks it had already received,
    # would report about 0. 0.33.0's stand-in runner steps so fast that a
    # frontend hands a client slowed by a loaded host several steps' tokens
    # in one chunk (a mean TPOT of 0.004 ms, seen in CI): there only a time
    # is asked for.
    floor_ms = 1.0 if VLLM_VERSION >= (0, 34, 0) else 0.0
    assert min(decode["mean_tpot_ms"], decode["mean_itl_ms"]) > floor_ms, decode
    assert len(decode["latencies"]) == DECODE.num_prompts

    # What the server said about prefix caching, from its own counters.
    runs = json.loads((out / "manifest.json").read_text())["runs"]
    assert [r["sweep"] for r in runs] == ["prefill", "decode"]
    for record in runs:
        evidence = record["prefix_caching"]
        assert evidence["prompt_tokens"] >= evidence["prompt_tokens_sent"] > 0
        assert (evidence["queries"] > 0) == caching(layout), evidence

    assert report_code == 0
    # The report's figures are the client's, as it wrote them.
    for name, point, saved in (
        ("prefill", PREFILL, prefill),
        ("decode", DECODE, decode),
    ):
        section = report.split(f"### {name} sweep")[1].split("\n### ")[0]
        for metric in bench.SWEEPS[name].metrics:
            row = point_row(section, bench.METRICS[metric][0], point)
            assert bench.fmt(metric, saved[metric]) in row, (name, metric, row)
    assert (results / "bench" / "decode.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with capsys.disabled():
        print(
            f"\n{layout}, {LAYOUTS[layout].frontend} frontend, arm {arm}: GSM8K "
            f"{accuracy}; prefix caching {runs[0]['prefix_caching']['observed']}"
        )
        print(report[report.index("### prefill sweep") :])


@pytest.mark.layouts(EVALUATED[0])
def test_the_bench_client_answers_with_its_exit_code_and_streams(bench_cli):
    """What the sweeps read of each client run, through the preloaded one:
    its exit code, its standard output and error."""
    wrong = subprocess.run(
        [bench_cli, "bench", "serve", "--no-such-flag"], capture_output=True, text=True
    )
    assert wrong.returncode == 2, wrong.stderr
    assert "unrecognized arguments: --no-such-flag" in wrong.stderr
    usage = subprocess.run(
        [bench_cli, "bench", "serve", "--help"], capture_output=True, text=True
    )
    assert usage.returncode == 0, usage.stderr
    assert usage.stdout.startswith("usage: vllm bench serve")
