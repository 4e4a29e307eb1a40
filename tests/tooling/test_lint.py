# SPDX-License-Identifier: Apache-2.0
"""``apply.py lint``: every prefix of a series applies and compiles, and DEP-3
headers say truthfully whether a patch went upstream."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

import apply
from tests.tooling.conftest import BASE, DATA, PROJECT_DIR, run_tool, series_dir

FIRST = "0001-Tooling-probe-mark-two-vLLM-modules.patch"
SECOND = "0002-Tooling-probe-change-the-version-probe-again.patch"
THIRD = "0003-Tooling-probe-change-the-version-probe-a-third-time.patch"
RELATED = "https://github.com/vllm-project/vllm/pull/54347"


def write_series(patch_set: Path, *names: str) -> None:
    (patch_set / "patches/series").write_text("".join(f"{n}\n" for n in names))


def add_probe_patch(patch_set: Path, name: str, old: str, new: str) -> None:
    """A patch shaped like the second one that turns the version probe's
    value ``old`` into ``new``: it applies only where the probe is ``old``."""
    text = (DATA / "patchset/patches" / SECOND).read_text()
    text = text.replace('-K3_SPPP_PROBE = "first"', f"-K3_SPPP_PROBE = {old}")
    text = text.replace('+K3_SPPP_PROBE = "second"', f"+K3_SPPP_PROBE = {new}")
    (patch_set / "patches" / name).write_text(text)


def lint_error(proc: subprocess.CompletedProcess[str]) -> str:
    assert proc.returncode == apply.EXIT_ERROR, proc.stdout + proc.stderr
    return proc.stderr


def test_a_patch_that_needs_a_later_one_fails_the_lint(patch_set, small_tool):
    """The second patch of 0001, 0003, 0002 rewrites what 0002 writes."""
    add_probe_patch(patch_set, THIRD, '"second"', '"third"')
    write_series(patch_set, FIRST, SECOND, THIRD)
    assert small_tool("manifest").returncode == 0
    assert small_tool("lint").returncode == 0
    write_series(patch_set, FIRST, THIRD, SECOND)
    assert (
        f"patches/series: the first 2 patch(es), up to {THIRD}, do not apply to "
        f"vLLM {BASE}: vllm/version.py hunk #1 (@@ -12,7 +12,7 @@) does not apply"
    ) in lint_error(small_tool("lint"))


def test_a_prefix_that_only_a_later_patch_makes_compile_fails_the_lint(
    patch_set, small_tool
):
    """The whole series applies and compiles, so ``apply`` takes it; stopping
    after its second patch leaves a vLLM that does not import."""
    add_probe_patch(patch_set, SECOND, '"first"', '"second" +')
    add_probe_patch(patch_set, THIRD, '"second" +', '"second"')
    write_series(patch_set, FIRST, SECOND, THIRD)
    assert small_tool("manifest").returncode == 0
    assert small_tool("apply").returncode == 0
    assert small_tool("revert").returncode == 0
    assert (
        f"the first 2 patch(es), up to {SECOND}, do not compile: "
        "vllm/version.py:15: the patched file does not compile"
    ) in lint_error(small_tool("lint"))


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


def project_series() -> list[str]:
    return (series_dir(PROJECT_DIR) / "series").read_text().split()


@pytest.mark.parametrize("name", project_series())
def test_each_project_patch_applies_alone_and_the_rest_without_it(
    name, pristine_cache, tmp_path
):
    """Every patch of the project's series (for the vLLM the tests run on)
    applies (and compiles) on the pinned sources by itself, and the series
    without it still does (its overlay as composed for that vLLM)."""
    for kept in ([name], [n for n in project_series() if n != name]):
        patch_set = tmp_path / f"{len(kept)}-patches"
        shutil.copytree(series_dir(PROJECT_DIR), patch_set / "patches")
        # which pull request takes a dropped patch is another lint's concern
        (patch_set / "patches" / "pull-requests.ini").unlink()
        write_series(patch_set, *kept)
        for unused in set(project_series()) - set(kept):
            (patch_set / "patches" / unused).unlink()
        for command in ("manifest", "lint"):
            proc = run_tool(patch_set, command, "--target", str(pristine_cache))
            assert proc.returncode == 0, f"{kept}: {proc.stderr}"
