# SPDX-License-Identifier: Apache-2.0
"""The arms file reproduces the upstream pull request's serve command (one
documented difference: a variable vLLM 0.33.0 names otherwise), printing
refuses a VLLM_* variable the serving vLLM does not define, and ``--run`` says
what a node lacks before it starts anything."""

from __future__ import annotations

import ast
import os
import re
import shlex
import stat
import subprocess
import sys
from pathlib import Path

import pytest

import apply
from eval import serve

DATA = Path(__file__).parent / "data"
VALUES = {
    "checkpoint": "/models/Kimi-K3",
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
    "mega-sp-seed": [],
}
# The arm that replays the seed's environment names too.
VERBATIM = {"mega-sp-seed"}
# The one intended difference from the seed's command. vLLM 0.33.0 does not
# define the seed's GEMM-RS variable (it would only warn, and MegaMoE+SP would
# run without GEMM-RS); it reads VLLM_ENABLE_GEMM_RS for Kimi K3 under SP.
RENAMED = {"VLLM_KIMI_K3_GEMM_RS": "VLLM_ENABLE_GEMM_RS"}
# What result manifests record of every arm's environment: each node's own
# values as make variables.
SERVED_ENV = {
    "PYTHONPATH": "<DEEPGEMM>",
    "VLLM_HOST_IP": "<HOST_IP>",
    "VLLM_KIMI_K3_SHARD_SP_SHARED_EXPERT": "1",
    "VLLM_ENABLE_GEMM_RS": "1",
    "VLLM_USE_RUST_FRONTEND": "1",
    "VLLM_USE_V2_MODEL_RUNNER": "1",
}


def seed_command(node_rank: int) -> tuple[list[tuple[str, str]], list[str]]:
    """The seed's command as bash would run it on that node: (env, argv)."""
    text = (DATA / "seed_serve.sh").read_text()
    command = text[text.index("PYTHONPATH=") :].replace("\\\n", " ")
    variables = {
        "MODEL": VALUES["checkpoint"],
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
    renamed = {} if arm in VERBATIM else RENAMED
    assert list(command.env) == [(renamed.get(name, name), v) for name, v in env]
    assert list(command.argv) == without(argv, SEED_REMOVALS[arm])
    assert ("--headless" in command.argv) == (node_rank == 1)


def test_the_renamed_variable_is_the_seeds_and_only_the_new_name_is_defined():
    env, _ = seed_command(0)
    assert set(RENAMED) <= {name for name, _ in env}  # seed_serve.sh kept verbatim
    command = serve.build("mega-sp", {**VALUES, "node_rank": "0"})
    defined = serve.defined_env(command, sys.executable)  # the installed 0.33.0
    for old, new in RENAMED.items():
        assert old not in defined and new in defined


@pytest.mark.parametrize("arm", sorted(SEED_REMOVALS))
def test_every_variable_of_the_arm_is_defined_by_the_installed_vllm(arm):
    command = serve.build(arm, {**VALUES, "node_rank": "0"})
    defined = serve.defined_env(command, sys.executable)
    command = serve.for_serving_vllm(command, defined)
    accepted = serve.get_arm(arm).undefined_env
    assert serve.undefined_env(command, defined, sys.executable, accepted) == []
    # Only the verbatim arm sets a name 0.33.0 does not read: the seed's.
    assert accepted - defined == (
        {"VLLM_KIMI_K3_GEMM_RS"} if arm in VERBATIM else set()
    )


def test_the_seeds_variable_is_refused_naming_the_one_meant():
    env, argv = seed_command(0)
    seed = serve.ServeCommand(tuple(env), tuple(argv))
    defined = serve.defined_env(seed, sys.executable)
    seed = serve.for_serving_vllm(seed, defined)
    (problem,) = serve.undefined_env(seed, defined, "py")
    assert problem.startswith("VLLM_KIMI_K3_GEMM_RS (eval/arms.toml) is not a ")
    assert "VLLM_ENABLE_GEMM_RS" in problem.split("closest defined: ")[1]


@pytest.mark.parametrize("arm", sorted(set(SEED_REMOVALS) - VERBATIM))
def test_manifests_record_the_environment_each_arm_is_served_with(arm, tmp_path):
    served = serve.served_as(arm, tmp_path)
    assert served["served_record"] is None
    # In the order the command sets it.
    assert list(served["serve_env"].items()) == list(SERVED_ENV.items())
    words = shlex.split(served["serve_command"].replace("\\\n", " "))
    assert words[: len(SERVED_ENV)] == [f"{k}={v}" for k, v in SERVED_ENV.items()]


@pytest.mark.parametrize("arm", sorted(SEED_REMOVALS))
def test_printed_command_is_what_bash_would_run(arm):
    command = serve.build(arm, {**VALUES, "node_rank": "0"})
    words = shlex.split(command.shell().replace("\\\n", " "))
    assert words == [f"{k}={v}" for k, v in command.env] + list(command.argv)


def test_missing_values_are_named_with_their_make_variables():
    with pytest.raises(serve.ServeError) as error:
        serve.build("mega-sp", {"checkpoint": "/m", "node_rank": "0"})
    assert str(error.value) == (
        "missing HOST_IP= (--host-ip), MASTER_ADDR= (--master-addr)"
    )
    with pytest.raises(serve.ServeError, match="set ARM= to one of"):
        serve.build("mega", {**VALUES, "node_rank": "0"})


def arm_env_names() -> list[str]:
    serve_spec, _ = serve.load_arms()
    return [name for name, _ in serve_spec["env"] if name.startswith("VLLM_")]


def fake_python(
    tmp_path: Path,
    vllm: bool = True,
    defines: list[str] | None = None,
    modules: tuple[str, ...] = (),
    deep_ep_reason: str | None = None,
    devices: tuple[str, int] = ("cuda", 8),
) -> str:
    """An interpreter whose only packages are a stand-in vLLM 0.33.0 (its envs.py
    defining ``defines``, default the arms' names; its platform seeing
    ``devices``, as vLLM's ``current_platform`` reports them: type and count)
    and empty ``modules``."""
    site = tmp_path / "site"
    site.mkdir(parents=True)
    if vllm:
        package = site / "vllm"
        (package / "utils").mkdir(parents=True)
        (package / "__init__.py").write_text("")
        kind, count = devices
        (package / "platforms.py").write_text(
            "class Platform:\n"
            f"    device_type = {kind!r}\n"
            "    @staticmethod\n"
            "    def device_count():\n"
            f"        return {count}\n"
            "current_platform = Platform()\n"
        )
        (package / "_version.py").write_text("__version__ = version = '0.33.0'\n")
        names = arm_env_names() if defines is None else defines
        (package / "envs.py").write_text(
            "environment_variables: dict = {\n"
            + "".join(f"    {name!r}: lambda: None,\n" for name in names)
            + "}\n"
        )
        if deep_ep_reason is not None:
            (package / "utils" / "import_utils.py").write_text(
                f"def deep_ep_v2_unavailable_reason():\n    return {deep_ep_reason!r}\n"
            )
    for module in modules:
        (site / module).mkdir()
        (site / module / "__init__.py").write_text("")
    script = tmp_path / "python"
    # -S: nothing from the real site-packages (which holds the real vLLM).
    # The arm's PYTHONPATH (DEEPGEMM=) after the stand-in's packages.
    path = f"{site}${{PYTHONPATH:+:$PYTHONPATH}}"
    script.write_text(f'#!/bin/sh\nPYTHONPATH={path} exec {sys.executable} -S "$@"\n')
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return str(script)


def ready_node(tmp_path: Path, node_rank: int = 0) -> dict[str, str]:
    """Values a node check passes: a model directory with a config and weights,
    and addresses of this machine."""
    model = tmp_path / "Kimi-K3"
    model.mkdir(parents=True)
    (model / "config.json").write_text("{}")
    (model / "model-00001-of-00001.safetensors").write_bytes(b"")
    return {
        **VALUES,
        "checkpoint": str(model),
        "host_ip": "127.0.0.1",
        "master_addr": "127.0.0.1",
        "deepgemm": "",  # vLLM's bundled copy, where the stand-in has one
        "node_rank": str(node_rank),
    }


def test_preflight_names_what_the_node_lacks(tmp_path):
    command = serve.build("mega-sp", ready_node(tmp_path))
    arm = serve.get_arm("mega-sp")
    no_vllm = fake_python(tmp_path / "none", vllm=False)
    (problem,) = serve.preflight(arm, command, no_vllm)
    assert "vLLM is not importable" in problem and "No module named" in problem

    bare = fake_python(tmp_path / "bare")
    problems = serve.preflight(arm, command, bare)
    assert len(problems) == 3
    assert "needs the k3-sppp patch set" in problems[0]
    assert "make apply VLLM=" in problems[0]
    assert "needs DeepGEMM" in problems[1] and "DEEPGEMM=" in problems[1]
    assert "bundled" in problems[1]
    assert problems[2].startswith("--all2all-backend deepep_v2 needs DeepEP")
    assert problems[2].endswith("No module named 'deep_ep'")

    # The FlashInfer arms need neither the patch set nor DeepGEMM; FI+EP keeps
    # the deepep_v2 all-to-all, FI/no-EP drops it.
    fi = serve.build("fi-ep", {**ready_node(tmp_path / "fi"), "deepgemm": ""})
    (problem,) = serve.preflight(serve.get_arm("fi-ep"), fi, bare)
    assert "needs DeepEP" in problem
    noep = serve.build("fi-noep", ready_node(tmp_path / "noep"))
    assert serve.preflight(serve.get_arm("fi-noep"), noep, bare) == []


def test_preflight_prints_the_series_revision_for_every_arm(tmp_path, capsys):
    applied = serve.series_note(apply.status(), "/venv")
    assert f"k3-sppp revision {apply.status()['revision']} applied" in applied
    bare = fake_python(tmp_path / "bare")
    for name in ("mega-sp", "fi-ep", "fi-noep"):
        command = serve.build(name, ready_node(tmp_path / name))
        serve.preflight(serve.get_arm(name), command, bare)
        note = capsys.readouterr().err
        assert "no k3-sppp series applied" in note, (name, note)
        assert "every node of this server must print the same" in note, note


def test_deepep_is_checked_the_way_the_serving_vllm_checks_it(tmp_path):
    fi = serve.build("fi-ep", ready_node(tmp_path))
    arm = serve.get_arm("fi-ep")
    # A vLLM without its own check: importing deep_ep is enough.
    ready = fake_python(tmp_path / "ready", modules=("deep_ep",))
    assert serve.preflight(arm, fi, ready) == []
    # vLLM 0.33.0's deep_ep_v2_unavailable_reason() has the last word.
    reason = "DeepEP v2 requires NCCL >= 2.30.4 but found 2.27.3."
    old_nccl = fake_python(
        tmp_path / "nccl", modules=("deep_ep",), deep_ep_reason=reason
    )
    (problem,) = serve.preflight(arm, fi, old_nccl)
    assert problem.endswith(reason)


def serve_cli(
    python: str, *extra: str, values: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    values = values or {
        "checkpoint": "/m",
        "host_ip": "h",
        "master_addr": "m",
        "deepgemm": "/d",
        "node_rank": "1",
    }
    options = [
        word
        for key, (_, option) in serve.PLACEHOLDERS.items()
        for word in (option, values[key])
    ]
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "eval.serve",
            "--arm",
            "mega-sp",
            *options,
            "--python",
            python,
            *extra,
        ],
        capture_output=True,
        text=True,
        cwd=serve.PROJECT_DIR,
        env={**os.environ, "PATH": "/nonexistent"},
    )


def test_run_refuses_before_starting_anything(tmp_path):
    values = ready_node(tmp_path / "node", node_rank=1)
    result = serve_cli(fake_python(tmp_path), "--run", values=values)
    assert result.returncode == 1
    assert "--headless" in result.stdout  # the command is shown first
    # This node's revision, then the three problems.
    assert result.stderr.startswith("serve: this node's vLLM")
    assert result.stderr.count("serve: ") == 4


def test_printing_says_nothing_was_started(tmp_path):
    result = serve_cli(fake_python(tmp_path))
    assert result.returncode == 0
    assert result.stdout.rstrip().endswith("--headless")  # stdout: the command
    assert result.stderr == (
        "serve: printed only, nothing was started; RUN=1 (--run) checks this "
        "node and then starts it\n"
    )


@pytest.mark.parametrize("release", ["0.33.0", "0.34.0"])
def test_the_v2_runner_switch_is_set_only_where_the_serving_vllm_defines_it(
    tmp_path, release
):
    # 0.34.0 removed the legacy runner and VLLM_USE_V2_MODEL_RUNNER with it.
    defines = arm_env_names()
    if release == "0.34.0":
        defines.remove("VLLM_USE_V2_MODEL_RUNNER")
    result = serve_cli(fake_python(tmp_path, defines=defines))
    assert result.returncode == 0, result.stderr
    assert ("VLLM_USE_V2_MODEL_RUNNER=1" in result.stdout) == (release == "0.33.0")
    assert "VLLM_USE_RUST_FRONTEND=1" in result.stdout


@pytest.mark.parametrize("run", [False, True], ids=["print", "run"])
def test_a_variable_the_serving_vllm_does_not_define_is_refused(tmp_path, run):
    # A vLLM that knows the seed's name and not ours.
    defines = [RENAMED.get(n, n) for n in arm_env_names()]
    defines = [n for n in defines if n != "VLLM_ENABLE_GEMM_RS"]
    defines += ["VLLM_KIMI_K3_GEMM_RS", "VLLM_ENABLE_GEMM_AR"]
    result = serve_cli(fake_python(tmp_path, defines=defines), *["--run"][:run])
    assert result.returncode == 1
    assert result.stdout == ""  # nothing to copy and paste
    assert result.stderr.splitlines() == [
        "serve: VLLM_ENABLE_GEMM_RS (eval/arms.toml) is not a variable the vLLM "
        f"of {tmp_path / 'python'} defines: it would warn and run as if it were "
        "unset; closest defined: VLLM_ENABLE_GEMM_AR, VLLM_KIMI_K3_GEMM_RS"
    ]


@pytest.mark.parametrize("run", [False, True], ids=["print", "run"])
@pytest.mark.parametrize(
    ("interpreter", "why"),
    [("without-vllm", "No module named 'vllm'"), ("none", "No such file")],
)
def test_printing_needs_the_serving_vllm(tmp_path, run, interpreter, why):
    python = (
        fake_python(tmp_path, vllm=False)
        if interpreter == "without-vllm"
        else str(tmp_path / "missing" / "python")
    )
    result = serve_cli(python, *["--run"][:run])
    assert result.returncode == 1
    assert result.stdout == ""
    (line,) = result.stderr.splitlines()
    assert line.startswith(f"serve: vLLM is not importable by {python} ({why}")
    assert "SERVE_PYTHON=" in line


@pytest.mark.parametrize(
    ("devices", "visible", "said"),
    [
        (("", 0), None, "finds no GPU (device type: none); it would stop with "),
        (("cuda", 4), None, "sees 4 GPU(s); the command runs TP8 x PP2 over 2 "),
        # vLLM counts what CUDA_VISIBLE_DEVICES leaves: the fake reports that.
        (("cuda", 2), "0,1", "sees 2 GPU(s) with CUDA_VISIBLE_DEVICES=0,1;"),
    ],
    ids=["no-gpu", "too-few", "hidden-by-visible-devices"],
)
def test_run_names_the_gpus_vllm_cannot_see(
    tmp_path, monkeypatch, devices, visible, said
):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    if visible is not None:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    python = fake_python(tmp_path, devices=devices)
    command = serve.build("fi-noep", ready_node(tmp_path))
    (problem,) = serve.preflight(serve.get_arm("fi-noep"), command, python)
    assert said in problem
    assert "nvidia-smi" in problem


def test_run_passes_with_one_nodes_share_of_the_gpus(tmp_path, monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    python = fake_python(tmp_path, devices=("cuda", 8))  # TP8 x PP2 / 2 nodes
    command = serve.build("fi-noep", ready_node(tmp_path))
    assert serve.preflight(serve.get_arm("fi-noep"), command, python) == []


@pytest.mark.parametrize(
    ("remove", "said"),
    [
        ("directory", "is not a directory on this node"),
        ("config.json", "holds no config.json"),
        ("model-00001-of-00001.safetensors", "holds no *.safetensors weights"),
    ],
)
def test_run_names_what_the_model_directory_lacks(tmp_path, remove, said):
    values = ready_node(tmp_path)
    model = Path(values["checkpoint"])
    if remove == "directory":
        values["checkpoint"] = str(tmp_path / "nowhere")
    else:
        (model / remove).unlink()
    command = serve.build("fi-noep", values)
    (problem,) = serve.preflight(
        serve.get_arm("fi-noep"), command, fake_python(tmp_path)
    )
    assert problem.startswith(f"CHECKPOINT={values['checkpoint']} {said}")
    assert "set CHECKPOINT= (--checkpoint; MODEL= as in the seed)" in problem


@pytest.mark.parametrize(
    ("node_rank", "change", "said"),
    [
        (1, {"master_addr": "node0.invalid"}, "MASTER_ADDR=node0.invalid does not "),
        (1, {"host_ip": "192.0.2.1"}, "HOST_IP=192.0.2.1 is not an address of "),
        (0, {"master_addr": "192.0.2.1"}, "MASTER_ADDR=192.0.2.1 is not an addr"),
    ],
    ids=["master-unresolved", "host-ip-elsewhere", "head-not-master"],
)
def test_run_names_an_address_the_nodes_cannot_meet_at(
    tmp_path, node_rank, change, said
):
    values = {**ready_node(tmp_path, node_rank), **change}
    command = serve.build("fi-noep", values)
    (problem,) = serve.preflight(
        serve.get_arm("fi-noep"), command, fake_python(tmp_path)
    )
    assert problem.startswith(said)


@pytest.mark.parametrize("arm", sorted(SEED_REMOVALS))
def test_deepgemm_is_on_every_arms_path_when_given_and_on_none_without(arm):
    given = serve.build(arm, {**VALUES, "node_rank": "0"})
    assert dict(given.env)["PYTHONPATH"] == VALUES["deepgemm"]
    bare = serve.build(arm, {**VALUES, "deepgemm": "", "node_rank": "0"})
    assert "PYTHONPATH" not in dict(bare.env)


def bundled_python(tmp_path: Path) -> str:
    """A stand-in vLLM whose wheel bundles deep_gemm, none on the path."""
    python = fake_python(tmp_path)
    bundled = tmp_path / "site" / "vllm" / "third_party" / "deep_gemm"
    bundled.mkdir(parents=True)
    (bundled.parent / "__init__.py").write_text("")
    (bundled / "__init__.py").write_text("")
    return python


def test_without_deepgemm_the_bundled_copy_is_accepted_and_named(tmp_path):
    python = bundled_python(tmp_path)
    values = {**ready_node(tmp_path / "node"), "deepgemm": ""}
    command = serve.build("mega-sp", values)
    assert serve.deep_gemm_problems(command, python) == []
    used = serve.deep_gemm_used(command, python)
    assert used.startswith("vLLM's bundled copy, vllm.third_party.deep_gemm (")


def test_a_deepgemm_that_is_not_imported_from_is_refused(tmp_path):
    python = bundled_python(tmp_path)
    values = {**ready_node(tmp_path / "node"), "deepgemm": str(tmp_path / "DG")}
    (problem,) = serve.deep_gemm_problems(serve.build("fi-ep", values), python)
    assert problem.startswith(f"DEEPGEMM={tmp_path / 'DG'} holds no deep_gemm")
    assert "vLLM's bundled copy" in problem
    # With the package there, it is the one vLLM prefers.
    (tmp_path / "DG" / "deep_gemm").mkdir(parents=True)
    (tmp_path / "DG" / "deep_gemm" / "__init__.py").write_text("")
    serve.deep_gemm_copy.cache_clear()  # one probe per process, as a start is
    command = serve.build("fi-ep", values)
    assert serve.deep_gemm_problems(command, python) == []
    assert serve.deep_gemm_used(command, python).startswith(
        f"deep_gemm from {tmp_path / 'DG' / 'deep_gemm'} (PYTHONPATH="
    )


def test_a_start_is_recorded_and_manifests_copy_it(tmp_path):
    values = {**ready_node(tmp_path / "node"), "deepgemm": ""}
    command = serve.build("mega-sp", values)
    arm = serve.get_arm("mega-sp")
    serve.record_start(arm, command, "vLLM's bundled copy", tmp_path)
    served = serve.served_as("mega-sp", tmp_path)
    assert served["serve_env"] == dict(command.env)
    assert "PYTHONPATH" not in served["serve_env"]  # what was served, not <DEEPGEMM>
    assert served["served_record"]["deep_gemm"] == "vLLM's bundled copy"


def test_the_seed_arm_names_its_difference_from_ours():
    note = serve.differences(serve.get_arm("mega-sp-seed"))
    assert note.startswith(
        "MegaMoE+SP (seed) is MegaMoE+SP with VLLM_KIMI_K3_GEMM_RS for "
        "VLLM_ENABLE_GEMM_RS: "
    )
    assert "GEMM-RS off" in note
    assert serve.differences(serve.get_arm("mega-sp")) is None


def test_serve_parses_as_python_3_9_up_to_its_version_check():
    source = Path(serve.__file__).read_text()
    ast.parse(source, feature_version=(3, 9))
