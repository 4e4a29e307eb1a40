# SPDX-License-Identifier: Apache-2.0
"""The arms file reproduces the upstream pull request's serve command, and
``--run`` says what a node lacks before it starts anything."""

from __future__ import annotations

import os
import re
import shlex
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from eval import serve

DATA = Path(__file__).parent / "data"
VALUES = {
    "model": "/models/Kimi-K3",
    "host_ip": "10.0.0.2",
    "master_addr": "10.0.0.1",
    "deepgemm": "/opt/DeepGEMM",
}
# The seed's prose: "For the FI+EP baseline, remove --kernel-config. For the
# FI/no-EP baseline, also remove --enable-expert-parallel and --all2all-backend
# deepep_v2."
SEED_REMOVALS = {
    "mega-sp": [],
    "fi-ep": ["--kernel-config"],
    "fi-noep": ["--kernel-config", "--enable-expert-parallel", "--all2all-backend"],
}


def seed_command(node_rank: int) -> tuple[list[tuple[str, str]], list[str]]:
    """The seed's command as bash would run it on that node: (env, argv)."""
    text = (DATA / "seed_serve.sh").read_text()
    command = text[text.index("PYTHONPATH=") :].replace("\\\n", " ")
    variables = {
        "MODEL": VALUES["model"],
        "HOST_IP": VALUES["host_ip"],
        "MASTER_ADDR": VALUES["master_addr"],
        "NODE_RANK": str(node_rank),
        "HEADLESS": "--headless" if node_rank else "",
    }
    command = command.replace("/path/to/DeepGEMM", VALUES["deepgemm"])
    command = re.sub(r"\$(\w+)", lambda m: variables[m[1]], command)
    words = shlex.split(command)
    env = []
    while "=" in words[0] and not words[0].startswith("-"):
        name, value = words.pop(0).split("=", 1)
        env.append((name, value))
    return env, words


def without(argv: list[str], flags: list[str]) -> list[str]:
    kept, i = [], 0
    while i < len(argv):
        takes_value = i + 1 < len(argv) and not argv[i + 1].startswith("--")
        width = 2 if takes_value and argv[i].startswith("--") else 1
        if argv[i] not in flags:
            kept += argv[i : i + width]
        i += width
    return kept


@pytest.mark.parametrize("node_rank", [0, 1])
@pytest.mark.parametrize("arm", sorted(SEED_REMOVALS))
def test_each_arm_is_the_seed_command_for_each_node(arm, node_rank):
    env, argv = seed_command(node_rank)
    command = serve.build(arm, {**VALUES, "node_rank": str(node_rank)})
    assert list(command.env) == env
    assert list(command.argv) == without(argv, SEED_REMOVALS[arm])
    assert ("--headless" in command.argv) == (node_rank == 1)


@pytest.mark.parametrize("arm", sorted(SEED_REMOVALS))
def test_printed_command_is_what_bash_would_run(arm):
    command = serve.build(arm, {**VALUES, "node_rank": "0"})
    words = shlex.split(command.shell().replace("\\\n", " "))
    assert words == [f"{k}={v}" for k, v in command.env] + list(command.argv)


def test_missing_values_are_named_with_their_make_variables():
    with pytest.raises(serve.ServeError) as error:
        serve.build("mega-sp", {"model": "/m", "node_rank": "0"})
    assert str(error.value) == (
        "missing HOST_IP= (--host-ip), MASTER_ADDR= (--master-addr), "
        "DEEPGEMM= (--deepgemm)"
    )
    with pytest.raises(serve.ServeError, match="set ARM= to one of"):
        serve.build("mega", {**VALUES, "node_rank": "0"})


def fake_python(tmp_path: Path, vllm_dir: Path | None, deep_gemm: bool) -> str:
    """An interpreter that answers the preflight probes as a node would."""
    script = tmp_path / "python"
    vllm_line = (
        f'*"import vllm"*) echo {vllm_dir}; exit 0;;'
        if vllm_dir
        else '*"import vllm"*) echo "No module named \'vllm\'" >&2; exit 1;;'
    )
    script.write_text(
        "#!/bin/sh\n"
        'case "$2" in\n'
        f"  {vllm_line}\n"
        f'  *"import deep_gemm"*) exit {0 if deep_gemm else 1};;\n'
        "esac\n"
    )
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return str(script)


def unpatched_vllm(tmp_path: Path) -> Path:
    package = tmp_path / "site-packages" / "vllm"
    package.mkdir(parents=True)
    (package / "_version.py").write_text("__version__ = version = '0.33.0'\n")
    return package


def test_preflight_names_what_the_node_lacks(tmp_path):
    command = serve.build("mega-sp", {**VALUES, "node_rank": "0"})
    arm = serve.get_arm("mega-sp")
    no_vllm = fake_python(tmp_path, None, deep_gemm=True)
    (problem,) = serve.preflight(arm, command, no_vllm)
    assert "vLLM is not importable" in problem and "No module named" in problem

    bare = fake_python(tmp_path, unpatched_vllm(tmp_path), deep_gemm=False)
    problems = serve.preflight(arm, command, bare)
    assert len(problems) == 2
    assert "needs the k3-sppp patch set" in problems[0]
    assert "make apply VLLM=" in problems[0]
    assert "needs DeepGEMM" in problems[1] and "DEEPGEMM=" in problems[1]

    # The FlashInfer arms need neither the patch set nor DeepGEMM.
    fi = serve.build("fi-ep", {**VALUES, "node_rank": "0"})
    assert serve.preflight(serve.get_arm("fi-ep"), fi, bare) == []


def test_run_refuses_before_starting_anything(tmp_path):
    python = fake_python(tmp_path, unpatched_vllm(tmp_path), deep_gemm=False)
    result = subprocess.run(
        [
            sys.executable,
            "eval/serve.py",
            "--arm",
            "mega-sp",
            "--node-rank",
            "1",
            "--model",
            "/m",
            "--host-ip",
            "h",
            "--master-addr",
            "m",
            "--deepgemm",
            "/d",
            "--python",
            python,
            "--run",
        ],
        capture_output=True,
        text=True,
        cwd=serve.PROJECT_DIR,
        env={**os.environ, "PATH": "/nonexistent"},
    )
    assert result.returncode == 1
    assert "--headless" in result.stdout  # the command is shown first
    assert result.stderr.count("serve: ") == 2
