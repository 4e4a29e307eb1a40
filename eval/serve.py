# SPDX-License-Identifier: Apache-2.0
"""Print, check and start one serving arm's `vllm serve` command on one node.

    python3 -m eval.serve --arm mega-sp --node-rank 0 --model /models/Kimi-K3 \\
        --master-addr 10.0.0.1 --host-ip 10.0.0.1 --deepgemm /opt/DeepGEMM

(from this checkout's root, with any Python 3.11 or newer; ``make serve``
runs it) prints the command (environment included) as the arms file defines it for
that node, after checking that the vLLM of ``--python`` defines every
``VLLM_*`` variable the arm sets (vLLM itself only warns about the others, and
runs as if they were unset); ``--run`` first checks what the node needs (vLLM
importable by ``--python``, the patch set applied where the arm needs it,
DeepGEMM importable where the MegaMoE backend is asked for, DeepEP where the
``deepep_v2`` all-to-all is), says what is missing, and otherwise replaces this
process with the server.
"""

from __future__ import annotations

import argparse
import difflib
import os
import re
import shlex
import subprocess
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path

import apply

PROJECT_DIR = Path(__file__).resolve().parent.parent
ARMS_FILE = PROJECT_DIR / "eval" / "arms.toml"
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

# Placeholder -> (make variable, CLI option): what a user sets to fill it.
PLACEHOLDERS = {
    "model": ("MODEL", "--model"),
    "host_ip": ("HOST_IP", "--host-ip"),
    "node_rank": ("NODE_RANK", "--node-rank"),
    "master_addr": ("MASTER_ADDR", "--master-addr"),
    "deepgemm": ("DEEPGEMM", "--deepgemm"),
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
        )
        for name, spec in data["arms"].items()
    }
    flags = {words[0] for words in data["serve"]["args"]}
    for arm in arms.values():
        if unknown := sorted(set(arm.drop) - flags):
            raise ServeError(
                f"{ARMS_FILE}: arm {arm.name} drops unknown flags {unknown}"
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


def build(arm_name: str, values: dict[str, str]) -> ServeCommand:
    """The arm's command for one node; ``values`` fills the placeholders."""
    serve, _ = load_arms()
    arm = get_arm(arm_name)
    if missing := [k for k in PLACEHOLDERS if not str(values.get(k, "")).strip()]:
        raise ServeError(
            "missing "
            + ", ".join(
                f"{PLACEHOLDERS[k][0]}= ({PLACEHOLDERS[k][1]})" for k in missing
            )
        )
    if not str(values["node_rank"]).isdigit():
        raise ServeError(f"NODE_RANK must be 0 or more, not {values['node_rank']!r}")
    env = tuple((name, fill(value, values)) for name, value in serve["env"])
    argv = ["vllm", "serve", values["model"]]
    for words in serve["args"]:
        if words[0] not in arm.drop:
            argv += [fill(w, values) for w in words]
    if int(values["node_rank"]) > 0:
        argv.append("--headless")
    return ServeCommand(env, tuple(argv))


def served_as(arm_name: str) -> dict:
    """What result manifests record of how the arm is served: its head-node
    command and, by name, the environment it sets (PYTHONPATH included), each
    node's own value left as ``<MAKEVAR>``."""
    values = {key: f"<{make}>" for key, (make, _) in PLACEHOLDERS.items()}
    command = build(arm_name, {**values, "node_rank": "0"})
    return {"serve_command": command.shell(), "serve_env": dict(command.env)}


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


def undefined_env(
    command: ServeCommand, defined: frozenset[str], python: str
) -> list[str]:
    """A line for each ``VLLM_*`` variable of the arm that vLLM does not define,
    with the defined names closest to it."""
    problems = []
    for name, _ in command.env:
        if not name.startswith("VLLM_") or name in defined:
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
    if arm.needs_patch_set:
        status = apply.status(vllm_dir)
        if status["exit_code"] != apply.EXIT_OK:
            problems.append(
                f"arm {arm.name} needs the k3-sppp patch set applied to {vllm_dir} "
                f"(apply.py status exit {status['exit_code']}): run "
                f"`make apply VLLM={vllm_dir}`\n{apply.status_text(status)}"
            )
    env = served_env(command)
    if MEGA_MOE_BACKEND in (flag_value(command, "--kernel-config") or ""):
        deep_gemm = subprocess.run(
            [python, "-c", "import deep_gemm"], env=env, capture_output=True, text=True
        )
        if deep_gemm.returncode != 0:
            problems.append(
                f"the {MEGA_MOE_BACKEND} backend needs DeepGEMM, which {python} "
                f"cannot import with PYTHONPATH={env.get('PYTHONPATH', '')}: set "
                "DEEPGEMM= (--deepgemm) to a DeepGEMM build"
            )
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


def run(command: ServeCommand, python: str) -> None:
    """Replace this process with the server, ``vllm`` taken from ``python``'s
    environment."""
    env = served_env(command)
    env["PATH"] = f"{Path(python).parent}{os.pathsep}{env.get('PATH', '')}"
    os.execvpe(command.argv[0], list(command.argv), env)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arm", required=True)
    for key, (_, option) in PLACEHOLDERS.items():
        parser.add_argument(option, dest=key, default="")
    parser.add_argument(
        "--python",
        default=str(PROJECT_DIR / ".venv" / "bin" / "python"),
        help="interpreter of the environment that serves (default: .venv)",
    )
    parser.add_argument("--run", action="store_true", help="check, then start it")
    args = parser.parse_args(argv)
    try:
        arm = get_arm(args.arm)
        command = build(args.arm, {k: getattr(args, k) for k in PLACEHOLDERS})
        defined = defined_env(command, args.python)
    except ServeError as error:
        print(f"serve: {error}", file=sys.stderr)
        return 1
    if undefined := undefined_env(command, defined, args.python):
        for problem in undefined:
            print(f"serve: {problem}", file=sys.stderr)
        return 1
    print(f"# {arm.label}: {arm.description}, node rank {args.node_rank}")
    print(command.shell())
    if not args.run:
        return 0
    if problems := preflight(arm, command, args.python):
        for problem in problems:
            print(f"serve: {problem}", file=sys.stderr)
        return 1
    sys.stdout.flush()
    run(command, args.python)
    return 0  # not reached: exec


if __name__ == "__main__":
    sys.exit(main())
