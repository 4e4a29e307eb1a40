# SPDX-License-Identifier: Apache-2.0
"""The bench client's preloaded process (tests/serving/preloaded_client.py):
a sweep whose client cannot start fails at once and names the log, instead
of waiting out its deadline."""

from __future__ import annotations

import os
import subprocess
import time

from tests.serving import preloaded_client


def test_a_client_that_cannot_start_fails_at_once_naming_its_log(tmp_path):
    broken = {**os.environ, "PYTHONHOME": str(tmp_path / "no-python-here")}
    with preloaded_client.command(tmp_path, broken, wait_s=120) as vllm:
        started = time.monotonic()
        run = subprocess.run(
            [vllm, "bench", "serve", "--help"], capture_output=True, text=True
        )
        waited = time.monotonic() - started
    assert run.returncode == 1
    assert f"see {tmp_path / 'preloaded-client.log'}" in run.stderr
    assert waited < 30, waited
    assert (tmp_path / "preloaded-client.exited").read_text().strip() != "0"
