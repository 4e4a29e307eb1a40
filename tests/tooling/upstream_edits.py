# SPDX-License-Identifier: Apache-2.0
"""Upstream-style edits of pristine vLLM files, aimed at the series' hunks.

The tests of ``git am -3`` and ``apply.py rebase`` need a newer vLLM that
moved a hunk's context, or changed the hunk's own lines. The hunk is picked
from the patches as they are when the tests run, never from their bytes
today: the first hunk of a file that only one patch touches (so its
preimage is the pristine file) which opens with two context lines and
removes at least one line.
"""

from __future__ import annotations

import re
import shutil
from dataclasses import dataclass
from pathlib import Path

from _apply import GIT_IDENTITY, git

UPSTREAM_LINE = "# upstream: a line added between two lines of a hunk's context"
UPSTREAM_EDIT = "  # upstream: this very line changed"


@dataclass
class Spot:
    patch: Path  # the patch file
    file: str  # the vLLM file the hunk changes
    number: int  # the hunk's number in that file, from 1
    header: str  # "@@ -a,b +c,d @@"
    first: int  # the hunk's first line in the pristine file (1-based)
    removed: int  # its first removed line in the pristine file (1-based)


def series(patch_dir: Path) -> list[Path]:
    return [patch_dir / n for n in (patch_dir / "series").read_text().split()]


def touched(patch: Path) -> list[str]:
    return re.findall(r"^diff --git a/\S+ b/(\S+)$", patch.read_text(), re.M)


def series_files(patch_dir: Path) -> list[str]:
    return sorted({rel for patch in series(patch_dir) for rel in touched(patch)})


def movable_hunk(patch_dir: Path) -> Spot:
    patches = series(patch_dir)
    owners = [rel for patch in patches for rel in touched(patch)]
    for patch in patches:
        current, number, hunk = None, 0, None
        for line in patch.read_text().split("\n") + ["diff --git end"]:
            if line.startswith(("diff --git ", "@@ ")) and hunk and current:
                body = hunk["body"]
                if (
                    owners.count(current) == 1
                    and body[:2] == [" ", " "]
                    and "-" in body
                    and not hunk["lines"][0].endswith("\\")
                ):
                    first = hunk["first"]
                    return Spot(
                        patch,
                        current,
                        number,
                        hunk["header"],
                        first,
                        first + body.index("-"),
                    )
                hunk = None
            if line.startswith("diff --git "):
                current, number = line.rsplit(" b/", 1)[-1], 0
            elif line.startswith("@@ "):
                number += 1
                start = int(re.match(r"@@ -(\d+)", line).group(1))
                header = line.split(" @@")[0] + " @@"
                hunk = {"first": start, "header": header, "body": [], "lines": []}
            elif hunk is not None and line[:1] in (" ", "-", "+"):
                hunk["body"].append(line[0])
                hunk["lines"].append(line[1:])
    raise AssertionError(f"no hunk in {patch_dir} that a context edit can move")


def replace_file(path: Path, lines: list[str]) -> None:
    """Write a new file rather than through a hard link into the cache."""
    path.unlink()
    path.write_text("\n".join(lines))


def move_context(tree: Path, spot: Spot) -> None:
    """Add a line between the hunk's first two context lines (one line away
    from what it changes: git merges that), and one at the top of the file,
    which moves every hunk."""
    path = tree / spot.file
    lines = path.read_text().split("\n")
    lines.insert(spot.first, UPSTREAM_LINE)
    replace_file(path, [UPSTREAM_LINE, *lines])


def change_removed_line(tree: Path, spot: Spot) -> str:
    """Change the first line the hunk removes; return the new line."""
    path = tree / spot.file
    lines = path.read_text().split("\n")
    lines[spot.removed - 1] += UPSTREAM_EDIT
    replace_file(path, lines)
    return lines[spot.removed - 1]


def copy_files(pristine: Path, dest: Path, rels: list[str]) -> None:
    for rel in rels:
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(pristine / rel, dest / rel)


def commit(repo: Path, message: str) -> None:
    git(["add", "-A"], repo)
    git([*GIT_IDENTITY, "commit", "-q", "-m", message], repo)


def context_after_an_earlier_patch(
    patch_dir: Path, pristine: Path
) -> tuple[int, str, int]:
    """A hunk of a later patch, in a file an earlier patch also changes,
    that opens with two context lines found once in the pristine file:
    (the patch's index in the series, the file, the line after which an
    upstream line lands between those two)."""
    patches = series(patch_dir)
    for index, patch in enumerate(patches):
        earlier = {rel for p in patches[:index] for rel in touched(p)}
        current = None
        lines = patch.read_text().split("\n")
        for at, line in enumerate(lines):
            if line.startswith("diff --git "):
                current = line.rsplit(" b/", 1)[-1]
            elif line.startswith("@@ ") and current in earlier:
                body = lines[at + 1 : at + 4]
                if not all(ln.startswith(" ") for ln in body):
                    continue
                text = (pristine / current).read_text().split("\n")
                pairs = [
                    i
                    for i in range(len(text) - 1)
                    if [text[i], text[i + 1]] == [body[0][1:], body[1][1:]]
                ]
                if len(pairs) == 1 and not body[0].endswith("\\"):
                    return index, current, pairs[0] + 1
    raise AssertionError(f"no later patch in {patch_dir} shares a file this way")


def insert_line(tree: Path, rel: str, after: int) -> None:
    path = tree / rel
    lines = path.read_text().split("\n")
    lines.insert(after, UPSTREAM_LINE)
    replace_file(path, lines)
