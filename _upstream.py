"""Hand the k3-sppp series upstream, and move it to another vLLM.

Two jobs a vLLM contributor does with a patch set, on top of ``_apply.py``
(whose git isolation, staging and patch parsing they reuse):

- ``export --pulls DIR`` (``make pr-diff``): one diff per upstream pull
  request, in the order they are opened, each with its description in vLLM's
  template (Purpose, Test Plan, Test Result).  Which patches and overlay files
  make which pull request is declared once, in ``patches/pull-requests.ini``;
  ``lint`` checks that declaration and that each diff applies with plain
  ``git apply`` on the pinned sources after the ones before it.
- ``rebase --onto TREE --out DIR``: the series applied three-way, patch by
  patch, to another vLLM tree (``git apply --3way`` in a repository that
  holds the pinned originals' blobs, which the patches' ``index`` lines
  name), written out as a complete patch set for that tree; a conflict is
  reported like ``git am -3`` and writes nothing.

Standard library only, Python 3.9+, as ``_apply.py``.
"""

from __future__ import annotations

import argparse
import configparser
import datetime
import re
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from _apply import (
    DIFF_ARGS,
    EXIT_OK,
    FORMAT_PATCH_ARGS,
    MANIFEST,
    RELATED_HEADER,
    RESULTS,
    ApplyError,
    Patch,
    PatchSet,
    Target,
    apply_patch,
    commit_all,
    git,
    load_patch_set,
    pristine_repo,
    pristine_source,
    read_text,
    require_clean,
    resolve_target,
    say,
    select_series,
    sha256_file,
    write_atomic,
)

PULLS = "pull-requests.ini"
PULL_KEYS = ("title", "patches", "overlay", "sections", "figures", "to-measure")
# What only the patch set needs (a seam upstream fills with what vLLM knows):
# declared in this section, never in a pull request; its patches say
# `Forwarded: not-needed`.
NOT_UPSTREAM = "not-upstream"
NOT_RUN_HERE = (
    "Not run here: the model on GPUs across ranks. k3-sppp's tests run on "
    "the CPU with gloo: unit tests with fakes, and a tiny Kimi K3 built from "
    "vLLM's own classes on real TP x PP rank processes against a "
    "single-process reference. On one GPU, the same tiny model ran eagerly "
    "and the runners' hand-over ran under CUDA graphs of a stand-in stage; "
    "no DeepGEMM, NCCL or other compiled-kernel path of the model has run, "
    "and no accuracy or throughput of Kimi K3 was measured."
)


# --------------------------------------------------------------------------
# The pull requests: declared once
# --------------------------------------------------------------------------


@dataclass
class PullRequest:
    key: str  # the section name: build/pr/NN-<key>.diff
    title: str
    patches: list[Patch]
    overlay: list[str]  # relative to vllm_overlay/, vllm/ and tests/
    figures: list[str]  # FILE#Heading
    to_measure: list[str]
    number: int = 0
    # FILE#Heading: quoted whole, each as a section of the description.
    sections: list[str] = field(default_factory=list)

    @property
    def stem(self) -> str:
        return f"{self.number:02d}-{self.key}"


def lines_of(section: configparser.SectionProxy, key: str) -> list[str]:
    return [v.strip() for v in section.get(key, "").splitlines() if v.strip()]


def read_pulls(patch_set: PatchSet) -> tuple[list[PullRequest], list[str]]:
    """The declared pull requests, and what is wrong with the declaration.

    Every patch of the series and every overlay file belongs to exactly one
    pull request, and the pull requests take the patches in series order
    (each diff is made after the ones before it).
    """
    path = patch_set.patch_dir / PULLS
    if not path.is_file():
        raise ApplyError(
            f"{path}: missing; it declares which patches and overlay files "
            "make which upstream pull request"
        )
    config = configparser.ConfigParser(interpolation=None)
    try:
        config.read_string(read_text(path), str(path))
    except configparser.Error as e:
        raise ApplyError(f"{path}: not INI: {e}") from e
    problems: list[str] = []
    by_name = {p.name: p for p in patch_set.patches}
    owner: dict[str, str] = {}
    pulls = []
    for key in config.sections():
        section = config[key]
        allowed = ("patches", "overlay") if key == NOT_UPSTREAM else PULL_KEYS
        for unknown in sorted(set(section) - set(allowed)):
            problems.append(f"{path}: [{key}] has unknown key {unknown!r}")
        if not section.get("title", "").strip() and key != NOT_UPSTREAM:
            problems.append(f"{path}: [{key}] has no title")
        names = lines_of(section, "patches")
        overlay = lines_of(section, "overlay")
        for name in names + overlay:
            if name in owner:
                problems.append(
                    f"{path}: {name} is declared in both [{owner[name]}] and [{key}]"
                )
            owner.setdefault(name, key)
        for name in names:
            if name not in by_name:
                problems.append(
                    f"{path}: [{key}] names {name}, which patches/series does not list"
                )
        for rel in overlay:
            if rel not in patch_set.overlay_export:
                problems.append(
                    f"{path}: [{key}] names {rel}, which is not under vllm_overlay/ "
                    "(nor the base's own)"
                )
        if key == NOT_UPSTREAM:
            for name in names:
                forwarded = (
                    by_name[name].headers.get("Forwarded") if name in by_name else ""
                )
                if forwarded != "not-needed":
                    problems.append(
                        f"{path}: [{key}] names {name}, whose Forwarded is "
                        f"{forwarded!r}, not 'not-needed'"
                    )
            continue
        pulls.append(
            PullRequest(
                key,
                section.get("title", "").strip(),
                [by_name[n] for n in names if n in by_name],
                overlay,
                lines_of(section, "figures"),
                lines_of(section, "to-measure"),
                len(pulls) + 1,
                lines_of(section, "sections"),
            )
        )
    for patch in patch_set.patches:
        if patch.name not in owner:
            problems.append(f"{patch.path}: belongs to no pull request in {path}")
    for rel in patch_set.overlay_export:
        if rel not in owner:
            problems.append(
                f"{patch_set.overlay_source(rel)}: belongs to no pull request in {path}"
            )
    declared = [p.name for pr in pulls for p in pr.patches]
    declared += (
        lines_of(config[NOT_UPSTREAM], "patches") if NOT_UPSTREAM in config else []
    )
    in_series = [p.name for p in patch_set.patches if p.name in declared]
    if declared != in_series:
        problems.append(
            f"{path}: takes the patches in the order {', '.join(declared)}; "
            "patches/series applies them in another order; declare them in "
            "series order, each pull request after the ones it needs"
        )
    for pr in pulls:
        for figure in pr.sections + pr.figures:
            try:
                figure_section(patch_set.root, figure)
            except ApplyError as e:
                problems.append(f"{path}: [{pr.key}] {e}")
    return pulls, problems


def figure_section(root: Path, figure: str) -> tuple[str, str, str]:
    """A committed result's title, the section ``FILE#Heading`` names, and
    the command that measured it (its ``Command:`` line), verbatim."""
    name, _, heading = figure.partition("#")
    path = root / name
    if not path.is_file() or not heading:
        raise ApplyError(f"figures: {figure!r} is not FILE#Heading of a file here")
    lines = read_text(path).splitlines()
    title = next((ln.lstrip("# ") for ln in lines if ln.startswith("# ")), name)
    command = next((ln for ln in lines if ln.startswith("Command:")), "")
    try:
        start = lines.index(f"## {heading}")
    except ValueError:
        raise ApplyError(f"figures: {name} has no section '## {heading}'") from None
    end = next(
        (i for i in range(start + 1, len(lines)) if lines[i].startswith("#")),
        len(lines),
    )
    section = lines[start + 1 : end]
    body = "\n".join(ln for ln in section if not ln.startswith("Command:"))
    return title, body.strip(), command


def staged_diff(repo: Path) -> str:
    git(["add", "-A"], repo)
    return git(list(DIFF_ARGS), repo).stdout


def pull_diffs(
    patch_set: PatchSet, target: Target, pulls: list[PullRequest]
) -> list[str]:
    """Each pull request's diff against the pinned sources with the ones
    before it applied: its patches in series order, then its overlay files."""
    diffs = []
    with tempfile.TemporaryDirectory(prefix="k3-sppp-pulls-") as tmp:
        repo = pristine_repo(
            patch_set, target, Path(tmp), f"vLLM {patch_set.base_version()}"
        )
        for pr in pulls:
            for patch in pr.patches:
                if failures := apply_patch(repo, patch):
                    raise ApplyError(
                        f"{patch.path} does not apply: " + "; ".join(failures)
                    )
            for rel in pr.overlay:
                dst = repo / rel
                dst.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(patch_set.overlay_source(rel), dst)
            diffs.append(preamble(patch_set, pr, pulls) + staged_diff(repo))
            commit_all(repo, pr.title)
    return diffs


def preamble(patch_set: PatchSet, pr: PullRequest, pulls: list[PullRequest]) -> str:
    before = [p.stem + ".diff" for p in pulls[: pr.number - 1]]
    lines = [
        f"{pr.title}",
        f"Pull request {pr.number} of {len(pulls)}, against vLLM "
        f"{patch_set.base_version()}.",
        *[f"{p.name}: {p.headers['Subject']}" for p in pr.patches],
        "Apply from a vLLM source root with `git apply`"
        + (f", after {', '.join(before)}." if before else "."),
    ]
    return "".join(f"# {line}\n" for line in lines)


def added_lines(diff: str) -> tuple[int, int]:
    """Lines a diff adds outside ``tests/`` and inside it."""
    code = tests = 0
    in_tests = False
    for line in diff.splitlines():
        if line.startswith("diff --git "):
            in_tests = line.split()[-1].startswith("b/tests/")
        elif line.startswith("+") and not line.startswith("+++"):
            tests += in_tests
            code += not in_tests
    return code, tests


def describe(
    patch_set: PatchSet, pr: PullRequest, pulls: list[PullRequest], diff: str = ""
) -> str:
    """The pull request's description in vLLM's template, from the patch
    headers, the declaration and the committed figures it names."""
    out = [f"# {pr.title}", "", "## Purpose", ""]
    if diff:
        code, tests = added_lines(diff)
        out += [f"Size: {code} lines added outside tests, {tests} in tests.", ""]
    if pr.number > 1:
        needs = ", ".join(f"{p.number}. {p.title}" for p in pulls[: pr.number - 1])
        out += [f"On top of the pull requests before it: {needs}.", ""]
    for patch in pr.patches:
        out += [f"**{patch.headers['Subject']}.** {patch.headers['Description']}", ""]
    related = sorted(
        {p.headers[RELATED_HEADER] for p in pr.patches if RELATED_HEADER in p.headers}
    )
    out += [f"Related: {url}" for url in related] + ([""] if related else [])
    new = [rel for rel in pr.overlay if rel.startswith("vllm/")]
    tests = [rel for rel in pr.overlay if rel.startswith("tests/")]
    if new:
        out += ["New files: " + ", ".join(f"`{rel}`" for rel in new) + ".", ""]
    for quoted in pr.sections:
        title, body, command = figure_section(patch_set.root, quoted)
        name, _, heading = quoted.partition("#")
        out += [f"## {heading}", "", body, "", f"(k3-sppp, `{name}`: {title}.)", ""]
        out += [command.replace("Command: ", "Measured with: "), ""] if command else []
    out += ["## Test Plan", ""]
    if tests:
        out += ["```", "pytest -q " + " \\\n    ".join(tests), "```", ""]
    out += [
        "k3-sppp (the patch set this pull request comes from) runs these "
        "tests in its `make test`, with the series applied to vLLM "
        f"{patch_set.base_version()}. The tests that need real TP x PP rank "
        "processes (gloo on the CPU, a tiny Kimi K3) stay in its test bed, "
        "which this diff does not carry.",
        "",
        "## Test Result",
        "",
    ]
    if pr.figures:
        out += [
            "Measured by k3-sppp, quoted from its committed results, each "
            "with the command that measured it:",
            "",
        ]
    for figure in pr.figures:
        title, body, command = figure_section(patch_set.root, figure)
        name, _, heading = figure.partition("#")
        out += [f"**{heading}** ({title}; `{name}`):", "", body, ""]
        out += [command.replace("Command: ", "Measured with: "), ""] if command else []
    for entry in pr.to_measure:
        what, _, command = (part.strip() for part in entry.partition("|"))
        out += [
            f"Not in this description, since no result of it is committed: "
            f"{what}; `{command}` in k3-sppp measures it.",
            "",
        ]
    out += [NOT_RUN_HERE, ""]
    return "\n".join(out)


def write_pulls(patch_set: PatchSet, target: Target, out: Path) -> list[Path]:
    """``build/pr``: NN-key.diff and NN-key.md per pull request; earlier
    files of this form that no pull request writes now are removed."""
    pulls, problems = read_pulls(patch_set)
    if problems:
        raise ApplyError(
            "the pull requests are declared wrongly:\n  " + "\n  ".join(problems)
        )
    diffs = pull_diffs(patch_set, target, pulls)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for pr in pulls:
        diff = diffs[pr.number - 1]
        described = describe(patch_set, pr, pulls, diff)
        for suffix, text in ((".diff", diff), (".md", described)):
            path = out / (pr.stem + suffix)
            path.write_text(text, encoding="utf-8")
            written.append(path)
    for stale in out.iterdir():
        if re.fullmatch(r"\d\d-.+\.(diff|md)", stale.name) and stale not in written:
            stale.unlink()
    return written


def pulls_problem(patch_set: PatchSet, target: Target) -> str | None:
    """For ``lint``: the declaration's problems, or the first pull request
    whose diff ``git apply`` refuses on the pinned sources after the ones
    before it; None when the pull requests stand in order.  A patch set
    that declares none (the tests' own) goes upstream as one diff."""
    if not (patch_set.patch_dir / PULLS).is_file():
        return None
    pulls, problems = read_pulls(patch_set)
    if problems:
        return "\n  ".join(problems)
    diffs = pull_diffs(patch_set, target, pulls)
    with tempfile.TemporaryDirectory(prefix="k3-sppp-pulls-lint-") as tmp:
        repo = pristine_repo(patch_set, target, Path(tmp))
        for pr in pulls:
            diff = diffs[pr.number - 1]
            path = Path(tmp) / (pr.stem + ".diff")
            path.write_text(diff, encoding="utf-8")
            proc = git(["apply", "--whitespace=error", str(path)], repo, check=False)
            if proc.returncode != 0:
                return (
                    f"pull request {pr.stem} does not `git apply` on vLLM "
                    f"{patch_set.base_version()} after the ones before it:\n"
                    + proc.stderr.strip()
                )
    return None


def cmd_export_pulls(args: argparse.Namespace) -> int:
    target = resolve_target(args.target, args.patch_set)
    patch_set = select_series(args.patch_set, target)
    require_clean(patch_set)
    for path in write_pulls(patch_set, target, args.pulls):
        lines = path.read_text(encoding="utf-8").count("\n")
        say(f"wrote {path} ({lines} lines)")
    return EXIT_OK


# --------------------------------------------------------------------------
# Rebase: the series on another vLLM tree, three-way
# --------------------------------------------------------------------------


@dataclass
class Hunk:
    header: str
    lines: list[str]  # with their " ", "-" or "+" mark

    def run(self, mark: str) -> list[str]:
        """The first run of lines the hunk removes ("-") or adds ("+")."""
        marks = "".join(line[:1] for line in self.lines)
        start = marks.find(mark)
        if start < 0:
            return []
        end = start + len(marks[start:]) - len(marks[start:].lstrip(mark))
        return [line[1:] for line in self.lines[start:end]]


def hunks_of(patch: Patch) -> dict[str, list[Hunk]]:
    """Every hunk of a format-patch file, by the file it changes."""
    return fresh_hunks(read_text(patch.path))


def contains(lines: list[str], part: list[str]) -> bool:
    starts = range(len(lines) - len(part) + 1)
    return any(lines[i : i + len(part)] == part for i in starts)


@dataclass
class Conflict:
    file: str
    line: int  # first line of the conflict in the merged file
    ours: list[str]  # the tree's lines
    base: list[str]  # the pinned vLLM's
    theirs: list[str]  # the patch's

    def hunks(self, hunks: list[Hunk]) -> list[int]:
        """The numbers (from 1) of the patch's hunks whose change the
        conflict holds: the lines a hunk removes among the base's, or those
        it adds among the patch's."""
        return [
            number
            for number, hunk in enumerate(hunks, 1)
            if (hunk.run("-") and contains(self.base, hunk.run("-")))
            or (hunk.run("+") and contains(self.theirs, hunk.run("+")))
        ]


def conflicts_in(text: str, rel: str) -> list[Conflict]:
    """The diff3-style conflict regions git left in a merged file."""
    found: list[Conflict] = []
    part = None
    for number, line in enumerate(text.split("\n"), 1):
        if line.startswith("<<<<<<< "):
            found.append(Conflict(rel, number, [], [], []))
            part = found[-1].ours
        elif line.startswith("||||||| ") and part is not None:
            part = found[-1].base
        elif line == "=======" and part is not None:
            part = found[-1].theirs
        elif line.startswith(">>>>>>> ") and part is not None:
            part = None
        elif part is not None:
            part.append(line)
    return found


_DEF = re.compile(r"^(\s*)(?:async\s+)?(?:def|class)\s+(\w+)")


def enclosing(lines: list[str], index: int) -> str:
    """What line ``index`` (from 0) of a Python file belongs to: the
    qualified name of the def or class around it, or the module."""
    names: list[str] = []
    indent = None
    for i in range(min(index, len(lines) - 1), -1, -1):
        line = lines[i]
        if not line.strip():
            continue
        width = len(line) - len(line.lstrip())
        match = _DEF.match(line)
        if indent is None:
            indent = width + 1 if match else width
        if match and width < indent:
            names.append(match.group(2))
            indent = width
            if width == 0:
                break
    return "in " + ".".join(reversed(names)) if names else "at module level"


def hunk_owner(preimage: list[str], hunk: Hunk) -> str:
    """``hunk``'s place in the file it was made on: what its first changed
    line (or the line it inserts after) belongs to."""
    start = int(re.match(r"@@ -(\d+)", hunk.header).group(1))
    marks = "".join(line[:1] for line in hunk.lines)
    lead = len(marks) - len(marks.lstrip(" "))
    first_changed = start - 1 + lead  # index in the preimage
    if marks[lead : lead + 1] == "+":  # an insertion: the line before it
        first_changed -= 1
    return enclosing(preimage, max(first_changed, 0))


@dataclass
class Obstacle:
    """A hunk of the series that does not carry over to the new tree."""

    kind: str  # GONE, CONFLICT, OBSOLETE, NOT TRIED
    patch: Patch
    file: str
    numbers: list[int]  # its hunks, from 1; empty: the file as a whole
    why: str
    detail: list[str] = field(default_factory=list)


@dataclass
class Rebased:
    patches: dict[str, bytes] = field(default_factory=dict)  # name -> file
    changed: list[str] = field(default_factory=list)
    results: dict[str, str] = field(default_factory=dict)  # rel -> SHA-256
    obstacles: list[Obstacle] = field(default_factory=list)


def today() -> str:
    now = datetime.datetime.now(datetime.timezone.utc)  # noqa: UP017 -- 3.9
    return now.strftime("%Y-%m-%d")


def refreshed(patch: Patch, fresh: str) -> str | None:
    """``patch`` with the diff ``format-patch`` made of it on the new base,
    or None when that diff is byte for byte the one it has.  The header is
    kept; ``Last-Update`` becomes today."""
    original = read_text(patch.path)
    old_head, _, old_body = original.partition("\ndiff --git ")
    new_head, _, new_body = fresh.partition("\ndiff --git ")
    if old_body == new_body:
        return None
    message, _, _ = old_head.partition("\n---\n")
    message = re.sub(
        r"^Last-Update:.*$", f"Last-Update: {today()}", message, count=1, flags=re.M
    )
    stat = new_head.partition("\n---\n")[2]
    return f"{message}\n---\n{stat}\ndiff --git {new_body}"


def tree_sources(onto: Target, rels: list[str]) -> dict[str, Path | None]:
    """Each file's original in the tree (its backup where k3-sppp is
    applied there), None where the tree has none."""
    source = pristine_source(onto)
    return {rel: source(rel) for rel in rels}


def changed_lines(hunks: list[Hunk]) -> list[str]:
    return [line for hunk in hunks for line in hunk.lines if line[:1] in "+-"]


def fresh_hunks(text: str) -> dict[str, list[Hunk]]:
    """The hunks of a diff held in a string, by file."""
    hunks: dict[str, list[Hunk]] = {}
    current: list[Hunk] | None = None
    for line in text.split("\n"):
        if line.startswith("diff --git "):
            current = hunks.setdefault(line.rsplit(" b/", 1)[1], [])
        elif current is not None and line.startswith("@@ "):
            current.append(Hunk(line.split(" @@")[0] + " @@", []))
        elif current and line[:1] in (" ", "-", "+"):
            current[-1].lines.append(line)
    return hunks


def rebase_series(
    patch_set: PatchSet, base: Target, onto: Target, tree: dict[str, Path | None]
) -> Rebased:
    """Apply the series three-way to ``tree``'s files, patch by patch, in a
    repository that holds the pinned originals and every intermediate blob
    the patches' ``index`` lines name.

    Goes on past what does not carry over, to name all of it
    (``Rebased.obstacles``): a file the tree lacks (every hunk of every patch
    to it), a conflict (the file is then left as the tree has it, and later
    patches' hunks in it are not tried), and a hunk the three-way merge
    dropped because the tree already has its change."""
    result = Rebased()
    base_name = f"vLLM {patch_set.base_version()}"
    preimages: dict[tuple[str, str], list[str]] = {}
    with tempfile.TemporaryDirectory(prefix="k3-sppp-rebase-") as tmp:
        repo = pristine_repo(
            patch_set, base, Path(tmp), f"vLLM {patch_set.base_version()}"
        )
        # Store every blob an index line names. git 2.32+ `apply --3way`
        # merges first and writes each postimage itself; older ones apply
        # directly where they can and write none, as `git am -3` does.
        for patch in patch_set.patches:
            for rel in patch.files:
                if (repo / rel).is_file():
                    preimages[(patch.name, rel)] = read_text(repo / rel).split("\n")
            if failures := apply_patch(repo, patch):
                raise ApplyError(
                    f"{patch.path} does not apply to the pinned vLLM "
                    f"{patch_set.base_version()}: " + "; ".join(failures)
                )
            git(["add", "-A"], repo)
        for rel, src in tree.items():
            (repo / rel).unlink(missing_ok=True)
            if src is not None:
                shutil.copy2(src, repo / rel)
        commit_all(repo, f"vLLM at {onto.root}")
        blocked: dict[str, str] = {}  # file -> the patch it conflicted in
        for patch in patch_set.patches:
            hunks = hunks_of(patch)
            for rel in patch.files:
                every = list(range(1, len(hunks.get(rel, [])) + 1))
                if tree[rel] is None:
                    result.obstacles.append(
                        Obstacle("GONE", patch, rel, every, f"not in {onto.root}")
                    )
                elif rel in blocked:
                    result.obstacles.append(
                        Obstacle(
                            "NOT TRIED",
                            patch,
                            rel,
                            every,
                            f"the file conflicts in {blocked[rel]} before it",
                        )
                    )
            apply_three_way(patch, repo, hunks, tree, blocked, onto, result, base_name)
            commit_all(repo, patch.headers["Subject"])
            fresh = git([*FORMAT_PATCH_ARGS, "--stdout", "-1", "HEAD"], repo).stdout
            dropped_hunks(patch, hunks, fresh, blocked, tree, onto, result)
            text = refreshed(patch, fresh)
            if text is not None:
                result.changed.append(patch.name)
            result.patches[patch.name] = (
                patch.path.read_bytes() if text is None else text.encode()
            )
        result.results = {
            rel: sha256_file(repo / rel)
            for rel in patch_set.patched_files
            if (repo / rel).is_file()
        }
    for obstacle in result.obstacles:
        preimage = preimages.get((obstacle.patch.name, obstacle.file), [])
        hunks = hunks_of(obstacle.patch).get(obstacle.file, [])
        obstacle.detail[:0] = [
            f"hunk #{n} ({hunks[n - 1].header}) {hunk_owner(preimage, hunks[n - 1])}"
            for n in obstacle.numbers
        ]
    return result


def apply_three_way(
    patch: Patch,
    repo: Path,
    hunks: dict[str, list[Hunk]],
    tree: dict[str, Path | None],
    blocked: dict[str, str],
    onto: Target,
    result: Rebased,
    base_name: str,
) -> None:
    """``git apply --3way`` of ``patch`` on the files it can reach; a file
    that conflicts is named with both sides, put back as the tree has it,
    and blocked for the patches after this one."""
    while True:
        skip = [rel for rel in patch.files if tree[rel] is None or rel in blocked]
        if all(rel in skip for rel in patch.files):
            return
        proc = git(
            ["-c", "merge.conflictStyle=diff3", "apply", "--3way"]
            + [f"--exclude={rel}" for rel in skip]
            + [str(patch.path)],
            repo,
            check=False,
        )
        if proc.returncode == 0:
            return
        stages = git(["ls-files", "-u"], repo).stdout.splitlines()
        unmerged = sorted({line.split("\t", 1)[1] for line in stages})
        for rel in unmerged:
            for conflict in conflicts_in(read_text(repo / rel), rel):
                result.obstacles.append(
                    conflict_obstacle(patch, conflict, hunks, onto, base_name)
                )
            blocked[rel] = patch.name
        if not unmerged:  # no merge to show: what git said, per file named
            errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
            named = [
                rel
                for rel in patch.files
                if rel not in skip and any(rel in e for e in errors)
            ]
            for rel in named or [rel for rel in patch.files if rel not in skip]:
                result.obstacles.append(
                    Obstacle(
                        "CONFLICT",
                        patch,
                        rel,
                        [],
                        "git apply --3way refused it",
                        [f"  {ln}" for ln in errors if rel in ln or not named],
                    )
                )
                blocked[rel] = patch.name
        # Back to the tree's files, then the rest of this patch without them.
        git(["reset", "-q", "--hard", "HEAD"], repo)


def conflict_obstacle(
    patch: Patch,
    conflict: Conflict,
    hunks: dict[str, list[Hunk]],
    onto: Target,
    base_name: str,
) -> Obstacle:
    """A conflict region as ``git am -3`` shows it, with the tree's side
    (ours), the pinned vLLM's (base) and the patch's (theirs); where the
    tree has none of the lines, it removed the code the hunk changes."""
    numbers = conflict.hunks(hunks.get(conflict.file, []))
    removed = not any(line.strip() for line in conflict.ours)
    why = (
        f"obsolete: {onto.root} no longer has the lines it changes"
        if removed
        else f"at line {conflict.line} of the merged file"
    )
    detail = []
    for side, text in (
        (f"{onto.root} (ours)", conflict.ours),
        (f"{base_name} (base)", conflict.base),
        (f"{patch.name} (theirs)", conflict.theirs),
    ):
        detail.append(f"    {side}:")
        detail += [f"      | {ln}" for ln in text] or ["      (no lines)"]
    return Obstacle("CONFLICT", patch, conflict.file, numbers, why, detail)


def dropped_hunks(
    patch: Patch,
    hunks: dict[str, list[Hunk]],
    fresh: str,
    blocked: dict[str, str],
    tree: dict[str, Path | None],
    onto: Target,
    result: Rebased,
) -> None:
    """Hunks that merged cleanly into nothing: the tree already makes their
    change, so the refreshed patch would silently lose them."""
    new = fresh_hunks(fresh)
    for rel, old in hunks.items():
        if tree[rel] is None or rel in blocked:  # named already
            continue
        kept = changed_lines(new.get(rel, []))
        gone = [
            number
            for number, hunk in enumerate(old, 1)
            if not all(line in kept for line in changed_lines([hunk]))
        ]
        if gone:
            result.obstacles.append(
                Obstacle(
                    "OBSOLETE",
                    patch,
                    rel,
                    gone,
                    f"{onto.root} already has its change (the three-way merge "
                    "drops it)",
                )
            )


def obstacles_report(
    patch_set: PatchSet, obstacles: list[Obstacle], onto: Target
) -> str:
    """Every hunk that does not carry over, patch by patch, as ``git am -3``
    would stop at each in turn."""
    lines = []
    base = f"vLLM {patch_set.base_version()}"
    for patch in patch_set.patches:
        mine = [o for o in obstacles if o.patch is patch]
        if not mine:
            continue
        lines.append(f"{patch.name} does not apply to {onto.root}, even three-way:")
        for o in mine:
            hunks = [d for d in o.detail if d.startswith("hunk #")]
            rest = [d for d in o.detail if d not in hunks]
            for hunk in hunks or ["the file"]:
                lines.append(f"  {o.kind} {o.file} {hunk}: {o.why}")
            lines += rest
    counts = {}
    for o in obstacles:
        counts[o.kind] = counts.get(o.kind, 0) + max(len(o.numbers), 1)
    lines.append(
        "in all: "
        + ", ".join(f"{n} {kind}" for kind, n in counts.items())
        + f" hunk(s) of the {base} series ({patch_set.series_name})"
    )
    return "\n".join(lines)


REBASE_ADVICE = (
    "nothing was written; `git am -3` of the series in a git clone of "
    "that vLLM stops at the first of these: resolve it there (a hunk of a "
    "file that is gone moves where the code went, or is dropped with its "
    "reason in the patch header), `git am --continue`, and `git "
    "format-patch` the commits into the new patch set "
    "(docs/editing-and-upstreaming.md: Upstreaming)"
)


def rebase(
    patch_set: PatchSet,
    base: Target,
    onto: Target,
    out: Path,
    version: str | None = None,
) -> Rebased:
    """Write to ``out`` the patch set rebased onto ``onto``: refreshed
    patches, series, the pull-request declaration (and the result files
    whose sections and figures it quotes) and any other file of ``patches/``,
    ``base.version``, ``base.sha256`` and ``patched.sha256`` for that tree,
    and the overlay unchanged.  ``patch_set`` is only read."""
    require_clean(patch_set)
    version = version or onto.version()
    if version is None:
        raise ApplyError(
            f"{onto.root}: its vLLM version is unknown (no vllm/_version.py or "
            "dist-info METADATA); name it with --onto-version"
        )
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ApplyError(f"{out}: exists and is not an empty directory")
    tree = tree_sources(onto, patch_set.patched_files)
    in_tree = pristine_source(onto)
    taken = [rel for rel in patch_set.overlay if in_tree(rel) is not None]
    if taken:
        raise ApplyError(
            f"{onto.root} already has " + ", ".join(taken) + ", which the overlay "
            "adds; nothing was written (drop it from vllm_overlay/ if upstream "
            "took it)"
        )
    result = rebase_series(patch_set, base, onto, tree)
    if result.obstacles:
        raise ApplyError(
            obstacles_report(patch_set, result.obstacles, onto) + "\n" + REBASE_ADVICE
        )
    out.parent.mkdir(parents=True, exist_ok=True)
    stage = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        write_rebased(patch_set, stage, result, tree, version)
        problems = load_patch_set(stage).problems
        if problems:
            raise ApplyError(
                "the rebased patch set is inconsistent:\n  " + "\n  ".join(problems)
            )
        if out.exists():
            out.rmdir()
        stage.rename(out)
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    return result


def write_rebased(
    patch_set: PatchSet,
    dest: Path,
    result: Rebased,
    tree: dict[str, Path | None],
    version: str,
) -> None:
    patches = dest / "patches"
    patches.mkdir()
    for path in sorted(patch_set.patch_dir.iterdir()):
        generated = (MANIFEST, RESULTS, "base.version")
        if path.is_file() and path.suffix != ".patch" and path.name not in generated:
            shutil.copy2(path, patches / path.name)
    for name, data in result.patches.items():
        write_atomic(patches / name, data)
    write_atomic(patches / "base.version", f"{version}\n".encode())
    base_lines = [
        f"# SHA-256 of the vLLM {version} files the series patches, as found in",
        "# the tree `apply.py rebase` moved the series to; do not edit.",
    ] + [f"{sha256_file(src)}  {rel}" for rel, src in tree.items() if src is not None]
    write_atomic(patches / MANIFEST, ("\n".join(base_lines) + "\n").encode())
    results = dict(result.results)
    results.update(
        (rel, sha256_file(patch_set.overlay_source(rel))) for rel in patch_set.overlay
    )
    result_lines = [
        f"# SHA-256 of every file the patch set writes into vLLM {version}: the",
        "# series applied by `apply.py rebase`, and the overlay files; do not edit.",
    ] + [f"{results[rel]}  {rel}" for rel in sorted(results)]
    write_atomic(patches / RESULTS, ("\n".join(result_lines) + "\n").encode())
    for rel in patch_set.overlay_export:  # composed: the base's own files
        (dest / "vllm_overlay" / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(patch_set.overlay_source(rel), dest / "vllm_overlay" / rel)
    if (patch_set.patch_dir / PULLS).is_file():  # the results they quote
        pulls, _ = read_pulls(patch_set)
        quoted = {f.partition("#")[0] for pr in pulls for f in pr.sections + pr.figures}
        for name in quoted:
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(patch_set.root / name, dest / name)


def cmd_rebase(args: argparse.Namespace) -> int:
    base = resolve_target(args.target, args.patch_set)
    patch_set = select_series(args.patch_set, base)
    onto = resolve_target(args.onto, args.patch_set)
    out = args.out.resolve()
    result = rebase(patch_set, base, onto, out, args.onto_version)
    for patch in patch_set.patches:
        state = "refreshed" if patch.name in result.changed else "unchanged"
        say(f"  {state:<10}{patch.name}")
    say(
        f"wrote {out}: {len(result.changed)} of {len(patch_set.patches)} patch(es) "
        f"refreshed; `python3 apply.py --patch-set {out} apply --target "
        f"{onto.root}` applies it"
    )
    return EXIT_OK
