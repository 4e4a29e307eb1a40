# SPDX-License-Identifier: Apache-2.0
"""Every name the applied series uses is defined, on GPU paths too.

The CPU tests import every patched and overlay module but run few of their
GPU-only paths (the V2 runner's capture and replay, NCCL hand-offs); a
misspelt or unimported name there would first fail on the cluster. Pyflakes'
rules over the applied files find such names without running them.
"""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

import apply

# Undefined name, redefinition, unused import, unused local.
RULES = "F821,F811,F401,F841"


def pyflakes(cwd: Path, *paths: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ruff", "check", "--no-cache", "--isolated",
         "--select", RULES, "--output-format", "concise", *paths],
        cwd=cwd,
        capture_output=True,
        text=True,
    )  # fmt: skip


def test_applied_files_define_every_name_they_use():
    report = apply.status()  # make test applies the series to .venv first
    assert report["state"] == "applied", apply.status_text(report)
    paths = [entry["path"] for entry in report["files"]]
    assert "vllm/v1/worker/gpu/model_runner.py" in paths
    proc = pyflakes(Path(report["target"]), *paths)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_applied_files_import_on_the_cpu():
    for entry in apply.status()["files"]:
        module = entry["path"].removesuffix(".py").replace("/", ".")
        assert importlib.import_module(module).__file__.endswith(entry["path"])


def test_a_name_only_a_gpu_path_uses_is_caught(tmp_path):
    applied = Path(apply.status()["target"]) / "vllm/v1/worker/gpu/pp_utils.py"
    copy = tmp_path / "pp_utils.py"
    copy.write_text(
        applied.read_text()
        + "\n\ndef replay_on_gpu(buffers):\n"
        + "    return hand_over_intermediate_tensor(buffers, None, 1)\n"
    )
    proc = pyflakes(tmp_path, copy.name)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "F821 Undefined name `hand_over_intermediate_tensor`" in proc.stdout
