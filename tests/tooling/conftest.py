# SPDX-License-Identifier: Apache-2.0
"""Fixtures for apply.py: pristine vLLM trees and the tests' patch set.

The tests run on the vLLM of the interpreter that runs them (``BASE``:
``make test`` runs .venv's, ``make test BASE=0.33.0`` .venv-0.33.0's), and
the tests' own patch set is pinned to it.  A pristine tree of every base the
project keeps a series for is cached in ``.cache/pristine-vllm-VERSION``
(``apply.pristine_sources``): built from that base's venv (``.venv``,
``.venv-VERSION``) where it exists, else unpacked from that release's wheel
by `make pristine`, which `make test` runs: ``pristine_caches``.

A pristine tree is the pinned wheel's own files: every file is checked
against the wheel's ``RECORD`` before it enters the cache, and files the
project's patch set has already changed in the venv come from the journal's
backups.  Only Python sources and the dist-info the tool reads are copied;
the compiled extensions (hundreds of MB) play no part in patching.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.metadata
import os
import shutil
import stat
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

import apply

PROJECT_DIR = Path(apply.__file__).resolve().parent
CACHE = PROJECT_DIR / ".cache"
DATA = Path(__file__).parent / "data"
# The vLLM these tests run on, and every base the project keeps a series for.
BASE = importlib.metadata.version("vllm").split("+")[0]
BASES = apply.bases()
# A vLLM no series is kept for: what a tree is made to say to be refused.
UNKEPT = "0.32.0"


def series_dir(root: Path, version: str = BASE) -> Path:
    """The series of the patch set ``root`` for vLLM ``version``: its
    ``patches/`` or ``bases/VERSION/patches/``, as apply.py picks it."""
    return apply.bases(root)[version]


def composed_overlay(root: Path, version: str = BASE) -> dict[str, Path]:
    """The overlay of ``root``'s series for vLLM ``version``, file by file:
    ``vllm_overlay/`` with that base's own ``bases/VERSION/vllm_overlay/``
    files in place of the shared ones of the same path."""
    files = {}
    own = series_dir(root, version).parent / "vllm_overlay"
    for directory in (root / "vllm_overlay", own):
        if directory.is_dir():
            files.update(
                (p.relative_to(directory).as_posix(), p)
                for p in directory.rglob("*")
                if p.is_file() and "__pycache__" not in p.parts
            )
    return files


def copy_project(dest: Path) -> Path:
    """This project's patch set (every base's series, the overlays, the
    committed results its pull requests quote, setup.cfg) at ``dest``."""
    for part in ("patches", "bases", "vllm_overlay", "results"):
        shutil.copytree(
            PROJECT_DIR / part,
            dest / part,
            ignore=shutil.ignore_patterns("__pycache__"),
        )
    shutil.copy2(PROJECT_DIR / "setup.cfg", dest / "setup.cfg")
    return dest


def flat_project(dest: Path, version: str = BASE) -> Path:
    """This project's series for vLLM ``version`` as a patch set of its own
    at ``dest``: that series as ``patches/``, its overlay as composed for
    it as ``vllm_overlay/``, and the results its pull requests quote."""
    shutil.copytree(series_dir(PROJECT_DIR, version), dest / "patches")
    for rel, src in composed_overlay(PROJECT_DIR, version).items():
        (dest / "vllm_overlay" / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, dest / "vllm_overlay" / rel)
    shutil.copytree(PROJECT_DIR / "results", dest / "results")
    return dest


def tree_digest(root: Path) -> dict[str, str]:
    """SHA-256 of every file under ``root``, by relative path."""
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def build_pristine(dest: Path, version: str = BASE) -> None:
    """The pristine vLLM ``version`` of that base's venv, into ``dest``."""
    root = apply.target_root(apply.venv(version))
    record = apply.record_hashes(root)
    source = apply.original_files(root)
    wanted = [rel for rel in record if rel.startswith("vllm/") and rel.endswith(".py")]
    wanted += [f"vllm-{version}.dist-info/{name}" for name in ("METADATA", "RECORD")]
    for rel in wanted:
        src = source(rel) if rel.startswith("vllm/") else root / rel
        if src is None:
            raise RuntimeError(f"{rel}: missing from {root}")
        if (
            rel in record
            and hashlib.sha256(src.read_bytes()).hexdigest() != record[rel]
        ):
            raise RuntimeError(
                f"{src}: not the file the vLLM {version} "
                "wheel ships (RECORD); reinstall it"
            )
        dst = dest / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, dst)


SMALL_TREE = (
    "vllm/__init__.py",
    "vllm/_version.py",
    "vllm/logger.py",
    "vllm/version.py",
)


def set_version(root: Path, version: str) -> None:
    """Make ``root`` say vLLM ``version`` where apply.py reads it: both
    ``vllm/_version.py`` and the wheel's METADATA (they must agree)."""
    said = tree_version(root)
    for path in [root / "vllm/_version.py", *root.glob("vllm-*.dist-info/METADATA")]:
        text = path.read_text()
        text = text.replace(f"'{said}'", f"'{version}'")
        text = text.replace(f"\nVersion: {said}\n", f"\nVersion: {version}\n")
        path.write_text(text)


def tree_version(root: Path) -> str:
    """The version a tree's ``vllm/_version.py`` names."""
    text = (root / "vllm/_version.py").read_text()
    return text.split("__version__ = version = '", 1)[1].split("'", 1)[0]


def file_signatures(root: Path) -> dict[str, tuple[int, int, int, int]]:
    """Inode, size, mtime and mode of every file: what a write shows in."""
    signatures = {}
    for path in root.rglob("*"):
        st = path.lstat()
        if stat.S_ISREG(st.st_mode):
            signatures[str(path.relative_to(root))] = (
                st.st_ino,
                st.st_size,
                st.st_mtime_ns,
                st.st_mode,
            )
    return signatures


def pristine_tree(version: str) -> Path:
    """The cached pristine tree of vLLM ``version``: unpacked from its wheel
    by `make pristine`, or built here once from its venv (pytest-xdist
    workers build it one at a time)."""
    cache = apply.pristine_sources(version)
    CACHE.mkdir(exist_ok=True)
    with open(CACHE / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not cache.is_dir():
            tmp = Path(tempfile.mkdtemp(prefix="pristine-", dir=CACHE))
            build_pristine(tmp, version)
            tmp.rename(cache)
    return cache


def has_pristine_tree(version: str) -> bool:
    """Whether a pristine tree of vLLM ``version`` is cached or can be built
    from its venv."""
    return apply.pristine_sources(version).is_dir() or apply.venv(version).is_dir()


@contextlib.contextmanager
def unwritten(cache: Path) -> Iterator[Path]:
    """Fail the session if a test wrote into ``cache`` through a link."""
    before = file_signatures(cache)
    yield cache
    after = file_signatures(cache)
    changed = sorted(
        rel for rel in before.keys() | after.keys() if before.get(rel) != after.get(rel)
    )
    if changed:
        shutil.rmtree(cache)  # rebuilt from the wheel by the next session
        pytest.fail(
            f"a test wrote through a hard link into {cache} "
            f"({', '.join(changed[:5])}); copy such files in linked_copy()"
        )


@pytest.fixture(scope="session")
def pristine_cache() -> Iterator[Path]:
    """The pristine tree of the vLLM these tests run on (``BASE``)."""
    with unwritten(pristine_tree(BASE)) as cache:
        yield cache


@pytest.fixture(scope="session")
def pristine_caches(pristine_cache: Path) -> Iterator[dict[str, Path]]:
    """A pristine tree of every base the project keeps a series for, by
    version; a test that needs a base with neither a venv nor its wheel's
    sources is skipped, naming the command that builds them (`make test`
    runs it first)."""
    with contextlib.ExitStack() as stack:
        caches = {BASE: pristine_cache}
        for version in BASES:
            if version != BASE and has_pristine_tree(version):
                caches[version] = stack.enter_context(unwritten(pristine_tree(version)))
        yield caches


def need_bases(caches: dict[str, Path], *versions: str) -> None:
    """Skip, naming what builds them, unless every base ``versions`` names
    has a pristine tree."""
    missing = [v for v in versions if v not in caches]
    if missing:
        pytest.skip(
            "no pristine tree of vLLM " + ", ".join(missing) + ": unpack its "
            "wheel's sources with `make pristine` (make test runs it)"
        )


def linked_copy(pristine: Path, dest: Path) -> Path:
    """A target with pristine's files, sharing those no test writes in place.

    The tests edit only ``SMALL_TREE`` and the dist-info in place, so only
    those are copied; every other file is a hard link to the cache: apply.py
    reads such files and swaps them with ``os.replace``, which replaces the
    link, never writes through it. ``pristine_cache`` fails the session if a
    cached file changed all the same. Across file systems every file is copied.
    """
    copied = {pristine / rel for rel in SMALL_TREE}

    def copy(src: str, dst: str) -> None:
        if Path(src) not in copied and ".dist-info" not in src:
            with contextlib.suppress(OSError):  # another file system: copy
                os.link(src, dst)
                return
        shutil.copy2(src, dst)

    shutil.copytree(pristine, dest, copy_function=copy)
    return dest


@pytest.fixture
def target(pristine_cache: Path, tmp_path: Path) -> Path:
    """A fresh site-packages-like copy of pristine vLLM (``BASE``)."""
    return linked_copy(pristine_cache, tmp_path / "site-packages")


def copy_small(pristine: Path, dest: Path) -> Path:
    """Copy only what the tests' patch set reads: the package's ``__init__``,
    its version, the two patched modules and the wheel's dist-info."""
    for rel in SMALL_TREE:
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(pristine / rel, dest / rel)
    for info in pristine.glob("vllm-*.dist-info"):
        shutil.copytree(info, dest / info.name)
    return dest


@pytest.fixture
def small_target(pristine_cache: Path, tmp_path: Path) -> Path:
    """A small pristine target, for runs repeated by the hundred."""
    return copy_small(pristine_cache, tmp_path / "small" / "site-packages")


@pytest.fixture(scope="session")
def manifested_patch_set(pristine_cache: Path, tmp_path_factory) -> Path:
    """The tests' own series, with its manifest generated from RECORD."""
    path = tmp_path_factory.mktemp("patchset") / "patchset"
    shutil.copytree(DATA / "patchset", path)
    # Its two patches change files that 0.33.0 and 0.34.0 ship alike.
    (path / "patches" / "base.version").write_text(f"{BASE}\n")
    proc = run_tool(path, "manifest", "--target", str(pristine_cache))
    assert proc.returncode == 0, proc.stderr
    return path


@pytest.fixture
def patch_set(manifested_patch_set: Path, tmp_path: Path) -> Path:
    """A copy of the tests' series of its own, free to edit."""
    return shutil.copytree(manifested_patch_set, tmp_path / "patchset")


def run_tool(
    patch_set: Path,
    *args: str,
    user: int | None = None,
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            sys.executable,
            str(PROJECT_DIR / "apply.py"),
            "--patch-set",
            str(patch_set),
            *args,
        ],
        capture_output=True,
        text=True,
        user=user,
        timeout=120,
    )


@pytest.fixture
def tool(
    patch_set: Path,
    target: Path,
) -> Callable[..., subprocess.CompletedProcess[str]]:
    """Run apply.py on the test target: ``tool("apply")``."""

    def run(command: str, *args: str, **kwargs) -> subprocess.CompletedProcess[str]:
        return run_tool(patch_set, command, "--target", str(target), *args, **kwargs)

    return run


@pytest.fixture
def small_tool(
    patch_set: Path,
    small_target: Path,
) -> Callable[..., subprocess.CompletedProcess[str]]:
    """``tool`` on ``small_target``."""

    def run(command: str, *args: str, **kwargs) -> subprocess.CompletedProcess[str]:
        return run_tool(
            patch_set, command, "--target", str(small_target), *args, **kwargs
        )

    return run
