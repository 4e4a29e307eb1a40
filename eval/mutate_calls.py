# SPDX-License-Identifier: Apache-2.0
"""Which test calls which function of the installed series: the map
``eval.mutate`` selects a mutant's tests from.

Run as a pytest plugin (``-p eval.mutate_calls``) with ``CALLS_ENV`` naming a
directory: every Python call into a file listed in ``FILES_ENV`` (the
installed files the series touches) is recorded with the test that made it,
in the pytest process and its threads, and in every test-bed rank (the
launcher wraps each case in :func:`recording` with the test that ran it). A
call made outside any test (collection, a rank's start-up) is recorded for
``"*"``: every test. One ``<pid>.jsonl`` per process.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

CALLS_ENV = "K3_SPPP_MUTATE_CALLS"
FILES_ENV = "K3_SPPP_MUTATE_FILES"
EVERY_TEST = "*"


def enabled() -> bool:
    return bool(os.environ.get(CALLS_ENV))


@contextlib.contextmanager
def recording(test: str | None) -> Iterator[None]:
    """Record the calls into the series' files made in this block as
    ``test``'s (a pytest node id or ``PYTEST_CURRENT_TEST``; ``None``: every
    test's)."""
    if not enabled():
        yield
        return
    files = {os.path.realpath(f) for f in os.environ[FILES_ENV].split(os.pathsep)}
    # Code file name -> the series' file it is (resolved: a tree reached
    # through a linked .venv names it otherwise), or None; once per name.
    seen: dict[str, str | None] = {}
    calls: set[tuple[str, int]] = set()

    def trace(frame, event, arg):
        code = frame.f_code
        name = code.co_filename
        if name not in seen:
            real = os.path.realpath(name)
            seen[name] = real if real in files else None
        if seen[name] is not None:
            calls.add((seen[name], code.co_firstlineno))
        return None  # no line events: calls only

    saved = sys.gettrace()
    sys.settrace(trace)
    threading.settrace(trace)
    try:
        yield
    finally:
        sys.settrace(saved)
        threading.settrace(None)
        test_file = (test or EVERY_TEST).split("::")[0]
        out = Path(os.environ[CALLS_ENV]) / f"{os.getpid()}.jsonl"
        with out.open("a") as f:
            f.write(json.dumps({"test": test_file, "calls": sorted(calls)}) + "\n")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    with recording(item.nodeid):
        yield


@pytest.hookimpl(hookwrapper=True)
def pytest_collection(session):
    with recording(None):
        yield
