# SPDX-License-Identifier: Apache-2.0
"""The series on a git clone of vLLM with ``git am``, and ``git am -3`` on a
newer upstream commit: the patches' ``index`` lines name their vLLM's blobs,
so git can merge three-way where upstream moved a hunk's context, and stops
naming the file and hunk where upstream changed the hunk's own lines.

The series is the one kept for the vLLM the tests run on (``BASE``). The
repository is built here from the pristine files the series touches (a
commit "vBASE"), with upstream edits of our own on top; git runs isolated
from every user and system configuration, as apply.py runs it. No network.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from _apply import GIT_IDENTITY, git
from tests.tooling.conftest import BASE, PROJECT_DIR, series_dir
from tests.tooling.upstream_edits import (
    UPSTREAM_LINE,
    change_removed_line,
    commit,
    context_after_an_earlier_patch,
    copy_files,
    insert_line,
    movable_hunk,
    move_context,
    series,
    series_files,
)

PATCHES = series_dir(PROJECT_DIR)


@pytest.fixture
def clone(pristine_cache: Path, tmp_path: Path) -> Path:
    """A vLLM repository whose one commit, "vBASE", holds the pristine
    files the series touches."""
    repo = tmp_path / "vllm"
    repo.mkdir()
    git(["init", "-q", "--template="], repo)
    copy_files(pristine_cache, repo, series_files(PATCHES))
    commit(repo, f"v{BASE}")
    return repo


def am(repo: Path, *flags: str) -> tuple[int, str]:
    proc = git(
        [*GIT_IDENTITY, "am", *flags, *map(str, series(PATCHES))], repo, check=False
    )
    return proc.returncode, proc.stdout + proc.stderr


def reviewed() -> dict[str, str]:
    """patched.sha256: what the series writes into its vLLM."""
    lines = (PATCHES / "patched.sha256").read_text().splitlines()
    return dict(reversed(ln.split("  ", 1)) for ln in lines if ln[:1] != "#")


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_git_am_puts_the_series_on_the_release_commit(clone):
    code, output = am(clone)
    assert code == 0, output
    commits = git(["rev-list", "--count", "HEAD"], clone).stdout.strip()
    assert int(commits) == 1 + len(series(PATCHES))
    for rel in series_files(PATCHES):
        assert digest(clone / rel) == reviewed()[rel], rel


@pytest.fixture
def moved(clone: Path) -> tuple[Path, str]:
    """A later upstream commit that moves a hunk's context, not its lines."""
    spot = movable_hunk(PATCHES)
    move_context(clone, spot)
    commit(clone, "upstream: move the context of a hunk")
    return clone, spot.file


def test_git_am_refuses_a_hunk_whose_context_moved(moved):
    repo, rel = moved
    code, output = am(repo)
    assert code != 0
    assert f"error: patch failed: {rel}:" in output


def test_git_am_3_merges_a_hunk_whose_context_moved(moved):
    repo, rel = moved
    code, output = am(repo, "-3")
    assert code == 0, output
    text = (repo / rel).read_text()
    assert text.count(UPSTREAM_LINE) == 2  # upstream's lines are kept
    without = text.replace(UPSTREAM_LINE + "\n", "").encode()
    assert hashlib.sha256(without).hexdigest() == reviewed()[rel]
    for other in set(series_files(PATCHES)) - {rel}:
        assert digest(repo / other) == reviewed()[other], other


def test_git_am_3_stops_naming_the_file_and_hunk_whose_lines_upstream_changed(
    clone,
):
    """git names the file and the patch; the hunk is where it leaves its
    conflict markers: upstream's line on one side, the patch's on the other."""
    spot = movable_hunk(PATCHES)
    edited = change_removed_line(clone, spot)
    commit(clone, "upstream: change a line a hunk removes")
    code, output = am(clone, "-3")
    assert code != 0
    assert f"CONFLICT (content): Merge conflict in {spot.file}" in output
    number = series(PATCHES).index(spot.patch) + 1
    assert f"Patch failed at {number:04d} " in output
    merged = (clone / spot.file).read_text().split("\n")
    start = next(i for i, ln in enumerate(merged) if ln.startswith("<<<<<<< "))
    assert edited in merged[start + 1 : merged.index("=======", start)]


def test_git_am_3_merges_a_file_an_earlier_patch_changed_with_the_series_blobs(
    clone, pristine_cache, tmp_path
):
    """Where upstream and an earlier patch both changed a file, the later
    patch's ``index`` line names a blob only a tree with the earlier patches
    holds: ``git am -3`` stops there until it is fetched (from a repository
    where the series went onto its vLLM, as ``apply.py devtree`` makes one)."""
    index, rel, after = context_after_an_earlier_patch(PATCHES, pristine_cache)
    insert_line(clone, rel, after)
    commit(clone, "upstream: move the context of a later patch's hunk")
    code, output = am(clone, "-3")
    assert code != 0
    assert f"Patch failed at {index + 1:04d} " in output
    assert "could not build fake ancestor" in output  # the blob is missing
    git([*GIT_IDENTITY, "am", "--abort"], clone)
    donor = tmp_path / "donor"
    donor.mkdir()
    git(["init", "-q", "--template="], donor)
    copy_files(pristine_cache, donor, series_files(PATCHES))
    commit(donor, f"v{BASE}")
    assert am(donor)[0] == 0
    git(["fetch", "-q", str(donor)], clone)
    code, output = am(clone, "-3")
    assert code == 0, output
    text = (clone / rel).read_text()
    assert text.replace(UPSTREAM_LINE + "\n", "") == (donor / rel).read_text()
