# SPDX-License-Identifier: Apache-2.0
"""Each serving arm's command (what ``make serve`` prints) on the CPU platform.

    VLLM_TARGET_DEVICE=cpu VLLM_LOGGING_LEVEL=ERROR \\
        .venv/bin/python -m tests.serving.arm_flags [--arms mega-sp,fi-ep] [--serve]

For every flag of an arm in eval/arms.toml, added alone to the serving tests'
command (tiny model, stand-in worker, TP2xPP2 on one host), vLLM's own
``vllm serve`` argument parser and ``EngineArgs.create_engine_config`` say
whether they accept it: what ``vllm serve`` checks before it starts anything.
``--serve`` then starts one real ``vllm serve`` per arm with every flag the
configuration accepted, and the arm's environment, and drops the variable or
flag a failure names until the server answers a completion, or stops where
the failure names none. The node-level flags (sizes, node rank, addresses, host,
port) are replaced by one host's: listed, not tried.
"""

from __future__ import annotations

import argparse
import os
import re
import socket
import sys
import tempfile
from pathlib import Path

from eval import serve
from tests.serving.server import SERVE_ARGS, Server, write_model_dir

# One CPU host stands in for two 8-GPU nodes: where the ranks run.
NODE_FLAGS = {
    "--tensor-parallel-size": "TP 2 here (8 per node on the cluster)",
    "--nnodes": "one host here",
    "--node-rank": "one host here",
    "--master-addr": "one host here",
    "--master-port": "one host here",
    "--host": "127.0.0.1 here",
    "--port": "a free port here",
}
HERE = ["-tp", "2", "-pp", "2"]
# How vLLM's messages name what some variables select.
SAID_FOR = {"VLLM_USE_V2_MODEL_RUNNER": "Model Runner V2"}


def arm_command(arm: str) -> serve.ServeCommand:
    """The command ``make serve ARM=arm NODE_RANK=0`` prints, on this host,
    for this interpreter's vLLM (without the variables it does not define
    that the arms file sets only where defined: 0.34.0's
    ``VLLM_USE_V2_MODEL_RUNNER``)."""
    command = serve.build(
        arm,
        {
            "checkpoint": "CHECKPOINT",
            "host_ip": "127.0.0.1",
            "node_rank": "0",
            "master_addr": "127.0.0.1",
        },
    )
    return serve.for_serving_vllm(command, serve.defined_env(command, sys.executable))


def flags(command: serve.ServeCommand) -> list[list[str]]:
    """The options after ``vllm serve CHECKPOINT``, one list per option."""
    grouped: list[list[str]] = []
    for word in command.argv[3:]:
        if word.startswith("--"):
            grouped.append([word])
        else:
            grouped[-1].append(word)
    return grouped


def config_verdict(model_dir: Path, flag: list[str]) -> str:
    """``accepted``, or what vLLM raises parsing it or building its config."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = ServeSubcommand().subparser_init(FlexibleArgumentParser().add_subparsers())
    try:
        args = parser.parse_args([str(model_dir), *SERVE_ARGS, *HERE, *flag])
        args.model = args.model_tag  # as `vllm serve` does with its positional
        AsyncEngineArgs.from_cli_args(args).create_engine_config()
    except SystemExit as error:
        return f"refused by the argument parser (exit {error.code})"
    except Exception as error:
        lines = [line.strip() for line in str(error).splitlines() if line.strip()]
        # pydantic ends with a link; its "Value error" line says what is wrong
        said = [line for line in lines if "Value error" in line] or lines[-1:]
        return f"refused: {type(error).__name__}: {said[0][:300] if said else ''}"
    return "accepted"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def named(flag: list[str], lines: list[str]) -> bool:
    """Whether a failure's lines name the flag: its name, its dest or value."""
    name = flag[0][2:].removeprefix("no-")
    words = {name, name.replace("-", "_")}
    words |= {w for w in flag[1:] if re.fullmatch(r"[\w.-]{3,}", w)}
    return any(word in line for line in lines for word in words)


def serve_arm(model_dir: Path, arm: str, accepted: list[list[str]], logs: Path):
    """Start the arm as far as the CPU platform goes; print what it refused."""
    # The servers log at vLLM's default level whatever this script's is.
    env = dict(arm_command(arm).env)
    logging = {"VLLM_LOGGING_LEVEL": "INFO"}
    kept = list(accepted)
    for attempt in range(1, len(kept) + len(env) + 2):
        args = [*HERE, *(word for flag in kept for word in flag)]
        log = logs / f"{arm}-{attempt}.log"
        server = Server(model_dir, free_port(), args, env | logging, log)
        step = "start"
        try:
            startup = server.wait_ready(timeout=420)
            step = "completion"
            text = server.complete("abc", 4)
            print(f"{arm}: served in {startup:.0f} s with {len(kept)} of the arm's "
                  f"flags and {sorted(env)}; 'abc' -> {text!r}")  # fmt: skip
            return
        except (RuntimeError, TimeoutError) as error:
            errors = server.errors() or str(error).splitlines()[:2]
        finally:
            server.stop()
        print(f"{arm}: attempt {attempt}, the {step} failed ({server.log}):")
        for line in errors[-4:]:
            print(f"    {line}")
        variables = [
            name
            for name in env
            if any(name in line or SAID_FOR.get(name, name) in line for line in errors)
        ]
        if variables:
            print(f"{arm}: refused at start-up: {variables[0]}={env.pop(variables[0])}")
            continue
        culprits = [flag for flag in kept if named(flag, errors)]
        if not culprits:
            print(f"{arm}: the failure names none of the remaining flags; stopped")
            return
        print(f"{arm}: refused at start-up: {' '.join(culprits[0])}")
        kept.remove(culprits[0])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arms", default=",".join(serve.load_arms()[1]))
    parser.add_argument("--serve", action="store_true", help="also start each arm")
    args = parser.parse_args(argv)
    if os.environ.get("VLLM_TARGET_DEVICE") != "cpu":
        # vLLM picks its platform when it is first imported (above).
        parser.error("run it with VLLM_TARGET_DEVICE=cpu in the environment")
    os.environ["HF_HUB_OFFLINE"] = "1"  # the tiny model is local
    work = Path(tempfile.mkdtemp(prefix="arm-flags-"))
    model_dir = write_model_dir(work / "tiny-k3")
    verdicts: dict[str, str] = {}
    for arm in args.arms.split(","):
        command = arm_command(arm)
        print(f"\n## {arm}\n")
        for name, value in command.env:
            print(f"{name}={value}: the environment, tried by --serve")
        accepted = []
        for flag in flags(command):
            key = " ".join(flag)
            if flag[0] in NODE_FLAGS:
                print(f"{key}: node-level, {NODE_FLAGS[flag[0]]}")
                continue
            if key not in verdicts:
                verdicts[key] = config_verdict(model_dir, flag)
            print(f"{key}: {verdicts[key]}")
            if verdicts[key] == "accepted":
                accepted.append(flag)
        if args.serve:
            serve_arm(model_dir, arm, accepted, work)
    print(f"\nlogs and the tiny model in {work}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
