# SPDX-License-Identifier: Apache-2.0
"""What a stage announces: upstream vLLM's version and build
(``stage_build``); with the series applied also the revision the installed
tree knows without its bytes depending on it (``k3_sppp_revision``, the
patch set's filler of that seam)."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

import vllm
from tests.sppp_testbed.pristine import installed_vllm_root
from vllm.v1.worker import k3_sppp_revision, pp_hand_off_agreement
from vllm.v1.worker.k3_sppp_revision import series_revision

REPO = Path(__file__).resolve().parents[2]


def test_installed_tree_announces_the_revision_make_status_prints():
    """The tree this interpreter imports (``.venv`` for 0.34.0,
    ``.venv-0.33.0`` for 0.33.0), as ``apply.py status`` reports it."""
    status = subprocess.run(
        [
            sys.executable,
            str(REPO / "apply.py"),
            "status",
            "--json",
            "--target",
            str(installed_vllm_root()),
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    report = json.loads(status.stdout)
    assert report["state"] == "applied", report
    assert series_revision() == report["revision"]


@pytest.mark.parametrize(
    "journal",
    [None, "not json", json.dumps(["a list"]), json.dumps({"state": "applying"})],
)
def test_a_tree_without_an_applied_journal_announces_unknown(
    tmp_path, monkeypatch, journal
):
    (tmp_path / "vllm").mkdir()
    if journal is not None:
        (tmp_path / ".k3_sppp").mkdir()
        (tmp_path / ".k3_sppp" / "journal.json").write_text(journal)
    monkeypatch.setattr(
        k3_sppp_revision, "JOURNAL", tmp_path / ".k3_sppp" / "journal.json"
    )
    assert series_revision() == "unknown"


def test_the_series_fills_the_seam_upstream_fills_with_vllms_build():
    """Upstream, ``stage_build`` names vLLM's version and commit; the series
    (imported by the patched gpu_worker) adds its revision and where to look."""
    importlib.import_module("vllm.v1.worker.gpu_worker")  # imports the filler

    upstream = k3_sppp_revision.vllm_build()
    assert upstream.startswith(f"vLLM {vllm.__version__}"), upstream
    assert "k3-sppp" not in upstream
    assert pp_hand_off_agreement.stage_build() == (
        f"{upstream}, k3-sppp revision {series_revision()} ({k3_sppp_revision.CHECK})"
    )
