# SPDX-License-Identifier: Apache-2.0
"""What produced a result: this checkout, the patch-set state of the vLLM it
targets, the date. Saved next to every GSM8K and benchmark result."""

from __future__ import annotations

import datetime
import platform
import subprocess
from pathlib import Path

import apply

PROJECT_DIR = Path(__file__).resolve().parent.parent


def checkout() -> dict:
    """This project's commit, and whether the work tree differs from it."""

    def git(*args: str) -> str:
        proc = subprocess.run(
            ["git", *args], cwd=PROJECT_DIR, capture_output=True, text=True
        )
        return proc.stdout.strip() if proc.returncode == 0 else ""

    return {
        "commit": git("rev-parse", "HEAD") or "unknown",
        "dirty": bool(git("status", "--porcelain")),
    }


def provenance(target: str | None = None) -> dict:
    """``patch_set`` is ``apply.py status --json`` of ``target`` (default:
    this project's .venv). ``series_revision`` is the revision applied to
    the vLLM this client runs, said as such: a client cannot see the
    server's nodes, whose stages each log theirs at start-up."""
    status = apply.status(target)
    return {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "host": platform.node(),
        "k3_sppp": checkout(),
        "series_revision": {
            "client": status["revision"],
            "of": "the vLLM this client runs (patch_set.target)",
            "server": "not visible to the client; each PP stage logs its own",
        },
        "patch_set": status,
    }
