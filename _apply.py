"""Apply, revert and inspect the k3-sppp patch set on a vLLM tree.

What ``--help`` prints is ``HELP_EPILOG`` below, not this docstring:
``python3 -OO`` drops docstrings, and no behaviour may depend on one.
"""

from __future__ import annotations

import argparse
import base64
import configparser
import contextlib
import csv
import datetime
import errno
import fcntl
import functools
import hashlib
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

HELP_DESCRIPTION = "Apply, revert and inspect the k3-sppp patch set on a vLLM tree."
HELP_EPILOG = """\
A *target* is a directory that contains the ``vllm/`` package: a
``site-packages`` directory, a vLLM git checkout root, or a virtual
environment (its ``site-packages`` is used).  The default is this project's
``.venv``, or the project venv ``.venv-VERSION`` whose Python runs apply.py.

The patch set keeps one series per vLLM release: ``patches/`` for the
default one (its ``base.version``), ``bases/VERSION/patches/`` for each
other.  Every command takes the series of the target's vLLM version (an
applied target: the one its journal records; a checkout that states no
version: the one whose pinned originals its files match) and refuses a
version the patch set keeps no series for, naming it, the files that say it
and the versions kept (exit 4), before anything is written.  The overlay
``vllm_overlay/`` is shared; ``bases/VERSION/vllm_overlay/`` holds only the
files that VERSION needs otherwise, each in place of the shared one.
``lint`` checks every series on a pristine tree of its own vLLM.

Every write goes through one transaction, for ``apply`` and ``revert``
alike: everything is checked and staged first (for apply: the series applied
to copies, every result hashed and compiled by the target's Python), then a
journal in ``<target>/.k3_sppp/`` records the run before files are swapped in
with ``os.replace`` under a lock.  Each file is therefore either
byte-identical to vLLM's original or byte-identical to the patched result, and the
next ``apply`` or ``revert`` finishes a run that was stopped; ``status``
verifies which state a tree is in.

Exit codes:
    0    success (``status``: applied, this revision, no drift)
    1    error; no file of the target was changed
    2    usage error
    3    ``status``: not applied
    4    base files differ from the pin or another vLLM version is there
         (``apply``, ``check``, ``status``), patched files changed or
         deleted since apply or are not the reviewed result
         (``patches/patched.sha256``), or a backup ``revert`` needs is
         missing or corrupt
    5    ``status``: an interrupted apply or revert, what it left, or a
         lost journal with backups of vLLM files; ``apply``/``revert``:
         stopped part-way (the message names the command that finishes
         it), or finished but could not remove its stage directory or lock
         (the next run removes them)
    6    ``status``: applied from a different revision of the patch set
    7    ``apply``: finished an interrupted run (the target is vLLM again,
         files changed), then failed before applying
    130  interrupted (Ctrl-C); ``status`` says where it stopped

Other programs read ``status --json``: one JSON object whose schema
``status()`` documents (``schema_version`` 1).  Python code imports
``apply.py`` (which refuses Pythons older than 3.9, then re-exports this
module's ``__all__``) and uses only those names; each takes ``target`` and
``patch_set`` as ``--target`` and ``--patch-set`` do.  Each series names
the vLLM version it applies to in its ``base.version``; ``bases()`` lists
them.
"""

__all__ = [
    "DRIFT_SUFFIX",
    "EXIT_CTRL_C",
    "EXIT_DRIFT",
    "EXIT_ERROR",
    "EXIT_INTERRUPTED",
    "EXIT_NOT_APPLIED",
    "EXIT_OK",
    "EXIT_OTHER_REVISION",
    "EXIT_RECOVERED_ONLY",
    "STATE_DIR",
    "STATUS_SCHEMA_VERSION",
    "ApplyError",
    "base_version",
    "bases",
    "original_files",
    "pristine_sources",
    "record_hashes",
    "status",
    "status_text",
    "target_root",
    "venv",
]

PROJECT_DIR = Path(__file__).resolve().parent

EXIT_OK = 0
EXIT_ERROR = 1
EXIT_NOT_APPLIED = 3
EXIT_DRIFT = 4
EXIT_INTERRUPTED = 5
EXIT_OTHER_REVISION = 6
EXIT_RECOVERED_ONLY = 7
EXIT_CTRL_C = 130

STATE_DIR = ".k3_sppp"
# The state directory names files a revert overwrites, and root may run
# that revert: it is its owner's alone, whatever the umask.
PRIVATE_DIR = 0o700
PRIVATE_FILE = 0o600
JOURNAL = "journal.json"
JOURNAL_FORMAT = 1
JOURNAL_STATES = ("applying", "applied", "reverting")
TMP_SUFFIX = ".k3-sppp-tmp"
DRIFT_SUFFIX = ".k3-sppp-drift"
STATUS_LOCK_WAIT_S = 30.0
MANIFEST = "base.sha256"
# SHA-256 of every file the patch set writes, as reviewed: what apply must
# install whatever the machine's git does (see ``git_env``).
RESULTS = "patched.sha256"
BASE_VERSION = "base.version"
# bases/VERSION/patches: the series for a vLLM other than the default one;
# bases/VERSION/vllm_overlay: the overlay files that VERSION needs otherwise.
BASES = "bases"
STATUS_SCHEMA_VERSION = 1
REQUIRED_HEADERS = ("Description", "Forwarded", "Drop-When", "Last-Update")
# DEP-3: a Forwarded value other than these means "sent upstream", and then
# names where, ideally as one URL.
NOT_FORWARDED = ("no", "not-needed")
# Upstream work that is related to a patch but is not that patch sent there
# (DEP-3's Bug and Forwarded would each claim more): one URL.
RELATED_HEADER = "X-Related-Upstream-PR"
_URL = re.compile(r"^https?://\S+$")
GIT_IDENTITY = (
    "-c",
    "user.name=k3-sppp",
    "-c",
    "user.email=k3-sppp@localhost",
    "-c",
    "commit.gpgsign=false",
)
DEVTREE_BASE_TAG = "k3-sppp-base"
# The diff ``export`` writes: what ``git apply`` reads on any machine.
DIFF_ARGS = (
    "-c",
    "core.quotepath=off",
    "diff",
    "--cached",
    "--no-color",
    "--no-ext-diff",
    "--src-prefix=a/",
    "--dst-prefix=b/",
)
# What ``refresh`` runs, so that a patch regenerated from an unchanged base
# is byte for byte the file it came from.
FORMAT_PATCH_ARGS = ("format-patch", "-N", "--zero-commit", "--no-signature")
_HEX64 = re.compile(r"^[0-9a-f]{64}$")
_VERSION = re.compile(r"[0-9][0-9A-Za-z.+!_-]*")
# Linux ioctl for inode flags (lsattr); immutable and append-only files
# refuse os.replace and unlink even for root.
_FS_IOC_GETFLAGS = 0x80086601
_FS_NO_REPLACE_FL = 0x10 | 0x20


class ApplyError(Exception):
    """A failure reported to the user as one message.

    ``code`` says what was left: 1 (nothing changed), 4 (refused, drift),
    5 (stopped part-way, or a lost journal refused) or 7 (an interrupted run
    was finished, then this one failed).
    """

    def __init__(self, message: str, code: int = EXIT_ERROR) -> None:
        super().__init__(message)
        self.code = code


def tell(message: str, stream_name: str = "stdout") -> None:
    """Print ``message``; a failing stream loses it, never the run's outcome.

    What a run did is decided before it reports it, and its exit code says so:
    an I/O error (or a closed pipe) on standard output or error must not turn
    a finished revert into an error or an error into a traceback.  A stream
    that failed is pointed at /dev/null, so that the interpreter's own flush
    at exit cannot fail again.
    """
    stream = getattr(sys, stream_name)
    try:
        print(message, file=stream, flush=True)
    except (OSError, ValueError):
        with contextlib.suppress(OSError, ValueError, AttributeError):
            null = os.open(os.devnull, os.O_WRONLY)
            os.dup2(null, stream.fileno())
            os.close(null)


def say(message: str) -> None:
    tell(message)


def warn(message: str) -> None:
    tell(f"apply.py: warning: {message}", "stderr")


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def file_hash_or_none(path: Path) -> str | None:
    return sha256_file(path) if path.is_file() else None


def utc_now() -> str:
    # timezone.utc, not datetime.UTC: the tool runs on Python 3.9 and 3.10.
    now = datetime.datetime.now(datetime.timezone.utc)  # noqa: UP017
    return now.strftime("%Y-%m-%dT%H:%M:%SZ")


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, data: bytes, mode: int | None = None) -> None:
    """Write ``path`` through a temporary file and ``os.replace``.

    Only used inside the state directory and the patch set, never inside a
    target's package: an interrupted write there leaves a named temp file
    that the next run removes.
    """
    tmp = path.with_name(f".{path.name}{TMP_SUFFIX}")
    with contextlib.suppress(FileNotFoundError):
        tmp.unlink()  # created anew below, with no other mode in between
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL
    with open(os.open(tmp, flags, 0o666 if mode is None else 0o600), "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    if mode is not None:
        os.chmod(tmp, mode)
    os.replace(tmp, path)
    fsync_dir(path.parent)


def copy_atomic(src: Path, dst: Path) -> None:
    """Replace ``dst`` with a copy of ``src`` (content and mode) atomically."""
    write_atomic(dst, src.read_bytes(), mode=src.stat().st_mode & 0o7777)


def is_immutable(path: Path) -> bool:
    """True for files with the immutable or append-only attribute (chattr)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError:
        return False
    try:
        flags = fcntl.ioctl(fd, _FS_IOC_GETFLAGS, b"\0" * 8)
    except OSError:  # no such attributes on this file system
        return False
    finally:
        os.close(fd)
    return bool(int.from_bytes(flags[:4], sys.byteorder) & _FS_NO_REPLACE_FL)


def is_safe_rel(rel: object) -> bool:
    """A relative path inside ``vllm/``: what a journal may name."""
    if not isinstance(rel, str) or not rel or "\0" in rel:
        return False
    parts = PurePosixPath(rel).parts
    return (
        not PurePosixPath(rel).is_absolute()
        and parts[0] == "vllm"
        and ".." not in parts
        and "." not in parts
    )


# --------------------------------------------------------------------------
# The patch set
# --------------------------------------------------------------------------


@dataclass
class Patch:
    name: str
    path: Path
    headers: dict[str, str]
    files: list[str]
    hunks: dict[str, list[str]]  # file -> hunk headers, in order


@dataclass
class PatchSet:
    """One series of the patch set, with the overlay it installs.

    ``root`` is the patch set (``--patch-set``): ``patches/`` holds the
    series for its default vLLM, ``bases/VERSION/patches/`` one for each
    other vLLM it keeps.  ``vllm_overlay/`` is shared by every series;
    ``bases/VERSION/vllm_overlay/`` holds only the files that VERSION needs
    otherwise, each replacing the shared file of the same path.
    """

    root: Path
    patches: list[Patch]
    overlay: list[str]  # installed overlay files (vllm/...)
    overlay_export: list[str]  # every overlay file, tests included
    manifest: dict[str, str]
    results: dict[str, str]  # path -> SHA-256 of what apply installs there
    problems: list[str] = field(default_factory=list)
    patch_dir: Path = Path()  # this series: root/patches or root/bases/V/patches
    # Every overlay file (as overlay_export names it) -> the file that holds it.
    overlay_sources: dict[str, Path] = field(default_factory=dict)

    @property
    def overlay_dir(self) -> Path:
        """The shared overlay (a base's own files replace some of it:
        ``overlay_source``)."""
        return self.root / "vllm_overlay"

    @property
    def base_dir(self) -> Path | None:
        """``bases/VERSION`` for a series other than the default, else None."""
        return None if self.is_default else self.patch_dir.parent

    @property
    def is_default(self) -> bool:
        return self.patch_dir == self.root / "patches"

    @property
    def series_name(self) -> str:
        """The series' directory as the patch set names it: ``patches`` or
        ``bases/VERSION/patches``."""
        return self.patch_dir.relative_to(self.root).as_posix()

    def overlay_source(self, rel: str) -> Path:
        """The file that holds overlay file ``rel`` for this series."""
        return self.overlay_sources.get(rel, self.overlay_dir / rel)

    def describe(self) -> str:
        """``the vLLM 0.33.0 series (bases/0.33.0/patches)``, for messages."""
        with contextlib.suppress(ApplyError):
            return f"the vLLM {self.base_version()} series ({self.series_name})"
        return f"the series {self.series_name}"

    @property
    def patched_files(self) -> list[str]:
        seen: dict[str, None] = {}
        for patch in self.patches:
            seen.update(dict.fromkeys(patch.files))
        return sorted(seen)

    @property
    def written_files(self) -> list[str]:
        """Every vLLM file apply writes: the patched and the overlay files."""
        return sorted(self.patched_files + self.overlay)

    def manifest_command(self) -> str:
        """The command that regenerates this series' two manifests."""
        return manifest_command(self.root, self.patch_dir)

    @property
    def base_version_file(self) -> Path:
        return self.patch_dir / BASE_VERSION

    def base_version(self) -> str:
        """The vLLM version the series applies to: its ``base.version``,
        one line (``#`` lines are comments)."""
        return read_base_version(self.base_version_file)

    def revision(self) -> str:
        """Content hash of series, patches and overlay files (as composed
        for this series), each named by its path in the patch set."""
        digest = hashlib.sha256()
        inputs = [self.patch_dir / "series"]
        inputs += [p.path for p in self.patches]
        inputs += [self.overlay_source(rel) for rel in self.overlay_export]
        for path in inputs:
            digest.update(str(path.relative_to(self.root)).encode() + b"\0")
            digest.update(path.read_bytes() + b"\0")
        return digest.hexdigest()[:12]


def read_base_version(path: Path) -> str:
    """The one version line of a ``base.version`` file."""
    if not path.is_file():
        raise ApplyError(
            f"{path}: missing; a patch set names the vLLM version it "
            "applies to there, in one line (e.g. 0.33.0)"
        )
    lines = [
        line.strip()
        for line in read_text(path).splitlines()
        if line.strip() and not line.lstrip().startswith("#")
    ]
    if len(lines) != 1 or not _VERSION.fullmatch(lines[0]):
        raise ApplyError(
            f"{path}: not one version line ({lines[:3]!r}); write the vLLM "
            "version the series applies to, e.g. 0.33.0"
        )
    return lines[0]


_DIFF_GIT = re.compile(r"^diff --git a/(\S+) b/(\S+)$")
_HUNK = re.compile(r"^@@ -(\d+)(?:,\d+)? \+\d+(?:,\d+)? @@")
_HEADER = re.compile(r"^([A-Z][A-Za-z-]*):\s?(.*)$")


def read_text(path: Path) -> str:
    """A patch-set file as UTF-8 text, or an error naming the first bad byte."""
    data = path.read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data[: e.start].count(b"\n") + 1
        raise ApplyError(
            f"{path}:{line}: byte {data[e.start]:#04x} at offset {e.start} is not "
            "UTF-8; patches and the series are UTF-8 text (re-export the patch "
            "with `git format-patch`, or fix the encoding)"
        ) from e


def parse_patch(path: Path) -> Patch:
    """Read a format-patch file: its DEP-3 headers, files and hunks."""
    text = read_text(path)
    head, sep, _ = text.partition("\ndiff --git ")
    body = "diff --git " + text.split("\ndiff --git ", 1)[1] if sep else ""
    headers: dict[str, str] = {}
    last = None
    for line in head.splitlines():
        if line == "---":
            break
        match = _HEADER.match(line)
        if match:
            last = match.group(1)
            headers[last] = match.group(2).strip()
        elif line.startswith((" ", "\t")) and last is not None:
            headers[last] = (headers[last] + " " + line.strip()).strip()
        else:
            last = None
    if "Subject" in headers:
        headers["Subject"] = re.sub(r"^\[PATCH[^\]]*\]\s*", "", headers["Subject"])
    files: list[str] = []
    hunks: dict[str, list[str]] = {}
    current = None
    for line in body.splitlines():
        match = _DIFF_GIT.match(line)
        if match:
            current = match.group(2)
            if current not in files:
                files.append(current)
            hunks.setdefault(current, [])
        elif current is not None and _HUNK.match(line):
            hunks[current].append(line.split(" @@")[0] + " @@")
    return Patch(path.name, path, headers, files, hunks)


def upstream_problem(headers: dict[str, str]) -> str | None:
    """What is wrong with a header's claims about upstream, if anything.

    ``Forwarded`` is ``no``, ``not-needed`` or the one URL the patch was sent
    to; related upstream work is named in ``X-Related-Upstream-PR`` instead,
    and is never the forward's URL.
    """
    forwarded = headers.get("Forwarded", "")
    related = headers.get(RELATED_HEADER)
    if related is not None and not _URL.match(related):
        return f"{RELATED_HEADER}: {related!r} is not one URL"
    if not forwarded or forwarded in NOT_FORWARDED:
        return None  # a missing Forwarded is named with the other fields
    if not _URL.match(forwarded):
        return (
            f"Forwarded: {forwarded!r} is neither `no`, `not-needed` nor the "
            "one URL the patch was sent to; say `no` until it is sent, and "
            f"name related upstream work in {RELATED_HEADER}"
        )
    if forwarded == related:
        return (
            f"Forwarded: {forwarded} is the related upstream work "
            f"({RELATED_HEADER}), not this patch sent upstream; say `no` "
            "until it is sent"
        )
    return None


def read_manifest(path: Path, regenerate: str) -> dict[str, str]:
    """``sha256sum`` lines: a SHA-256 in hex, space, mode mark and path."""
    manifest: dict[str, str] = {}
    if not path.is_file():
        return manifest
    for number, line in enumerate(read_text(path).splitlines(), 1):
        if not line.strip() or line.startswith("#"):
            continue
        digest, _, rel = line.partition(" ")
        rel = rel.lstrip(" *")
        if not _HEX64.match(digest) or not rel:
            raise ApplyError(
                f"{path}:{number}: not a `SHA-256  path` line: {line[:80]!r}; "
                f"regenerate the file with `{regenerate}`"
            )
        manifest[rel] = digest
    return manifest


def series_dirs(root: Path) -> list[Path]:
    """Every series the patch set at ``root`` keeps: ``patches/`` (its
    default vLLM), then ``bases/VERSION/patches/`` for each other VERSION,
    newest first."""
    if root.parent.name == BASES and (root.parent.parent / "patches/series").is_file():
        project = root.parent.parent
        raise ApplyError(
            f"{root}: the vLLM {root.name} part of the patch set {project}, not a "
            f"patch set of its own (its vllm_overlay/ holds only what differs "
            f"from {project / 'vllm_overlay'}); pass --patch-set {project}, or "
            "leave it out for this project: the series is chosen by the "
            "target's vLLM version"
        )
    default = root / "patches"
    if not (default / "series").is_file():
        raise ApplyError(
            f"{default / 'series'}: no series file; a patch set needs "
            "patches/series (empty when there are no patches)"
        )
    bases = root / BASES
    others = (
        sorted(
            (d for d in bases.iterdir() if (d / "patches").is_dir()),
            key=lambda d: version_key(d.name),
            reverse=True,
        )
        if bases.is_dir()
        else []
    )
    return [default] + [d / "patches" for d in others]


def version_key(version: str) -> tuple:
    """Order release versions as numbers (0.10.0 after 0.9.0)."""
    return tuple(
        (0, int(part), "") if part.isdigit() else (1, 0, part)
        for part in re.split(r"[.+!_-]", version)
    )


def kept_versions(root: Path) -> dict[str, Path]:
    """The vLLM versions the patch set keeps a series for -> that series'
    directory: the default series' ``base.version``, and each base's
    directory name (``lint`` checks that its ``base.version`` agrees)."""
    dirs = series_dirs(root)
    kept = {read_base_version(dirs[0] / BASE_VERSION): dirs[0]}
    for patch_dir in dirs[1:]:
        kept.setdefault(patch_dir.parent.name, patch_dir)
    return kept


def overlay_files(directory: Path) -> list[str]:
    if not directory.is_dir():
        return []
    return sorted(
        p.relative_to(directory).as_posix()
        for p in directory.rglob("*")
        if p.is_file() and "__pycache__" not in p.parts
    )


def load_patch_set(root: Path, patch_dir: Path | None = None) -> PatchSet:
    """Load and lint one series of the patch set at ``root`` (default: its
    ``patches/``) with the overlay composed for it; lint problems are kept
    in ``problems``."""
    series = series_dirs(root)
    patch_dir = series[0] if patch_dir is None else patch_dir
    if patch_dir not in series:
        raise ApplyError(f"{patch_dir}: not a series of the patch set {root}")
    series_file = patch_dir / "series"
    problems: list[str] = []
    if not series_file.is_file():
        raise ApplyError(
            f"{series_file}: no series file; a series needs one "
            "(empty when there are no patches)"
        )
    names = [
        line.split("#", 1)[0].strip() for line in read_text(series_file).splitlines()
    ]
    names = [n for n in names if n]
    patches = []
    for name in sorted({n for n in names if names.count(n) > 1}):
        problems.append(f"{series_file}: {name} is listed more than once")
    for name in dict.fromkeys(names):
        path = patch_dir / name
        if not path.is_file():
            problems.append(f"{series_file}: lists {name}, which does not exist")
            continue
        patch = parse_patch(path)
        missing = [
            h for h in ("Subject",) + REQUIRED_HEADERS if not patch.headers.get(h)
        ]
        if missing:
            problems.append(f"{path}: DEP-3 header lacks " + ", ".join(missing))
        if problem := upstream_problem(patch.headers):
            problems.append(f"{path}: {problem}")
        if "\r\ndiff --git " in read_text(path):
            problems.append(
                f"{path}: has CRLF (Windows) line endings; convert the patch "
                "to LF line endings (`dos2unix`, or `git format-patch` again)"
            )
        elif not patch.files:
            problems.append(f"{path}: holds no 'diff --git' section")
        patches.append(patch)
    for path in sorted(patch_dir.glob("*.patch")):
        if path.name not in names:
            problems.append(
                f"{path}: not listed in {series_file}; add it to "
                "the series or delete it"
            )
    # The shared overlay, where this base's own files replace some of it.
    sources = {
        rel: root / "vllm_overlay" / rel for rel in overlay_files(root / "vllm_overlay")
    }
    if patch_dir != series[0]:
        own = patch_dir.parent / "vllm_overlay"
        sources.update((rel, own / rel) for rel in overlay_files(own))
    overlay_export = sorted(sources)
    for rel in overlay_export:
        if not rel.startswith(("vllm/", "tests/")):
            problems.append(
                f"{sources[rel]}: overlay files live under vllm/ "
                "(installed) or tests/ (export only)"
            )
    overlay = [rel for rel in overlay_export if rel.startswith("vllm/")]
    regenerate = manifest_command(root, patch_dir)
    manifest = read_manifest(patch_dir / MANIFEST, regenerate)
    results = read_manifest(patch_dir / RESULTS, regenerate)
    patch_set = PatchSet(
        root,
        patches,
        overlay,
        overlay_export,
        manifest,
        results,
        problems,
        patch_dir,
        sources,
    )
    problems += base_version_problems(patch_set)
    for name, listed, wanted in (
        (MANIFEST, manifest, patch_set.patched_files),
        (RESULTS, results, patch_set.written_files),
    ):
        if set(listed) == set(wanted):
            continue
        extra = sorted(set(listed) - set(wanted))
        lacking = sorted(set(wanted) - set(listed))
        detail = "; ".join(
            part
            for part in (
                f"lacks {', '.join(lacking)}" if lacking else "",
                f"lists unwritten {', '.join(extra)}" if extra else "",
            )
            if part
        )
        problems.append(
            f"{patch_dir / name}: out of date ({detail}); run `{regenerate}`"
        )
    touched = set(patch_set.patched_files)
    for rel in overlay:
        if rel in touched:
            problems.append(
                f"{sources[rel]}: also changed by a patch; "
                "a file is either patched or new"
            )
    return patch_set


def require_clean(patch_set: PatchSet) -> None:
    if patch_set.problems:
        raise ApplyError(
            "the patch set is inconsistent:\n  " + "\n  ".join(patch_set.problems)
        )


def base_version_problems(patch_set: PatchSet) -> list[str]:
    """A missing or malformed ``base.version``, one that is not the version
    its ``bases/VERSION`` directory names, or a ``setup.cfg`` beside the
    patch set whose pins (what ``make setup`` installs) say otherwise: its
    ``vllm`` is the default series', its ``vllm_bases`` lists every series'."""
    try:
        base = patch_set.base_version()
    except ApplyError as e:
        return [str(e)]
    if patch_set.base_dir is not None and base != patch_set.base_dir.name:
        return [
            f"{patch_set.base_version_file}: says {base}, but the series is kept "
            f"in {patch_set.base_dir} for vLLM {patch_set.base_dir.name}; make "
            "them agree"
        ]
    setup_cfg = patch_set.root / "setup.cfg"
    config = configparser.ConfigParser()
    config.read(setup_cfg)
    if patch_set.is_default:
        pinned = config.get("k3_sppp", "vllm", fallback=base)
        if pinned != base:
            return [
                f"{setup_cfg}: pins vllm = {pinned}, but "
                f"{patch_set.base_version_file} says {base}; make them agree "
                "(setup.cfg installs vLLM, base.version is what the series "
                "applies to)"
            ]
    listed = config.get("k3_sppp", "vllm_bases", fallback=base).split()
    if base not in listed:
        return [
            f"{setup_cfg}: vllm_bases = {' '.join(listed)} lacks {base}, which "
            f"{patch_set.base_version_file} says; list every vLLM the patch set "
            "keeps a series for there (`make setup BASE=VERSION` builds its venv)"
        ]
    return []


class UnsupportedVersion(ApplyError):
    """A target whose vLLM is none that the patch set keeps a series for."""

    def __init__(self, target: Target, version: str, kept: dict[str, Path]) -> None:
        project = series_root(next(iter(kept.values())))
        supported = [
            f"{v} ({(d / BASE_VERSION).relative_to(project)})" for v, d in kept.items()
        ]
        if len(supported) > 1:
            supported[-2:] = [f"{supported[-2]} and {supported[-1]}"]
        default = next(iter(kept))
        said = target.version_files()
        files = f"{'say' if ' and ' in said else 'says'} {said}"
        rebase = command_line(
            project, None, "rebase", "--onto", str(target.root), "--out", "DIR"
        )
        super().__init__(
            f"{target.root}: vLLM {version} (so {files}); the patch set "
            f"{project} keeps a series only for vLLM {', '.join(supported)}, "
            "so nothing was written. "
            f"Install one of those there (`pip install vllm=={default}`), or "
            f"move a series onto vLLM {version}: `{rebase}` names every hunk "
            "that does not carry over",
            code=EXIT_DRIFT,
        )
        self.version = version
        self.kept = kept


def series_root(patch_dir: Path) -> Path:
    """The patch set that holds the series ``patch_dir``."""
    if patch_dir.parent.parent.name == BASES:
        return patch_dir.parent.parent.parent
    return patch_dir.parent


def select_series(root: Path, target: Target, *, strict: bool = True) -> PatchSet:
    """The series of the patch set at ``root`` for ``target``'s vLLM.

    A target the patch set was applied to keeps the series its journal names
    (by vLLM version); otherwise the target's vLLM version chooses, and where
    the target names none (a bare checkout), the series whose pinned
    originals its files match (the most of them).  A version the patch set
    keeps no series for is refused naming the target's version files and the
    versions kept (``UnsupportedVersion``, exit 4), unless not ``strict``:
    then the default series is compared against (``status``).  A patch set
    of one series takes it; ``check_version`` refuses another vLLM later.
    """
    dirs = series_dirs(root)
    if len(dirs) == 1:
        return load_patch_set(root)
    kept = kept_versions(root)
    journal = target.read_journal()
    if journal is not None:
        applied = journal.get("base_version") or journal["vllm_version"]
        if applied in kept:
            return load_patch_set(root, kept[applied])
    version = target.version()
    if version is None:
        source = pristine_source(target)

        def matching(version: str) -> int:
            pinned = read_manifest(kept[version] / MANIFEST, "")
            return sum(
                (path := source(rel)) is not None and sha256_file(path) == digest
                for rel, digest in pinned.items()
            )

        version = max(kept, key=lambda v: (matching(v), v == next(iter(kept))))
    if version in kept:
        return load_patch_set(root, kept[version])
    if strict:
        raise UnsupportedVersion(target, version, kept)
    return load_patch_set(root)


def manifest_command(root: Path, patch_dir: Path) -> str:
    """The command that regenerates the manifests of the series
    ``patch_dir``: ``make manifest`` (``BASE=VERSION`` for another base)
    for this project, else apply.py with a tree of that vLLM."""
    if patch_dir == root / "patches":
        return command_line(root, None, "manifest")
    version = patch_dir.parent.name
    if Path(root).resolve() == PROJECT_DIR:
        return command_line(root, project_venv(version), "manifest")
    return command_line(root, None, "manifest", "--target", f"VLLM_{version}_TREE")


# --------------------------------------------------------------------------
# The target
# --------------------------------------------------------------------------


MAKE_VERBS = ("apply", "revert", "status", "check", "manifest", "lint")
VLLM_VERBS = ("apply", "revert", "status", "check")  # the targets taking VLLM=
# The header of both manifests names the command that writes them, the same
# whatever directory it ran in.
GENERATED_BY = "`make manifest` (`python3 apply.py manifest`)"
MAKE_FLAGS = {"--force": "FORCE=1"}
_MAKE_SAFE = re.compile(r"[\w@%+=:,./-]+", re.ASCII)


def default_version() -> str | None:
    """The vLLM this project's default series applies to (``.venv``'s)."""
    with contextlib.suppress(ApplyError, OSError):
        return read_base_version(PROJECT_DIR / "patches" / BASE_VERSION)
    return None


def project_venv(version: str | None = None) -> Path:
    """This project's venv for vLLM ``version``: ``.venv`` for the default
    series' vLLM (``patches/base.version``, setup.cfg's ``vllm``),
    ``.venv-VERSION`` for another base (``make setup BASE=VERSION``)."""
    if version is None or version == default_version():
        return PROJECT_DIR / ".venv"
    return PROJECT_DIR / f".venv-{version}"


def pristine_sources(version: str) -> Path:
    """Where `make pristine` unpacks the Python sources of vLLM ``version``'s
    wheel (``_pristine.py``, checked against its RECORD and the series'
    ``base.sha256``): a pristine tree of that release for ``lint`` without
    its venv."""
    return PROJECT_DIR / ".cache" / f"pristine-vllm-{version}"


def project_venv_bases() -> dict[Path, str | None]:
    """The directory holding vllm/ in each of this project's venvs that
    exists -> its base for ``make BASE=``: None for ``.venv``, the version
    for ``.venv-VERSION``."""
    venvs: dict[Path, str | None] = {}
    with contextlib.suppress(ApplyError, OSError):
        for version in kept_versions(PROJECT_DIR):
            venv = project_venv(version)
            if venv.is_dir():
                with contextlib.suppress(ApplyError, OSError):
                    base = None if venv.name == ".venv" else version
                    venvs[resolve_target(venv).root] = base
    return venvs


def default_root() -> Path | None:
    """The directory holding vllm/ in this project's .venv, if there is one:
    the default target of ``python3 apply.py``."""
    with contextlib.suppress(ApplyError, OSError):
        return resolve_target(PROJECT_DIR / ".venv").root
    return None


def command_line(
    patch_set: Path | None, target: Path | None, verb: str, *flags: str
) -> str:
    """The command that runs ``verb`` (with ``flags``) on ``target`` with
    ``patch_set``, as a user types it: this project's make target where the
    Makefile can say it (``BASE=VERSION`` for this project's venv of another
    base, ``VLLM=`` for another target), else ``python3 apply.py`` with the
    same ``--patch-set`` and ``--target``.

    Every word is quoted for the shell, and a path make would read as its
    own syntax (``$``, quotes, whitespace: ``make_can_carry``) takes the
    ``python3 apply.py`` form, where ``option`` keeps a leading dash a value.
    """
    own = patch_set is None or Path(patch_set).resolve() == PROJECT_DIR
    here = False
    with contextlib.suppress(OSError):
        here = Path.cwd().resolve() == PROJECT_DIR
    base = None
    other = False
    if target is not None:
        venvs = project_venv_bases()
        resolved = Path(target).resolve()
        if resolved in venvs:
            base = venvs[resolved]
        else:
            other = True
    if (
        own
        and verb in (VLLM_VERBS if other else MAKE_VERBS)
        and all(flag in MAKE_FLAGS for flag in flags)
        and (not other or make_can_carry(str(target)))
        and (here or make_can_carry(str(PROJECT_DIR)))
    ):
        words = ["make"] if here else ["make", "-C", str(PROJECT_DIR)]
        words += [verb, *(MAKE_FLAGS[flag] for flag in flags)]
        words += [f"BASE={base}"] if base is not None else []
        words += [f"VLLM={target}"] if other else []
        return shlex.join(words)
    words = ["python3", "apply.py" if here else str(PROJECT_DIR / "apply.py")]
    words += [] if own else option("--patch-set", str(patch_set))
    words += [verb, *flags]
    if target is not None and Path(target).resolve() != default_root():
        words += option("--target", str(target))
    return shlex.join(words)


def option(name: str, value: str) -> list[str]:
    """``name value`` as argparse reads it back: ``name=value`` when the
    value starts with a dash and would be taken for an option."""
    return [f"{name}={value}"] if value.startswith("-") else [name, value]


def make_can_carry(path: str) -> bool:
    """Whether ``path`` reaches apply.py unchanged as ``make VLLM=PATH``:
    make expands ``$`` and splits on whitespace, so only the characters
    that neither make nor the shell treats specially (shlex's own)."""
    return _MAKE_SAFE.fullmatch(path) is not None


@dataclass
class Target:
    root: Path
    patch_set: Path = PROJECT_DIR  # the patch set the commands act with
    # What a run could not clean up (stage directories, the lock): it still
    # finished, but ``status`` will show these, so its exit code says so.
    unclean: list[str] = field(default_factory=list)
    recovered: bool = False  # an interrupted run was finished before this one

    def command(self, verb: str, *flags: str) -> str:
        """The command that runs ``verb`` on this target (``command_line``)."""
        return command_line(self.patch_set, self.root, verb, *flags)

    @property
    def state_dir(self) -> Path:
        return self.root / STATE_DIR

    @property
    def journal_path(self) -> Path:
        return self.state_dir / JOURNAL

    @property
    def lock_path(self) -> Path:
        return self.state_dir / "lock"

    def path(self, rel: str) -> Path:
        return self.root / rel

    def version(self) -> str | None:
        """vLLM version from ``vllm/_version.py`` and the wheel's METADATA.

        Each says it where present and they must agree: a ``_version.py``
        that names no version, or two that differ, is refused rather than
        guessed (None only where neither is there, as in a bare checkout).
        """
        return self.version_sources()[0]

    def version_files(self) -> str:
        """The files that state the target's vLLM version, for messages."""
        files = self.version_sources()[1]
        return " and ".join(str(f) for f in files) or "no file"

    def version_sources(self) -> tuple[str | None, list[Path]]:
        """``version()`` and the files that say it."""
        found: dict[Path, str] = {}
        version_file = self.root / "vllm" / "_version.py"
        if os.path.lexists(version_file):
            match = None
            with contextlib.suppress(OSError):
                match = re.search(
                    r"^__version__\s*=[^'\"\n]*['\"]([^'\"]+)['\"]",
                    version_file.read_text(encoding="utf-8", errors="replace"),
                    re.MULTILINE,
                )
            if match is None:
                raise ApplyError(
                    f"{version_file}: names no __version__ (unreadable or "
                    "broken); reinstall vLLM there, nothing was changed"
                )
            found[version_file] = match.group(1)
        for metadata in sorted(self.root.glob("vllm-*.dist-info/METADATA")):
            text = metadata.read_text(encoding="utf-8", errors="replace")
            for line in text.splitlines():
                if line.startswith("Version:"):
                    found[metadata] = line.split(":", 1)[1].strip()
                    break
        if len(set(found.values())) > 1:
            raise ApplyError(
                f"{self.root}: the vLLM version files disagree ("
                + ", ".join(f"{path} says {v}" for path, v in found.items())
                + "); reinstall vLLM there, nothing was changed"
            )
        return next(iter(found.values()), None), list(found)

    def interpreter(self) -> Path | None:
        """The Python that imports this vLLM: a venv's, or the prefix's own.

        A site-packages directory ``PREFIX/lib/pythonX.Y/site-packages`` is
        run by ``PREFIX/bin/pythonX.Y``; a checkout root names none.
        """
        root = self.root
        if root.name != "site-packages" or not root.parent.name.startswith("python"):
            return None
        prefix = root.parent.parent.parent
        for name in (root.parent.name, "python3", "python"):
            candidate = prefix / "bin" / name
            if os.access(candidate, os.X_OK):
                return candidate
        return None

    def adopt(self, path: Path, like: Path | None = None) -> None:
        """Give a file we created the owner of ``like`` (default: the target).

        Only root changes owners: a root run on a user's tree must leave
        nothing the user cannot replace or remove.
        """
        if os.geteuid() != 0:
            return
        stat = (like or self.root).stat()
        if (stat.st_uid, stat.st_gid) != (0, 0):
            os.chown(path, stat.st_uid, stat.st_gid, follow_symlinks=False)

    def mkdir(
        self, path: Path, like: Path | None = None, mode: int | None = None
    ) -> None:
        if mode is None:
            path.mkdir()
        else:  # exactly ``mode``, at once: not the umask's, never in between
            umask = os.umask(0)
            try:
                path.mkdir(mode=mode)
            finally:
                os.umask(umask)
        self.adopt(path, like)

    def record_hashes(self) -> dict[str, str]:
        """SHA-256 (hex) of every file as shipped, from the wheel's RECORD."""
        records = sorted(self.root.glob("vllm-*.dist-info/RECORD"))
        if not records:
            raise ApplyError(
                f"{self.root}: no vllm-*.dist-info/RECORD; the manifest is "
                "generated from an installed vLLM wheel (make setup)"
            )
        hashes = {}
        with open(records[0], newline="", encoding="utf-8") as f:
            for row in csv.reader(f):
                if len(row) >= 2 and row[1].startswith("sha256="):
                    raw = row[1].split("=", 1)[1]
                    raw += "=" * (-len(raw) % 4)
                    hashes[row[0]] = base64.urlsafe_b64decode(raw).hex()
        return hashes

    def not_a_journal(self) -> str:
        """What to do about a journal this tool cannot believe."""
        return (
            f"move it away: `{self.command('revert')}` then restores vLLM's "
            f"originals from the backups in {self.state_dir / 'backups'}, which "
            "no run deletes while a file they name is not original (with no "
            "backups there, reinstall vLLM)"
        )

    def read_journal(self) -> dict | None:
        if not os.path.lexists(self.journal_path):
            return None
        try:
            data = self.journal_path.read_bytes()
        except OSError as e:
            raise ApplyError(
                f"{self.journal_path}: cannot be read ({e.strerror}); nothing is "
                f"undone or deleted without it. Make it readable, or "
                + self.not_a_journal()
            ) from e
        try:
            journal = json.loads(data.decode("utf-8"))
        except ValueError as e:
            raise ApplyError(
                f"{self.journal_path}: not JSON ({e}); this file is not a journal "
                "k3-sppp wrote, so nothing is undone from it. " + self.not_a_journal()
            ) from e
        if isinstance(journal, dict) and journal.get("format") not in (
            None,
            JOURNAL_FORMAT,
        ):
            raise ApplyError(
                f"{self.journal_path}: journal format "
                f"{journal.get('format')!r} is not "
                f"{JOURNAL_FORMAT}; use the k3-sppp checkout "
                "that applied it"
            )
        if problem := journal_problem(journal):
            raise ApplyError(
                f"{self.journal_path}: {problem}; this is not a journal k3-sppp "
                "wrote, so nothing is undone from it. " + self.not_a_journal()
            )
        return journal

    def write_journal(self, journal: dict) -> None:
        write_atomic(
            self.journal_path,
            (json.dumps(journal, indent=2, sort_keys=True) + "\n").encode(),
            mode=PRIVATE_FILE,
        )
        self.adopt(self.journal_path)

    def clear_bytecode(self, rels: list[str]) -> None:
        """Drop cached bytecode of the given modules, as far as we may.

        Python also checks a ``.pyc`` against its source's size and mtime, so
        one we cannot remove is a warning, not a failure.
        """
        for rel in rels:
            path = self.path(rel)
            if path.suffix != ".py":
                continue
            cache = path.parent / "__pycache__"
            for pyc in cache.glob(f"{path.stem}.*.pyc"):
                try:
                    pyc.unlink()
                except OSError as e:
                    warn(f"{pyc}: stale bytecode not removed ({e.strerror})")

    @functools.cached_property
    def originals_by_hash(self) -> dict[str, set[str]]:
        """vLLM files by the SHA-256 of their original, as far as the wheel's
        ``RECORD`` and the patch set's ``base.sha256`` can be read."""
        names: dict[str, set[str]] = {}
        sources: list[dict[str, str]] = []
        with contextlib.suppress(ApplyError, OSError, ValueError):
            sources.append(self.record_hashes())
        with contextlib.suppress(ApplyError, OSError):
            for patch_dir in series_dirs(self.patch_set):  # every base's
                with contextlib.suppress(ApplyError, OSError):
                    sources.append(read_manifest(patch_dir / MANIFEST, ""))
        for hashes in sources:
            for rel, digest in hashes.items():
                if is_safe_rel(rel):
                    names.setdefault(digest, set()).add(rel)
        return names

    def backup_needed(self, digest: str) -> bool:
        """Whether a backup named ``digest`` may be the only copy of an
        original: it names no known file, or a file not at that hash."""
        rels = self.originals_by_hash.get(digest)
        return not rels or any(
            file_hash_or_none(self.path(rel)) != digest for rel in rels
        )

    def leftovers(
        self, journal: dict | None
    ) -> tuple[list[Path], list[Path], list[Path]]:
        """Files in the state directory that no journal lists: ours, others,
        and orphans.

        Ours are what this tool names and no run needs: ``stage-*``
        directories, temp files, backups (named by their own SHA-256) whose
        every original is in place in the tree, and an unheld lock without a
        journal.  Orphans are backups no journal lists that may be the only
        copy of an original (``backup_needed``): never removed, restored by
        ``revert`` (a journal that was lost).
        """
        if not self.state_dir.is_dir():
            return [], [], []
        needed = {JOURNAL, "lock"} if journal is not None else {"lock"}
        backups = {
            e["backup"].split("/", 1)[1] for e in (journal or {}).get("files", [])
        }
        ours: list[Path] = []
        others: list[Path] = []
        orphans: list[Path] = []
        for path in sorted(self.state_dir.iterdir()):
            name = path.name
            if name in needed:
                continue
            if path.is_dir() and not path.is_symlink() and name == "backups":
                for backup in sorted(path.iterdir()):
                    if backup.name in backups:
                        continue
                    regular = backup.is_file() and not backup.is_symlink()
                    if regular and _HEX64.match(backup.name):
                        needed_here = self.backup_needed(backup.name)
                        (orphans if needed_here else ours).append(backup)
                    elif (
                        regular
                        and backup.name.startswith(".")
                        and backup.name.endswith(TMP_SUFFIX)
                    ):
                        ours.append(backup)
                    else:
                        others.append(backup)
            elif (
                name.startswith("stage-") and path.is_dir() and not path.is_symlink()
            ) or (name == f".{JOURNAL}{TMP_SUFFIX}" and path.is_file()):
                ours.append(path)
            else:
                others.append(path)
        return ours, others, orphans

    def remove_leftovers(self, journal: dict | None) -> None:
        ours, _, _ = self.leftovers(journal)
        if ours:
            say(
                f"removing {len(ours)} leftover(s) of a stopped run "
                f"from {self.state_dir}"
            )
        for path in ours:
            if path.is_dir():
                shutil.rmtree(path)
            else:
                path.unlink()
        backups = self.state_dir / "backups"
        if journal is None and backups.is_dir() and not any(backups.iterdir()):
            backups.rmdir()


def journal_problem(journal: object) -> str | None:
    """What makes ``journal`` something this tool did not write, or None.

    A journal names files to overwrite and delete, so it is checked before
    it is believed: every path inside ``vllm/``, every hash a SHA-256.
    """
    if not isinstance(journal, dict):
        return "not a JSON object"
    if journal.get("format") != JOURNAL_FORMAT:
        return "no journal format"
    if journal.get("state") not in JOURNAL_STATES:
        return f"unknown state {journal.get('state')!r}"
    for key in ("started", "revision", "vllm_version"):
        if not isinstance(journal.get(key), str):
            return f"no {key!r}"
    lists = {k: journal.get(k) for k in ("files", "overlay", "created_dirs")}
    if not all(isinstance(v, list) for v in lists.values()):
        return "no list of files, overlay files and created directories"
    for entry in lists["files"] + lists["overlay"]:
        if not isinstance(entry, dict) or not is_safe_rel(entry.get("path")):
            return f"a file entry outside vllm/: {entry!r:.80}"
        hashes = [entry.get("result")]
        if entry in lists["files"]:
            hashes.append(entry.get("base"))
            if entry.get("backup") != f"backups/{entry.get('base')}":
                return f"{entry['path']}: backup is not named by its hash"
            link = entry.get("symlink")
            if link is not None and (not isinstance(link, str) or not link):
                return f"{entry['path']}: bad symlink"
        if not all(isinstance(h, str) and _HEX64.match(h) for h in hashes):
            return f"{entry['path']}: not a SHA-256"
    if not all(is_safe_rel(d) for d in lists["created_dirs"]):
        return "a created directory outside vllm/"
    kept = journal.get("kept", {})
    if not isinstance(kept, dict) or not all(
        is_safe_rel(k) and isinstance(v, str) and _HEX64.match(v)
        for k, v in kept.items()
    ):
        return "bad list of kept edits"
    return None


def default_target() -> Path:
    """The venv a command without ``--target`` acts on: this project's venv
    whose Python runs apply.py (``.venv-0.33.0/bin/python apply.py status``
    asks about ``.venv-0.33.0``, and so does code importing apply in it),
    else ``.venv``."""
    running = Path(sys.prefix).resolve()
    venv = PROJECT_DIR / ".venv"
    if running.parent == PROJECT_DIR and running.name.startswith(".venv-"):
        venv = running
    if not venv.is_dir():
        raise ApplyError(
            f"{venv}: no project venv; run `make setup` (or "
            "`make apply`), or pass --target"
        )
    return venv


def venv_site_packages(venv: Path) -> Path:
    """The site-packages of the venv's own Python (pyvenv.cfg ``version``).

    A venv upgraded in place keeps ``lib/python3.9`` beside ``lib/python3.11``;
    the highest X.Y that holds vllm/ is taken when pyvenv.cfg does not say.
    """
    candidates = {
        tuple(int(n) for n in m.group(1, 2)): p
        for p in venv.glob("lib/python*/site-packages")
        if (m := re.fullmatch(r"python(\d+)\.(\d+)", p.parent.name))
    }
    if not candidates:
        raise ApplyError(
            f"{venv}: a virtual environment without lib/pythonX.Y/site-packages"
        )
    config = (venv / "pyvenv.cfg").read_text(encoding="utf-8", errors="replace")
    match = re.search(r"^version(?:_info)?\s*=\s*(\d+)\.(\d+)", config, re.MULTILINE)
    if match and (own := candidates.get((int(match[1]), int(match[2])))):
        return own
    with_vllm = [v for v in sorted(candidates) if (candidates[v] / "vllm").is_dir()]
    return candidates[with_vllm[-1] if with_vllm else max(candidates)]


def resolve_target(path: Path | None, patch_set: Path | None = None) -> Target:
    """Find the directory that holds ``vllm/`` for a user-given path."""
    path = (path or default_target()).resolve()
    if path.is_dir() and not os.access(path, os.R_OK | os.X_OK):
        raise ApplyError(f"{path}: not readable by this user")
    if (path / "pyvenv.cfg").is_file():
        path = venv_site_packages(path)
    if path.name == "vllm" and (path / "__init__.py").is_file():
        path = path.parent
    if not (path / "vllm" / "__init__.py").is_file():
        raise ApplyError(
            f"{path}: no vllm/ package here; pass a site-packages directory, "
            "a vLLM checkout root, a venv, or the vllm/ package itself"
        )
    return Target(path, (patch_set or PROJECT_DIR).resolve())


def lock_holder(fd: int) -> str:
    return os.pread(fd, 64, 0).decode(errors="replace").strip() or "?"


def take_lock(target: Target) -> int:
    """Create the state directory and take its lock; return the lock's fd."""
    while True:
        with contextlib.suppress(FileExistsError):
            target.mkdir(target.state_dir, mode=PRIVATE_DIR)
        try:
            fd = os.open(target.lock_path, os.O_RDWR | os.O_CREAT, PRIVATE_FILE)
        except FileNotFoundError:
            continue  # the holder before us removed the directory; again
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            holder = lock_holder(fd)
            os.close(fd)
            if e.errno not in (errno.EAGAIN, errno.EACCES):
                raise
            raise ApplyError(
                f"{target.lock_path}: another k3-sppp run holds this target "
                f"(pid {holder}); wait for it to finish"
            ) from e
        with contextlib.suppress(FileNotFoundError):
            if os.stat(target.lock_path).st_ino == os.fstat(fd).st_ino:
                return fd
        os.close(fd)  # the holder before us removed that file; lock anew


@contextlib.contextmanager
def locked(target: Target) -> Iterator[None]:
    """Hold the target's lock; leave no lock file or empty state behind.

    Leftovers of a killed run (stage directories, temp files, unlisted
    backups) are removed first: with the lock held, no other run owns them.
    """
    if not os.access(target.root, os.W_OK):
        raise ApplyError(
            f"{target.root}: not writable by this user; run as "
            "the owner of the vLLM install"
        )
    try:
        fd = take_lock(target)
    except BaseException:
        with contextlib.suppress(OSError):  # empty unless another run is in it
            target.state_dir.rmdir()
        raise
    try:
        target.adopt(target.lock_path)
        os.pwrite(fd, f"{os.getpid()}\n".encode().ljust(12), 0)
        target.remove_leftovers(target.read_journal())
        yield
    finally:
        try:
            target.lock_path.unlink()
            with contextlib.suppress(OSError):  # holds a journal or others' files
                target.state_dir.rmdir()
        except OSError as e:
            warn(
                f"{target.lock_path}: not removed ({e.strerror}); "
                "`status` reports it and the next run removes it"
            )
            target.unclean.append(str(target.lock_path))
        finally:
            os.close(fd)


@contextlib.contextmanager
def reading(target: Target) -> Iterator[bool]:
    """Wait until no run holds the target, and keep runs out while reading.

    Takes a shared lock on an existing lock file and writes nothing, so a
    user who may only read the install can ask for ``status``.  Yields
    whether a lock file was there (a run that was killed leaves one).
    """
    deadline = time.monotonic() + STATUS_LOCK_WAIT_S
    while True:
        try:
            fd = os.open(target.lock_path, os.O_RDONLY)
        except FileNotFoundError:
            yield False
            return
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except OSError as e:
                if e.errno not in (errno.EAGAIN, errno.EACCES):
                    raise
                if time.monotonic() > deadline:
                    raise ApplyError(
                        f"{target.lock_path}: another k3-sppp run (pid "
                        f"{lock_holder(fd)}) has held this target for "
                        f"{STATUS_LOCK_WAIT_S:.0f} s; ask again when it is done"
                    ) from e
                time.sleep(0.05)
                continue
            with contextlib.suppress(FileNotFoundError):
                if os.stat(target.lock_path).st_ino == os.fstat(fd).st_ino:
                    yield True
                    return
        finally:
            os.close(fd)


# --------------------------------------------------------------------------
# git apply, in a repository of its own
# --------------------------------------------------------------------------


# Settings that change the bytes git writes, pinned on the command line,
# which outranks every configuration file (a second line of defence behind
# ``git_env``; the patched manifest is the third).
GIT_PINNED = (
    "-c",
    "core.autocrlf=false",
    "-c",
    "core.eol=lf",
    "-c",
    "core.safecrlf=false",
    "-c",
    f"core.attributesFile={os.devnull}",
)


def git_env() -> dict[str, str]:
    """The environment every git call runs in: no configuration but ours.

    git reads configuration from the system file, the global files
    (``$HOME/.gitconfig``, ``$XDG_CONFIG_HOME/git/config``), the
    repository's ``.git/config``, the command line and ``GIT_*`` variables
    (``GIT_CONFIG_GLOBAL``, ``GIT_CONFIG_COUNT``/``KEY_n``/``VALUE_n``,
    ``GIT_CONFIG_PARAMETERS``, ...); and attributes from the system file,
    ``core.attributesFile`` (by default ``$XDG_CONFIG_HOME/git/attributes``),
    ``.git/info/attributes`` and ``.gitattributes`` in the tree.  So: every
    ``GIT_*`` variable of the caller is dropped; ``GIT_CONFIG_NOSYSTEM`` and
    ``GIT_ATTR_NOSYSTEM`` turn the system files off; ``HOME`` and
    ``XDG_CONFIG_HOME`` point at /dev/null, where no file can exist, and
    ``GIT_CONFIG_GLOBAL`` and ``GIT_CONFIG_SYSTEM`` name /dev/null too
    (git 2.32+); our repositories are made by ``git init --template=`` (no
    info/attributes, no hooks) and hold no ``.gitattributes``.
    """
    env = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith("GIT_") and key not in ("HOME", "XDG_CONFIG_HOME")
    }
    env.update(
        LC_ALL="C",
        HOME=os.devnull,
        XDG_CONFIG_HOME=os.devnull,
        GIT_CONFIG_NOSYSTEM="1",
        GIT_CONFIG_SYSTEM=os.devnull,
        GIT_CONFIG_GLOBAL=os.devnull,
        GIT_ATTR_NOSYSTEM="1",
    )
    return env


def git(
    args: list[str],
    cwd: Path,
    check: bool = True,
) -> subprocess.CompletedProcess[str]:
    """Run git in ``cwd``, which is always the top of a repository of ours,
    isolated from the user's and the system's configuration (``git_env``).

    Each stage is a repository of its own (``make_repo``), so git never finds
    a repository around the target.  ``GIT_CEILING_DIRECTORIES`` cannot do
    that for every path: it splits on ``:``.
    """
    try:
        proc = subprocess.run(
            ["git", *GIT_PINNED, *args],
            cwd=cwd,
            env=git_env(),
            text=True,
            capture_output=True,
        )
    except FileNotFoundError as e:
        raise ApplyError(
            "git is not installed; k3-sppp applies patches with `git apply` "
            "(install it: `apt-get install git`, `dnf install git`)"
        ) from e
    if proc.returncode < 0:
        raise ApplyError(
            f"git {' '.join(args)} was killed by signal {-proc.returncode} in "
            f"{cwd}; nothing was written (run it again)"
        )
    if check and proc.returncode != 0:
        raise ApplyError(
            f"git {' '.join(args)} failed in {cwd}:\n" + proc.stderr.strip()
        )
    return proc


def describe_rejects(patch: Patch, output: str) -> list[str]:
    """Turn ``git apply --reject`` output into 'file hunk #n (@@ ..)' lines."""
    failures = []
    current = None
    for line in output.splitlines():
        if match := re.match(r"Applying patch (\S+) with \d+ reject", line):
            current = match.group(1)
        elif (match := re.match(r"Rejected hunk #(\d+)\.", line)) and current:
            number = int(match.group(1))
            headers = patch.hunks.get(current, [])
            where = f" ({headers[number - 1]})" if number <= len(headers) else ""
            failures.append(f"{current} hunk #{number}{where}")
        elif match := re.match(
            r"error: (\S+): (No such file or directory|"
            r"does not exist in index)",
            line,
        ):
            failures.append(f"{match.group(1)}: missing in the target")
        elif match := re.match(r"error: (\S+): already exists", line):
            failures.append(f"{match.group(1)}: already exists in the target")
    return failures


def apply_patch(stage: Path, patch: Patch) -> list[str]:
    """Apply one patch in ``stage``; return its failures (empty when clean).

    ``--reject`` makes git apply what it can and name each rejected hunk; the
    stage is thrown away on any failure, so nothing half-applied survives.
    """
    proc = git(
        ["apply", "--verbose", "--reject", "--whitespace=error", str(patch.path)],
        stage,
        check=False,
    )
    output = proc.stdout + proc.stderr
    if skipped := re.findall(r"Skipped patch '([^']+)'", output):
        return [f"{rel}: skipped by git" for rel in skipped]
    if proc.returncode == 0:
        return []
    return (
        describe_rejects(patch, output)
        or [line for line in output.splitlines() if line.startswith("error:")]
        or [output.strip()]
    )


def copy_base(
    stage: Path, rels: list[str], source: Callable[[str], Path | None]
) -> None:
    """Copy the original of each file into ``stage`` (absent ones are not)."""
    for rel in rels:
        src = source(rel)
        if src is not None:
            dst = stage / rel
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst)


def stage_patch_set(
    patch_set: PatchSet,
    stage: Path,
    *,
    overlay: list[str],
    keep_going: bool = False,
    skip_series: bool = False,
) -> dict[str, list[str]]:
    """Apply the series (unless ``skip_series``: applied already), then add
    ``overlay``; return failures per patch."""
    failures: dict[str, list[str]] = {}
    for patch in [] if skip_series else patch_set.patches:
        if problems := apply_patch(stage, patch):
            failures[patch.name] = problems
            if not keep_going:
                return failures
    for rel in overlay:
        dst = stage / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(patch_set.overlay_source(rel), dst)
    for leftover in stage.rglob("*.rej"):
        leftover.unlink()
    return failures


_COMPILE = """
import sys
for path in sys.argv[1:]:
    try:
        with open(path, "rb") as f:
            compile(f.read(), path, "exec", dont_inherit=True)
    except SyntaxError as e:
        print(f"{e.lineno}\\0{e.msg}\\0{path}")
        sys.exit(1)
"""


def byte_compile(
    patch_set: PatchSet, stage: Path, rels: list[str], python: Path | None
) -> None:
    """Compile every staged module with the target's own interpreter.

    vLLM's sources use the syntax of the Python vLLM runs on, which may be
    newer or older than the one running this tool.  Without a known
    interpreter (a checkout root) this tool's own compiles them.
    """
    sources = [rel for rel in rels if rel.endswith(".py")]
    if python is None:
        for rel in sources:
            try:
                compile((stage / rel).read_bytes(), rel, "exec", dont_inherit=True)
            except SyntaxError as e:
                raise not_compiling(patch_set, rel, e.lineno, e.msg) from e
        return
    try:
        proc = subprocess.run(
            [str(python), "-I", "-S", "-c", _COMPILE, *sources],
            cwd=stage,
            capture_output=True,
            text=True,
        )
    except OSError as e:
        raise ApplyError(
            f"{python}: cannot run the target's Python to compile the "
            f"patched files ({e.strerror})"
        ) from e
    if proc.returncode == 0:
        return
    lineno, _, rest = proc.stdout.strip().partition("\0")
    msg, _, rel = rest.partition("\0")
    if not rel:
        raise ApplyError(
            f"{python}: failed to compile the patched files:\n"
            + (proc.stderr or proc.stdout).strip()
        )
    raise not_compiling(patch_set, rel, lineno, f"{msg}, with {python}")


def not_compiling(
    patch_set: PatchSet, rel: str, lineno: object, msg: str
) -> ApplyError:
    """A result that does not compile, naming the file to fix."""
    if rel in patch_set.overlay_export:
        sources = [str(patch_set.overlay_source(rel))]
    else:
        sources = [str(p.path) for p in patch_set.patches if rel in p.files]
    return ApplyError(
        f"{rel}:{lineno}: the patched file does not compile ({msg}); fix "
        + (" or ".join(sources) or "the patch or overlay file that changes it")
    )


# --------------------------------------------------------------------------
# Checks against the pin
# --------------------------------------------------------------------------


def check_version(target: Target, patch_set: PatchSet) -> str | None:
    """The target's vLLM version, refused unless it is the series' base
    (None, a checkout that says none, is judged by the hashes alone)."""
    version = target.version()
    base = patch_set.base_version()
    if version is not None and version != base:
        kept = {base: patch_set.patch_dir}
        with contextlib.suppress(ApplyError, OSError):
            kept = kept_versions(patch_set.root)
        raise UnsupportedVersion(target, version, kept)
    return version


def base_drift(target: Target, patch_set: PatchSet) -> dict[str, str]:
    """Files that are not the pinned base, each with the reason."""
    problems = {}
    for rel in patch_set.patched_files:
        path = target.path(rel)
        if not path.is_file():
            problems[rel] = "missing from the target"
        elif (digest := sha256_file(path)) != patch_set.manifest.get(rel):
            problems[rel] = (
                f"SHA-256 {digest[:12]}… is not the pinned "
                f"{patch_set.manifest.get(rel, '?')[:12]}…"
            )
    for rel in patch_set.overlay:
        if target.path(rel).exists():
            problems[rel] = "exists, but the patch set adds it as a new file"
    return problems


def unwritable_dirs(target: Target, patch_set: PatchSet) -> list[str]:
    dirs = {target.path(rel).parent for rel in patch_set.patched_files}
    for rel in patch_set.overlay:
        parent = target.path(rel).parent
        while not parent.exists():
            parent = parent.parent
        dirs.add(parent)
    return sorted(str(d) for d in dirs if not os.access(d, os.W_OK))


# --------------------------------------------------------------------------
# Journal-driven transactions
# --------------------------------------------------------------------------


def drifted_files(target: Target, journal: dict) -> list[str]:
    """Journal entries whose current content is not the applied result."""
    return [
        entry["path"]
        for entry in journal["files"] + journal["overlay"]
        if file_hash_or_none(target.path(entry["path"])) != entry["result"]
    ]


def at_base(target: Target, entry: dict) -> bool:
    """Whether a patched file is its original again (a symlink as a symlink)."""
    path = target.path(entry["path"])
    if entry.get("symlink") is not None and (
        not path.is_symlink() or os.readlink(path) != entry["symlink"]
    ):
        return False
    return file_hash_or_none(path) == entry["base"]


def new_stage(target: Target) -> Path:
    return Path(tempfile.mkdtemp(prefix="stage-", dir=target.state_dir))


def remove_stage(target: Target, stage: Path) -> None:
    try:
        shutil.rmtree(stage)
    except FileNotFoundError:
        pass
    except OSError as e:
        warn(f"{stage}: not removed ({e}); the next apply or revert removes it")
        target.unclean.append(str(stage))


@dataclass
class Restore:
    """What returning a journal's files to vLLM takes, checked before writing."""

    files: list[dict]  # patched files to restore from their backups
    remove: list[str]  # overlay files to delete
    kept: dict[str, str]  # edited files to save first: path -> their SHA-256


def plan_restore(
    target: Target, journal: dict, *, force: bool, any_version: bool
) -> Restore:
    """Check everything a restore needs, or raise before anything is written.

    Refuses edited or deleted files (unless ``force``), a vLLM other than the
    one the journal was written for (unless ``any_version``), a missing or
    corrupt backup (exit 4, as ``status`` says), and a destination of the
    wrong type or that this user cannot replace, or backups it cannot delete.
    """
    version = None if any_version else target.version()
    applied_to = journal["vllm_version"]
    if version is not None and applied_to not in (version, "unknown"):
        raise ApplyError(
            f"{target.root}: vLLM {version} is installed, but the patch set was "
            f"applied to vLLM {applied_to}; reverting would write {applied_to} "
            f"files into {version}. If vLLM {version} was installed over the "
            f"patched tree, its own files are in place: delete {target.state_dir} "
            "and the overlay files it lists instead; to put the "
            f"{applied_to} files back anyway, pass --any-version",
            code=EXIT_DRIFT,
        )
    kept_before = journal.get("kept", {})

    def known(entry: dict, current: str | None) -> bool:
        return current is not None and current in (
            entry["result"],
            kept_before.get(entry["path"]),
        )

    restore: list[dict] = []
    remove: list[str] = []
    unknown: list[str] = []
    for entry in journal["files"]:
        if at_base(target, entry):
            continue
        if not known(entry, file_hash_or_none(target.path(entry["path"]))):
            unknown.append(entry["path"])
        restore.append(entry)
    for entry in journal["overlay"]:
        path = target.path(entry["path"])
        if not os.path.lexists(path):
            if journal["state"] == "applied":  # deleted since apply
                unknown.append(entry["path"])
            continue
        if not known(entry, file_hash_or_none(path)):
            unknown.append(entry["path"])
        remove.append(entry["path"])
    if unknown and not force:
        raise ApplyError(
            "changed or deleted since apply, refusing to overwrite: "
            + ", ".join(unknown)
            + f" (in {target.root}); `{target.command('revert', '--force')}` keeps "
            f"each edited file as FILE{DRIFT_SUFFIX} (never overwriting an "
            "earlier one) and restores the originals",
            code=EXIT_DRIFT,
        )
    kept = {
        rel: digest
        for rel in [e["path"] for e in restore] + remove
        if (digest := file_hash_or_none(target.path(rel))) is not None
        and (rel in unknown or digest == kept_before.get(rel))
    }
    lost = lost_backups(target, restore)
    problems = list(lost)
    for rel in [e["path"] for e in restore] + remove:
        problems += destination_problems(target.path(rel))
    for directory in (target.state_dir, target.state_dir / "backups"):
        if directory.is_dir() and not os.access(directory, os.W_OK | os.X_OK):
            problems.append(
                f"{directory}: not writable by this user (revert deletes the "
                "backups and the journal there last)"
            )
    if problems:
        raise ApplyError(
            "cannot restore vLLM "
            + applied_to
            + ", nothing was changed:\n  "
            + "\n  ".join(dict.fromkeys(problems))
            + f"\nfix these and run it again; a lost backup means reinstalling vLLM "
            f"{applied_to} and deleting {target.state_dir}",
            code=EXIT_DRIFT if lost else EXIT_ERROR,
        )
    return Restore(restore, remove, kept)


def lost_backups(target: Target, entries: list[dict]) -> list[str]:
    """The backups of ``entries`` that are missing or not their original."""
    return [
        f"{target.state_dir / e['backup']}: the backup of {e['path']} is missing "
        "or corrupt"
        for e in entries
        if file_hash_or_none(target.state_dir / e["backup"]) != e["base"]
    ]


def destination_problems(path: Path) -> list[str]:
    """Why ``path`` cannot be replaced by a file or removed, checked before
    the first write: its directory, its type and its attributes."""
    if not path.parent.is_dir():
        return [f"{path.parent}: not a directory, where vLLM has one"]
    if not os.access(path.parent, os.W_OK | os.X_OK):
        return [f"{path.parent}: not writable by this user"]
    if os.path.isdir(path) and not path.is_symlink():
        return [f"{path}: a directory where a file belongs; move it away"]
    if path.exists() and is_immutable(path):
        return [f"{path}: immutable or append-only (`chattr -i`)"]
    return []


def keep_edit(target: Target, rel: str, digest: str) -> None:
    """Save an edited file next to itself before it is overwritten.

    The copy is a hard link under the first free name ``FILE.k3-sppp-drift``,
    ``FILE.k3-sppp-drift.1``, ...: creating a link never replaces a file, so
    an earlier saved edit is never lost.
    """
    path = target.path(rel)
    if file_hash_or_none(path) != digest:
        return  # restored already, by the run that saved it
    stem = path.name + DRIFT_SUFFIX
    names = [stem] + [f"{stem}.{n}" for n in range(1, 1000)]
    for name in names:
        candidate = path.with_name(name)
        if candidate.is_file() and sha256_file(candidate) == digest:
            return  # saved by a run that was interrupted after saving it
        try:
            os.link(path, candidate)
        except FileExistsError:
            continue
        except OSError:  # no hard links here: copy, still never overwriting
            try:
                with open(candidate, "xb") as f:
                    f.write(path.read_bytes())
                    f.flush()
                    os.fsync(f.fileno())
            except FileExistsError:
                continue
            os.chmod(candidate, path.stat().st_mode & 0o7777)
            target.adopt(candidate, like=path)
        say(f"kept your edited {rel} as {candidate}")
        return
    raise ApplyError(f"{path}: {len(names)} saved edits already; move them away")


def restore(target: Target, journal: dict, plan: Restore) -> int:
    """Carry out ``plan``: stage, record "reverting", save edits, swap, clean.

    Once the journal says "reverting", any failure leaves it in place, so the
    next ``apply`` or ``revert`` finishes the job.
    """
    stage = new_stage(target)
    try:
        for entry in plan.files:
            staged = stage / entry["path"]
            staged.parent.mkdir(parents=True, exist_ok=True)
            if entry.get("symlink") is not None:
                os.symlink(entry["symlink"], staged)
            else:
                shutil.copy2(target.state_dir / entry["backup"], staged)
                if sha256_file(staged) != entry["base"]:
                    raise ApplyError(
                        f"{staged}: copy of {entry['backup']} differs from it "
                        "(out of disk space?); nothing was changed"
                    )
            path = target.path(entry["path"])
            target.adopt(staged, like=path if path.exists() else path.parent)
        journal = dict(journal, state="reverting")
        journal["kept"] = {**journal.get("kept", {}), **plan.kept}
        try:
            target.write_journal(journal)
            for rel, digest in plan.kept.items():
                keep_edit(target, rel, digest)
            for entry in plan.files:
                path = target.path(entry["path"])
                link = os.readlink(path) if path.is_symlink() else None
                os.replace(stage / entry["path"], path)
                if link is not None and entry.get("symlink") is None:
                    warn(
                        f"{entry['path']} was a symbolic link of yours (-> {link}); "
                        "vLLM's original file replaces the link, its target is "
                        "untouched"
                    )
            for rel in plan.remove:
                target.path(rel).unlink(missing_ok=True)
            for rel in sorted(journal["created_dirs"], key=len, reverse=True):
                path = target.path(rel)
                with contextlib.suppress(FileNotFoundError):
                    shutil.rmtree(path / "__pycache__")
                try:
                    path.rmdir()
                except FileNotFoundError:
                    pass
                except OSError as e:
                    if e.errno != errno.ENOTEMPTY:
                        raise
                    warn(f"{path}: holds files k3-sppp did not write; left in place")
            target.clear_bytecode(
                [e["path"] for e in journal["files"] + journal["overlay"]]
            )
            for entry in journal["files"]:
                if not at_base(target, entry):
                    raise ApplyError(f"{entry['path']}: not the original after restore")
            for entry in journal["files"]:  # only its own: never an orphan
                (target.state_dir / entry["backup"]).unlink(missing_ok=True)
            with contextlib.suppress(FileNotFoundError, OSError):
                (target.state_dir / "backups").rmdir()  # unless others are there
            target.journal_path.unlink()
        except (OSError, ApplyError) as e:
            raise stopped("revert", target, e) from e
    finally:
        remove_stage(target, stage)
    return len(plan.files) + len(plan.remove)


def stopped(verb: str, target: Target, cause: object) -> ApplyError:
    return ApplyError(
        f"{verb} stopped part-way: {cause}; {target.journal_path} records what "
        f"was done. Fix the cause, then {finisher(target)} "
        f"(`{target.command('status')}` shows the state)",
        code=EXIT_INTERRUPTED,
    )


def edited_files(target: Target, journal: dict) -> list[str]:
    """Files of ``journal`` that are neither vLLM's, nor the result, nor an
    edit the journal already keeps: what only ``revert --force`` overwrites."""
    kept = journal.get("kept", {})
    edited = []
    for entry in journal["files"] + journal["overlay"]:
        current = file_hash_or_none(target.path(entry["path"]))
        if "base" in entry and at_base(target, entry):
            continue
        if current is None and "base" not in entry:
            continue
        if current is None or current not in (
            entry["result"],
            kept.get(entry["path"]),
        ):
            edited.append(entry["path"])
    return edited


def finisher(target: Target) -> str:
    """Which command finishes what the journal on disk records, exactly."""
    try:
        journal = target.read_journal()
        edited = edited_files(target, journal) if journal else []
    except (ApplyError, OSError):
        return f"`{target.command('status')}` says what finishes it"
    if journal is None:
        return f"`{target.command('revert')}` finishes it"
    if edited:
        return (
            f"only `{target.command('revert', '--force')}` finishes it (apply and "
            f"revert refuse the files edited since apply: {', '.join(edited)})"
        )
    if journal["state"] == "applied":  # a revert that stopped before it began
        return f"`{target.command('revert')}` finishes it"
    return f"`{target.command('apply')}` or `{target.command('revert')}` finishes it"


def put_back(
    target: Target, journal: dict, *, force: bool = False, any_version: bool = False
) -> int:
    """Return every file of ``journal`` to vLLM and drop the state."""
    return restore(
        target,
        journal,
        plan_restore(target, journal, force=force, any_version=any_version),
    )


def swap_in(target: Target, stage: Path, journal: dict) -> None:
    """Move staged results into the target; put everything back on failure.

    The journal ("applying") is written before the first backup, so from then
    on an interrupted run is finished by the next ``apply`` or ``revert``.
    """
    touched = [e["path"] for e in journal["files"] + journal["overlay"]]
    try:
        target.write_journal(journal)
        backups = target.state_dir / "backups"
        with contextlib.suppress(FileExistsError):
            target.mkdir(backups, mode=PRIVATE_DIR)
        for entry in journal["files"]:
            backup = target.state_dir / entry["backup"]
            if file_hash_or_none(backup) != entry["base"]:
                copy_atomic(target.path(entry["path"]), backup)
                target.adopt(backup)
            if sha256_file(backup) != entry["base"]:
                raise ApplyError(f"{backup}: differs from {entry['path']} once written")
        for rel in journal["created_dirs"]:
            parent = target.path(rel).parent
            target.mkdir(
                target.path(rel), like=parent, mode=parent.stat().st_mode & 0o7777
            )
        for entry in journal["files"]:
            target.adopt(stage / entry["path"], like=target.path(entry["path"]))
        for entry in journal["overlay"]:
            target.adopt(stage / entry["path"], like=target.path(entry["path"]).parent)
        for rel in touched:
            os.replace(stage / rel, target.path(rel))
        for entry in journal["files"] + journal["overlay"]:
            if sha256_file(target.path(entry["path"])) != entry["result"]:
                raise ApplyError(
                    f"{entry['path']}: content after the swap is not the staged result"
                )
        target.clear_bytecode(touched)
        journal["state"] = "applied"
        target.write_journal(journal)
    except BaseException as e:
        undo_apply(target, journal, e)
        raise


def undo_apply(target: Target, journal: dict, cause: BaseException) -> None:
    """After a failed swap, put every file back; raise saying what was left."""
    if target.journal_path.exists():
        try:
            put_back(target, dict(journal, state="applying"), any_version=True)
        except (OSError, ApplyError) as e:
            why = e.__cause__ if e.__cause__ is not None else e
            raise stopped("apply", target, f"{cause}; putting files back: {why}") from e
    else:
        with contextlib.suppress(OSError):  # a torn journal write
            target.remove_leftovers(None)
    if isinstance(cause, (OSError, ApplyError)):
        raise ApplyError(f"{cause}; every file was put back as it was") from cause


def cmd_apply(args: argparse.Namespace) -> int:
    target = resolve_target(args.target, args.patch_set)
    patch_set = select_series(args.patch_set, target)
    require_clean(patch_set)
    try:
        with locked(target):
            done = apply_locked(target, patch_set)
    except (ApplyError, OSError) as e:
        if not target.recovered or getattr(e, "code", EXIT_ERROR) != EXIT_ERROR:
            raise
        raise ApplyError(
            f"{e}; before this, the interrupted run recorded in "
            f"{target.journal_path} was finished: {target.root} holds vLLM's "
            "own files again, the patch set is not applied",
            code=EXIT_RECOVERED_ONLY,
        ) from e
    say(done)
    return finished(target)


def finished(target: Target) -> int:
    """The exit code of a run that did its work: 0, or 5 when it could not
    remove its stage directory or lock (``status`` reports those as 5 too)."""
    if not target.unclean:
        return EXIT_OK
    warn(
        "finished, but left "
        + ", ".join(target.unclean)
        + f"; `{target.command('status')}` lists it and the next apply or revert "
        "removes it (exit 5)"
    )
    return EXIT_INTERRUPTED


def apply_locked(target: Target, patch_set: PatchSet) -> str:
    """``apply`` with the lock held; returns what to report."""
    base = patch_set.base_version()
    revision = patch_set.revision()
    journal = target.read_journal()
    if journal is not None and journal["state"] == "applied":
        if journal["revision"] != revision:
            raise ApplyError(
                f"{target.root}: revision {journal['revision']} of the "
                f"patch set is applied, this checkout is {revision}; run "
                f"`{target.command('revert')}` first, then apply"
            )
        if drift := drifted_files(target, journal):
            raise ApplyError(
                f"{target.root}: applied, but changed since: "
                + ", ".join(drift)
                + f"; `{target.command('revert', '--force')}` keeps the edits "
                "aside and restores vLLM, then apply again",
                code=EXIT_DRIFT,
            )
        return (
            f"already applied (revision {revision}, {patch_set.describe()}) "
            f"in {target.root}"
        )
    if journal is None and (orphans := target.leftovers(None)[2]):
        raise ApplyError(lost_journal(target, orphans), code=EXIT_INTERRUPTED)
    if journal is not None:
        restored = put_back(target, journal)
        target.recovered = True
        say(
            f"recovered from an interrupted {journal['state']} started "
            f"{journal['started']}: {restored} file(s) restored to vLLM "
            f"{journal['vllm_version']}"
        )
    version = check_version(target, patch_set)
    if problems := base_drift(target, patch_set):
        raise ApplyError(
            f"{target.root} is not pristine vLLM {base}; "
            "nothing was written:\n  "
            + "\n  ".join(f"{rel}: {why}" for rel, why in problems.items())
            + f"\nreinstall vllm=={base} (or restore these files) "
            "and apply again",
            code=EXIT_DRIFT,
        )
    if blocked := unwritable_dirs(target, patch_set):
        raise ApplyError("not writable by this user: " + ", ".join(blocked))
    if blocked := immutable_paths(target, patch_set):
        raise ApplyError(
            "immutable or append-only (`chattr -i`), nothing was written: "
            + ", ".join(blocked)
        )
    stage_root = new_stage(target)
    try:
        stage = stage_root / "tree"
        stage.mkdir()
        make_repo(stage)
        copy_base(stage, patch_set.patched_files, target.path)
        failures = stage_patch_set(patch_set, stage, overlay=patch_set.overlay)
        if failures:
            name, problems = next(iter(failures.items()))
            raise ApplyError(
                f"{patch_set.patch_dir / name} does not apply to {target.root}: "
                + "; ".join(problems)
                + f" (`{target.command('check')}` lists every failing hunk)"
            )
        byte_compile(patch_set, stage, patch_set.written_files, target.interpreter())
        check_results(patch_set, stage)
        for rel in patch_set.patched_files:  # its original's mode, not the umask's
            os.chmod(stage / rel, target.path(rel).stat().st_mode & 0o7777)
        for rel in patch_set.overlay:
            os.chmod(stage / rel, new_file_mode(target, rel))
        journal = new_journal(target, patch_set, stage, revision, version)
        swap_in(target, stage, journal)
    finally:
        remove_stage(target, stage_root)
    return (
        f"applied revision {revision}, {patch_set.describe()}, to "
        f"{target.root}: {len(patch_set.patches)} patch(es), "
        f"{len(patch_set.patched_files)} file(s) patched, "
        f"{len(patch_set.overlay)} overlay file(s) added"
    )


def check_results(patch_set: PatchSet, stage: Path) -> None:
    """Refuse a staged file that is not what ``patches/patched.sha256`` says
    the patch set writes: the reviewed bytes, whatever produced these."""
    wrong = [
        f"{rel}: SHA-256 {digest[:12]}… is not the reviewed "
        f"{patch_set.results[rel][:12]}…"
        for rel in patch_set.written_files
        if (digest := sha256_file(stage / rel)) != patch_set.results[rel]
    ]
    if wrong:
        raise ApplyError(
            "the staged files are not the results "
            f"{patch_set.patch_dir / RESULTS} records; nothing was written:\n  "
            + "\n  ".join(wrong)
            + "\neither the patch set changed since its manifest was generated "
            f"(`{patch_set.manifest_command()}` regenerates it, `make lint` "
            "checks it) or this machine's git wrote other bytes"
        )


def new_file_mode(target: Target, rel: str) -> int:
    """The mode of a new overlay file: that of the modules beside it (of the
    nearest directory that exists), never the umask's."""
    parent = target.path(rel).parent
    while not parent.is_dir():
        parent = parent.parent
    for sibling in [parent / "__init__.py", *sorted(parent.glob("*.py"))]:
        if sibling.is_file():
            return sibling.stat().st_mode & 0o7777
    return parent.stat().st_mode & 0o666


def immutable_paths(target: Target, patch_set: PatchSet) -> list[str]:
    """Files apply replaces, and directories it writes in, that carry the
    immutable or append-only attribute (refused before anything is written,
    as ``revert`` does)."""
    paths = {target.path(rel) for rel in patch_set.patched_files}
    for rel in patch_set.written_files:
        parent = target.path(rel).parent
        while not parent.exists():
            parent = parent.parent
        paths.add(parent)
    return sorted(str(p) for p in paths if p.exists() and is_immutable(p))


def new_journal(
    target: Target, patch_set: PatchSet, stage: Path, revision: str, version: str | None
) -> dict:
    created_dirs: list[str] = []
    for rel in patch_set.overlay:
        parent = Path(rel).parent
        missing = []
        while not target.path(str(parent)).exists():
            missing.append(str(parent))
            parent = parent.parent
        created_dirs += [d for d in reversed(missing) if d not in created_dirs]
    files = []
    for rel in patch_set.patched_files:
        entry = {
            "path": rel,
            "base": patch_set.manifest[rel],
            "result": sha256_file(stage / rel),
            "backup": f"backups/{patch_set.manifest[rel]}",
        }
        if target.path(rel).is_symlink():
            entry["symlink"] = os.readlink(target.path(rel))
        files.append(entry)
    return {
        "format": JOURNAL_FORMAT,
        "state": "applying",
        "started": utc_now(),
        "revision": revision,
        "vllm_version": version or "unknown",
        # The series applied: status and a later apply compare against it.
        "base_version": patch_set.base_version(),
        "series": patch_set.series_name,
        "patches": [p.name for p in patch_set.patches],
        "files": files,
        "overlay": [
            {"path": rel, "result": sha256_file(stage / rel)}
            for rel in patch_set.overlay
        ],
        "created_dirs": created_dirs,
    }


def cmd_revert(args: argparse.Namespace) -> int:
    target = resolve_target(args.target, args.patch_set)
    with locked(target):
        journal = target.read_journal()
        if journal is not None:
            restored = put_back(
                target, journal, force=args.force, any_version=args.any_version
            )
            done = (
                f"reverted {target.root}: {restored} file(s) back to vLLM "
                f"{journal['vllm_version']}; revision {journal['revision']} "
                f"{applied_series(journal)}was applied"
            )
        elif orphans := target.leftovers(None)[2]:
            patch_set = select_series(args.patch_set, target)
            restored = revert_without_journal(target, patch_set, orphans)
            done = (
                f"reverted {target.root} without its journal: {restored} file(s) "
                "back to vLLM's originals, from the backups (the files of "
                f"{patch_set.describe()})"
            )
        else:
            done = f"not applied in {target.root}; nothing to revert"
    say(done)
    return finished(target)


def applied_series(journal: dict) -> str:
    """``of the vLLM 0.33.0 series (bases/0.33.0/patches) ``, as the journal
    records it; empty for a journal written before it did."""
    series, base = journal.get("series"), journal.get("base_version")
    if isinstance(series, str) and isinstance(base, str):
        return f"of the vLLM {base} series ({series}) "
    return ""


def lost_journal(target: Target, orphans: list[Path]) -> str:
    """What a lost journal left, and the command that recovers from it."""
    named = []
    for backup in orphans:
        rels = sorted(target.originals_by_hash.get(backup.name, []))
        named.append(
            f"{backup.name[:12]}… ({', '.join(rels) or 'a file no manifest names'})"
        )
    return (
        f"{target.journal_path} is missing, but {len(orphans)} backup(s) of "
        f"vLLM's original files are in {target.state_dir / 'backups'}: "
        + ", ".join(named)
        + f"; `{target.command('revert')}` restores the originals from them "
        "(no run deletes them meanwhile)"
    )


def revert_without_journal(
    target: Target, patch_set: PatchSet, orphans: list[Path]
) -> int:
    """Restore vLLM from backups no journal lists (the journal was lost).

    A backup goes back only to a file whose pinned base hash is its name and
    which is exactly the patch set's result (``patched.sha256``); an overlay
    file is removed only when it is exactly the result too.  Anything else is
    refused, naming it, before the first write.  Each step can be repeated:
    a restored file is original again, and backups go last.
    """
    by_hash: dict[str, list[str]] = {}
    for rel, digest in patch_set.manifest.items():
        by_hash.setdefault(digest, []).append(rel)
    back: list[tuple[str, Path]] = []
    remove: list[str] = []
    problems: list[str] = []
    for backup in orphans:
        rels = by_hash.get(backup.name)
        if not rels:
            problems.append(
                f"{backup}: the original of no file {patch_set.root}'s series "
                "patches; revert with the patch set that applied it (--patch-set)"
            )
        elif sha256_file(backup) != backup.name:
            problems.append(f"{backup}: corrupt (not the SHA-256 it is named by)")
        else:
            for rel in rels:
                current = file_hash_or_none(target.path(rel))
                if current == backup.name:
                    continue
                if current is not None and current == patch_set.results[rel]:
                    back.append((rel, backup))
                else:
                    problems.append(
                        f"{target.path(rel)}: neither vLLM's original nor this "
                        "patch set's result (edited, or another revision)"
                    )
    saved = {backup.name for backup in orphans}
    for rel in patch_set.patched_files:
        current = file_hash_or_none(target.path(rel))
        if current == patch_set.results[rel] and patch_set.manifest[rel] not in saved:
            problems.append(f"{target.path(rel)}: patched, but no backup of it is left")
    for rel in patch_set.overlay:
        current = file_hash_or_none(target.path(rel))
        if current == patch_set.results[rel]:
            remove.append(rel)
        elif current is not None:
            problems.append(
                f"{target.path(rel)}: not the file the patch set adds; left alone"
            )
    for rel in [rel for rel, _ in back] + remove:
        path = target.path(rel)
        if not os.access(path.parent, os.W_OK | os.X_OK):
            problems.append(f"{path.parent}: not writable by this user")
        elif is_immutable(path):
            problems.append(f"{path}: immutable or append-only (`chattr -i`)")
    if problems:
        raise ApplyError(
            f"{target.journal_path} is missing; cannot restore vLLM from the "
            "backups, nothing was changed:\n  "
            + "\n  ".join(dict.fromkeys(problems))
            + "\nfix these and revert again; the backups stay where they are"
        )
    stage = new_stage(target)
    changed = False
    try:
        for rel, backup in back:
            staged = stage / rel
            staged.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(backup, staged)
            if sha256_file(staged) != backup.name:
                raise ApplyError(
                    f"{staged}: copy of {backup} differs from it (out of disk "
                    "space?); nothing was changed"
                )
            target.adopt(staged, like=target.path(rel))
        try:
            # Overlay files first: once every original is back, no backup is
            # left to say that a revert is not finished.
            for rel in patch_set.overlay:
                if rel in remove:
                    target.path(rel).unlink(missing_ok=True)
                    changed = True
                remove_empty_parents(target, rel)
            for rel, _ in back:
                os.replace(stage / rel, target.path(rel))
                changed = True
            target.clear_bytecode([rel for rel, _ in back] + remove)
            for backup in orphans:
                if not target.backup_needed(backup.name):
                    backup.unlink()
            with contextlib.suppress(OSError):  # unless others are there
                (target.state_dir / "backups").rmdir()
        except (OSError, ApplyError) as e:
            if not changed:
                raise
            raise ApplyError(
                f"revert stopped part-way: {e}; run `{target.command('revert')}` "
                "again: it finishes from the backups that are left",
                code=EXIT_INTERRUPTED,
            ) from e
    finally:
        remove_stage(target, stage)
    return len(back) + len(remove)


def remove_empty_parents(target: Target, rel: str) -> None:
    """Remove the directories above a removed overlay file that it alone
    filled (apply made them: a vLLM directory holds files of its own)."""
    parent = target.path(rel).parent
    top = target.path("vllm")
    while parent != top and top in parent.parents:
        if not parent.is_dir():
            parent = parent.parent
            continue
        if any(entry.name != "__pycache__" for entry in parent.iterdir()):
            return
        with contextlib.suppress(FileNotFoundError):
            shutil.rmtree(parent / "__pycache__")
        with contextlib.suppress(FileNotFoundError):
            parent.rmdir()
        parent = parent.parent


def status(
    target: str | os.PathLike[str] | None = None,
    patch_set: str | os.PathLike[str] | None = None,
) -> dict:
    """Where ``target`` stands: the object ``apply.py status --json`` prints.

    Reads only, waiting while another run holds the target; never raises for
    what ``status`` reports as an error (``state`` "error"). Keys, in order
    (``schema_version`` 1; a new key keeps the version, a changed one bumps it):

    schema_version  1
    exit_code       what ``apply.py status`` exits with (the exit codes above)
    state           "not-applied", "applied", "applying" or "reverting" (an
                    apply or revert stopped part-way), "journal-lost" (no
                    journal, but backups of vLLM files: ``orphans``), or
                    "error"
    error           the message when ``state`` is "error", else null
    target          the directory that holds ``vllm/``; null if not found
    vllm_version    the target's vLLM version; null if it does not say
    patch_set       the patch-set directory compared against
    base_version    the vLLM version that patch set applies to
                    (``patches/base.version``); null if missing or malformed
    revision        the patch-set revision the journal records; null when
                    not applied
    patch_set_revision  that patch set's revision; ``revision`` differs from
                    it when another revision is applied (exit 6)
    started         when the applying (or stopped) run started, UTC; null
                    when not applied
    patches         patch names as applied; [] when not applied
    files           one object per vLLM file: ``path`` (relative to
                    ``target``), ``kind`` ("patched" or "new") and ``drift``:
                    null, or why the file is not what this state expects.
                    Applied: the journal's files, drift "changed since
                    apply", or (this revision) not the reviewed result of
                    ``patches/patched.sha256``. Not applied: the files the
                    patch set would patch or add, drift why each is not the
                    pinned base. Applying or reverting: the journal's files;
                    journal lost: the patch set's; drift null (not judged)
    drift           the paths of ``files`` whose ``drift`` is not null
    leftovers       paths a stopped run left in ``TARGET/.k3_sppp`` (the next
                    apply or revert removes them; exit 5)
    alien           paths there that k3-sppp did not write (left alone)
    orphans         backups no journal lists that may hold the only copy of
                    an original (exit 5; never removed, ``revert`` restores
                    from them)
    finish          the command that finishes a stopped run, restores from
                    orphans or removes leftovers, as a sentence; else null
    applied_to      the vLLM version the journal says the patch set was
                    applied to (``revert`` refuses another: exit 4); null
                    without a journal
    series          the series directory compared against (``patches`` or
                    ``bases/VERSION/patches`` of ``patch_set``): the one the
                    journal names where applied, else the one for the
                    target's vLLM version (the default series where the
                    patch set keeps none for it: exit 4); null if unknown
    bases           every vLLM version the patch set keeps a series for ->
                    that series' directory, the default first
    """
    report: dict = {
        "schema_version": STATUS_SCHEMA_VERSION,
        "exit_code": EXIT_ERROR,
        "state": "error",
        "error": None,
        "target": None,
        "vllm_version": None,
        "patch_set": str(Path(patch_set or PROJECT_DIR).resolve()),
        "base_version": None,
        "revision": None,
        "patch_set_revision": None,
        "started": None,
        "patches": [],
        "files": [],
        "drift": [],
        "leftovers": [],
        "alien": [],
        "orphans": [],
        "finish": None,
        "applied_to": None,
        "series": None,
        "bases": {},
    }
    try:
        status_of(report, as_path(target))
    except (ApplyError, OSError) as e:
        report["state"] = "error"
        report["error"] = str(e)
        report["exit_code"] = e.code if isinstance(e, ApplyError) else EXIT_ERROR
    return report


def as_path(path: str | os.PathLike[str] | None) -> Path | None:
    return None if path is None else Path(path)


def status_of(report: dict, target_path: Path | None) -> None:
    """Fill ``report`` (see ``status``) as far as the target can be read."""
    root = Path(report["patch_set"])
    with contextlib.suppress(ApplyError, OSError):
        report["bases"] = {v: str(d) for v, d in kept_versions(root).items()}
    target: Target | None = None
    with contextlib.suppress(ApplyError, OSError):
        target = resolve_target(target_path, root)
    private = (
        target is not None
        and target.state_dir.is_dir()
        and not os.access(target.state_dir, os.R_OK | os.X_OK)
    )
    if target is None or private:
        patch_set = load_patch_set(root)
    else:  # a vLLM the patch set keeps no series for: against the default
        patch_set = select_series(root, target, strict=False)
    report["series"] = str(patch_set.patch_dir)
    report["patch_set_revision"] = patch_set.revision()
    with contextlib.suppress(ApplyError):
        report["base_version"] = patch_set.base_version()
    require_clean(patch_set)  # no pin to compare against otherwise
    target = resolve_target(target_path, root)
    report["target"] = str(target.root)
    if private:
        raise ApplyError(
            f"{target.state_dir}: private to its owner (uid "
            f"{target.state_dir.stat().st_uid}); ask as that user or root"
        )
    with reading(target) as lock_left:
        journal = target.read_journal()
        ours, others, orphans = target.leftovers(journal)
        if lock_left:
            ours.append(target.lock_path)
        if (
            journal is None
            and target.state_dir.is_dir()
            and not ours + others + orphans
        ):
            ours.append(target.state_dir)  # empty: its run was killed early
        report["vllm_version"] = target.version()
        entries = [(rel, "patched") for rel in patch_set.patched_files]
        entries += [(rel, "new") for rel in patch_set.overlay]
        drift: dict[str, str] = {}
        if journal is None and orphans:
            state = "journal-lost"
        elif journal is None:
            state = "not-applied"
            drift = base_drift(target, patch_set)
        else:
            state = journal["state"]
            if state == "applied":
                changed = drifted_files(target, journal)
                drift = dict.fromkeys(changed, "changed since apply")
                restoring = [e for e in journal["files"] if not at_base(target, e)]
                for entry in restoring:
                    if entry["path"] not in drift and lost_backups(target, [entry]):
                        drift[entry["path"]] = (
                            "its backup is missing or corrupt; revert refuses"
                        )
                if journal["revision"] == report["patch_set_revision"]:
                    for rel, digest in patch_set.results.items():
                        if rel not in drift and (
                            file_hash_or_none(target.path(rel)) != digest
                        ):
                            drift[rel] = (
                                f"not the reviewed result ({RESULTS}); "
                                "installed so, not changed since"
                            )
            entries = [(e["path"], "patched") for e in journal["files"]]
            entries += [(e["path"], "new") for e in journal["overlay"]]
            report["revision"] = journal["revision"]
            report["started"] = journal["started"]
            report["patches"] = journal.get("patches", [])
        if state in ("applying", "reverting") or (ours and drift):
            report["finish"] = finisher(target)
        elif state == "journal-lost":
            report["finish"] = f"`{target.command('revert')}` restores them"
        elif ours:
            report["finish"] = (
                f"the next `{target.command('apply')}` or "
                f"`{target.command('revert')}` removes it"
            )
    report["applied_to"] = journal["vllm_version"] if journal else None
    report["state"] = state
    if state not in ("not-applied", "applied") or ours:
        code = EXIT_INTERRUPTED
    elif drift or other_version(report):
        code = EXIT_DRIFT
    elif state == "not-applied":
        code = EXIT_NOT_APPLIED
    elif report["revision"] != report["patch_set_revision"]:
        code = EXIT_OTHER_REVISION
    else:
        code = EXIT_OK
    report["state"] = state
    report["exit_code"] = code
    report["files"] = [
        {"path": rel, "kind": kind, "drift": drift.get(rel)} for rel, kind in entries
    ]
    report["drift"] = [rel for rel, _ in entries if rel in drift]
    report["leftovers"] = [str(path) for path in ours]
    report["alien"] = [str(path) for path in others]
    report["orphans"] = [str(path) for path in orphans]


def other_version(report: dict) -> bool:
    """Whether the target's vLLM is not the one ``apply`` (not applied) or
    ``revert`` (applied) accepts: both refuse it, so ``status`` exits 4."""
    want = report["base_version"]
    if report["state"] == "applied":
        want = report["applied_to"]
    return report["vllm_version"] not in (None, want, "unknown")


def series_line(report: dict) -> str:
    """Which series the report compares against, and which others there are."""
    series = Path(report["series"])
    root = Path(report["patch_set"])
    name = series.relative_to(root) if root in series.parents else series
    others = [v for v in report["bases"] if v != report["base_version"]]
    version = report["vllm_version"]
    if report["state"] == "not-applied" and version not in (None, *report["bases"]):
        kept = ", ".join(
            f"{v} ({Path(d).relative_to(root)})" for v, d in report["bases"].items()
        )
        return f"series:   none for vLLM {version} in {root}, which keeps {kept}"
    return f"series:   {name} of {root}, for vLLM {report['base_version']}" + (
        f" (also kept: {', '.join(others)})" if others else ""
    )


def status_text(report: dict) -> str:
    """What ``apply.py status`` prints for ``report`` (a ``status`` object)."""
    if report["state"] == "error":
        return f"error: {report['error']}"
    lines = [
        f"target:   {report['target']} (vLLM {report['vllm_version'] or 'unknown'})",
        series_line(report),
    ]
    state, files = report["state"], report["files"]
    if state == "not-applied":
        other = other_version(report)
        kept = ", ".join(report["bases"]) or report["base_version"]
        lines.append(
            "state:    not applied"
            + (
                f"; vLLM {report['vllm_version']} is not one the patch set keeps "
                f"a series for ({kept}), `apply` will refuse"
                if other
                else ""
            )
            + (
                "; base differs from the pin:"
                if report["drift"]
                else ("" if other else "; base matches the pin")
            )
        )
        lines += [f"  {f['path']}: {f['drift']}" for f in files if f["drift"]]
    elif state == "journal-lost":
        lines.append(
            "state:    journal lost: the journal is missing, but backups of "
            f"vLLM's originals are left; {report['finish']}"
        )
        lines += [f"  BACKUP {path}" for path in report["orphans"]]
    elif state != "applied":
        lines.append(
            f"state:    interrupted {state} (started {report['started']}); "
            f"{report['finish']}"
        )
    else:
        current = report["patch_set_revision"]
        where = Path(report["patch_set"]), Path(report["target"])
        lines.append(
            f"state:    applied revision {report['revision']} at {report['started']}"
            + (
                ""
                if report["revision"] == current
                else f" (this checkout is {current}: "
                f"`{command_line(*where, 'revert')}`, then "
                f"`{command_line(*where, 'apply')}`)"
            )
        )
        if other_version(report):
            lines.append(
                f"  vLLM {report['vllm_version']} is installed, the patch set was "
                f"applied to {report['applied_to']}: `revert` refuses "
                "(--any-version)"
            )
        for f in files:
            mark = "DRIFT" if f["drift"] else "ok"
            why = f" ({f['drift']})" if f["drift"] else ""
            lines.append(f"  {mark:<6}{f['kind']:<8}{f['path']}{why}")
        if report["drift"]:
            lines.append(f"{len(report['drift'])} file(s) not as applied")
    lines += [
        f"  LEFT  {path} (of a run that was stopped)" for path in report["leftovers"]
    ]
    if report["leftovers"] and state in ("applied", "not-applied"):
        lines.append(f"left by a stopped run: {report['finish']}")
    lines += [
        f"  ALIEN {path} (not written by k3-sppp; left alone)"
        for path in report["alien"]
    ]
    return "\n".join(lines)


def cmd_status(args: argparse.Namespace) -> int:
    report = status(args.target, args.patch_set)
    if args.json:
        say(json.dumps(report, indent=2))
    elif report["state"] != "error":
        say(status_text(report))
    if report["error"] is not None:
        tell(f"apply.py status: error: {report['error']}", "stderr")
    return report["exit_code"]


def pristine_source(target: Target) -> Callable[[str], Path | None]:
    """Map a vLLM path to its original file in ``target`` (None: absent).

    On an applied target the originals are the journal's backups.
    """
    journal = target.read_journal()
    backups = {}
    overlay = set()
    if journal is not None:
        if journal["state"] != "applied":
            raise ApplyError(
                f"{target.root}: an interrupted "
                f"{journal['state']}; {finisher(target)} first"
            )
        backups = {e["path"]: target.state_dir / e["backup"] for e in journal["files"]}
        overlay = {e["path"] for e in journal["overlay"]}

    def source(rel: str) -> Path | None:
        if rel in backups:
            return backups[rel]
        if rel in overlay or not target.path(rel).is_file():
            return None
        return target.path(rel)

    return source


def target_root(target: str | os.PathLike[str] | None = None) -> Path:
    """The directory that holds ``vllm/``, for ``target`` as ``--target``
    takes it (a venv, site-packages, checkout root or the package itself;
    default: this project's ``.venv``)."""
    return resolve_target(as_path(target)).root


def original_files(
    target: str | os.PathLike[str] | None = None,
) -> Callable[[str], Path | None]:
    """For a path relative to ``target_root(target)``, the file that holds its
    vLLM original: the file itself, or its backup where the patch set is
    applied; None for an overlay file or a file the target lacks.  Raises
    ``ApplyError`` where an apply or revert stopped part-way."""
    return pristine_source(resolve_target(as_path(target)))


def record_hashes(target: str | os.PathLike[str] | None = None) -> dict[str, str]:
    """SHA-256 (hex) of every file as the target's vLLM wheel shipped it (its
    dist-info ``RECORD``), by path relative to ``target_root(target)``."""
    return resolve_target(as_path(target)).record_hashes()


def base_version(patch_set: str | os.PathLike[str] | None = None) -> str:
    """The vLLM version ``patch_set``'s default series (default: this
    project's) applies to, from its ``patches/base.version``;
    ``ApplyError`` names that file if it is missing or malformed."""
    return load_patch_set(Path(patch_set or PROJECT_DIR).resolve()).base_version()


def bases(patch_set: str | os.PathLike[str] | None = None) -> dict[str, Path]:
    """Every vLLM version ``patch_set`` (default: this project) keeps a
    series for -> that series' directory: ``patches`` for the default
    (first), ``bases/VERSION/patches`` for each other, newest first."""
    return kept_versions(Path(patch_set or PROJECT_DIR).resolve())


def venv(version: str | None = None) -> Path:
    """This project's venv for vLLM ``version`` (default: the default
    series'): ``.venv``, or ``.venv-VERSION`` for another base; it may not
    exist yet (``make setup BASE=VERSION`` builds it)."""
    return project_venv(version)


def cmd_check(args: argparse.Namespace) -> int:
    target = resolve_target(args.target, args.patch_set)
    # A vLLM no series is kept for is dry-run with the default series: what
    # fails is what a port has to move (apply refuses it, exit 4).
    patch_set = select_series(args.patch_set, target, strict=False)
    require_clean(patch_set)
    base = patch_set.base_version()
    source = pristine_source(target)
    version = target.version()
    say(
        f"target: {target.root} (vLLM {version or 'unknown'}; "
        f"{patch_set.describe()}, pinned {base})"
    )
    drift = [
        f"{rel}: differs from the pinned base"
        for rel in patch_set.patched_files
        if (path := source(rel)) is not None
        and sha256_file(path) != patch_set.manifest[rel]
    ]
    with tempfile.TemporaryDirectory(prefix="k3-sppp-check-") as tmp:
        stage = Path(tmp) / "tree"
        stage.mkdir()
        make_repo(stage)
        copy_base(stage, patch_set.patched_files, source)
        failures = stage_patch_set(
            patch_set, stage, overlay=patch_set.overlay, keep_going=True
        )
        for patch in patch_set.patches:
            problems = failures.get(patch.name, [])
            say(f"  {'FAIL' if problems else 'ok':<5}{patch.name}")
            for problem in problems:
                say(f"         {problem} does not apply")
        for rel in patch_set.overlay:
            if source(rel) is not None:
                say(f"  FAIL {rel}: exists in the target, the overlay adds it")
                failures.setdefault("vllm_overlay", []).append(rel)
        if not failures:  # what apply compiles and compares, checked the same
            try:
                byte_compile(
                    patch_set, stage, patch_set.written_files, target.interpreter()
                )
                if not drift and version in (None, base):
                    check_results(patch_set, stage)
            except ApplyError as e:
                say(f"  FAIL {e}")
                failures["results"] = [str(e)]
    unkept = (
        f"vLLM {version} is installed; the patch set keeps a series for vLLM "
        f"{', '.join(kept_versions(patch_set.root))} ({patch_set.describe()} "
        "was tried)"
    )
    if failures:
        say(
            f"{len(failures)} of {len(patch_set.patches)} patch(es) fail; "
            "nothing was written"
            + (f"; {unkept}" if version not in (None, base) else "")
        )
        return EXIT_ERROR
    if drift or version not in (None, base):
        say(
            "the series applies, but the base is not the pinned "
            f"vLLM {base}; `apply` will refuse:"
        )
        if version not in (None, base):
            say(f"  {unkept}")
        for problem in drift:
            say(f"  {problem}")
        return EXIT_DRIFT
    say(f"the series applies cleanly to vLLM {base}")
    return EXIT_OK


# --------------------------------------------------------------------------
# Export, manifest and the editing workflow
# --------------------------------------------------------------------------


def make_repo(path: Path) -> None:
    git(["init", "-q", "--template="], path)  # no sample hooks to copy


def commit_all(repo: Path, message: str) -> None:
    git(["add", "-A"], repo)
    git([*GIT_IDENTITY, "commit", "-q", "--allow-empty", "-m", message], repo)


def copy_pristine(
    patch_set: PatchSet, target: Target, dest: Path, rels: list[str]
) -> None:
    """Copy verified original files into ``dest``."""
    source = pristine_source(target)
    for rel in rels:
        src = source(rel)
        if src is None:
            raise ApplyError(
                f"{target.root}: {rel} is missing; export needs the pinned vLLM sources"
            )
        if rel in patch_set.manifest and sha256_file(src) != patch_set.manifest[rel]:
            raise ApplyError(f"{src}: not the pinned vLLM base of {rel}")
        dst = dest / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, dst)


def pristine_repo(
    patch_set: PatchSet, target: Target, parent: Path, message: str | None = None
) -> Path:
    """A git repository in ``parent`` of the files the series patches, as
    pinned; committed as ``message`` when one is given."""
    repo = parent / "tree"
    repo.mkdir()
    make_repo(repo)
    copy_pristine(patch_set, target, repo, patch_set.patched_files)
    if message is not None:
        commit_all(repo, message)
    return repo


def cmd_export(args: argparse.Namespace) -> int:
    """One unified diff of the whole series (``export --pulls`` is
    ``_upstream.cmd_export_pulls``, chosen by the command line)."""
    target = resolve_target(args.target, args.patch_set)
    patch_set = select_series(args.patch_set, target)
    require_clean(patch_set)
    with tempfile.TemporaryDirectory(prefix="k3-sppp-export-") as tmp:
        repo = pristine_repo(patch_set, target, Path(tmp), "base")
        failures = stage_patch_set(patch_set, repo, overlay=patch_set.overlay_export)
        if failures:
            name, problems = next(iter(failures.items()))
            raise ApplyError(
                f"{patch_set.patch_dir / name} does not apply: " + "; ".join(problems)
            )
        git(["add", "-A"], repo)
        diff = git(list(DIFF_ARGS), repo).stdout
    preamble = "".join(
        f"# {line}\n"
        for line in [
            f"k3-sppp revision {patch_set.revision()} against vLLM "
            f"{patch_set.base_version()} ({patch_set.series_name})",
            *[f"{p.name}: {p.headers['Subject']}" for p in patch_set.patches],
            "Apply from a vLLM source root with `git apply`.",
        ]
    )
    text = preamble + diff
    if args.output:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(text, encoding="utf-8")
        say(f"wrote {args.output} ({text.count(chr(10))} lines)")
    else:
        sys.stdout.write(text)
    return EXIT_OK


def write_manifest(patch_set: PatchSet, target: Target) -> list[Path]:
    """Write both manifests: ``base.sha256`` from the wheel's RECORD, then
    ``patched.sha256`` from the series applied to those verified originals."""
    base_path = write_base_manifest(patch_set, target)
    patch_set = load_patch_set(patch_set.root, patch_set.patch_dir)
    with tempfile.TemporaryDirectory(prefix="k3-sppp-manifest-") as tmp:
        stage = Path(tmp) / "tree"
        stage.mkdir()
        make_repo(stage)
        copy_pristine(patch_set, target, stage, patch_set.patched_files)
        failures = stage_patch_set(patch_set, stage, overlay=patch_set.overlay)
        if failures:
            name, problems = next(iter(failures.items()))
            raise ApplyError(
                f"{patch_set.patch_dir / name} does not apply to vLLM "
                f"{patch_set.base_version()}: " + "; ".join(problems)
            )
        lines = [
            "# SHA-256 of every file the patch set writes into vLLM "
            f"{patch_set.base_version()}: the",
            "# series applied to the pinned originals, and the overlay files.",
            f"# Generated by {GENERATED_BY}; do not edit. apply",
            "# installs nothing else; where it is applied, `sha256sum -c` checks them.",
        ]
        lines += [
            f"{sha256_file(stage / rel)}  {rel}" for rel in patch_set.written_files
        ]
    path = patch_set.patch_dir / RESULTS
    write_atomic(path, ("\n".join(lines) + "\n").encode())
    return [base_path, path]


def write_base_manifest(patch_set: PatchSet, target: Target) -> Path:
    base = patch_set.base_version()
    version = target.version()
    if version != base:
        raise ApplyError(
            f"{target.root}: the manifest is generated from vLLM {base} "
            f"({patch_set.base_version_file}), found {version}"
        )
    record = target.record_hashes()
    lines = [
        f"# SHA-256 of the vLLM {base} files the series patches, as",
        "# shipped in the wheel (its dist-info RECORD). Generated by",
        f"# {GENERATED_BY}; do not edit. In a pristine",
        "# site-packages, `sha256sum -c` checks them.",
    ]
    for rel in patch_set.patched_files:
        if rel not in record:
            patches = [str(p.path) for p in patch_set.patches if rel in p.files]
            raise ApplyError(
                f"{rel}: not in vLLM {base}'s RECORD ({target.root}), but "
                f"{', '.join(patches)} changes it; a new file belongs in "
                f"{patch_set.overlay_dir}/ (or the base's own vllm_overlay/), "
                "not a patch"
            )
        lines.append(f"{record[rel]}  {rel}")
    path = patch_set.patch_dir / MANIFEST
    write_atomic(path, ("\n".join(lines) + "\n").encode())
    return path


def cmd_manifest(args: argparse.Namespace) -> int:
    target = resolve_target(args.target, args.patch_set)
    patch_set = select_series(args.patch_set, target)
    paths = write_manifest(patch_set, target)
    say(
        f"wrote {paths[0]} ({len(patch_set.patched_files)} file(s)) and "
        f"{paths[1]} ({len(patch_set.written_files)} file(s))"
    )
    return EXIT_OK


def series_prefix_problem(patch_set: PatchSet, target: Target) -> str | None:
    """The shortest prefix of the series that does not apply to the pinned
    sources and compile, named; None when every prefix does.

    Quilt users stop at any patch and drop patches from the end of a series,
    so each prefix must stand on its own: a patch that needs a later one to
    apply (or to compile) is out of order.
    """
    with tempfile.TemporaryDirectory(prefix="k3-sppp-lint-") as tmp:
        stage = Path(tmp) / "tree"
        stage.mkdir()
        make_repo(stage)
        copy_pristine(patch_set, target, stage, patch_set.patched_files)
        touched: list[str] = []
        for number, patch in enumerate(patch_set.patches, 1):
            prefix = f"patches/series: the first {number} patch(es), up to {patch.name}"
            if failures := apply_patch(stage, patch):
                return (
                    f"{prefix}, do not apply to vLLM {patch_set.base_version()}: "
                    + "; ".join(failures)
                    + " does not apply; move the patch after the one it needs"
                )
            touched += [rel for rel in patch.files if rel not in touched]
            try:
                byte_compile(patch_set, stage, touched, target.interpreter())
            except ApplyError as e:
                return f"{prefix}, do not compile: {e}"
        stage_patch_set(patch_set, stage, overlay=patch_set.overlay, skip_series=True)
        try:
            byte_compile(patch_set, stage, patch_set.overlay, target.interpreter())
            check_results(patch_set, stage)
        except ApplyError as e:
            return str(e)
    return None


def cmd_devtree(args: argparse.Namespace) -> int:
    target = resolve_target(args.target, args.patch_set)
    patch_set = select_series(args.patch_set, target)
    require_clean(patch_set)
    repo = args.dir.resolve()
    if repo.exists() and any(repo.iterdir()):
        raise ApplyError(
            f"{repo}: exists and is not empty; devtree makes a new one. If a "
            f"devtree run was stopped there, remove it (`rm -rf -- "
            f"{shlex.quote(str(repo))}`) and run devtree again; else name "
            "another directory"
        )
    repo.mkdir(parents=True, exist_ok=True)
    source = pristine_source(target)
    overlay = set(patch_set.overlay)
    rels = sorted(
        str(p.relative_to(target.root))
        for p in (target.root / "vllm").rglob("*.py")
        if "__pycache__" not in p.parts
    )
    copy_pristine(
        patch_set,
        target,
        repo,
        [rel for rel in rels if rel not in overlay and source(rel) is not None],
    )
    make_repo(repo)
    commit_all(repo, f"vLLM {patch_set.base_version()} sources")
    git(["tag", DEVTREE_BASE_TAG], repo)
    for patch in patch_set.patches:
        proc = git(
            [*GIT_IDENTITY, "am", "-q", "--keep-cr", str(patch.path)], repo, check=False
        )
        if proc.returncode != 0:
            raise ApplyError(
                f"{patch.path}: `git am` failed in {repo}:\n{proc.stdout}{proc.stderr}"
            )
    say(
        f"{repo}: {len(patch_set.patches)} commit(s) on tag "
        f"{DEVTREE_BASE_TAG} ({patch_set.describe()}); edit, commit (or "
        "rebase -i), then "
        f"`{command_line(patch_set.root, target.root, 'refresh', str(args.dir))}`"
    )
    return EXIT_OK


def cmd_refresh(args: argparse.Namespace) -> int:
    target = resolve_target(args.target, args.patch_set)
    patch_set = select_series(args.patch_set, target)
    repo = args.dir.resolve()
    if (
        git(
            ["rev-parse", "-q", "--verify", DEVTREE_BASE_TAG], repo, check=False
        ).returncode
        != 0
    ):
        raise ApplyError(
            f"{repo}: no tag {DEVTREE_BASE_TAG}; make it with "
            f"`{command_line(patch_set.root, None, 'devtree', 'DIR')}`"
        )
    top = git(["rev-parse", "--show-toplevel"], repo, check=False).stdout.strip()
    if not top or Path(top).resolve() != repo:
        raise ApplyError(
            f"{repo}: not the top of a git repository; refresh reads a devtree "
            f"made by `{command_line(patch_set.root, None, 'devtree', 'DIR')}`"
        )
    if git(["status", "--porcelain"], repo).stdout.strip():
        raise ApplyError(f"{repo}: uncommitted changes; commit them first")
    made_from = git(["log", "-1", "--format=%s", DEVTREE_BASE_TAG], repo).stdout
    if made_from.strip() != f"vLLM {patch_set.base_version()} sources":
        raise ApplyError(
            f"{repo}: made from {made_from.strip() or 'unknown sources'} "
            f"({DEVTREE_BASE_TAG}), but {target.root} selects "
            f"{patch_set.describe()}; refresh with --target a tree of the vLLM "
            "the devtree was made from"
        )
    with tempfile.TemporaryDirectory(prefix="k3-sppp-refresh-") as tmp:
        git([*FORMAT_PATCH_ARGS, "-q", "-o", tmp, f"{DEVTREE_BASE_TAG}..HEAD"], repo)
        fresh = sorted(Path(tmp).glob("*.patch"))
        for path in patch_set.patch_dir.glob("*.patch"):
            path.unlink()
        for path in fresh:
            shutil.copy2(path, patch_set.patch_dir / path.name)
    series = "".join(f"{p.name}\n" for p in fresh)
    write_atomic(patch_set.patch_dir / "series", series.encode())
    refreshed = load_patch_set(patch_set.root, patch_set.patch_dir)
    write_manifest(refreshed, target)
    refreshed = load_patch_set(patch_set.root, patch_set.patch_dir)
    require_clean(refreshed)
    say(f"wrote {len(fresh)} patch(es) and the manifest to {patch_set.patch_dir}")
    return EXIT_OK
