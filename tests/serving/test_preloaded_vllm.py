# SPDX-License-Identifier: Apache-2.0
"""The preloaded vllm process (tests/serving/preloaded_vllm.py): a sweep
whose client cannot start fails at once and names the log, instead of
waiting out its deadline; signals to a run's caller reach the run, and no
run outlives its caller."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time

import psutil
import pytest

from tests.serving import preloaded_vllm


def test_a_client_that_cannot_start_fails_at_once_naming_its_log(tmp_path):
    broken = {**os.environ, "PYTHONHOME": str(tmp_path / "no-python-here")}
    with preloaded_vllm.command(tmp_path, broken, wait_s=120) as vllm:
        started = time.monotonic()
        run = subprocess.run(
            [vllm, "bench", "serve", "--help"], capture_output=True, text=True
        )
        waited = time.monotonic() - started
    assert run.returncode == 1
    assert f"see {tmp_path / 'preloaded-vllm.log'}" in run.stderr
    assert waited < 30, waited
    assert (tmp_path / "preloaded-vllm.exited").read_text().strip() != "0"


def peer_pid(conn: socket.socket) -> int:
    """The process at the other end of a local TCP connection."""
    peer = conn.getpeername()
    return next(
        c.pid for c in psutil.net_connections("tcp4") if c.laddr == peer and c.pid
    )


def gone(pid: int, within_s: float) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.1)
    return False


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=str)
def test_a_signal_to_the_caller_reaches_the_run_and_no_run_outlives_it(servers, sig):
    """``Server.stop`` signals the caller's group: SIGTERM must reach the
    run (a server, with its EngineCore and ranks), and a caller killed
    outright must take its run along."""
    with socket.socket() as silent:  # accepts, never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        silent.settimeout(120)
        url = f"http://127.0.0.1:{silent.getsockname()[1]}/v1"
        caller = subprocess.Popen(
            [servers.vllm, "complete", "--url", url],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        try:
            conn, _ = silent.accept()  # the run asks for the served models
            run = peer_pid(conn)
            caller.send_signal(sig)
            caller.wait(30)
            assert gone(run, within_s=10), f"the run (pid {run}) outlived its caller"
            conn.close()
        finally:
            caller.kill()
            caller.wait()
    # No answer from a run that a signal ended: the caller says so.
    assert caller.returncode == (70 if sig == signal.SIGTERM else -signal.SIGKILL)
