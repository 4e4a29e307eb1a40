# SPDX-License-Identifier: Apache-2.0
"""Fixtures for apply.py: pristine vLLM 0.33.0 trees and the tests' patch set.

The pristine tree is the pinned wheel's own files: every file is checked
against the wheel's ``RECORD`` before it enters the cache, and files the
project's patch set has already changed in ``.venv`` come from the journal's
backups.  Only Python sources and the dist-info the tool reads are copied;
the compiled extensions (hundreds of MB) play no part in patching.
"""

from __future__ import annotations

import contextlib
import hashlib
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


def tree_digest(root: Path) -> dict[str, str]:
    """SHA-256 of every file under ``root``, by relative path."""
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def build_pristine(dest: Path) -> None:
    root = apply.target_root()
    record = apply.record_hashes(root)
    source = apply.original_files(root)
    version = apply.base_version()
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
    for path in [root / "vllm/_version.py", *root.glob("vllm-*.dist-info/METADATA")]:
        text = path.read_text()
        text = text.replace("'0.33.0'", f"'{version}'")
        text = text.replace("\nVersion: 0.33.0\n", f"\nVersion: {version}\n")
        path.write_text(text)


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


@pytest.fixture(scope="session")
def pristine_cache() -> Iterator[Path]:
    version = apply.base_version()
    cache = CACHE / f"pristine-vllm-{version}"
    if not cache.is_dir():
        CACHE.mkdir(exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix="pristine-", dir=CACHE))
        build_pristine(tmp)
        tmp.rename(cache)
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
    """A fresh site-packages-like copy of pristine vLLM 0.33.0."""
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
