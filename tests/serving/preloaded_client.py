# SPDX-License-Identifier: Apache-2.0
"""``vllm bench serve`` with vLLM's CLI imported once for every run.

Each run of the real client spends about 13 s of CPU importing vLLM before it
sends a request, and the serving tests run it four times while the servers
compete for the same two cores. Here one process imports the CLI once; each
run is a fork of it that executes vLLM's own ``vllm`` entry point
(``vllm.entrypoints.cli.main.main``) with the caller's arguments, working
directory, environment and standard streams, and answers with its exit code.
The client's code is unchanged: only its imports happened earlier.

Two differences follow from that. What a module reads from the environment
as it is imported (huggingface_hub's and datasets' offline flags, vLLM's
logging set-up) comes from the preloaded process's environment, so
:func:`command` is given the environment the runs will have. And a client
that replaces itself (``vllm bench serve`` execs ``vllm-rs`` where
``VLLM_USE_RUST_BENCH=1``; the sweeps pin it to 0) closes the answer's
socket: its caller exits 70.

``python -m tests.serving.preloaded_client NAME`` serves on the abstract
socket NAME; :func:`command` writes the executable that a sweep runs in
place of ``vllm``.
"""

from __future__ import annotations

import contextlib
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

# The executable a sweep runs as ``vllm``: argv, cwd, environment and the
# three standard streams go to the preloaded process (waiting while it
# imports, unless it has exited); its exit code comes back.
CALLER = """\
import json, os, socket, struct, sys, time
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
    answer = conn.recv(4)
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


def run_client(conn: socket.socket) -> int:
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
    # arguments, and the bench subcommands `vllm bench` then imports.
    import vllm.entrypoints.cli.benchmark.main
    import vllm.entrypoints.cli.collect_env
    import vllm.entrypoints.cli.download_kernels
    import vllm.entrypoints.cli.launch
    import vllm.entrypoints.cli.main
    import vllm.entrypoints.cli.openai
    import vllm.entrypoints.cli.preload
    import vllm.entrypoints.cli.run_batch
    import vllm.entrypoints.cli.serve
    import vllm.entrypoints.cli.snapshot  # noqa: F401

    vllm.entrypoints.cli.benchmark.main._import_bench_subcommand_modules()
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
                    listener.close()
                    code = run_client(conn)
                except BaseException:
                    traceback.print_exc()
                finally:
                    # The fork never returns into this loop, whatever happened.
                    with contextlib.suppress(BaseException):
                        sys.stdout.flush()
                        sys.stderr.flush()
                        conn.sendall(struct.pack("!i", code))
                    os._exit(code & 0xFF)
            conn.close()


@contextmanager
def command(directory: Path, env: dict[str, str], wait_s: int = 300) -> Iterator[Path]:
    """An executable ``directory/vllm`` that runs vLLM's CLI in forks of one
    preloaded process, started here (its imports overlap what the caller
    does next) and stopped when the block ends."""
    directory.mkdir(parents=True, exist_ok=True)
    name = f"k3-sppp-cli-{uuid.uuid4().hex[:12]}"
    log = directory / "preloaded-client.log"
    exited = directory / "preloaded-client.exited"
    exited.unlink(missing_ok=True)
    with open(log, "wb") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "tests.serving.preloaded_client", name],
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
