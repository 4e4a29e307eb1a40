# SPDX-License-Identifier: Apache-2.0
"""Run ``apply.main`` in a forked child whose Nth file operation fails.

The child counts every call that changes the file system (``os.replace``,
``os.rename``, ``os.link``, ``os.symlink``, ``os.unlink``, ``os.remove``,
``os.mkdir``, ``os.rmdir``, ``os.fsync``, ``os.pwrite``, ``os.sendfile``,
``os.chmod``, ``os.chown``, and every ``open``/``os.open`` for writing).  At
call N it raises ``OSError(EIO)``, raises ``KeyboardInterrupt`` (Ctrl-C), or
kills itself with SIGKILL, before the call happens.  Nothing but the standard
library is needed: no syscall injection, no root.

The children are forked from a small worker interpreter that imports only
apply.py and this module: forking the test process itself, which holds torch
and vLLM for other tests, makes each run about twice as slow.
"""

from __future__ import annotations

import builtins
import contextlib
import errno
import io
import json
import multiprocessing
import os
import signal
import sys
import traceback
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import apply

KINDS = ("eio", "ctrl-c", "kill")
COUNTED = (
    "replace",
    "rename",
    "link",
    "symlink",
    "unlink",
    "remove",
    "mkdir",
    "rmdir",
    "fsync",
    "pwrite",
    "sendfile",
    "chmod",
    "chown",
)
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND


@dataclass
class Outcome:
    code: int  # exit status; -9 when killed
    output: str
    ops: list[str]  # the counted calls reached, in order


def _install(fail_at: int, kind: str, ops: list[str]) -> None:
    """Wrap the counted calls so that call ``fail_at`` (1-based) fails."""

    def fire(name: str) -> None:
        ops.append(name)
        if len(ops) != fail_at:
            return
        if kind == "eio":
            raise OSError(errno.EIO, f"injected I/O error in {name}")
        if kind == "ctrl-c":
            raise KeyboardInterrupt
        os.kill(os.getpid(), signal.SIGKILL)

    def counted(name: str, real: Callable) -> Callable:
        def call(*args, **kwargs):
            fire(name)
            return real(*args, **kwargs)

        return call

    for name in COUNTED:
        setattr(os, name, counted(name, getattr(os, name)))

    real_os_open = os.open

    def os_open(path, flags, *args, **kwargs):
        if flags & _WRITE_FLAGS:
            fire("open")
        return real_os_open(path, flags, *args, **kwargs)

    os.open = os_open
    real_open = builtins.open

    def open_(file, mode="r", *args, **kwargs):
        if isinstance(file, (str, os.PathLike)) and set(mode) & set("wax+"):
            fire("open")
        return real_open(file, mode, *args, **kwargs)

    builtins.open = io.open = open_


_forker: ProcessPoolExecutor | None = None


def run(
    argv: list[str], fail_at: int, kind: str, log: Path, umask: int = 0o022
) -> Outcome:
    """``apply.main(argv)`` in a forked child under ``umask``; ``fail_at=0``
    injects nothing."""
    global _forker
    if _forker is None:
        _forker = ProcessPoolExecutor(1, multiprocessing.get_context("spawn"))
    return _forker.submit(_run_forked, argv, fail_at, kind, log, umask).result()


def _run_forked(
    argv: list[str], fail_at: int, kind: str, log: Path, umask: int
) -> Outcome:
    sys.stdout.flush()
    sys.stderr.flush()
    report = log.with_suffix(".ops")
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        code = 99
        try:
            fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(fd, 1)
            os.dup2(fd, 2)
            sys.stdout = io.TextIOWrapper(os.fdopen(1, "wb", buffering=0))
            sys.stderr = sys.stdout
            ops: list[str] = []
            ops_fd = os.open(report, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            pwrite = os.pwrite
            os.umask(umask)
            _install(fail_at, kind, ops)
            try:
                code = apply.main(argv)
            finally:
                with contextlib.suppress(BaseException):
                    sys.stdout.flush()
                pwrite(ops_fd, json.dumps(ops).encode(), 0)
        except BaseException:
            with contextlib.suppress(BaseException):
                traceback.print_exc()
                sys.stdout.flush()
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    code = os.waitstatus_to_exitcode(status)
    ops = json.loads(report.read_text() or "[]") if report.exists() else []
    return Outcome(code, log.read_text(errors="replace"), ops)
