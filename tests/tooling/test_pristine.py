# SPDX-License-Identifier: Apache-2.0
"""`make pristine` (_pristine.py): a base's vLLM from its wheel alone, the
Python sources and the dist-info, each file checked against the wheel's
RECORD and the series' base.sha256 before the tree is put in place."""

from __future__ import annotations

import base64
import hashlib
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.tooling.conftest import BASE, PROJECT_DIR, tree_digest

PATCHED = "vllm/v1/worker/gpu/pp_utils.py"  # a file every series patches


def record_line(rel: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=")
    return f"{rel},sha256={digest.decode()},{len(data)}"


def write_wheel(
    tree: Path,
    wheel: Path,
    edit: dict[str, bytes] | None = None,
    recorded: bool = False,
) -> Path:
    """``tree`` (a pristine cache) as a wheel, plus a compiled extension the
    unpacking must leave out; ``edit`` replaces files' bytes, and with
    ``recorded`` the RECORD lists the replaced bytes too."""
    edit = edit or {}
    info = f"vllm-{BASE}.dist-info"
    files = {
        p.relative_to(tree).as_posix(): p.read_bytes()
        for p in sorted(tree.rglob("*"))
        if p.is_file() and not p.name.endswith(".pyc")
    }
    files["vllm/_C.abi3.so"] = b"\x7fELF not unpacked"
    record = files.pop(f"{info}/RECORD").decode().splitlines()
    record.append(record_line("vllm/_C.abi3.so", files["vllm/_C.abi3.so"]))
    for rel, data in edit.items():
        files[rel] = data
        if recorded:
            record = [ln for ln in record if not ln.startswith(f"{rel},")]
            record.append(record_line(rel, data))
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_STORED) as out:
        for rel, data in files.items():
            out.writestr(rel, data)
        out.writestr(f"{info}/RECORD", "\n".join(record) + "\n")
    return wheel


def unpack(wheel: Path, dest: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(PROJECT_DIR / "_pristine.py"), str(wheel), str(dest)],
        capture_output=True,
        text=True,
        cwd=PROJECT_DIR,
    )


@pytest.fixture(scope="module")
def wheel_of_base(pristine_cache, tmp_path_factory) -> Path:
    return write_wheel(pristine_cache, tmp_path_factory.mktemp("wheel") / "vllm.whl")


def test_the_wheels_sources_are_the_pristine_tree(
    wheel_of_base, pristine_cache, tmp_path
):
    dest = tmp_path / f"pristine-vllm-{BASE}"
    proc = unpack(wheel_of_base, dest)
    assert proc.returncode == 0, proc.stderr
    record = f"vllm-{BASE}.dist-info/RECORD"
    unpacked, cached = tree_digest(dest), tree_digest(pristine_cache)
    with zipfile.ZipFile(wheel_of_base) as wheel:  # it lists the extension too
        assert (dest / record).read_bytes() == wheel.read(record)
    assert {k: v for k, v in unpacked.items() if k != record} == {
        k: v for k, v in cached.items() if k != record
    }
    assert not (dest / "vllm/_C.abi3.so").exists()


def test_a_file_that_is_not_the_one_its_record_lists_leaves_nothing(
    pristine_cache, tmp_path
):
    wheel = write_wheel(pristine_cache, tmp_path / "vllm.whl", {PATCHED: b"# moved\n"})
    dest = tmp_path / "cache" / f"pristine-vllm-{BASE}"
    proc = unpack(wheel, dest)
    assert proc.returncode != 0
    assert f"{PATCHED} is not the file its RECORD lists" in proc.stderr
    assert list(dest.parent.iterdir()) == []


def test_a_wheel_of_other_bytes_than_the_series_pins_leaves_nothing(
    pristine_cache, tmp_path
):
    """A RECORD that agrees with its files is not enough: the files the
    series patches must be those its base.sha256 pins."""
    wheel = write_wheel(
        pristine_cache, tmp_path / "vllm.whl", {PATCHED: b"# moved\n"}, recorded=True
    )
    dest = tmp_path / "cache" / f"pristine-vllm-{BASE}"
    proc = unpack(wheel, dest)
    assert proc.returncode != 0
    assert (
        f"{PATCHED} is not the vLLM {BASE} file the series' base.sha256 pins"
    ) in proc.stderr
    assert list(dest.parent.iterdir()) == []
