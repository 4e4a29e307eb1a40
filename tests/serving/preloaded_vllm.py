# SPDX-License-Identifier: Apache-2.0
"""``vllm serve`` and ``vllm bench serve`` with vLLM's CLI imported once.

Each ``vllm`` process spends 17 to 20 s of CPU importing vLLM before it does
anything, and the serving tests start four servers and run the bench client
four times on the same two cores. Here one process imports the CLI and the
serving path once; each run is a fork of it that executes vLLM's own ``vllm``
entry point (``vllm.entrypoints.cli.main.main``) with the caller's arguments,
working directory, environment and standard streams, and answers with its
exit code. vLLM's code is unchanged: only its imports happened earlier (and
what they made is frozen out of the garbage collector's sight). The
servers' EngineCore and workers are forked from there as on a GPU node
(tests/serving/fork_processes.py).

Each fork leads a process group of its own, which holds the server's
EngineCore and workers: a signal sent to the caller (``Server.stop`` sends
SIGTERM to the caller's group) is passed on to that group, and the group is
killed when the caller dies or the run ends, so no rank outlives its caller.

Two differences follow from the preloading. What a module reads from the
environment as it is imported (huggingface_hub's and datasets' offline
flags, vLLM's logging set-up, the platform) comes from the preloaded
process's environment, so :func:`command` is given the environment every run
shares; what differs per run (``VLLM_USE_RUST_FRONTEND``, the worker's own
variables) is read later and comes from the caller. And a run that replaces
itself (``vllm bench serve`` execs ``vllm-rs`` where ``VLLM_USE_RUST_BENCH=1``;
the sweeps pin it to 0) closes the answer's socket: its caller exits 70.

``python -m tests.serving.preloaded_vllm NAME`` serves on the abstract socket
NAME; :func:`command` writes the executable run in place of ``vllm``.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import json
import os
import signal
import socket
import struct
import subprocess
import sys
import threading
import traceback
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# The executable run as ``vllm``: argv, cwd, environment and the three
# standard streams go to the preloaded process (waiting while it imports,
# unless it has exited); SIGTERM, SIGINT and SIGHUP go on to the run as one
# byte each; its exit code comes back.
CALLER = """\
import json, os, signal, socket, struct, sys, time
request = json.dumps({{"argv": sys.argv, "cwd": os.getcwd(), "env": dict(os.environ)}})
with socket.socket(socket.AF_UNIX) as conn:
    deadline = time.monotonic() + {wait_s}
    while True:
        try:
            conn.connect("\\0" + {name!r})
            break
        except ConnectionRefusedError:
            if os.path.exists({exited!r}) or time.monotonic() > deadline:
                sys.exit("the preloaded vllm CLI is not listening; see " + {log!r})
            time.sleep(0.2)
    data = request.encode()
    socket.send_fds(conn, [struct.pack("!I", len(data)) + data], [0, 1, 2])
    def pass_on(sig, frame):
        try:
            conn.send(bytes([sig]))
        except OSError:
            pass  # the run has ended: its answer, or EOF, follows
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, pass_on)
    answer = b""
    while len(answer) < 4:
        chunk = conn.recv(4 - len(answer))
        if not chunk:
            break
        answer += chunk
sys.exit(struct.unpack("!i", answer)[0] if len(answer) == 4 else 70)
"""


def recv_exactly(conn: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = conn.recv(size - len(data))
        if not chunk:
            raise EOFError("the caller hung up")
        data += chunk
    return data


def pass_on_signals(conn: socket.socket) -> None:
    """In the fork, a thread: each byte the caller sends is a signal for this
    run's process group; the caller gone, the group is killed."""
    while signals := conn.recv(16):
        for sig in signals:
            os.killpg(0, sig)
    os.killpg(0, signal.SIGKILL)


def run_cli(conn: socket.socket) -> int:
    """In the fork: take the caller's request and streams, run vLLM's CLI."""
    head, fds, _, _ = socket.recv_fds(conn, 4, 3)
    request = json.loads(recv_exactly(conn, struct.unpack("!I", head)[0]))
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    sys.argv = request["argv"]
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    threading.Thread(target=pass_on_signals, args=(conn,), daemon=True).start()
    from vllm.entrypoints.cli.main import main

    try:
        main()
    except SystemExit as done:
        if done.code is None or isinstance(done.code, int):
            return done.code or 0
        print(done.code, file=sys.stderr)  # as the interpreter would
        return 1
    return 0


def serve(name: str) -> None:
    # What `vllm.entrypoints.cli.main.main` imports before it parses the
    # arguments, the bench subcommands `vllm bench` then imports, and the
    # API server and engine that `vllm serve` imports.
    import vllm.entrypoints.cli.benchmark.main
    import vllm.entrypoints.cli.collect_env
    import vllm.entrypoints.cli.download_kernels
    import vllm.entrypoints.cli.launch
    import vllm.entrypoints.cli.main
    import vllm.entrypoints.cli.openai
    import vllm.entrypoints.cli.preload
    import vllm.entrypoints.cli.run_batch
    import vllm.entrypoints.cli.serve
    import vllm.entrypoints.cli.snapshot
    import vllm.entrypoints.openai.api_server
    import vllm.v1.engine.core
    import vllm.v1.executor.multiproc_executor  # noqa: F401
    from tests.sppp_testbed.bases import HAS_LEGACY_RUNNER

    vllm.entrypoints.cli.benchmark.main._import_bench_subcommand_modules()
    # And what each server's processes import after the fork: the API server
    # Kimi K3's config and processor, every rank the tests' worker
    # (``--worker-cls``), its runner and the model modules below them (1.7
    # CPU-s a rank, alone; ``tests/serving`` starts 26 ranks). Not on vLLM
    # 0.33.0: there each rank rebinds Triton kernels before it imports the
    # worker, scanning every module loaded by then
    # (``triton_utils/dispatcher.py``, ``_rebind_kernels``), and fails on
    # llvmlite's ``_lib_fn_wrapper``, which these imports bring in.
    if not HAS_LEGACY_RUNNER:
        for module in ("vllm.models.kimi_k3", "tests.serving.v2_runner"):
            importlib.import_module(module)
    # Out of the collector's sight from here on: each fork (and its API
    # server, EngineCore and ranks) would otherwise walk all of it again in
    # every full collection (vLLM's ``DeviceMemoryProfiler`` runs two per
    # model load), writing to each page it walks, so every process pays the
    # walk and a private copy of pages the fork could have shared.
    gc.freeze()
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # forks reap themselves
    with socket.socket(socket.AF_UNIX) as listener:
        # An abstract address: no file, and no limit from the path's length.
        listener.bind("\0" + name)
        listener.listen()
        while True:
            conn, _ = listener.accept()
            sys.stdout.flush()
            sys.stderr.flush()
            if os.fork() == 0:
                code = 1
                try:
                    os.setsid()  # a process group for the run and its children
                    listener.close()
                    code = run_cli(conn)
                except BaseException:
                    traceback.print_exc()
                finally:
                    # The fork never returns into this loop, whatever happened.
                    with contextlib.suppress(BaseException):
                        sys.stdout.flush()
                        sys.stderr.flush()
                        conn.sendall(struct.pack("!i", code))
                    # What the run started and left (a server's EngineCore
                    # and workers, on a failed start-up) goes with it.
                    with contextlib.suppress(BaseException):
                        os.killpg(0, signal.SIGKILL)
                    os._exit(code & 0xFF)
            conn.close()


@contextmanager
def command(directory: Path, env: dict[str, str], wait_s: int = 300) -> Iterator[Path]:
    """An executable ``directory/vllm`` that runs vLLM's CLI in forks of one
    preloaded process, started here with ``env`` (its imports overlap what
    the caller does next) and stopped when the block ends."""
    directory.mkdir(parents=True, exist_ok=True)
    name = f"k3-sppp-cli-{uuid.uuid4().hex[:12]}"
    log = directory / "preloaded-vllm.log"
    exited = directory / "preloaded-vllm.exited"
    exited.unlink(missing_ok=True)
    with open(log, "wb") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "tests.serving.preloaded_vllm", name],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=ROOT,
            start_new_session=True,
        )

    def watch() -> None:  # a caller stops waiting once this file exists
        exited.write_text(f"{process.wait()}\n")

    threading.Thread(target=watch, daemon=True).start()
    executable = directory / "vllm"
    caller = CALLER.format(name=name, exited=str(exited), log=str(log), wait_s=wait_s)
    executable.write_text(f"#!{sys.executable}\n{caller}")
    executable.chmod(0o755)
    try:
        yield executable
    finally:
        for sig in (signal.SIGTERM, signal.SIGKILL):
            with contextlib.suppress(ProcessLookupError):  # it may have exited
                os.killpg(process.pid, sig)
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(30)
                break


if __name__ == "__main__":
    serve(sys.argv[1])
