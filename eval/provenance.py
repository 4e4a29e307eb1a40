# SPDX-License-Identifier: Apache-2.0
"""What produced a result: this checkout, the patch-set state of the vLLM it
targets, the date. Saved next to every GSM8K and benchmark result."""

from __future__ import annotations

import datetime
import platform
import subprocess
import sys
from pathlib import Path

PROJECT_DIR = Path(__file__).resolve().parent.parent

# apply.py status exit codes (see its docstring).
STATUS = {
    0: "applied (this revision)",
    1: "error",
    3: "not applied",
    4: "drift",
    5: "interrupted",
    6: "applied (another revision)",
}


def patch_set_state(target: str | None = None) -> dict:
    """``apply.py status`` of ``target`` (default: this project's .venv)."""
    command = [sys.executable, str(PROJECT_DIR / "apply.py"), "status"]
    if target:
        command += ["--target", target]
    proc = subprocess.run(command, capture_output=True, text=True)
    return {
        "state": STATUS.get(proc.returncode, f"exit {proc.returncode}"),
        "report": (proc.stdout + proc.stderr).strip().splitlines(),
    }


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
    return {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "host": platform.node(),
        "k3_sppp": checkout(),
        "patch_set": patch_set_state(target),
    }
