# SPDX-License-Identifier: Apache-2.0
"""Print, check and start one serving arm's `vllm serve` command on one node.

    python3 eval/serve.py --arm mega-sp --node-rank 0 --model /models/Kimi-K3 \\
        --master-addr 10.0.0.1 --host-ip 10.0.0.1 --deepgemm /opt/DeepGEMM

prints the command (environment included) as the arms file defines it for
that node; ``--run`` first checks what the node needs (vLLM importable by
``--python``, the patch set applied where the arm needs it, DeepGEMM
importable where the MegaMoE backend is asked for), says what is missing,
and otherwise replaces this process with the server.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import subprocess
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path

PROJECT_DIR = Path(__file__).resolve().parent.parent
ARMS_FILE = PROJECT_DIR / "eval" / "arms.toml"
MEGA_MOE_BACKEND = "deep_gemm_mega_moe"

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


def load_arms(path: Path = ARMS_FILE) -> tuple[dict, dict[str, Arm]]:
    with open(path, "rb") as f:
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
            raise ServeError(f"{path}: arm {arm.name} drops unknown flags {unknown}")
    return data["serve"], arms


def get_arm(name: str, path: Path = ARMS_FILE) -> Arm:
    _, arms = load_arms(path)
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


def build(
    arm_name: str, values: dict[str, str], path: Path = ARMS_FILE
) -> ServeCommand:
    """The arm's command for one node; ``values`` fills the placeholders."""
    serve, arms = load_arms(path)
    arm = get_arm(arm_name, path)
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


def command_template(arm_name: str) -> str:
    """The arm's head-node command with each value left as ``<MAKEVAR>``:
    what result manifests record."""
    values = {key: f"<{make}>" for key, (make, _) in PLACEHOLDERS.items()}
    return build(arm_name, {**values, "node_rank": "0"}).shell()


def flag_value(command: ServeCommand, flag: str) -> str | None:
    argv = list(command.argv)
    return argv[argv.index(flag) + 1] if flag in argv else None


def preflight(arm: Arm, command: ServeCommand, python: str) -> list[str]:
    """What this node lacks to run ``command``; empty when it is ready."""
    problems = []
    probe = subprocess.run(
        [python, "-c", "import vllm, os; print(os.path.dirname(vllm.__file__))"],
        capture_output=True,
        text=True,
    )
    if probe.returncode != 0:
        tail = (probe.stderr.strip().splitlines() or ["not found"])[-1]
        return [
            f"vLLM is not importable by {python} ({tail}); run `make apply` "
            "or pass SERVE_PYTHON= (--python) for the environment that has it"
        ]
    vllm_dir = probe.stdout.strip().splitlines()[-1]
    if arm.needs_patch_set:
        status = subprocess.run(
            [
                sys.executable,
                str(PROJECT_DIR / "apply.py"),
                "status",
                "--target",
                vllm_dir,
            ],
            capture_output=True,
            text=True,
        )
        if status.returncode != 0:
            problems.append(
                f"arm {arm.name} needs the k3-sppp patch set applied to {vllm_dir} "
                f"(apply.py status exit {status.returncode}): run "
                f"`make apply VLLM={vllm_dir}`\n{status.stdout.strip()}"
            )
    if MEGA_MOE_BACKEND in (flag_value(command, "--kernel-config") or ""):
        env = {**os.environ, **dict(command.env)}
        deep_gemm = subprocess.run(
            [python, "-c", "import deep_gemm"], env=env, capture_output=True, text=True
        )
        if deep_gemm.returncode != 0:
            problems.append(
                f"the {MEGA_MOE_BACKEND} backend needs DeepGEMM, which {python} "
                f"cannot import with PYTHONPATH={env.get('PYTHONPATH', '')}: set "
                "DEEPGEMM= (--deepgemm) to a DeepGEMM build"
            )
    return problems


def run(command: ServeCommand, python: str) -> None:
    """Replace this process with the server, ``vllm`` taken from ``python``'s
    environment."""
    env = {**os.environ, **dict(command.env)}
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
    except ServeError as error:
        print(f"serve: {error}", file=sys.stderr)
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
