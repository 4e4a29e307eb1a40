# SPDX-License-Identifier: Apache-2.0
"""What a stage announces: the revision the installed tree knows without its
bytes depending on it, and a tolerant reading of other announcements."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import vllm
from tests.sppp_testbed.pristine import installed_vllm_root
from vllm.v1.worker import pp_stage_announcement
from vllm.v1.worker.pp_stage_announcement import (
    DEFAULT_TIMEOUT_S,
    TIMEOUT_ENV,
    announcement_timeout,
    series_revision,
)

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
    monkeypatch.setattr(vllm, "__file__", str(tmp_path / "vllm" / "__init__.py"))
    assert series_revision() == "unknown"


def test_the_bound_is_settable_and_defaults_to_two_minutes(monkeypatch):
    monkeypatch.delenv(TIMEOUT_ENV, raising=False)
    assert announcement_timeout() == DEFAULT_TIMEOUT_S == 120.0
    monkeypatch.setenv(TIMEOUT_ENV, "7.5")
    assert announcement_timeout() == 7.5
    monkeypatch.setenv(TIMEOUT_ENV, "soon")
    with pytest.raises(ValueError, match=TIMEOUT_ENV):
        announcement_timeout()


@pytest.mark.parametrize("raw", [b"\xff\x00", b"[1, 2]", b"3"])
def test_an_announcement_that_is_not_ours_reads_as_another_protocol(raw):
    parsed = pp_stage_announcement._parse(raw)
    assert str(parsed["protocol"]).startswith("unreadable"), parsed


def test_an_unreadable_announcement_is_shown_by_its_first_40_bytes():
    raw = b"\xff" + bytes(range(60))
    assert pp_stage_announcement._parse(raw) == {"protocol": f"unreadable {raw[:40]!r}"}
