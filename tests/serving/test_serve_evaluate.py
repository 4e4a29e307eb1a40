# SPDX-License-Identifier: Apache-2.0
"""``make evaluate`` against real ``vllm serve`` servers, one per frontend:
GSM8K through lm-eval, then the prefill and decode sweeps through the real
``vllm bench serve`` client, each step through the code the Makefile runs
(eval/evaluate.py -> eval/gsm8k.py, eval/bench.py). Only the sweeps' point
tables are made tiny; everything else is what a cluster run does."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from eval import bench, evaluate, gsm8k
from tests.serving.conftest import LAYOUTS, REPLICATED, SP

GSM8K_DATA = Path(__file__).resolve().parents[1] / "eval" / "data" / "gsm8k"
LIMIT = 2
PREFILL = bench.Point(128, 1)
DECODE = bench.Point(64, 2, 16)


@pytest.fixture
def tiny_sweeps(monkeypatch):
    """One point per sweep, small enough for the CPU ranks."""
    for name, point in (("prefill", PREFILL), ("decode", DECODE)):
        sweep = dataclasses.replace(bench.SWEEPS[name], points=(point,))
        monkeypatch.setitem(bench.SWEEPS, name, sweep)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")


@pytest.mark.parametrize(
    "layout",
    [pytest.param(n, marks=pytest.mark.layouts(n), id=n) for n in (SP, REPLICATED)],
)
def test_make_evaluate_against_the_real_server(
    servers, model_dir, tmp_path, tiny_sweeps, capsys, layout
):
    server, arm = servers[layout], LAYOUTS[layout].arm
    caching = "--no-enable-prefix-caching" not in LAYOUTS[layout].args
    argv = [
        "--results", str(tmp_path),
        "--arm", arm,
        "--base-url", server.url,
        "--served-model-name", "tiny-k3",
        "--checkpoint", str(model_dir),
        "--served", str(tmp_path / "served"),
        "--sweeps", "prefill,decode",
        "--limit", str(LIMIT),
        "--data", str(GSM8K_DATA),
    ]  # fmt: skip
    if caching:  # the bench refuses a caching server unless told
        argv.append("--allow-prefix-caching")
    assert evaluate.main(argv) == 0

    manifest = json.loads((tmp_path / "evaluate" / f"{arm}.json").read_text())
    (run,) = manifest["runs"]
    assert run["served_vllm_version"] == "0.33.0"
    assert [(s["step"], s["state"]) for s in run["steps"]] == [
        ("gsm8k", "finished"),
        ("bench prefill", "finished"),
        ("bench decode", "finished"),
    ]
    accuracy = gsm8k.arm_summary(gsm8k.load_arm(tmp_path / "gsm8k" / arm))
    assert accuracy["n"] == LIMIT

    out = tmp_path / "bench" / arm
    prefill = json.loads((out / PREFILL.filename).read_text())
    decode = json.loads((out / DECODE.filename).read_text())
    assert (prefill["completed"], prefill["failed"]) == (PREFILL.num_prompts, 0)
    # The client's prompts through the chat template, which adds one "\n".
    sent = PREFILL.num_prompts * (PREFILL.input_len + 1)
    assert prefill["total_input_tokens"] == sent
    assert (decode["completed"], decode["failed"]) == (DECODE.num_prompts, 0)
    assert decode["total_output_tokens"] == DECODE.num_prompts * DECODE.output_len
    assert decode["mean_tpot_ms"] > 0

    # What the server said about prefix caching, from its own counters.
    runs = json.loads((out / "manifest.json").read_text())["runs"]
    assert [r["sweep"] for r in runs] == ["prefill", "decode"]
    for record in runs:
        evidence = record["prefix_caching"]
        assert evidence["prompt_tokens"] >= evidence["prompt_tokens_sent"] > 0
        assert (evidence["queries"] > 0) == caching, evidence

    assert bench.main(["--results", str(tmp_path / "bench"), "report"]) == 0
    report = capsys.readouterr().out
    with capsys.disabled():
        print(
            f"\n{layout}, {LAYOUTS[layout].frontend} frontend, arm {arm}: GSM8K "
            f"{accuracy}; prefix caching {runs[0]['prefix_caching']['observed']}"
        )
        print(report[report.index("### prefill sweep") :])
