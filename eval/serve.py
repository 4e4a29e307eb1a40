# SPDX-License-Identifier: Apache-2.0
"""Print, check and start one serving arm's `vllm serve` command on one node.

    .venv/bin/python -m eval.serve --arm mega-sp --node-rank 0 \\
        --checkpoint /models/Kimi-K3 --master-addr 10.0.0.1 --host-ip 10.0.0.1 \\
        --deepgemm /opt/DeepGEMM

(from this checkout's root, with Python 3.11 or newer, as vLLM 0.33.0 and
0.34.0 need:
``make serve`` runs it with the serving interpreter, ``SERVE_PYTHON``) prints
the command (environment included) as the arms file defines it for that node,
after checking that the vLLM of ``--python`` defines every ``VLLM_*`` variable
the arm sets (vLLM itself only warns about the others, and runs as if they
were unset). Printing starts nothing. ``--run`` first checks what the node
needs (vLLM importable by ``--python``; the GPUs vLLM sees, as many as one
node's share of TP x PP; the model directory and its config; the addresses;
the patch set applied where the arm needs it; DeepGEMM importable where the
MegaMoE backend is asked for, DeepEP where the ``deepep_v2`` all-to-all is),
says what is missing, and otherwise says which DeepGEMM the server will use,
records the command and environment it starts under ``results/served/`` (the
evaluation manifests copy it) and replaces this process with the server.
"""

from __future__ import annotations

import sys

if sys.version_info < (3, 11):  # noqa: UP036 -- before tomllib, named below
    sys.exit(
        "eval.serve needs Python 3.11 or newer, as vLLM 0.33.0 and 0.34.0 do; "
        f"{sys.executable} is {sys.version.split()[0]}. Run it with the python "
        "of the environment that serves vLLM: `make serve "
        "SERVE_PYTHON=/path/to/bin/python` (default: this checkout's .venv)."
    )

import argparse
import datetime
import difflib
import functools
import json
import os
import platform
import re
import shlex
import socket
import subprocess
import tomllib
from dataclasses import dataclass
from pathlib import Path

import apply

PROJECT_DIR = Path(__file__).resolve().parent.parent
ARMS_FILE = PROJECT_DIR / "eval" / "arms.toml"
SERVED_DIR = PROJECT_DIR / "results" / "served"
MEGA_MOE_BACKEND = "deep_gemm_mega_moe"
DEEPEP_BACKEND = "deepep_v2"

# Run by the serving interpreter: its vLLM package and the names its envs.py
# defines. vLLM warns about any VLLM_* variable that is not a key of
# envs.environment_variables (Platform.validate_environ); the keys are read
# from that dict literal without importing vllm, which imports torch: seconds
# on every printed command, and a GPU stack on the machine that prints it.
DEFINED_ENV_PROBE = """
import ast, importlib.util, os, sys
spec = importlib.util.find_spec("vllm")
if spec is None or not spec.submodule_search_locations:
    sys.exit("No module named 'vllm'")
vllm_dir = list(spec.submodule_search_locations)[0]
path = os.path.join(vllm_dir, "envs.py")
with open(path) as f:
    tree = ast.parse(f.read(), path)
for node in tree.body:
    target = node.target if isinstance(node, ast.AnnAssign) else None
    if isinstance(node, ast.Assign):
        target = node.targets[0]
    if getattr(target, "id", "") == "environment_variables":
        keys = getattr(node.value, "keys", None)
        if not keys or not all(isinstance(getattr(k, "value", 0), str) for k in keys):
            sys.exit(f"{path}: environment_variables is not a dict of names")
        print("\\n".join(k.value for k in keys))
        break
else:
    sys.exit(f"{path} has no environment_variables dict")
"""

# Run by the serving interpreter with the arm's environment: why the deepep_v2
# all-to-all cannot start, through vLLM's own check where it has one (the
# deep_ep module, its v2 ElasticBuffer API, the NCCL it needs).
DEEP_EP_PROBE = """
import importlib.util, sys
if importlib.util.find_spec("deep_ep") is None:
    sys.exit("No module named 'deep_ep'")
try:
    from vllm.utils.import_utils import deep_ep_v2_unavailable_reason
except ImportError:
    import deep_ep
else:
    if reason := deep_ep_v2_unavailable_reason():
        sys.exit(reason)
"""

# Run by the serving interpreter with the arm's environment: the DeepGEMM that
# vLLM's _import_deep_gemm (vllm/utils/deep_gemm.py) would load: a deep_gemm
# module on the path (PYTHONPATH=DEEPGEMM) first, else the copy bundled in the
# wheel, vllm.third_party.deep_gemm.
DEEP_GEMM_PROBE = """
import importlib, os, sys
try:
    module, copy = importlib.import_module("deep_gemm"), "external"
except ImportError as error:
    try:
        module = importlib.import_module("vllm.third_party.deep_gemm")
    except Exception as bundled:
        sys.exit(f"{error}; vLLM's bundled vllm.third_party.deep_gemm: {bundled}")
    copy = "bundled"
print("deep_gemm", copy, os.path.dirname(module.__file__))
"""

# Run by the serving interpreter with the arm's environment: the device vLLM
# infers and how many of them it sees, by vLLM's own probe (its platform
# plugins: NVML for CUDA; CUDA_VISIBLE_DEVICES counts). A platform of no
# device is what later fails as "Failed to infer device type".
DEVICE_PROBE = """
from vllm.platforms import current_platform
kind = current_platform.device_type
print("devices", kind or "none", current_platform.device_count() if kind else 0)
"""

# Placeholder -> (make variable, CLI option): what a user sets to fill it.
PLACEHOLDERS = {
    "checkpoint": ("CHECKPOINT", "--checkpoint"),
    "host_ip": ("HOST_IP", "--host-ip"),
    "node_rank": ("NODE_RANK", "--node-rank"),
    "master_addr": ("MASTER_ADDR", "--master-addr"),
    "deepgemm": ("DEEPGEMM", "--deepgemm"),
}

OPTION_HELP = {
    "checkpoint": "local directory of the model's checkpoint (config.json, "
    "weights); --model is the same (make serve: CHECKPOINT=, or MODEL= as in "
    "the seed)",
    "host_ip": "this node's IP on the network the nodes share (VLLM_HOST_IP)",
    "node_rank": "0 on the head node, 1 on the second (it runs --headless)",
    "master_addr": "node rank 0's address, the same on every node",
    "deepgemm": "a DeepGEMM build put on the PYTHONPATH of every arm, as the "
    "seed does; without it vLLM serves its bundled copy",
}


class ServeError(Exception):
    """A command that cannot be built or run, with what to set."""


@dataclass(frozen=True)
class Arm:
    name: str
    label: str
    description: str
    drop: tuple[str, ...]
    needs_patch_set: bool
    rename_env: dict[str, str]
    undefined_env: frozenset[str]
    variant_of: str | None


@dataclass(frozen=True)
class ServeCommand:
    env: tuple[tuple[str, str], ...]
    argv: tuple[str, ...]

    def shell(self) -> str:
        """The command as a shell line per variable and per flag."""
        lines = [f"{name}={shlex.quote(value)}" for name, value in self.env]
        lines.append(" ".join(shlex.quote(word) for word in self.argv[:3]))
        rest, i = self.argv[3:], 0
        while i < len(rest):
            words = [rest[i]]
            if i + 1 < len(rest) and not rest[i + 1].startswith("--"):
                words.append(rest[i + 1])
            lines.append("  " + " ".join(shlex.quote(w) for w in words))
            i += len(words)
        return " \\\n".join(lines)


def load_arms() -> tuple[dict, dict[str, Arm]]:
    with open(ARMS_FILE, "rb") as f:
        data = tomllib.load(f)
    arms = {
        name: Arm(
            name=name,
            label=spec["label"],
            description=spec["description"],
            drop=tuple(spec.get("drop", ())),
            needs_patch_set=spec.get("needs_patch_set", False),
            rename_env=dict(spec.get("rename_env", {})),
            undefined_env=frozenset(spec.get("undefined_env", ())),
            variant_of=spec.get("variant_of"),
        )
        for name, spec in data["arms"].items()
    }
    flags = {words[0] for words in data["serve"]["args"]}
    names = {name for name, _ in data["serve"]["env"]}
    if unknown := sorted(set(data["serve"].get("where_defined", ())) - names):
        raise ServeError(
            f"{ARMS_FILE}: where_defined names unknown variables {unknown}"
        )
    for arm in arms.values():
        if unknown := sorted(set(arm.drop) - flags):
            raise ServeError(
                f"{ARMS_FILE}: arm {arm.name} drops unknown flags {unknown}"
            )
        if unknown := sorted(set(arm.rename_env) - names):
            raise ServeError(
                f"{ARMS_FILE}: arm {arm.name} renames unknown variables {unknown}"
            )
        if arm.variant_of is not None and arm.variant_of not in arms:
            raise ServeError(
                f"{ARMS_FILE}: arm {arm.name} is a variant of unknown arm "
                f"{arm.variant_of!r}"
            )
    return data["serve"], arms


def get_arm(name: str) -> Arm:
    _, arms = load_arms()
    if name not in arms:
        raise ServeError(f"unknown arm {name!r}: set ARM= to one of {sorted(arms)}")
    return arms[name]


def fill(text: str, values: dict[str, str]) -> str:
    """``text`` with each ``{placeholder}`` replaced; other braces (JSON) kept."""
    return re.sub(
        r"\{(\w+)\}",
        lambda m: str(values[m[1]]) if m[1] in PLACEHOLDERS else m[0],
        text,
    )


def asks_mega_moe(args: list[list[str]]) -> bool:
    """Whether the flags ask for the MegaMoE backend, the one DeepGEMM serves."""
    return any(
        words[0] == "--kernel-config" and MEGA_MOE_BACKEND in " ".join(words[1:])
        for words in args
    )


def build(arm_name: str, values: dict[str, str]) -> ServeCommand:
    """The arm's command for one node; ``values`` fills the placeholders.

    DeepGEMM is optional for every arm, as in the seed: given, it is on every
    arm's ``PYTHONPATH``; without it no arm sets ``PYTHONPATH`` and vLLM
    serves the copy bundled in its wheel (``preflight`` says which)."""
    serve, _ = load_arms()
    arm = get_arm(arm_name)
    args = [words for words in serve["args"] if words[0] not in arm.drop]
    optional = {"deepgemm"}
    given = {k for k in PLACEHOLDERS if str(values.get(k, "")).strip()}
    if missing := [k for k in PLACEHOLDERS if k not in given | optional]:
        raise ServeError(
            "missing "
            + ", ".join(
                f"{PLACEHOLDERS[k][0]}= ({PLACEHOLDERS[k][1]})" for k in missing
            )
        )
    if not str(values["node_rank"]).isdigit():
        raise ServeError(f"NODE_RANK must be 0 or more, not {values['node_rank']!r}")
    values = {k: str(values.get(k, "")) for k in PLACEHOLDERS}
    env = tuple(
        (arm.rename_env.get(name, name), fill(value, values))
        for name, value in serve["env"]
        if fill(value, values)
    )
    argv = ["vllm", "serve", values["checkpoint"]]
    for words in args:
        argv += [fill(w, values) for w in words]
    if int(values["node_rank"]) > 0:
        argv.append("--headless")
    return ServeCommand(env, tuple(argv))


def served_record(arm_name: str, served: Path = SERVED_DIR) -> Path:
    """Where ``--run`` on node rank 0 records how it started the arm."""
    return served / f"{arm_name}.json"


def served_as(arm_name: str, served: Path = SERVED_DIR) -> dict:
    """What result manifests record of how the arm is served: the head node's
    command and environment as ``--run`` started them (its record, copied),
    or, where this checkout did not start the arm, the arms file's command
    with each node's own value left as ``<MAKEVAR>``."""
    path = served_record(arm_name, served)
    if path.is_file():
        record = json.loads(path.read_text())
        return {
            "serve_command": record["serve_command"],
            "serve_env": record["serve_env"],
            "served_record": {"path": str(path), **record},
        }
    command = declared(arm_name)
    return {
        "serve_command": command.shell(),
        "serve_env": dict(command.env),
        "served_record": None,
    }


def declared(arm_name: str) -> ServeCommand:
    """The arm's head-node command as the arms file says it, each node's own
    values left as ``<MAKEVAR>``."""
    values = {key: f"<{make}>" for key, (make, _) in PLACEHOLDERS.items()}
    return build(arm_name, {**values, "node_rank": "0"})


def record_start(
    arm: Arm, command: ServeCommand, deep_gemm: str, served: Path = SERVED_DIR
) -> Path:
    """Write what node rank 0 is about to serve, for ``served_as``."""
    path = served_record(arm.name, served)
    path.parent.mkdir(parents=True, exist_ok=True)
    record = {
        "arm": arm.name,
        "serve_command": command.shell(),
        "serve_env": dict(command.env),
        "deep_gemm": deep_gemm,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "host": platform.node(),
    }
    path.write_text(json.dumps(record, indent=2) + "\n")
    return path


def differences(arm: Arm) -> str | None:
    """How a variant differs from the arm it is a variant of, for reports."""
    if arm.variant_of is None:
        return None
    base = get_arm(arm.variant_of)
    changes = [f"{new} for {old}" for old, new in arm.rename_env.items()] + [
        f"without {flag}" for flag in sorted(set(arm.drop) - set(base.drop))
    ]
    return f"{arm.label} is {base.label} with {', '.join(changes)}: {arm.description}"


def flag_value(command: ServeCommand, flag: str) -> str | None:
    argv = list(command.argv)
    return argv[argv.index(flag) + 1] if flag in argv else None


def served_env(command: ServeCommand) -> dict[str, str]:
    """The environment the server gets: this one with the arm's on top."""
    return {**os.environ, **dict(command.env)}


def last_line(proc: subprocess.CompletedProcess, default: str) -> str:
    return (proc.stderr.strip().splitlines() or [default])[-1]


def no_vllm(python: str, why: str) -> str:
    return (
        f"vLLM is not importable by {python} ({why}); run `make apply` "
        "or pass SERVE_PYTHON= (--python) for the environment that has it"
    )


def defined_env(command: ServeCommand, python: str) -> frozenset[str]:
    """The ``VLLM_*`` names the vLLM that ``python`` serves with defines."""
    try:
        probe = subprocess.run(
            [python, "-c", DEFINED_ENV_PROBE],
            env=served_env(command),
            capture_output=True,
            text=True,
        )
    except OSError as error:  # no such interpreter, or not executable
        raise ServeError(no_vllm(python, error.strerror)) from None
    if probe.returncode != 0:
        raise ServeError(no_vllm(python, last_line(probe, "no answer")))
    return frozenset(probe.stdout.split())


def for_serving_vllm(command: ServeCommand, defined: frozenset[str]) -> ServeCommand:
    """The command without the variables of ``where_defined`` (arms file) that
    the serving vLLM does not define: a release that dropped one (0.34.0's
    VLLM_USE_V2_MODEL_RUNNER) gets a command without it."""
    serve, _ = load_arms()
    absent = set(serve.get("where_defined", ())) - defined
    return ServeCommand(
        tuple((name, value) for name, value in command.env if name not in absent),
        command.argv,
    )


def undefined_env(
    command: ServeCommand,
    defined: frozenset[str],
    python: str,
    accepted: frozenset[str] = frozenset(),
) -> list[str]:
    """A line for each ``VLLM_*`` variable of the arm that vLLM does not define,
    with the defined names closest to it; ``accepted`` names are let through
    (an arm that replays a command verbatim)."""
    problems = []
    for name, _ in command.env:
        if not name.startswith("VLLM_") or name in defined | accepted:
            continue
        # Several names: the closest by spelling need not be the one meant
        # (the seed's VLLM_KIMI_K3_GEMM_RS is nearest VLLM_KIMI_K3_GEMM_AR).
        close = difflib.get_close_matches(name, sorted(defined), n=3)
        problems.append(
            f"{name} (eval/arms.toml) is not a variable the vLLM of {python} "
            "defines: it would warn and run as if it were unset; "
            + (f"closest defined: {', '.join(close)}" if close else "none is close")
        )
    return problems


def gpus_per_node(command: ServeCommand) -> int:
    """One node's share of the TP x PP ranks the command starts."""
    sizes = [
        int(flag_value(command, flag) or 1)
        for flag in ("--tensor-parallel-size", "--pipeline-parallel-size")
    ]
    return sizes[0] * sizes[1] // int(flag_value(command, "--nnodes") or 1)


def device_problems(command: ServeCommand, python: str) -> list[str]:
    """Why vLLM under ``python`` cannot start this node's ranks on its GPUs."""
    probe = subprocess.run(
        [python, "-c", DEVICE_PROBE],
        env=served_env(command),
        capture_output=True,
        text=True,
    )
    answer = [ln for ln in probe.stdout.splitlines() if ln.startswith("devices ")]
    if probe.returncode != 0 or not answer:
        why = last_line(probe, "no answer")
        return [f"vLLM under {python} could not probe the GPUs: {why}"]
    _, kind, count = answer[-1].split()
    need = gpus_per_node(command)
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    shown = "" if visible is None else f" with CUDA_VISIBLE_DEVICES={visible}"
    if kind != "cuda":
        return [
            f"vLLM under {python} finds no GPU{shown} (device type: {kind}); it "
            "would stop with 'Failed to infer device type'. The command needs "
            f"{need} NVIDIA GPUs on this node: check `nvidia-smi` (driver "
            "loaded, GPUs listed) and CUDA_VISIBLE_DEVICES"
        ]
    if int(count) < need:
        return [
            f"vLLM under {python} sees {count} GPU(s){shown}; the command runs "
            f"TP{flag_value(command, '--tensor-parallel-size')} x "
            f"PP{flag_value(command, '--pipeline-parallel-size')} over "
            f"{flag_value(command, '--nnodes') or 1} node(s), {need} GPUs on "
            "each: free or expose them (`nvidia-smi`, CUDA_VISIBLE_DEVICES)"
        ]
    return []


def model_problems(model: str) -> list[str]:
    """Why ``model`` is not a local model directory vLLM can load."""
    path = Path(model)
    fix = (
        "set CHECKPOINT= (--checkpoint; MODEL= as in the seed) to the local "
        "directory of Kimi K3's Hugging Face checkpoint (config.json and "
        "*.safetensors), on every node"
    )
    if not path.is_dir():
        return [f"CHECKPOINT={model} is not a directory on this node: {fix}"]
    if not (path / "config.json").is_file():
        return [f"CHECKPOINT={model} holds no config.json: {fix}"]
    if not any(path.glob("*.safetensors")):
        return [
            f"CHECKPOINT={model} holds no *.safetensors weights (the arms load "
            f"with --load-format fastsafetensors): {fix}"
        ]
    return []


def address_problems(command: ServeCommand, node_rank: int) -> list[str]:
    """Why the addresses would leave the nodes unable to meet: the master
    address must resolve, and this node must own its ``VLLM_HOST_IP`` (and,
    on node rank 0, the master address it listens on)."""
    problems = []
    master = flag_value(command, "--master-addr") or ""
    try:
        socket.getaddrinfo(master, None)
    except OSError as error:
        problems.append(
            f"MASTER_ADDR={master} does not resolve on this node ({error}): set "
            "it to node rank 0's address on the network the nodes share"
        )
    owned = [("HOST_IP", dict(command.env).get("VLLM_HOST_IP", ""))]
    if node_rank == 0 and not problems:
        owned.append(("MASTER_ADDR", master))
    for make_var, address in owned:
        if address and (why := not_local(address)):
            problems.append(
                f"{make_var}={address} is not an address of this node ({why}): "
                + (
                    "set HOST_IP= to this node's own IP on the network the nodes share"
                    if make_var == "HOST_IP"
                    else "node rank 0 listens on MASTER_ADDR: start it on the "
                    "node that owns that address"
                )
            )
    return problems


def not_local(address: str) -> str | None:
    """Why this node cannot listen on ``address``, or None when it can."""
    try:
        infos = socket.getaddrinfo(address, 0, type=socket.SOCK_STREAM)
        family, kind, proto, _, where = infos[0]
        with socket.socket(family, kind, proto) as probe:
            probe.bind(where)
    except OSError as error:
        return error.strerror or str(error)
    return None


def series_note(status: dict, vllm_dir: str) -> str:
    """This node's series revision, for every arm: PP stages on nodes with
    different revisions (or one without the series) refuse each other at
    start-up, so the line is what to compare across nodes."""
    if status["state"] == "applied":
        revision = f"k3-sppp revision {status['revision']} applied"
    elif status["state"] == "not-applied":
        revision = "no k3-sppp series applied"
    else:
        revision = f"k3-sppp series {status['state']}"
    return (
        f"this node's vLLM {status['vllm_version'] or '?'} at {vllm_dir}: "
        f"{revision}; every node of this server must print the same"
    )


def preflight(arm: Arm, command: ServeCommand, python: str) -> list[str]:
    """What this node lacks to run ``command``; empty when it is ready."""
    problems = []
    probe = subprocess.run(
        [python, "-c", "import vllm, os; print(os.path.dirname(vllm.__file__))"],
        env=served_env(command),
        capture_output=True,
        text=True,
    )
    if probe.returncode != 0:
        return [no_vllm(python, last_line(probe, "not found"))]
    vllm_dir = probe.stdout.strip().splitlines()[-1]
    problems += device_problems(command, python)
    problems += model_problems(command.argv[2])
    node_rank = int(flag_value(command, "--node-rank") or 0)
    problems += address_problems(command, node_rank)
    status = apply.status(vllm_dir)
    print(f"serve: {series_note(status, vllm_dir)}", file=sys.stderr)
    if arm.needs_patch_set and status["exit_code"] != apply.EXIT_OK:
        problems.append(
            f"arm {arm.name} needs the k3-sppp patch set applied to {vllm_dir} "
            f"(apply.py status exit {status['exit_code']}): run "
            f"`make apply VLLM={vllm_dir}`\n{apply.status_text(status)}"
        )
    env = served_env(command)
    problems += deep_gemm_problems(command, python)
    if flag_value(command, "--all2all-backend") == DEEPEP_BACKEND:
        deep_ep = subprocess.run(
            [python, "-c", DEEP_EP_PROBE], env=env, capture_output=True, text=True
        )
        if deep_ep.returncode != 0:
            problems.append(
                f"--all2all-backend {DEEPEP_BACKEND} needs DeepEP v2 (the deep_ep "
                f"module) in the environment of {python}: "
                f"{last_line(deep_ep, 'no answer')}"
            )
    return problems


@functools.cache
def deep_gemm_copy(python: str, env: tuple[tuple[str, str], ...]) -> tuple[str, str]:
    """Which DeepGEMM vLLM under ``python`` loads with ``env``: ("external" or
    "bundled", its directory), or ("none", why)."""
    probe = subprocess.run(
        [python, "-c", DEEP_GEMM_PROBE], env=dict(env), capture_output=True, text=True
    )
    answer = [ln for ln in probe.stdout.splitlines() if ln.startswith("deep_gemm ")]
    if probe.returncode != 0 or not answer:
        return "none", last_line(probe, "no answer")
    _, copy, where = answer[-1].split(" ", 2)
    return copy, where


def deep_gemm_used(command: ServeCommand, python: str) -> str:
    """A line saying which DeepGEMM the server will load."""
    copy, where = deep_gemm_copy(python, tuple(served_env(command).items()))
    given = dict(command.env).get("PYTHONPATH")
    if copy == "bundled":
        return f"vLLM's bundled copy, vllm.third_party.deep_gemm ({where})"
    if copy == "external":
        source = f"PYTHONPATH={given}" if given else "not DEEPGEMM="
        return f"deep_gemm from {where} ({source}; vLLM prefers it to its bundled copy)"
    return f"none ({where})"


def deep_gemm_problems(command: ServeCommand, python: str) -> list[str]:
    """Why the DeepGEMM this server would load is not the one asked for: none
    where the MegaMoE backend needs it, or not the DEEPGEMM= build given."""
    copy, where = deep_gemm_copy(python, tuple(served_env(command).items()))
    given = dict(command.env).get("PYTHONPATH")
    if copy == "none" and MEGA_MOE_BACKEND in (
        flag_value(command, "--kernel-config") or ""
    ):
        return [
            f"the {MEGA_MOE_BACKEND} backend needs DeepGEMM, which {python} "
            f"cannot import with PYTHONPATH={given or ''} ({where}): set "
            "DEEPGEMM= (--deepgemm) to a DeepGEMM build, or install vLLM with "
            "its bundled copy"
        ]
    inside = copy == "external" and Path(where).resolve().is_relative_to(
        Path(given or "/").resolve()
    )
    if given and not inside:
        return [
            f"DEEPGEMM={given} holds no deep_gemm that {python} imports: vLLM "
            f"would load {deep_gemm_used(command, python)}; set DEEPGEMM= to "
            "the directory that holds the deep_gemm package, or leave it empty "
            "for vLLM's bundled copy"
        ]
    return []


def run(command: ServeCommand, python: str) -> None:
    """Replace this process with the server, ``vllm`` taken from ``python``'s
    environment."""
    env = served_env(command)
    env["PATH"] = f"{Path(python).parent}{os.pathsep}{env.get('PATH', '')}"
    os.execvpe(command.argv[0], list(command.argv), env)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--arm", required=True, help="the serving arm, one of eval/arms.toml"
    )
    for key, (_, option) in PLACEHOLDERS.items():
        aliases = ["--model"] if key == "checkpoint" else []
        parser.add_argument(
            option, *aliases, dest=key, default="", help=OPTION_HELP[key]
        )
    parser.add_argument(
        "--python",
        default=str(PROJECT_DIR / ".venv" / "bin" / "python"),
        help="python of the environment that serves vLLM (default: .venv's)",
    )
    parser.add_argument(
        "--served",
        type=Path,
        default=SERVED_DIR,
        help="where --run on node rank 0 records the command and environment "
        "it starts, for the evaluation manifests (default: results/served)",
    )
    parser.add_argument(
        "--run",
        action="store_true",
        help="check this node, then start the server in this process's place "
        "(without it, the command is only printed)",
    )
    args = parser.parse_args(argv)
    try:
        arm = get_arm(args.arm)
        command = build(args.arm, {k: getattr(args, k) for k in PLACEHOLDERS})
        defined = defined_env(command, args.python)
        command = for_serving_vllm(command, defined)
    except ServeError as error:
        print(f"serve: {error}", file=sys.stderr)
        return 1
    if undefined := undefined_env(command, defined, args.python, arm.undefined_env):
        for problem in undefined:
            print(f"serve: {problem}", file=sys.stderr)
        return 1
    print(f"# {arm.label}: {arm.description}, node rank {args.node_rank}")
    print(command.shell(), flush=True)
    for name in sorted(arm.undefined_env - defined):
        print(
            f"serve: {name} is not a variable the vLLM of {args.python} defines; "
            f"arm {arm.name} sets it as its source command did, so vLLM warns "
            "and runs as if it were unset",
            file=sys.stderr,
        )
    if not args.run:
        print(
            "serve: printed only, nothing was started; RUN=1 (--run) checks "
            "this node and then starts it",
            file=sys.stderr,
        )
        return 0
    if problems := preflight(arm, command, args.python):
        for problem in problems:
            print(f"serve: {problem}", file=sys.stderr)
        return 1
    deep_gemm = deep_gemm_used(command, args.python)
    print(f"serve: DeepGEMM: {deep_gemm}", file=sys.stderr)
    if int(args.node_rank) == 0:
        path = record_start(arm, command, deep_gemm, args.served)
        print(f"serve: recorded in {path}", file=sys.stderr)
    sys.stdout.flush()
    run(command, args.python)
    return 0  # not reached: exec


if __name__ == "__main__":
    sys.exit(main())
