#!/usr/bin/env python3
"""Apply, revert and inspect the k3-sppp patch set on a vLLM tree.

A *target* is a directory that contains the ``vllm/`` package: a
``site-packages`` directory (the default is this project's ``.venv``), a vLLM
git checkout root, or a virtual environment (its ``site-packages`` is used).

Every write goes through one transaction: the series and the overlay files are
applied to a staged copy first, every result is hashed and byte-compiled, and
only then are files swapped in with ``os.replace`` under a lock, with a journal
in ``<target>/.k3_sppp/`` that lets ``apply`` or ``revert`` undo an
interrupted run.  Each file is therefore either byte-identical to vLLM
0.33.0 or byte-identical to the patched result; ``status`` verifies which.

Exit codes:
    0  success (``status``: applied, this revision, no drift)
    1  error; the target was left exactly as it was
    2  usage error
    3  ``status``: not applied
    4  base files differ from the pin, or patched files changed since apply
    5  ``status``: an interrupted apply or revert; run ``apply`` or ``revert``
    6  ``status``: applied from a different revision of the patch set
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
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

PROJECT_DIR = Path(__file__).resolve().parent

EXIT_OK = 0
EXIT_ERROR = 1
EXIT_NOT_APPLIED = 3
EXIT_DRIFT = 4
EXIT_INTERRUPTED = 5
EXIT_OTHER_REVISION = 6

STATE_DIR = ".k3_sppp"
JOURNAL = "journal.json"
JOURNAL_FORMAT = 1
MANIFEST = "base.sha256"
REQUIRED_HEADERS = ("Description", "Drop-When", "Last-Update")
FORWARDED_HEADERS = ("Forwarded", "Upstream-Status")
GIT_IDENTITY = (
    "-c",
    "user.name=k3-sppp",
    "-c",
    "user.email=k3-sppp@localhost",
    "-c",
    "commit.gpgsign=false",
)
DEVTREE_BASE_TAG = "k3-sppp-base"


class ApplyError(Exception):
    """A failure reported to the user as one message; nothing was written."""

    def __init__(self, message: str, code: int = EXIT_ERROR) -> None:
        super().__init__(message)
        self.code = code


def say(message: str) -> None:
    print(message, flush=True)


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def file_hash_or_none(path: Path) -> str | None:
    return sha256_file(path) if path.is_file() else None


def utc_now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, data: bytes, mode: int | None = None) -> None:
    """Write ``path`` through a temporary file and ``os.replace``."""
    tmp = path.with_name(f".{path.name}.k3-sppp-tmp")
    with open(tmp, "wb") as f:
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
    root: Path
    patches: list[Patch]
    overlay: list[str]  # installed overlay files (vllm/...)
    overlay_export: list[str]  # every overlay file, tests included
    manifest: dict[str, str]
    problems: list[str] = field(default_factory=list)

    @property
    def patch_dir(self) -> Path:
        return self.root / "patches"

    @property
    def overlay_dir(self) -> Path:
        return self.root / "vllm_overlay"

    @property
    def patched_files(self) -> list[str]:
        seen: dict[str, None] = {}
        for patch in self.patches:
            seen.update(dict.fromkeys(patch.files))
        return sorted(seen)

    def revision(self) -> str:
        """Content hash of series, patches and overlay files."""
        digest = hashlib.sha256()
        inputs = [self.patch_dir / "series"]
        inputs += [p.path for p in self.patches]
        inputs += [self.overlay_dir / rel for rel in self.overlay_export]
        for path in inputs:
            digest.update(str(path.relative_to(self.root)).encode() + b"\0")
            digest.update(path.read_bytes() + b"\0")
        return digest.hexdigest()[:12]


_DIFF_GIT = re.compile(r"^diff --git a/(\S+) b/(\S+)$")
_HUNK = re.compile(r"^@@ -(\d+)(?:,\d+)? \+\d+(?:,\d+)? @@")
_HEADER = re.compile(r"^([A-Z][A-Za-z-]*):\s?(.*)$")


def parse_patch(path: Path) -> Patch:
    """Read a format-patch file: its DEP-3 headers, files and hunks."""
    text = path.read_text(encoding="utf-8")
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


def read_manifest(path: Path) -> dict[str, str]:
    manifest: dict[str, str] = {}
    if not path.is_file():
        return manifest
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.strip() and not line.startswith("#"):
            digest, rel = line.split(maxsplit=1)
            manifest[rel.lstrip("*")] = digest
    return manifest


def load_patch_set(root: Path) -> PatchSet:
    """Load and lint the series; lint problems are kept in ``problems``."""
    patch_dir = root / "patches"
    series_file = patch_dir / "series"
    problems: list[str] = []
    if not series_file.is_file():
        raise ApplyError(
            f"{series_file}: no series file; a patch set needs "
            "patches/series (empty when there are no patches)"
        )
    names = [
        line.split("#", 1)[0].strip()
        for line in series_file.read_text(encoding="utf-8").splitlines()
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
        if not any(patch.headers.get(h) for h in FORWARDED_HEADERS):
            missing.append("Forwarded (or Upstream-Status)")
        if missing:
            problems.append(f"{path}: DEP-3 header lacks " + ", ".join(missing))
        if not patch.files:
            problems.append(f"{path}: holds no 'diff --git' section")
        patches.append(patch)
    for path in sorted(patch_dir.glob("*.patch")):
        if path.name not in names:
            problems.append(
                f"{path}: not listed in {series_file}; add it to "
                "the series or delete it"
            )
    overlay_dir = root / "vllm_overlay"
    overlay_export = (
        sorted(
            str(p.relative_to(overlay_dir))
            for p in overlay_dir.rglob("*")
            if p.is_file() and "__pycache__" not in p.parts
        )
        if overlay_dir.is_dir()
        else []
    )
    for rel in overlay_export:
        if not rel.startswith(("vllm/", "tests/")):
            problems.append(
                f"{overlay_dir / rel}: overlay files live under vllm/ "
                "(installed) or tests/ (export only)"
            )
    overlay = [rel for rel in overlay_export if rel.startswith("vllm/")]
    manifest = read_manifest(patch_dir / MANIFEST)
    patch_set = PatchSet(root, patches, overlay, overlay_export, manifest, problems)
    touched = set(patch_set.patched_files)
    if set(manifest) != touched:
        extra = sorted(set(manifest) - touched)
        lacking = sorted(touched - set(manifest))
        detail = "; ".join(
            part
            for part in (
                f"lacks {', '.join(lacking)}" if lacking else "",
                f"lists untouched {', '.join(extra)}" if extra else "",
            )
            if part
        )
        problems.append(
            f"{patch_dir / MANIFEST}: out of date ({detail}); "
            "run `python apply.py manifest`"
        )
    for rel in overlay:
        if rel in touched:
            problems.append(
                f"vllm_overlay/{rel}: also changed by a patch; "
                "a file is either patched or new"
            )
    return patch_set


def require_clean(patch_set: PatchSet) -> None:
    if patch_set.problems:
        raise ApplyError(
            "the patch set is inconsistent:\n  " + "\n  ".join(patch_set.problems)
        )


def read_pins() -> dict[str, str]:
    config = configparser.ConfigParser()
    config.read(PROJECT_DIR / "setup.cfg")
    return dict(config["k3_sppp"])


# --------------------------------------------------------------------------
# The target
# --------------------------------------------------------------------------


@dataclass
class Target:
    root: Path

    @property
    def state_dir(self) -> Path:
        return self.root / STATE_DIR

    @property
    def journal_path(self) -> Path:
        return self.state_dir / JOURNAL

    def path(self, rel: str) -> Path:
        return self.root / rel

    def version(self) -> str | None:
        """vLLM version from ``vllm/_version.py`` or the wheel's METADATA."""
        version_file = self.root / "vllm" / "_version.py"
        if version_file.is_file():
            match = re.search(
                r"^__version__\s*=[^'\"\n]*['\"]([^'\"]+)['\"]",
                version_file.read_text(encoding="utf-8"),
                re.MULTILINE,
            )
            if match:
                return match.group(1)
        for metadata in self.root.glob("vllm-*.dist-info/METADATA"):
            for line in metadata.read_text(encoding="utf-8").splitlines():
                if line.startswith("Version:"):
                    return line.split(":", 1)[1].strip()
        return None

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

    def read_journal(self) -> dict | None:
        if not self.journal_path.is_file():
            return None
        try:
            journal = json.loads(self.journal_path.read_text(encoding="utf-8"))
        except ValueError as e:
            raise ApplyError(
                f"{self.journal_path}: unreadable journal ({e}); inspect it by hand"
            ) from e
        if journal.get("format") != JOURNAL_FORMAT:
            raise ApplyError(
                f"{self.journal_path}: journal format "
                f"{journal.get('format')!r} is not "
                f"{JOURNAL_FORMAT}; use the k3-sppp checkout "
                "that applied it"
            )
        return journal

    def write_journal(self, journal: dict) -> None:
        write_atomic(
            self.journal_path,
            (json.dumps(journal, indent=2, sort_keys=True) + "\n").encode(),
        )

    def clear_bytecode(self, rels: list[str]) -> None:
        """Drop cached bytecode of the given modules (stale after a swap)."""
        for rel in rels:
            path = self.path(rel)
            if path.suffix != ".py":
                continue
            cache = path.parent / "__pycache__"
            for pyc in cache.glob(f"{path.stem}.*.pyc"):
                pyc.unlink()


def default_target() -> Path:
    venv = PROJECT_DIR / ".venv"
    if not venv.is_dir():
        raise ApplyError(
            f"{venv}: no project venv; run `make setup` (or "
            "`make apply`), or pass --target"
        )
    return venv


def resolve_target(path: Path | None) -> Target:
    """Find the directory that holds ``vllm/`` for a user-given path."""
    path = (path or default_target()).resolve()
    if path.is_dir() and not os.access(path, os.R_OK | os.X_OK):
        raise ApplyError(f"{path}: not readable by this user")
    if (path / "pyvenv.cfg").is_file():
        candidates = sorted(path.glob("lib/python*/site-packages"))
        if not candidates:
            raise ApplyError(
                f"{path}: a virtual environment without lib/python*/site-packages"
            )
        path = candidates[-1]
    if path.name == "vllm" and (path / "__init__.py").is_file():
        path = path.parent
    if not (path / "vllm" / "__init__.py").is_file():
        raise ApplyError(
            f"{path}: no vllm/ package here; pass a site-packages directory, "
            "a vLLM checkout root, a venv, or the vllm/ package itself"
        )
    return Target(path)


@contextlib.contextmanager
def locked(target: Target) -> Iterator[None]:
    """Hold the target's lock; leave no lock file or empty state behind."""
    if not os.access(target.root, os.W_OK):
        raise ApplyError(
            f"{target.root}: not writable by this user; run as "
            "the owner of the vLLM install"
        )
    target.state_dir.mkdir(exist_ok=True)
    lock_path = target.state_dir / "lock"
    while True:
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip()
            os.close(fd)
            if e.errno not in (errno.EAGAIN, errno.EACCES):
                raise
            raise ApplyError(
                f"{lock_path}: another k3-sppp run holds this target "
                f"(pid {holder or '?'}); wait for it to finish"
            ) from e
        with contextlib.suppress(FileNotFoundError):
            if os.stat(lock_path).st_ino == os.fstat(fd).st_ino:
                break
        os.close(fd)  # the holder before us removed that file; lock anew
    try:
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        for stale in target.state_dir.glob("stage-*"):
            shutil.rmtree(stale)  # left by a run that was killed
        yield
    finally:
        lock_path.unlink()
        if not any(target.state_dir.iterdir()):
            target.state_dir.rmdir()
        os.close(fd)


# --------------------------------------------------------------------------
# git apply, outside any repository
# --------------------------------------------------------------------------


def git(
    args: list[str],
    cwd: Path,
    check: bool = True,
) -> subprocess.CompletedProcess[str]:
    """Run git with repository discovery stopped at ``cwd``'s parent."""
    env = dict(
        os.environ,
        GIT_CEILING_DIRECTORIES=str(cwd.parent),
        LC_ALL="C",
        GIT_CONFIG_NOSYSTEM="1",
    )
    for var in ("GIT_DIR", "GIT_WORK_TREE", "GIT_INDEX_FILE"):
        env.pop(var, None)
    try:
        proc = subprocess.run(
            ["git", *args], cwd=cwd, env=env, text=True, capture_output=True
        )
    except FileNotFoundError as e:
        raise ApplyError(
            "git is not installed; k3-sppp applies patches with `git apply`"
        ) from e
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
    patch_set: PatchSet, stage: Path, *, overlay: list[str], keep_going: bool = False
) -> dict[str, list[str]]:
    """Apply the series, then add ``overlay``; return failures per patch."""
    failures: dict[str, list[str]] = {}
    for patch in patch_set.patches:
        if problems := apply_patch(stage, patch):
            failures[patch.name] = problems
            if not keep_going:
                return failures
    for rel in overlay:
        dst = stage / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(patch_set.overlay_dir / rel, dst)
    for leftover in stage.rglob("*.rej"):
        leftover.unlink()
    return failures


def byte_compile(stage: Path, rels: list[str]) -> None:
    for rel in rels:
        if not rel.endswith(".py"):
            continue
        try:
            compile((stage / rel).read_bytes(), rel, "exec", dont_inherit=True)
        except SyntaxError as e:
            raise ApplyError(
                f"{rel}:{e.lineno}: the patched file does not "
                f"compile ({e.msg}); fix the patch or overlay "
                "file that changes it"
            ) from e


# --------------------------------------------------------------------------
# Checks against the pin
# --------------------------------------------------------------------------


def check_version(target: Target, pins: dict[str, str]) -> str | None:
    version = target.version()
    if version is not None and version != pins["vllm"]:
        raise ApplyError(
            f"{target.root}: vLLM {version} found, the patch set is pinned to "
            f"{pins['vllm']}; install vllm=={pins['vllm']} there, or port the "
            "series (`python apply.py check --target ...` shows what fails)"
        )
    return version


def base_drift(target: Target, patch_set: PatchSet) -> list[str]:
    """Files whose content is not the pinned 0.33.0 base, with the reason."""
    problems = []
    for rel in patch_set.patched_files:
        path = target.path(rel)
        if not path.is_file():
            problems.append(f"{rel}: missing from the target")
        elif (digest := sha256_file(path)) != patch_set.manifest.get(rel):
            problems.append(
                f"{rel}: SHA-256 {digest[:12]}… is not the pinned "
                f"{patch_set.manifest.get(rel, '?')[:12]}…"
            )
    for rel in patch_set.overlay:
        if target.path(rel).exists():
            problems.append(f"{rel}: exists, but the patch set adds it as a new file")
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


def roll_back(target: Target, journal: dict, *, force: bool = False) -> int:
    """Return every journal file to its base; raise naming unknown content.

    Safe to repeat: files already at their base are left alone.
    """
    unknown = []
    for entry in journal["files"]:
        current = file_hash_or_none(target.path(entry["path"]))
        if current not in (entry["base"], entry["result"]):
            unknown.append(entry["path"])
    for entry in journal["overlay"]:
        current = file_hash_or_none(target.path(entry["path"]))
        if current not in (None, entry["result"]):
            unknown.append(entry["path"])
    if unknown and not force:
        raise ApplyError(
            "changed since apply, refusing to overwrite: "
            + ", ".join(unknown)
            + f" (in {target.root}); save your edits, then "
            "`python apply.py revert --force` restores the originals",
            code=EXIT_DRIFT,
        )
    for rel in unknown:
        edited = target.path(rel)
        if edited.exists():
            keep = edited.with_name(edited.name + ".k3-sppp-drift")
            shutil.copy2(edited, keep)
            say(f"kept your edited {rel} as {keep}")
    restored = 0
    for entry in journal["files"]:
        path = target.path(entry["path"])
        if file_hash_or_none(path) == entry["base"]:
            continue
        backup = target.state_dir / entry["backup"]
        if sha256_file(backup) != entry["base"]:
            raise ApplyError(
                f"{backup}: backup of {entry['path']} is corrupt; reinstall vLLM 0.33.0"
            )
        copy_atomic(backup, path)
        restored += 1
    for entry in journal["overlay"]:
        path = target.path(entry["path"])
        if path.exists():
            path.unlink()
            restored += 1
    for rel in sorted(journal["created_dirs"], key=len, reverse=True):
        path = target.path(rel)
        shutil.rmtree(path / "__pycache__", ignore_errors=True)
        with contextlib.suppress(OSError):  # gone already, or holds user files
            path.rmdir()
    target.clear_bytecode([e["path"] for e in journal["files"] + journal["overlay"]])
    for entry in journal["files"]:
        if sha256_file(target.path(entry["path"])) != entry["base"]:
            raise ApplyError(
                f"{entry['path']}: still not the original after "
                "restore; reinstall vLLM 0.33.0"
            )
    return restored


def finish_revert(target: Target) -> None:
    """Drop the journal and backups once every file is back at its base."""
    target.journal_path.unlink()
    shutil.rmtree(target.state_dir / "backups", ignore_errors=True)


def recover_if_interrupted(target: Target, journal: dict | None) -> None:
    if journal is None or journal["state"] == "applied":
        return
    restored = roll_back(target, journal)
    finish_revert(target)
    say(
        f"recovered from an interrupted {journal['state']} started "
        f"{journal['started']}: {restored} file(s) restored to vLLM "
        f"{journal['vllm_version']}"
    )


def swap_in(target: Target, patch_set: PatchSet, stage: Path, journal: dict) -> None:
    """Move staged results into the target; undo everything on failure."""
    for entry in journal["files"]:
        backup = target.state_dir / entry["backup"]
        if file_hash_or_none(backup) != entry["base"]:
            copy_atomic(target.path(entry["path"]), backup)
    target.write_journal(journal)
    try:
        for rel in journal["created_dirs"]:
            target.path(rel).mkdir()
        for entry in journal["files"] + journal["overlay"]:
            os.replace(stage / entry["path"], target.path(entry["path"]))
        for entry in journal["files"] + journal["overlay"]:
            if sha256_file(target.path(entry["path"])) != entry["result"]:
                raise ApplyError(
                    f"{entry['path']}: content after the swap is not the staged result"
                )
    except BaseException:
        roll_back(target, journal, force=True)
        finish_revert(target)
        raise
    target.clear_bytecode([e["path"] for e in journal["files"] + journal["overlay"]])
    journal["state"] = "applied"
    target.write_journal(journal)


def cmd_apply(args: argparse.Namespace) -> int:
    patch_set = load_patch_set(args.patch_set)
    require_clean(patch_set)
    pins = read_pins()
    target = resolve_target(args.target)
    revision = patch_set.revision()
    with locked(target):
        journal = target.read_journal()
        if journal is not None and journal["state"] == "applied":
            if journal["revision"] != revision:
                raise ApplyError(
                    f"{target.root}: revision {journal['revision']} of the "
                    f"patch set is applied, this checkout is {revision}; run "
                    "`make revert` first, then apply"
                )
            if drift := drifted_files(target, journal):
                raise ApplyError(
                    f"{target.root}: applied, but changed since: "
                    + ", ".join(drift)
                    + "; `make revert` (with --force to "
                    "discard the edits) and apply again",
                    code=EXIT_DRIFT,
                )
            say(f"already applied (revision {revision}) in {target.root}")
            return EXIT_OK
        recover_if_interrupted(target, journal)
        version = check_version(target, pins)
        if problems := base_drift(target, patch_set):
            raise ApplyError(
                f"{target.root} is not pristine vLLM {pins['vllm']}; "
                "nothing was written:\n  "
                + "\n  ".join(problems)
                + f"\nreinstall vllm=={pins['vllm']} (or restore these files) "
                "and apply again",
                code=EXIT_DRIFT,
            )
        if blocked := unwritable_dirs(target, patch_set):
            raise ApplyError("not writable by this user: " + ", ".join(blocked))
        stage_root = Path(tempfile.mkdtemp(prefix="stage-", dir=target.state_dir))
        try:
            stage = stage_root / "tree"
            stage.mkdir()
            copy_base(stage, patch_set.patched_files, target.path)
            failures = stage_patch_set(patch_set, stage, overlay=patch_set.overlay)
            if failures:
                name, problems = next(iter(failures.items()))
                raise ApplyError(
                    f"patches/{name} does not apply to {target.root}: "
                    + "; ".join(problems)
                    + " (`python apply.py check` lists every failing hunk)"
                )
            byte_compile(stage, patch_set.patched_files + patch_set.overlay)
            (target.state_dir / "backups").mkdir(exist_ok=True)
            journal = new_journal(target, patch_set, stage, revision, version)
            swap_in(target, patch_set, stage, journal)
        finally:
            shutil.rmtree(stage_root, ignore_errors=True)
    say(
        f"applied revision {revision} to {target.root}: "
        f"{len(patch_set.patches)} patch(es), "
        f"{len(patch_set.patched_files)} file(s) patched, "
        f"{len(patch_set.overlay)} overlay file(s) added"
    )
    return EXIT_OK


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
    return {
        "format": JOURNAL_FORMAT,
        "state": "applying",
        "started": utc_now(),
        "revision": revision,
        "vllm_version": version or "unknown",
        "patches": [p.name for p in patch_set.patches],
        "files": [
            {
                "path": rel,
                "base": patch_set.manifest[rel],
                "result": sha256_file(stage / rel),
                "backup": f"backups/{patch_set.manifest[rel]}",
            }
            for rel in patch_set.patched_files
        ],
        "overlay": [
            {"path": rel, "result": sha256_file(stage / rel)}
            for rel in patch_set.overlay
        ],
        "created_dirs": created_dirs,
    }


def cmd_revert(args: argparse.Namespace) -> int:
    target = resolve_target(args.target)
    with locked(target):
        journal = target.read_journal()
        if journal is None:
            say(f"not applied in {target.root}; nothing to revert")
            return EXIT_OK
        restored = roll_back(target, journal, force=args.force)
        finish_revert(target)
    say(
        f"reverted {target.root}: {restored} file(s) back to vLLM "
        f"{journal['vllm_version']}"
    )
    return EXIT_OK


def cmd_status(args: argparse.Namespace) -> int:
    patch_set = load_patch_set(args.patch_set)
    target = resolve_target(args.target)
    journal = target.read_journal()
    say(f"target:   {target.root} (vLLM {target.version() or 'unknown'})")
    if journal is None:
        problems = base_drift(target, patch_set)
        say(
            "state:    not applied"
            + ("; base differs from the pin:" if problems else "; base matches the pin")
        )
        for problem in problems:
            say(f"  {problem}")
        return EXIT_DRIFT if problems else EXIT_NOT_APPLIED
    if journal["state"] != "applied":
        say(
            f"state:    interrupted {journal['state']} (started "
            f"{journal['started']}); `make apply` or `make revert` recovers"
        )
        return EXIT_INTERRUPTED
    revision = patch_set.revision()
    say(
        f"state:    applied revision {journal['revision']} at "
        f"{journal['started']}"
        + (
            ""
            if journal["revision"] == revision
            else f" (this checkout is {revision}: make revert && make apply)"
        )
    )
    drift = set(drifted_files(target, journal))
    for kind, entries in (("patched", journal["files"]), ("new", journal["overlay"])):
        for entry in entries:
            mark = "DRIFT" if entry["path"] in drift else "ok"
            say(f"  {mark:<6}{kind:<8}{entry['path']}")
    if drift:
        say(f"{len(drift)} file(s) changed since apply")
        return EXIT_DRIFT
    return EXIT_OK if journal["revision"] == revision else EXIT_OTHER_REVISION


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
                f"{journal['state']}; run `make apply` or "
                "`make revert` first"
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


def cmd_check(args: argparse.Namespace) -> int:
    patch_set = load_patch_set(args.patch_set)
    require_clean(patch_set)
    pins = read_pins()
    target = resolve_target(args.target)
    source = pristine_source(target)
    version = target.version()
    say(f"target: {target.root} (vLLM {version or 'unknown'}, pinned {pins['vllm']})")
    drift = [
        f"{rel}: differs from the pinned base"
        for rel in patch_set.patched_files
        if (path := source(rel)) is not None
        and sha256_file(path) != patch_set.manifest[rel]
    ]
    with tempfile.TemporaryDirectory(prefix="k3-sppp-check-") as tmp:
        stage = Path(tmp) / "tree"
        stage.mkdir()
        copy_base(stage, patch_set.patched_files, source)
        failures = stage_patch_set(patch_set, stage, overlay=[], keep_going=True)
    for patch in patch_set.patches:
        problems = failures.get(patch.name, [])
        say(f"  {'FAIL' if problems else 'ok':<5}{patch.name}")
        for problem in problems:
            say(f"         {problem} does not apply")
    for rel in patch_set.overlay:
        if source(rel) is not None:
            say(f"  FAIL {rel}: exists in the target, the overlay adds it")
            failures.setdefault("vllm_overlay", []).append(rel)
    if failures:
        say(
            f"{len(failures)} of {len(patch_set.patches)} patch(es) fail; "
            "nothing was written"
        )
        return EXIT_ERROR
    if drift or version not in (None, pins["vllm"]):
        say(
            "the series applies, but the base is not the pinned "
            f"vLLM {pins['vllm']}; `apply` will refuse:"
        )
        for problem in drift:
            say(f"  {problem}")
        return EXIT_DRIFT
    say(f"the series applies cleanly to vLLM {pins['vllm']}")
    return EXIT_OK


# --------------------------------------------------------------------------
# Export, manifest and the editing workflow
# --------------------------------------------------------------------------


def make_repo(path: Path) -> None:
    git(["init", "-q"], path)


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


def cmd_export(args: argparse.Namespace) -> int:
    patch_set = load_patch_set(args.patch_set)
    require_clean(patch_set)
    target = resolve_target(args.target)
    with tempfile.TemporaryDirectory(prefix="k3-sppp-export-") as tmp:
        repo = Path(tmp) / "tree"
        repo.mkdir()
        make_repo(repo)
        copy_pristine(patch_set, target, repo, patch_set.patched_files)
        commit_all(repo, "base")
        failures = stage_patch_set(patch_set, repo, overlay=patch_set.overlay_export)
        if failures:
            name, problems = next(iter(failures.items()))
            raise ApplyError(f"patches/{name} does not apply: " + "; ".join(problems))
        git(["add", "-A"], repo)
        diff = git(
            [
                "-c",
                "core.quotepath=off",
                "diff",
                "--cached",
                "--no-color",
                "--no-ext-diff",
                "--src-prefix=a/",
                "--dst-prefix=b/",
            ],
            repo,
        ).stdout
    preamble = "".join(
        f"# {line}\n"
        for line in [
            f"k3-sppp revision {patch_set.revision()} against vLLM "
            + read_pins()["vllm"],
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


def write_manifest(patch_set: PatchSet, target: Target) -> Path:
    pins = read_pins()
    version = target.version()
    if version != pins["vllm"]:
        raise ApplyError(
            f"{target.root}: the manifest is generated from "
            f"vLLM {pins['vllm']}, found {version}"
        )
    record = target.record_hashes()
    lines = [
        f"# SHA-256 of the vLLM {pins['vllm']} files the series patches, as",
        "# shipped in the wheel (its dist-info RECORD). Generated by",
        "# `python apply.py manifest`; do not edit. In a pristine",
        "# site-packages, `sha256sum -c` checks them.",
    ]
    for rel in patch_set.patched_files:
        if rel not in record:
            raise ApplyError(
                f"{rel}: not in vLLM {pins['vllm']}'s RECORD; a "
                "new file belongs in vllm_overlay/, not a patch"
            )
        lines.append(f"{record[rel]}  {rel}")
    path = patch_set.patch_dir / MANIFEST
    write_atomic(path, ("\n".join(lines) + "\n").encode())
    return path


def cmd_manifest(args: argparse.Namespace) -> int:
    patch_set = load_patch_set(args.patch_set)
    path = write_manifest(patch_set, resolve_target(args.target))
    say(f"wrote {path} ({len(patch_set.patched_files)} file(s))")
    return EXIT_OK


def cmd_lint(args: argparse.Namespace) -> int:
    patch_set = load_patch_set(args.patch_set)
    require_clean(patch_set)
    say(
        f"{len(patch_set.patches)} patch(es), "
        f"{len(patch_set.overlay_export)} overlay file(s): consistent"
    )
    return EXIT_OK


def cmd_devtree(args: argparse.Namespace) -> int:
    patch_set = load_patch_set(args.patch_set)
    require_clean(patch_set)
    target = resolve_target(args.target)
    repo = args.dir.resolve()
    if repo.exists() and any(repo.iterdir()):
        raise ApplyError(f"{repo}: exists and is not empty")
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
    commit_all(repo, f"vLLM {read_pins()['vllm']} sources")
    git(["tag", DEVTREE_BASE_TAG], repo)
    for patch in patch_set.patches:
        proc = git(
            [*GIT_IDENTITY, "am", "-q", "--keep-cr", str(patch.path)], repo, check=False
        )
        if proc.returncode != 0:
            raise ApplyError(
                f"patches/{patch.name}: `git am` failed in {repo}:"
                f"\n{proc.stdout}{proc.stderr}"
            )
    say(
        f"{repo}: {len(patch_set.patches)} commit(s) on tag "
        f"{DEVTREE_BASE_TAG}; edit, commit (or rebase -i), then "
        f"`python apply.py refresh {args.dir}`"
    )
    return EXIT_OK


def cmd_refresh(args: argparse.Namespace) -> int:
    patch_set = load_patch_set(args.patch_set)
    repo = args.dir.resolve()
    if (
        git(
            ["rev-parse", "-q", "--verify", DEVTREE_BASE_TAG], repo, check=False
        ).returncode
        != 0
    ):
        raise ApplyError(
            f"{repo}: no tag {DEVTREE_BASE_TAG}; make it with "
            "`python apply.py devtree DIR`"
        )
    if git(["status", "--porcelain"], repo).stdout.strip():
        raise ApplyError(f"{repo}: uncommitted changes; commit them first")
    with tempfile.TemporaryDirectory(prefix="k3-sppp-refresh-") as tmp:
        git(
            [
                "format-patch",
                "-q",
                "-N",
                "--zero-commit",
                "--no-signature",
                "-o",
                tmp,
                f"{DEVTREE_BASE_TAG}..HEAD",
            ],
            repo,
        )
        fresh = sorted(Path(tmp).glob("*.patch"))
        for path in patch_set.patch_dir.glob("*.patch"):
            path.unlink()
        for path in fresh:
            shutil.copy2(path, patch_set.patch_dir / path.name)
    series = "".join(f"{p.name}\n" for p in fresh)
    write_atomic(patch_set.patch_dir / "series", series.encode())
    refreshed = load_patch_set(args.patch_set)
    write_manifest(refreshed, resolve_target(args.target))
    refreshed = load_patch_set(args.patch_set)
    require_clean(refreshed)
    say(f"wrote {len(fresh)} patch(es) and the manifest to {patch_set.patch_dir}")
    return EXIT_OK


# --------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="apply.py",
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--patch-set",
        type=Path,
        default=PROJECT_DIR,
        help="directory holding patches/ and vllm_overlay/ (default: this project)",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    def add(
        name: str,
        func: Callable[[argparse.Namespace], int],
        text: str,
    ) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=text, description=text)
        p.add_argument(
            "--target",
            type=Path,
            default=None,
            help="site-packages, venv or vLLM checkout root "
            "(default: this project's .venv)",
        )
        p.set_defaults(func=func)
        return p

    add("apply", cmd_apply, "apply the series and overlay files, all or nothing")
    add("revert", cmd_revert, "restore the original files byte for byte").add_argument(
        "--force",
        action="store_true",
        help="also overwrite files edited since apply (each "
        "is kept as FILE.k3-sppp-drift)",
    )
    add("status", cmd_status, "what is applied where, and any drift")
    add("check", cmd_check, "dry run: name every patch and hunk that fails")
    add(
        "export", cmd_export, "one unified diff for an upstream pull request"
    ).add_argument(
        "-o", "--output", type=Path, help="write here instead of standard output"
    )
    add(
        "manifest",
        cmd_manifest,
        "regenerate patches/base.sha256 from the wheel's RECORD",
    )
    add("lint", cmd_lint, "check the series, headers and manifest")
    add(
        "devtree", cmd_devtree, "git repo of pristine sources, one commit per patch"
    ).add_argument("dir", type=Path)
    add("refresh", cmd_refresh, "write patches/ back from a devtree").add_argument(
        "dir", type=Path
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ApplyError as e:
        print(f"apply.py {args.command}: error: {e}", file=sys.stderr)
        return e.code
    except OSError as e:
        print(
            f"apply.py {args.command}: error: {e}; every file is either "
            "original or patched, and the journal says which: fix the "
            "cause and run the command again",
            file=sys.stderr,
        )
        return EXIT_ERROR


if __name__ == "__main__":
    sys.exit(main())
