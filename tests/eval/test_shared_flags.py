# SPDX-License-Identifier: Apache-2.0
"""The options ``eval.bench run``, ``eval.gsm8k run`` and ``eval.evaluate``
share with ``vllm bench serve`` and lm-eval mean what they mean there
(vllm/benchmarks/serve.py ``add_cli_args``; lm-eval 0.4.13's ``--seed``,
``--limit`` and local-completions' ``model=`` and ``base_url=``): the seed's
``--model Kimi-K3 --tokenizer "$MODEL"`` works unchanged, and a value of the
old or of another tool's meaning is refused before any server is asked,
naming the option it belongs to. make keeps the seed's ``MODEL=`` as the
checkpoint."""

from __future__ import annotations

import argparse
import json
import os
import stat
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from lm_eval._cli.utils import _int_or_none_list_arg_type

from eval import bench, evaluate, gsm8k, openai_server
from tests.eval.test_bench import seed_command

PROJECT_DIR = bench.PROJECT_DIR
SERVER = "http://127.0.0.1:9"  # nothing listens there
TOOLS = {"bench": bench, "gsm8k": gsm8k, "evaluate": evaluate}


def tool_argv(name: str, tmp_path: Path, *extra: str) -> list[str]:
    """``name``'s command line against SERVER, results under ``tmp_path``."""
    where = ["--results", str(tmp_path / "results")]
    common = ["--arm", "fi-ep", "--served", str(tmp_path / "served"), *extra]
    if "--base-url" not in extra:
        common += ["--base-url", SERVER]
    return [*where, *common] if name == "evaluate" else [*where, "run", *common]


class Asked(Exception):
    """The server was asked: carries the name asked for."""


@pytest.fixture
def asked(monkeypatch) -> list[str]:
    """The model names each tool's server check is asked for; the check then
    stops the run (exit 1)."""
    names: list[str] = []

    def check_server(base_url, model, arm):
        names.append(model)
        raise openai_server.ServerError(f"asked for {model!r}")

    for tool in TOOLS.values():
        monkeypatch.setattr(tool, "check_server", check_server)
    return names


# -- the bench: the seed's client flags, as the seed passes them -------------


def stand_in_client(tmp_path: Path) -> Path:
    """A ``vllm`` that records its argv in ``argv.json`` and saves a finished
    result for the point it was asked for."""
    script = tmp_path / "vllm"
    script.write_text(
        f"#!{sys.executable}\n"
        "import json, sys\n"
        f"sys.path.insert(0, {str(PROJECT_DIR)!r})\n"
        "from tests.eval.test_bench import result_file\n"
        "from eval.bench import Point\n"
        "a = sys.argv[1:]\n"
        f"open({str(tmp_path / 'argv.json')!r}, 'w').write(json.dumps(a))\n"
        "v = lambda flag: a[a.index(flag) + 1]\n"
        "p = Point(int(v('--random-input-len')), int(v('--max-concurrency')), "
        "int(v('--random-output-len')))\n"
        "open(v('--result-dir') + '/' + v('--result-filename'), 'w')"
        ".write(json.dumps(result_file(p, 1000.0, 100.0)))\n"
    )
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return script


@pytest.fixture
def client(tmp_path, monkeypatch):
    """``bench.main`` with a server that serves any name without prefix
    caching, and the stand-in client: (run, the client's argv)."""
    monkeypatch.setattr(bench, "check_server", lambda *args: "0.33.0")
    monkeypatch.setattr(
        bench, "prefix_caching", lambda *args: (False, {"observed": "off"})
    )
    vllm = stand_in_client(tmp_path)

    def run(*flags: str) -> int:
        argv = tool_argv("bench", tmp_path, *flags, "--vllm", str(vllm))
        return bench.main([*argv, "--points", "128x1"])

    return run, lambda: json.loads((tmp_path / "argv.json").read_text())


def saved_manifest(tmp_path: Path) -> dict:
    return json.loads((tmp_path / "results" / "fi-ep" / "manifest.json").read_text())


SEEDS_CLIENT_FLAGS = ("--base-url", "--model", "--tokenizer", "--seed")


def test_the_seeds_client_flags_give_the_seeds_command(client, tmp_path):
    """``--base-url``, ``--model``, ``--tokenizer`` and ``--seed`` copied
    from the seed's run_point (``$MODEL`` the checkpoint): the client runs
    the seed's command, word for word."""
    run, client_argv = client
    point = bench.Point(128, 1)
    seed = seed_command(point)
    pasted = [w for f in SEEDS_CLIENT_FLAGS for w in (f, seed[seed.index(f) + 1])]
    assert pasted[3] == "Kimi-K3" and pasted[5] == "/models/Kimi-K3"
    assert run(*pasted) == 0
    saved = ["--save-result", "--result-dir", str(tmp_path / "results" / "fi-ep")]
    assert client_argv() == [
        *seed, *saved, "--result-filename", point.filename
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("flags", "model", "tokenizer"),
    [
        (["--model", "tiny-k3", "--tokenizer", "/t"], "tiny-k3", "/t"),
        (["--model", "tiny-k3", "--checkpoint", "/c"], "tiny-k3", "/c"),
        (["--tokenizer", "/t", "--checkpoint", "/c"], "Kimi-K3", "/t"),
        # vllm bench serve: --served-model-name is what requests carry, and
        # --model is then the model, the tokenizer's default.
        (["--model", "/c", "--served-model-name", "tiny-k3"], "tiny-k3", "/c"),
        (["--served-model-name", "tiny-k3", "--checkpoint", "/c"], "tiny-k3", "/c"),
    ],
    ids=["model-tokenizer", "model-checkpoint", "default-name", "vllm-served-name",
         "served-name-checkpoint"],
)  # fmt: skip
def test_the_client_gets_the_served_name_as_model_and_the_tokenizer(
    client, tmp_path, flags, model, tokenizer
):
    run, client_argv = client
    assert run(*flags) == 0
    argv = client_argv()
    assert argv[argv.index("--model") + 1] == model
    assert argv[argv.index("--tokenizer") + 1] == tokenizer
    assert "--served-model-name" not in argv
    manifest = saved_manifest(tmp_path)
    assert (manifest["model"], manifest["tokenizer"]) == (model, tokenizer)


@pytest.mark.parametrize(("flags", "seed"), [([], "2026"), (["--seed", "7"], "7")])
def test_seed_is_the_clients_and_recorded(client, tmp_path, flags, seed):
    run, client_argv = client
    assert run("--tokenizer", "/t", *flags) == 0
    argv = client_argv()
    assert argv[argv.index("--seed") + 1] == seed
    manifest = saved_manifest(tmp_path)
    assert manifest["runs"][-1]["seed"] == int(seed)


# -- every tool: what requests carry, and values of another meaning ----------


@pytest.mark.parametrize("tool", TOOLS)
@pytest.mark.parametrize(
    ("flags", "name"),
    [
        ([], "Kimi-K3"),
        (["--model", "tiny-k3"], "tiny-k3"),
        (["--model", "moonshotai/Kimi-K3"], "moonshotai/Kimi-K3"),  # a hub id
        (["--model", "/c", "--served-model-name", "tiny-k3"], "tiny-k3"),
    ],
    ids=["default", "model", "hub-id", "served-model-name"],
)
def test_requests_carry_the_served_name(tmp_path, asked, tool, flags, name):
    argv = tool_argv(tool, tmp_path, *flags, "--tokenizer", "/t")
    assert TOOLS[tool].main(argv) == 1
    assert asked == [name]


@pytest.mark.parametrize("tool", TOOLS)
@pytest.mark.parametrize(
    ("flags", "said"),
    [
        (
            ["--model", "/models/Kimi-K3"],
            ["--model /models/Kimi-K3 is a path: --model is the served model name",
             "--tokenizer /models/Kimi-K3", "--checkpoint /models/Kimi-K3"],
        ),
        (  # a directory here, named without a slash
            ["--model", "ckpt"],
            ["--model ckpt is a path", "--tokenizer ckpt", "--checkpoint ckpt"],
        ),
        (
            ["--checkpoint", "Kimi-K3"],
            ["--checkpoint Kimi-K3 (make: CHECKPOINT=, or MODEL=", "is no directory",
             "pass --model Kimi-K3 (SERVED_MODEL=Kimi-K3) instead"],
        ),
        (
            ["--model", "local-completions"],
            ["--model local-completions is lm-eval's client (lm_eval --model)",
             "lm-eval's model_args model="],
        ),
        (
            ["--base-url", f"{SERVER}/v1/completions/"],
            ["ends in /v1/completions: it is the server's root",
             f"pass --base-url {SERVER}"],
        ),
        (
            ["--base-url", f"{SERVER}/v1"],
            ["ends in /v1: it is the server's root", f"pass --base-url {SERVER}"],
        ),
    ],
    ids=["model-path", "model-directory", "checkpoint-name", "lm-eval-model",
         "lm-eval-base-url", "v1-base-url"],
)  # fmt: skip
def test_another_meaning_is_refused_naming_the_option(
    tmp_path, monkeypatch, asked, capsys, tool, flags, said
):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "ckpt").mkdir()
    assert TOOLS[tool].main(tool_argv(tool, tmp_path, *flags, "--tokenizer", "/t")) == 1
    err = capsys.readouterr().err
    for text in said:
        assert text in err
    assert asked == []  # before any server is asked


# -- GSM8K: lm-eval's meanings -----------------------------------------------


@pytest.fixture
def lm_eval_command(monkeypatch):
    """The lm-eval command ``gsm8k run`` starts (it then stops: exit 1)."""
    monkeypatch.setattr(gsm8k, "check_server", lambda *args: "0.33.0")
    started: list[list[str]] = []

    def run(command, **kwargs):
        started.append(command)
        return subprocess.CompletedProcess(command, 1)

    monkeypatch.setattr(gsm8k, "subprocess", SimpleNamespace(run=run))
    return started


def option(command: list[str], flag: str) -> str:
    return command[command.index(flag) + 1]


def test_gsm8k_hands_lm_eval_the_name_and_the_route(tmp_path, lm_eval_command):
    argv = tool_argv(
        "gsm8k", tmp_path, "--model", "tiny-k3", "--base-url", "http://10.0.0.1:8691"
    )
    assert gsm8k.main(argv) == 1
    (command,) = lm_eval_command
    assert option(command, "--model") == "local-completions"
    pairs = option(command, "--model_args").split(",")
    model_args = dict(pair.split("=", 1) for pair in pairs)
    assert model_args["model"] == "tiny-k3"
    assert model_args["base_url"] == "http://10.0.0.1:8691/v1/completions"


@pytest.mark.parametrize(
    ("flags", "seed", "limit"),
    [
        ([], gsm8k.SEED, None),
        (["--seed", "7", "--limit", "200"], "7,7,7,7", "200"),
        (["--seed", "1,None,3", "--limit", "0.25"], "1,None,3,1234", "0.25"),
    ],
    ids=["defaults", "one-seed-a-count", "three-seeds-a-fraction"],
)
def test_gsm8k_seed_and_limit_are_lm_evals(
    tmp_path, lm_eval_command, flags, seed, limit
):
    assert gsm8k.main(tool_argv("gsm8k", tmp_path, *flags)) == 1
    (command,) = lm_eval_command
    assert option(command, "--seed") == seed
    assert (option(command, "--limit") if "--limit" in command else None) == limit


@pytest.mark.parametrize(
    "text", ["7", "0,1234,1234,1234", "1,None,3,4", "-1,+2,3", "None"]
)
def test_a_seed_means_to_lm_eval_what_it_meant_as_given(text):
    """lm-eval's own parser of ``--seed`` reads the four seeds handed to it
    as it reads what the user typed."""

    def lm_eval(value):
        return _int_or_none_list_arg_type(3, 4, gsm8k.SEED, value)

    assert lm_eval(gsm8k.lm_eval_seed(text)) == lm_eval(text)


@pytest.mark.parametrize("text", ["1,2", "a", "1,2,3,4,5", "", "--1"])
def test_a_seed_lm_eval_refuses_is_refused(text):
    with pytest.raises(ValueError):
        _int_or_none_list_arg_type(3, 4, gsm8k.SEED, text)
    with pytest.raises(argparse.ArgumentTypeError, match="lm-eval's --seed is"):
        gsm8k.lm_eval_seed(text)


@pytest.mark.parametrize(
    ("text", "value"), [("200", 200), ("1", 1), ("0.1", 0.1), ("5.0", 5)]
)
def test_limit_is_a_count_or_a_fraction(text, value):
    assert gsm8k.lm_eval_limit(text) == value
    assert type(gsm8k.lm_eval_limit(text)) is type(value)


@pytest.mark.parametrize("text", ["0", "-3", "1.5", "all", "nan"])
def test_a_limit_that_is_neither_is_refused(text):
    with pytest.raises(argparse.ArgumentTypeError, match="a number of questions"):
        gsm8k.lm_eval_limit(text)


# -- make: MODEL= is still the checkpoint ------------------------------------


def make(*args: str, env: dict[str, str] | None = None):
    return subprocess.run(
        ["make", "-s", *args], cwd=PROJECT_DIR, capture_output=True, text=True,
        timeout=120, env={**os.environ, **(env or {})},
    )  # fmt: skip


@pytest.mark.parametrize("target", ["bench", "gsm8k", "evaluate"])
def test_make_maps_its_variables_to_the_clients_flags(target):
    dry = make(
        "-n", target, "ARM=fi-ep", f"BASE_URL={SERVER}", "MODEL=/models/Kimi-K3",
        "SERVED_MODEL=tiny-k3", "TOKENIZER=/t", "SEED=7",
    )  # fmt: skip
    assert dry.returncode == 0, dry.stderr
    assert (
        '--model "tiny-k3" --checkpoint "/models/Kimi-K3" --tokenizer "/t" --seed "7"'
    ) in " ".join(dry.stdout.split())
    wins = make("-n", target, "ARM=fi-ep", "MODEL=/m", "CHECKPOINT=/c")
    assert '--checkpoint "/c"' in wins.stdout
    assert '--checkpoint "/m"' not in wins.stdout


def test_make_bench_takes_the_seeds_exported_model_as_the_checkpoint():
    """``export MODEL=/path/to/Kimi-K3``, as the seed does: the bench has its
    tokenizer and goes on to the server (none at port 9)."""
    proc = make(
        "bench", "ARM=fi-ep", f"BASE_URL={SERVER}", env={"MODEL": "/models/Kimi-K3"}
    )
    assert proc.returncode != 0
    assert f"no OpenAI-compatible server at {SERVER}/v1/models" in proc.stderr


def test_make_help_says_which_variable_is_which_flag():
    text = " ".join(make("help").stdout.split())
    assert "MODEL= is the checkpoint directory, as the seed exports it" in text
    assert "the Python tools' --checkpoint" in text
    assert "Their --model is the served model name, as `vllm bench serve`'s" in text
    assert "make's SERVED_MODEL=" in text
