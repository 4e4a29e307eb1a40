# SPDX-License-Identifier: Apache-2.0
"""The base version a patch set carries in ``patches/base.version``."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import apply
from tests.tooling.conftest import PROJECT_DIR, tree_digest

# -- the base version a patch set carries -------------------------------------


def set_base(patch_set: Path, text: str) -> Path:
    path = patch_set / "patches" / "base.version"
    path.write_text(text)
    return path


def test_a_patch_set_for_another_vllm_is_refused_naming_its_base_file(
    small_tool, small_target, patch_set
):
    path = set_base(patch_set, "# ported\n0.34.0\n")
    assert apply.base_version(patch_set) == "0.34.0"
    before = tree_digest(small_target)
    proc = small_tool("apply")
    assert proc.returncode == apply.EXIT_ERROR
    assert f"vLLM 0.33.0 found, the patch set is pinned to 0.34.0 ({path})" in (
        proc.stderr
    )
    assert tree_digest(small_target) == before
    proc = small_tool("manifest")
    assert proc.returncode == apply.EXIT_ERROR
    assert f"generated from vLLM 0.34.0 ({path}), found 0.33.0" in proc.stderr


@pytest.mark.parametrize(
    "text, message",
    [
        (None, "base.version: missing"),
        ("", "base.version: not one version line ([])"),
        ("0.33.0\n0.34.0\n", "base.version: not one version line"),
        ("vllm==0.33.0\n", "base.version: not one version line (['vllm==0.33.0'])"),
    ],
    ids=["missing", "empty", "two-versions", "not-a-version"],
)
def test_a_missing_or_malformed_base_version_is_refused(
    small_tool, small_target, patch_set, text, message
):
    if text is None:
        (patch_set / "patches" / "base.version").unlink()
    else:
        set_base(patch_set, text)
    before = tree_digest(small_target)
    for command in ("apply", "lint"):
        proc = small_tool(command)
        assert proc.returncode == apply.EXIT_ERROR, proc.stdout
        assert "the patch set is inconsistent" in proc.stderr
        assert message in proc.stderr
    assert tree_digest(small_target) == before
    with pytest.raises(apply.ApplyError, match=re.escape(message)):
        apply.base_version(patch_set)


def test_lint_wants_the_setup_cfg_pin_and_the_base_version_to_agree(
    small_tool, patch_set
):
    (patch_set / "setup.cfg").write_text("[k3_sppp]\nvllm = 0.34.0\n")
    proc = small_tool("lint")
    assert proc.returncode == apply.EXIT_ERROR
    assert (
        f"{patch_set / 'setup.cfg'}: pins vllm = 0.34.0, but "
        f"{patch_set / 'patches' / 'base.version'} says 0.33.0"
    ) in proc.stderr
    set_base(patch_set, "0.34.0\n")
    assert small_tool("lint").returncode == apply.EXIT_OK


def test_the_project_states_its_base_as_setup_cfg_pins_it():
    pinned = re.search(
        r"^vllm = (\S+)$", (PROJECT_DIR / "setup.cfg").read_text(), re.M
    ).group(1)
    assert apply.base_version() == pinned
