# SPDX-License-Identifier: Apache-2.0
"""One start per arm: GSM8K, then the chosen sweeps, against one server;
a finished step is skipped, a failed one stops the rest, one manifest says
which ran; the options it shares with the two tools reach each of them in
their meaning (tests/eval/test_shared_flags.py: what each tool does with
them)."""

from __future__ import annotations

import json

import pytest

from eval import bench, evaluate, gsm8k


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


def option(argv: list[str], flag: str) -> str | None:
    return argv[argv.index(flag) + 1] if flag in argv else None


@pytest.mark.parametrize(
    ("flags", "name", "tokenizer", "checkpoint"),
    [
        (["--model", "tiny-k3"], "tiny-k3", "/models/Kimi-K3", "/models/Kimi-K3"),
        (["--tokenizer", "/t"], "Kimi-K3", "/t", "/models/Kimi-K3"),
        # vllm bench serve's --served-model-name: the name, --model the model.
        (["--model", "/m", "--served-model-name", "n"], "n", "/m", "/models/Kimi-K3"),
    ],
    ids=["model", "tokenizer", "served-model-name"],
)
def test_both_tools_get_the_name_tokenizer_and_checkpoint_as_resolved(
    tmp_path, calls, flags, name, tokenizer, checkpoint
):
    """Each tool is handed the name requests carry as --served-model-name
    (which takes any name, a path one included), and the same tokenizer and
    checkpoint; the manifest records them."""
    seen, _ = calls
    assert evaluate.main(evaluate_argv(tmp_path, *flags)) == 0
    for tool, argv in seen:
        got = [option(argv, f) for f in ("--served-model-name", "--tokenizer")]
        assert got == [name, tokenizer], tool
        assert option(argv, "--checkpoint") == checkpoint, tool
        assert option(argv, "--model") is None, tool
    manifest = json.loads((tmp_path / "evaluate" / "mega-sp.json").read_text())
    assert (manifest["model"], manifest["tokenizer"]) == (name, tokenizer)


@pytest.mark.parametrize(
    ("flags", "seed", "limit"),
    [([], None, None), (["--seed", "7", "--limit", "0.5"], "7", "0.5")],
    ids=["tools-defaults", "given"],
)
def test_seed_goes_to_both_tools_and_limit_to_gsm8k(
    tmp_path, calls, flags, seed, limit
):
    """One --seed for lm-eval's four and the bench client's; none given:
    neither gets one, and each keeps its own default."""
    seen, _ = calls
    assert evaluate.main(evaluate_argv(tmp_path, *flags)) == 0
    (gsm8k_argv,), bench_argvs = [
        [argv for tool, argv in seen if tool == name] for name in ("gsm8k", "bench")
    ]
    assert [option(gsm8k_argv, f) for f in ("--seed", "--limit")] == [seed, limit]
    assert [option(argv, "--seed") for argv in bench_argvs] == [seed]
    assert option(bench_argvs[0], "--limit") is None


def test_a_seed_only_lm_eval_reads_is_a_usage_error(tmp_path, calls, capsys):
    seen, _ = calls
    with pytest.raises(SystemExit) as exit_:
        evaluate.main(evaluate_argv(tmp_path, "--seed", "0,1234,1234,1234"))
    assert exit_.value.code == 2
    assert "argument --seed: invalid int value" in capsys.readouterr().err
    assert seen == []
