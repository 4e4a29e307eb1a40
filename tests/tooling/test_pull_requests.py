# SPDX-License-Identifier: Apache-2.0
"""``make pr-diff`` (``apply.py export --pulls DIR``): one diff and one
description per upstream pull request, as ``patches/pull-requests.ini``
declares them, and the lint that keeps that declaration whole.

Everything is read from the patch set as it is when the tests run: the
declaration, the patch headers and the committed result files.
"""

from __future__ import annotations

import configparser
import hashlib
import re
from pathlib import Path

import pytest

from _apply import git
from tests.tooling.conftest import (
    PROJECT_DIR,
    composed_overlay,
    flat_project,
    run_tool,
    series_dir,
)
from tests.tooling.upstream_edits import copy_files, series, series_files

# The series of the vLLM the tests run on (a base's own, on another base).
SERIES = series_dir(PROJECT_DIR)
PULLS = SERIES / "pull-requests.ini"


def declared() -> configparser.ConfigParser:
    config = configparser.ConfigParser(interpolation=None)
    config.read_string(PULLS.read_text())
    return config


def upstream() -> list[str]:
    """The pull requests, in order; not the patch set's own part."""
    return [key for key in declared().sections() if key != "not-upstream"]


def values(section: configparser.SectionProxy, key: str) -> list[str]:
    return section.get(key, "").split()


def entries(section: configparser.SectionProxy, key: str) -> list[str]:
    """One entry a line (a FILE#Heading may hold spaces)."""
    return [ln.strip() for ln in section.get(key, "").splitlines() if ln.strip()]


@pytest.fixture(scope="module")
def pulls(pristine_cache: Path, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("pr")
    proc = run_tool(
        PROJECT_DIR, "export", "--pulls", str(out), "--target", str(pristine_cache)
    )
    assert proc.returncode == 0, proc.stderr
    return out


@pytest.fixture
def project(tmp_path: Path) -> Path:
    """A copy of this project's series for the vLLM the tests run on, as a
    patch set of its own, free to edit."""
    return flat_project(tmp_path / "k3-sppp")


def test_pr_diffs_apply_in_order_and_add_up_to_the_series(
    pulls, pristine_cache, tmp_path
):
    """``git apply`` of each diff after the ones before it, on the pinned
    sources, writes exactly what the series and the overlay write."""
    repo = tmp_path / "vllm"
    repo.mkdir()
    git(["init", "-q", "--template="], repo)
    copy_files(pristine_cache, repo, series_files(SERIES))
    stems = [f"{n:02d}-{key}" for n, key in enumerate(upstream(), 1)]
    assert sorted(p.stem for p in pulls.glob("*.diff")) == stems
    for stem in stems:
        proc = git(["apply", str(pulls / f"{stem}.diff")], repo, check=False)
        assert proc.returncode == 0, f"{stem}: {proc.stderr}"
    # The patch set's own part, which no pull request carries, on top.
    own = declared()["not-upstream"]
    for name in values(own, "patches"):
        proc = git(["apply", str(SERIES / name)], repo, check=False)
        assert proc.returncode == 0, f"{name}: {proc.stderr}"
    for rel in values(own, "overlay"):
        (repo / rel).write_bytes(composed_overlay(PROJECT_DIR)[rel].read_bytes())
    lines = (SERIES / "patched.sha256").read_text().splitlines()
    for line in (ln for ln in lines if ln[:1] != "#"):
        digest, rel = line.split("  ", 1)
        assert hashlib.sha256((repo / rel).read_bytes()).hexdigest() == digest, rel
    for rel, test in composed_overlay(PROJECT_DIR).items():
        if not rel.startswith("tests/"):
            continue
        assert (repo / rel).read_bytes() == test.read_bytes(), rel


def test_each_diff_holds_exactly_its_declared_patches_and_files(pulls):
    for number, key in enumerate(upstream(), 1):
        section = declared()[key]
        diff = (pulls / f"{number:02d}-{key}.diff").read_text()
        files = set(re.findall(r"^diff --git a/\S+ b/(\S+)$", diff, re.M))
        patched = {
            rel
            for patch in series(SERIES)
            if patch.name in values(section, "patches")
            for rel in re.findall(
                r"^diff --git a/\S+ b/(\S+)$", patch.read_text(), re.M
            )
        }
        assert files == patched | set(values(section, "overlay")), key


# What only this repository knows: its name, its journal, its make targets,
# its paths and its revision header.
REPOSITORY_WORDS = re.compile(
    r"k3.sppp|journal|\bmake (apply|status|test|lint|pr-diff|comm-report)\b"
    r"|results/|apply\.py|\brevision\b",
    re.I,
)


def test_no_word_of_this_repository_in_the_added_lines(pulls):
    """vLLM's reviewers see vLLM's code: what only the patch set needs (the
    series revision in the PP stage announcement) lives in its own patch and
    overlay file, declared `not-upstream`, behind ``stage_build``."""
    for diff in sorted(pulls.glob("*.diff")):
        added = [
            line
            for line in diff.read_text().splitlines()
            if line.startswith("+") and not line.startswith("+++")
        ]
        assert added, diff.name
        found = [line for line in added if REPOSITORY_WORDS.search(line)]
        assert not found, (diff.name, found[:5])
        # The header before the diff names no revision of the series either.
        head = diff.read_text().split("diff --git", 1)[0]
        assert not REPOSITORY_WORDS.search(head), (diff.name, head)


def test_the_patch_set_keeps_its_revision_behind_the_seam():
    own = declared()["not-upstream"]
    assert values(own, "overlay") == ["vllm/v1/worker/k3_sppp_revision.py"]
    for name in values(own, "patches"):
        assert "Forwarded: not-needed" in (SERIES / name).read_text(), name


def test_description_is_vllms_template_from_the_patch_headers(pulls):
    for number, key in enumerate(upstream(), 1):
        section = declared()[key]
        text = (pulls / f"{number:02d}-{key}.md").read_text()
        assert text.startswith(f"# {section['title']}\n")
        heads = [ln for ln in text.splitlines() if ln.startswith("## ")]
        quoted = [f"## {e.split('#', 1)[1]}" for e in entries(section, "sections")]
        assert heads == ["## Purpose", *quoted, "## Test Plan", "## Test Result"]
        for name in values(section, "patches"):
            patch = (SERIES / name).read_text()
            description = re.search(
                r"^Description: (.*?)\n(?=\S)", patch, re.M | re.S
            ).group(1)
            assert " ".join(description.split()) in text, name
        for rel in values(section, "overlay"):
            if rel.startswith("tests/"):
                assert rel in text.split("## Test Plan")[1].split("## Test Result")[0]
        assert "Not run here: the model on GPUs across ranks." in text


def test_description_quotes_the_committed_figures_it_names(project, pristine_cache):
    """A figure changed in the result file changes the description: the
    table is quoted, not typed a second time."""
    figures = [
        f
        for key in declared().sections()
        for f in declared()[key].get("figures", "").splitlines()
        if f.strip()
    ]
    assert figures, "the declaration names no committed figure"
    name, heading = figures[0].strip().split("#", 1)
    result = project / name
    text = result.read_text()
    section = text.split(f"## {heading}\n", 1)[1]
    row = next(
        ln
        for ln in section.splitlines()
        if ln.startswith("| ") and "µs" not in ln and "---" not in ln
    )
    changed = row.replace("|", "| 12345.6 ", 1)
    result.write_text(text.replace(row, changed, 1))
    out = project / "build"
    proc = run_tool(
        project, "export", "--pulls", str(out), "--target", str(pristine_cache)
    )
    assert proc.returncode == 0, proc.stderr
    assert any(changed in md.read_text() for md in out.glob("*.md"))


def test_description_quotes_each_section_it_names_under_its_heading(
    project, pristine_cache
):
    """The section's text, commands included, stands under its own heading
    before the Test Plan; an edit of the result file shows there."""
    named = [
        (key, e)
        for key in declared().sections()
        for e in entries(declared()[key], "sections")
    ]
    assert named, "the declaration names no section"
    key, entry = named[0]
    name, heading = entry.split("#", 1)
    result = project / name
    text = result.read_text()
    body = text.split(f"## {heading}\n", 1)[1].split("\n## ", 1)[0]
    line = next(ln for ln in body.splitlines() if ln.startswith("    make "))
    changed = line + " --edited"
    result.write_text(text.replace(line, changed, 1))
    out = project / "build"
    proc = run_tool(
        project, "export", "--pulls", str(out), "--target", str(pristine_cache)
    )
    assert proc.returncode == 0, proc.stderr
    number = list(declared().sections()).index(key) + 1
    md = (out / f"{number:02d}-{key}.md").read_text()
    quoted = md.split(f"\n## {heading}\n", 1)[1].split("\n## Test Plan\n", 1)[0]
    assert changed in quoted.splitlines()


def edit_declaration(project: Path, old: str, new: str) -> None:
    path = project / "patches" / "pull-requests.ini"
    text = path.read_text()
    assert old in text
    path.write_text(text.replace(old, new, 1))


def lint(project: Path, pristine: Path) -> str:
    proc = run_tool(project, "lint", "--target", str(pristine))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    return proc.stderr


def test_lint_names_a_patch_no_pull_request_declares(project, pristine_cache):
    last = series(project / "patches")[-1]
    edit_declaration(project, f"    {last.name}\n", "")
    assert f"{last}: belongs to no pull request in" in lint(project, pristine_cache)


def test_lint_names_an_overlay_file_no_pull_request_declares(project, pristine_cache):
    rel = next(
        rel
        for key in declared().sections()
        for rel in values(declared()[key], "overlay")
    )
    edit_declaration(project, f"    {rel}\n", "")
    overlay = project / "vllm_overlay" / rel
    assert f"{overlay}: belongs to no pull request in" in lint(project, pristine_cache)


def test_lint_names_a_file_declared_in_two_pull_requests(project, pristine_cache):
    first, second = declared().sections()[:2]
    rel = values(declared()[first], "overlay")[0]
    path = project / "patches" / "pull-requests.ini"
    head, _, tail = path.read_text().partition(f"[{second}]\n")
    tail = tail.replace("overlay =\n", f"overlay =\n    {rel}\n", 1)
    path.write_text(f"{head}[{second}]\n{tail}")
    assert f"{rel} is declared in both [{first}] and [{second}]" in lint(
        project, pristine_cache
    )


def test_lint_names_pull_requests_out_of_series_order(project, pristine_cache):
    config = declared()
    first, second, *rest = config.sections()
    swapped = configparser.ConfigParser(interpolation=None)
    for key in (second, first, *rest):
        swapped[key] = dict(config[key])
    with open(project / "patches" / "pull-requests.ini", "w") as f:
        swapped.write(f)
    assert "patches/series applies them in another order" in lint(
        project, pristine_cache
    )
