# SPDX-License-Identifier: Apache-2.0
"""``apply.py rebase --onto TREE --out DIR``: the project's series moved
three-way onto another vLLM tree and written as a patch set for it.

The trees are small copies of the pristine cache (the files the series
touches, the package's ``__init__`` and version, the dist-info), edited the
way upstream would (``upstream_edits``), at a hunk picked from the patches
as they are when the tests run.
"""

from __future__ import annotations

import datetime
import re
import shutil
from pathlib import Path

import pytest

import apply
from _apply import git, parse_patch
from tests.tooling.conftest import (
    BASE,
    PROJECT_DIR,
    copy_small,
    flat_project,
    run_tool,
    series_dir,
    tree_digest,
)
from tests.tooling.upstream_edits import (
    UPSTREAM_EDIT,
    UPSTREAM_LINE,
    change_removed_line,
    context_after_an_earlier_patch,
    copy_files,
    insert_line,
    movable_hunk,
    move_context,
    series,
    series_files,
)

OLD_DATE = "Last-Update: 2000-01-01"


@pytest.fixture
def project(tmp_path: Path) -> Path:
    """A copy of this project's series for the vLLM the tests run on, as a
    patch set of its own, whose patches were last updated long ago, so a
    refreshed one shows it."""
    root = flat_project(tmp_path / "k3-sppp")
    for patch in series(root / "patches"):
        text = re.sub(r"^Last-Update: .*$", OLD_DATE, patch.read_text(), flags=re.M)
        patch.write_text(text)
    return root


@pytest.fixture
def tree(pristine_cache: Path, tmp_path: Path) -> Path:
    """The pristine files that the series reads, in a tree of their own."""
    root = copy_small(pristine_cache, tmp_path / "vllm-tree")
    copy_files(pristine_cache, root, series_files(series_dir(PROJECT_DIR)))
    return root


def rebase(project: Path, tree: Path, out: Path, pristine: Path):
    return run_tool(
        project,
        "rebase",
        "--target",
        str(pristine),
        "--onto",
        str(tree),
        "--out",
        str(out),
    )


def test_rebase_onto_the_pinned_sources_changes_no_byte_of_any_patch(
    project, tree, pristine_cache, tmp_path
):
    out = tmp_path / "rebased"
    proc = rebase(project, tree, out, pristine_cache)
    assert proc.returncode == 0, proc.stderr
    patches = series(project / "patches")
    assert f"0 of {len(patches)} patch(es) refreshed" in proc.stdout
    for patch in patches:
        assert (out / "patches" / patch.name).read_bytes() == patch.read_bytes()
    assert tree_digest(out / "vllm_overlay") == tree_digest(project / "vllm_overlay")
    for name in ("series", "pull-requests.ini"):
        assert (out / "patches" / name).read_bytes() == (
            project / "patches" / name
        ).read_bytes()


def test_rebase_onto_moved_context_refreshes_that_patch_alone(
    project, tree, pristine_cache, tmp_path
):
    spot = movable_hunk(project / "patches")
    move_context(tree, spot)
    out = tmp_path / "rebased"
    proc = rebase(project, tree, out, pristine_cache)
    assert proc.returncode == 0, proc.stderr
    for patch in series(project / "patches"):
        new = (out / "patches" / patch.name).read_text()
        if patch != spot.patch:
            assert new == patch.read_text(), patch.name
            continue
        today = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")  # noqa: UP017
        old_head = patch.read_text().split("\n---\n")[0].split("\n")
        new_head = new.split("\n---\n")[0].split("\n")
        assert [ln for ln in new_head if not ln.startswith("Last-Update:")] == [
            ln for ln in old_head if not ln.startswith("Last-Update:")
        ]
        assert f"Last-Update: {today}" in new_head
        assert OLD_DATE in old_head
        assert (
            new.split("\ndiff --git ")[1:]
            != patch.read_text().split("\ndiff --git ")[1:]
        )


def test_the_rebased_set_applies_and_reverts_on_its_tree(
    project, tree, pristine_cache, tmp_path
):
    spot = movable_hunk(project / "patches")
    move_context(tree, spot)
    out = tmp_path / "rebased"
    assert rebase(project, tree, out, pristine_cache).returncode == 0
    before = tree_digest(tree)
    applied = run_tool(out, "apply", "--target", str(tree))
    assert applied.returncode == 0, applied.stderr
    text = (tree / spot.file).read_text()
    assert text.count(UPSTREAM_LINE) == 2
    assert (tree / spot.file).read_bytes() != (pristine_cache / spot.file).read_bytes()
    status = apply.status(tree, out)
    assert status["state"] == "applied" and status["exit_code"] == 0, status
    reverted = run_tool(out, "revert", "--target", str(tree))
    assert reverted.returncode == 0, reverted.stderr
    after = {k: v for k, v in tree_digest(tree).items() if "__pycache__" not in k}
    assert after == before


def test_rebase_onto_changed_lines_names_the_hunk_with_both_sides_and_writes_nothing(
    project, tree, pristine_cache, tmp_path
):
    spot = movable_hunk(project / "patches")
    edited = change_removed_line(tree, spot)
    out = tmp_path / "rebased"
    proc = rebase(project, tree, out, pristine_cache)
    assert proc.returncode == apply.EXIT_ERROR
    assert f"{spot.patch.name} does not apply to {tree}, even three-way" in proc.stderr
    assert f"CONFLICT {spot.file} hunk #{spot.number} ({spot.header})" in proc.stderr
    sides = proc.stderr.split(f"{tree} (ours):")[1]
    ours, rest = sides.split(f"vLLM {BASE} (base):")
    base, theirs = rest.split(f"{spot.patch.name} (theirs):")
    assert f"| {edited}" in ours
    assert f"| {edited.replace(UPSTREAM_EDIT, '')}" in base
    assert UPSTREAM_EDIT not in theirs
    assert not out.exists()


def test_rebase_never_writes_this_checkouts_patch_set(
    project, tree, pristine_cache, tmp_path
):
    before = tree_digest(project / "patches")
    spot = movable_hunk(project / "patches")
    change_removed_line(tree, spot)
    assert rebase(project, tree, tmp_path / "conflict", pristine_cache).returncode != 0
    (tree / spot.file).unlink()
    shutil.copy2(pristine_cache / spot.file, tree / spot.file)
    move_context(tree, spot)
    assert rebase(project, tree, tmp_path / "rebased", pristine_cache).returncode == 0
    assert tree_digest(project / "patches") == before


def test_rebase_refuses_an_output_directory_that_holds_files(
    project, tree, pristine_cache, tmp_path
):
    out = tmp_path / "rebased"
    (out / "patches").mkdir(parents=True)
    (out / "patches" / "series").write_text("mine\n")
    proc = rebase(project, tree, out, pristine_cache)
    assert proc.returncode == apply.EXIT_ERROR
    assert f"{out}: exists and is not an empty directory" in proc.stderr
    assert (out / "patches" / "series").read_text() == "mine\n"
    shutil.rmtree(out)


def test_the_rebased_set_writes_its_pull_requests_against_its_tree(
    project, tree, pristine_cache, tmp_path
):
    spot = movable_hunk(project / "patches")
    move_context(tree, spot)
    out = tmp_path / "rebased"
    assert rebase(project, tree, out, pristine_cache).returncode == 0
    pulls = tmp_path / "pr"
    proc = run_tool(out, "export", "--pulls", str(pulls), "--target", str(tree))
    assert proc.returncode == 0, proc.stderr
    diffs = sorted(pulls.glob("*.diff"))
    assert diffs and len(diffs) == len(sorted(pulls.glob("*.md")))
    git(["init", "-q", "--template="], tree)
    for diff in diffs:
        applied = git(["apply", str(diff)], tree, check=False)
        assert applied.returncode == 0, applied.stderr
    assert UPSTREAM_LINE in (tree / spot.file).read_text()


def test_rebase_writes_the_version_the_tree_says_or_the_one_named(
    project, tree, pristine_cache, tmp_path
):
    (tree / "vllm" / "_version.py").unlink()
    for info in tree.glob("vllm-*.dist-info"):
        shutil.rmtree(info)
    proc = rebase(project, tree, tmp_path / "unknown", pristine_cache)
    assert proc.returncode == apply.EXIT_ERROR
    assert "its vLLM version is unknown" in proc.stderr
    assert "--onto-version" in proc.stderr
    out = tmp_path / "named"
    proc = run_tool(
        project,
        "rebase",
        "--target",
        str(pristine_cache),
        "--onto",
        str(tree),
        "--out",
        str(out),
        "--onto-version",
        "0.35.0.dev1",
    )
    assert proc.returncode == 0, proc.stderr
    assert apply.base_version(out) == "0.35.0.dev1"


def test_rebase_names_every_hunk_of_a_file_the_tree_lacks(
    project, tree, pristine_cache, tmp_path
):
    """Each hunk of the file, with what it changed (the def or class around
    it in the pinned original); the rest of the series is still tried, and
    nothing is written."""
    spot = movable_hunk(project / "patches")
    (tree / spot.file).unlink()
    out = tmp_path / "rebased"
    proc = rebase(project, tree, out, pristine_cache)
    assert proc.returncode == apply.EXIT_ERROR
    report = proc.stderr.split(f"{spot.patch.name} does not apply to {tree}, even ")
    headers = parse_patch(spot.patch).hunks[spot.file]
    for number, header in enumerate(headers, 1):
        assert re.search(
            rf"\n  GONE {re.escape(spot.file)} hunk #{number} \({re.escape(header)}\) "
            rf"(in \w[\w.]*|at module level): not in {re.escape(str(tree))}\n",
            report[1],
        ), number
    owner = enclosing_def(pristine_cache / spot.file, spot.removed)
    where = f"in {owner}" if owner else "at module level"
    assert f"hunk #{spot.number} ({spot.header}) {where}: " in proc.stderr
    assert f"in all: {len(headers)} GONE hunk(s) of the vLLM {BASE} series" in (
        proc.stderr
    )
    assert not out.exists()


def test_rebase_names_the_hunks_whose_change_the_tree_already_has(
    project, tree, pristine_cache, tmp_path
):
    """Where upstream took a patch's change to a file, the three-way merge
    drops its hunks silently: rebase names each, and writes nothing."""
    spot = movable_hunk(project / "patches")
    applied = copy_small(pristine_cache, tmp_path / "applied")
    copy_files(pristine_cache, applied, series_files(project / "patches"))
    proc = run_tool(project, "apply", "--target", str(applied))
    assert proc.returncode == 0, proc.stderr
    (tree / spot.file).write_bytes((applied / spot.file).read_bytes())
    out = tmp_path / "rebased"
    proc = rebase(project, tree, out, pristine_cache)
    assert proc.returncode == apply.EXIT_ERROR, proc.stdout
    report = proc.stderr.split(f"{spot.patch.name} does not apply to {tree}, even ")
    headers = parse_patch(spot.patch).hunks[spot.file]
    for number, header in enumerate(headers, 1):
        assert (f"  OBSOLETE {spot.file} hunk #{number} ({header}) ") in report[1], (
            number
        )
    assert f"{tree} already has its change" in report[1]
    assert not out.exists()


def enclosing_def(path: Path, line: int) -> str:
    """The qualified name of the def or class around ``line`` (1-based)."""
    names, indent = [], None
    for text in reversed(path.read_text().split("\n")[: line - 1]):
        match = re.match(r"^(\s*)(?:async\s+)?(?:def|class)\s+(\w+)", text)
        width = len(text) - len(text.lstrip())
        if text.strip() and indent is None:
            indent = width
        if match and width < indent:
            names.append(match.group(2))
            indent = width
    return ".".join(reversed(names))


def test_rebase_refuses_a_tree_that_already_has_an_overlay_module(
    project, tree, pristine_cache, tmp_path
):
    rel = next(
        str(p.relative_to(project / "vllm_overlay"))
        for p in sorted((project / "vllm_overlay" / "vllm").rglob("*.py"))
    )
    (tree / rel).parent.mkdir(parents=True, exist_ok=True)
    (tree / rel).write_text("# upstream took it\n")
    proc = rebase(project, tree, tmp_path / "rebased", pristine_cache)
    assert proc.returncode == apply.EXIT_ERROR
    assert f"{tree} already has {rel}, which the overlay adds" in proc.stderr


def test_rebase_merges_a_file_an_earlier_patch_and_upstream_both_changed(
    project, tree, pristine_cache, tmp_path
):
    """Where ``git am -3`` on a plain clone lacks the blob a later patch's
    ``index`` line names (``test_git_am.py``), rebase has it: it stores every
    intermediate blob (and this machine's git, 2.32 or newer, writes each
    postimage as it merges an earlier patch three-way)."""
    index, rel, after = context_after_an_earlier_patch(
        project / "patches", pristine_cache
    )
    insert_line(tree, rel, after)
    out = tmp_path / "rebased"
    proc = rebase(project, tree, out, pristine_cache)
    assert proc.returncode == 0, proc.stderr
    name = series(project / "patches")[index].name
    assert f"refreshed {name}" in " ".join(proc.stdout.split())
    applied = run_tool(out, "apply", "--target", str(tree))
    assert applied.returncode == 0, applied.stderr
    assert UPSTREAM_LINE in (tree / rel).read_text()
