# SPDX-License-Identifier: Apache-2.0
"""``apply.py lint``: DEP-3 headers say truthfully whether a patch went upstream."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

import apply

FIRST = "0001-Tooling-probe-mark-two-vLLM-modules.patch"
RELATED = "https://github.com/vllm-project/vllm/pull/54347"


def lint_error(proc: subprocess.CompletedProcess[str]) -> str:
    assert proc.returncode == apply.EXIT_ERROR, proc.stdout + proc.stderr
    return proc.stderr


def set_headers(patch_set: Path, **fields: str) -> None:
    """Replace the first patch's Forwarded line by ``fields`` (Name: value)."""
    path = patch_set / "patches" / FIRST
    lines = "".join(f"{k.replace('_', '-')}: {v}\n" for k, v in fields.items())
    path.write_text(path.read_text().replace("Forwarded: not-needed\n", lines))


@pytest.mark.parametrize(
    "fields",
    [
        {"Forwarded": "no", "X_Related_Upstream_PR": RELATED},
        {"Forwarded": "not-needed"},
        {
            "Forwarded": "https://lists.example.org/patch/1",
            "X_Related_Upstream_PR": RELATED,
        },
    ],
    ids=["no", "not-needed", "sent"],
)
def test_forwarded_says_no_not_needed_or_where_it_was_sent(
    patch_set, small_tool, fields
):
    set_headers(patch_set, **fields)
    proc = small_tool("lint")
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (
            {"Forwarded": f"{RELATED} (same intent, own code)"},
            f"Forwarded: '{RELATED} (same intent, own code)' is neither `no`, "
            "`not-needed` nor the one URL the patch was sent to",
        ),
        (
            {"Forwarded": "yes"},
            "Forwarded: 'yes' is neither `no`, `not-needed` nor the one URL",
        ),
        (
            {"Forwarded": RELATED, "X_Related_Upstream_PR": RELATED},
            f"Forwarded: {RELATED} is the related upstream work "
            "(X-Related-Upstream-PR), not this patch sent upstream",
        ),
        (
            {"Forwarded": "no", "X_Related_Upstream_PR": "vllm#54347"},
            "X-Related-Upstream-PR: 'vllm#54347' is not one URL",
        ),
        ({"Sent": "no"}, "DEP-3 header lacks Forwarded"),
    ],
    ids=["url-with-comment", "yes", "related-as-forward", "related-not-url", "none"],
)
def test_forwarded_that_claims_a_forward_it_cannot_show_fails_the_lint(
    patch_set, small_tool, fields, message
):
    set_headers(patch_set, **fields)
    assert f"{FIRST}: {message}" in lint_error(small_tool("lint"))
