# SPDX-License-Identifier: Apache-2.0
"""One start per arm: GSM8K, then the chosen sweeps, against one server;
a finished step is skipped, a failed one stops the rest, one manifest says
which ran; MODEL= means the checkpoint, and its old meaning is refused by
the new name."""

from __future__ import annotations

import json

import pytest

from eval import bench, evaluate, gsm8k, openai_server


@pytest.fixture
def calls(monkeypatch):
    """Each tool's ``main`` records its argv and answers 0 (or ``codes``)."""
    seen: list[tuple[str, list[str]]] = []
    codes: dict[str, int] = {}

    def tool(name):
        def main(argv):
            seen.append((name, argv))
            return codes.get(name, 0)

        return main

    monkeypatch.setattr(gsm8k, "main", tool("gsm8k"))
    monkeypatch.setattr(bench, "main", tool("bench"))
    monkeypatch.setattr(evaluate, "check_server", lambda *args: "0.33.0")
    seen_codes = codes
    return seen, seen_codes


def evaluate_argv(tmp_path, *extra):
    return [
        "--results", str(tmp_path), "--served", str(tmp_path / "served"),
        "--arm", "mega-sp", "--base-url", "http://127.0.0.1:9",
        "--checkpoint", "/models/Kimi-K3", *extra,
    ]  # fmt: skip


def test_gsm8k_then_each_sweep_with_one_manifest(tmp_path, calls):
    seen, _ = calls
    assert evaluate.main(evaluate_argv(tmp_path, "--sweeps", "prefill,decode")) == 0
    assert [name for name, _ in seen] == ["gsm8k", "bench", "bench"]
    sweeps = [argv[argv.index("--sweep") + 1] for name, argv in seen[1:]]
    assert sweeps == ["prefill", "decode"]
    assert all("/models/Kimi-K3" in argv for _, argv in seen[1:])  # tokenizer
    manifest = json.loads((tmp_path / "evaluate" / "mega-sp.json").read_text())
    (run,) = manifest["runs"]
    assert [s["state"] for s in run["steps"]] == ["finished"] * 3
    assert "--kernel-config" in manifest["serve_command"]


def test_a_finished_gsm8k_is_skipped_and_a_failure_stops_the_rest(tmp_path, calls):
    seen, codes = calls
    (tmp_path / "gsm8k" / "mega-sp").mkdir(parents=True)
    (tmp_path / "gsm8k" / "mega-sp" / "manifest.json").write_text("{}")
    codes["bench"] = 1
    assert evaluate.main(evaluate_argv(tmp_path, "--sweeps", "all")) == 1
    assert [name for name, _ in seen] == ["bench"]  # prefill failed: no decode
    manifest = json.loads((tmp_path / "evaluate" / "mega-sp.json").read_text())
    states = [s["state"] for s in manifest["runs"][-1]["steps"]]
    assert states == ["done before, skipped", "exit 1", "pending", "pending"]


def test_an_unknown_sweep_is_refused_before_the_server(tmp_path, calls, capsys):
    seen, _ = calls
    assert evaluate.main(evaluate_argv(tmp_path, "--sweeps", "prefil")) == 1
    assert "prefil is no sweep" in capsys.readouterr().err
    assert seen == []


@pytest.mark.parametrize("tool", [evaluate, gsm8k, bench])
def test_model_as_a_served_name_is_refused_naming_served_model(tool, capsys):
    argv = ["--arm", "fi-ep", "--base-url", "http://127.0.0.1:9", "--model", "Kimi-K3"]
    if tool is not evaluate:
        argv = ["run", *argv]
    assert tool.main(argv) == 1
    err = capsys.readouterr().err
    assert "MODEL= is the checkpoint directory" in err
    assert "SERVED_MODEL=Kimi-K3" in err


def test_model_as_a_path_is_the_checkpoint(tmp_path):
    args = type("Args", (), {"model": "/models/Kimi-K3", "checkpoint": ""})()
    openai_server.resolve_model_names(args)
    assert args.checkpoint == "/models/Kimi-K3"
