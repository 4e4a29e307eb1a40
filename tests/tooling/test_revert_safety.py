# SPDX-License-Identifier: Apache-2.0
"""Issue 14, item by item: revert as safe as apply, and no input a traceback.

Interrupted runs at every file operation are covered by test_faults.py; each
test here is one failure named in the issue, on the small target.
"""

from __future__ import annotations

import fcntl
import glob
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

import apply
from tests.tooling import faults
from tests.tooling.conftest import (
    BASE,
    PROJECT_DIR,
    UNKEPT,
    copy_small,
    run_tool,
    set_version,
    tree_digest,
)
from tests.tooling.test_apply import unprivileged_python

PROBE = "vllm/k3_sppp_probe/__init__.py"
FIRST = "0001-Tooling-probe-mark-two-vLLM-modules.patch"


def ok(proc: subprocess.CompletedProcess[str]) -> subprocess.CompletedProcess[str]:
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


def refused(
    tool, target: Path, code: int, *args: str
) -> subprocess.CompletedProcess[str]:
    """Run ``tool(*args)``; it must exit ``code`` and change no byte."""
    before = tree_digest(target)
    proc = tool(*args)
    assert proc.returncode == code, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    assert tree_digest(target) == before
    return proc


def append(path: Path, text: str) -> bytes:
    with open(path, "a") as f:
        f.write(text)
    return path.read_bytes()


def python(version: str) -> str | None:
    """A working ``pythonX.Y`` on this machine, or None."""
    candidates = [shutil.which(f"python{version}")]
    candidates += glob.glob(f"/root/.pyenv/versions/{version}.*/bin/python{version}")
    candidates += glob.glob(f"/usr/bin/python{version}")
    for candidate in filter(None, candidates):
        if subprocess.run([candidate, "-c", "pass"], capture_output=True).returncode:
            continue
        return candidate
    return None


# -- 1. user edits are never overwritten ---------------------------------------


def test_each_forced_revert_keeps_its_edit_under_a_new_name(small_tool, small_target):
    logger = small_target / "vllm/logger.py"
    edits = []
    for n in range(3):
        ok(small_tool("apply"))
        edits.append(append(logger, f"# edit {n}\n"))
        proc = ok(small_tool("revert", "--force"))
        assert "kept your edited vllm/logger.py as" in proc.stdout
    kept = [
        small_target / f"vllm/logger.py.k3-sppp-drift{suffix}"
        for suffix in ("", ".1", ".2")
    ]
    assert [path.read_bytes() for path in kept] == edits
    assert f"as {kept[2]}" in proc.stdout


# -- 2. revert checks everything before its first write ------------------------


def test_revert_with_a_corrupt_backup_changes_nothing(small_tool, small_target):
    ok(small_tool("apply"))
    journal = json.loads((small_target / ".k3_sppp/journal.json").read_text())
    backup = small_target / ".k3_sppp" / journal["files"][1]["backup"]
    backup.write_bytes(b"not vLLM\n")
    status = small_tool("status")
    assert status.returncode == apply.EXIT_DRIFT, status.stdout
    assert "vllm/version.py (its backup is missing or corrupt" in status.stdout
    proc = refused(small_tool, small_target, apply.EXIT_DRIFT, "revert")
    assert f"{backup}: the backup of vllm/version.py is missing or corrupt" in (
        proc.stderr
    )
    assert "nothing was changed" in proc.stderr


def test_revert_meeting_an_immutable_file_changes_nothing(small_tool, small_target):
    ok(small_tool("apply"))
    version = small_target / "vllm/version.py"
    if subprocess.run(["chattr", "+i", str(version)], capture_output=True).returncode:
        pytest.skip("chattr +i is not available here (needs root and ext4/xfs)")
    try:
        proc = refused(small_tool, small_target, apply.EXIT_ERROR, "revert")
        assert f"{version}: immutable or append-only" in proc.stderr
    finally:
        subprocess.run(["chattr", "-i", str(version)], check=True)
    ok(small_tool("revert"))


def test_revert_killed_mid_swap_is_reported_and_finished_by_apply(
    small_tool, small_target, patch_set, tmp_path
):
    pristine = tree_digest(small_target)
    ok(small_tool("apply"))
    argv = ["--patch-set", str(patch_set), "revert", "--target", str(small_target)]
    count = tmp_path / "count"
    shutil.copytree(small_target, count)
    ops = faults.run([*argv[:-1], str(count)], 0, "eio", tmp_path / "log").ops
    # the journal ("reverting") is the first replace; the swaps follow
    second_swap = [n for n, op in enumerate(ops, 1) if op == "replace"][2]
    assert faults.run(argv, second_swap, "kill", tmp_path / "log").code == -9
    proc = small_tool("status")
    assert proc.returncode == apply.EXIT_INTERRUPTED, proc.stdout
    assert "interrupted reverting" in proc.stdout
    assert "recovered from an interrupted reverting" in ok(small_tool("apply")).stdout
    ok(small_tool("status"))
    ok(small_tool("revert"))
    assert tree_digest(small_target) == pristine


# -- 3. exit 1 means nothing changed --------------------------------------------


def test_error_on_the_last_journal_write_puts_everything_back(
    small_target, patch_set, tmp_path
):
    pristine = tree_digest(small_target)
    argv = ["--patch-set", str(patch_set), "apply", "--target", str(small_target)]
    count = tmp_path / "count"
    shutil.copytree(small_target, count)
    ops = faults.run([*argv[:-1], str(count)], 0, "eio", tmp_path / "log").ops
    last_fsync = max(n for n, op in enumerate(ops, 1) if op == "fsync")
    outcome = faults.run(argv, last_fsync, "eio", tmp_path / "log")
    assert outcome.code == apply.EXIT_ERROR, outcome.output
    assert "every file was put back as it was" in outcome.output
    assert tree_digest(small_target) == pristine


def test_bytecode_that_cannot_be_removed_is_a_warning(
    small_tool, small_target, monkeypatch, patch_set, capsys
):
    cache = small_target / "vllm/__pycache__"
    cache.mkdir()
    (cache / "logger.cpython-311.pyc").write_bytes(b"stale")
    real_unlink = Path.unlink

    def refuse_pyc(path: Path, missing_ok: bool = False) -> None:
        if path.suffix == ".pyc":
            raise PermissionError(13, "Permission denied", str(path))
        real_unlink(path, missing_ok)

    monkeypatch.setattr(Path, "unlink", refuse_pyc)
    argv = ["--patch-set", str(patch_set), "apply", "--target", str(small_target)]
    assert apply.main(argv) == apply.EXIT_OK
    assert (
        "logger.cpython-311.pyc: stale bytecode not removed" in capsys.readouterr().err
    )
    monkeypatch.undo()
    ok(small_tool("status"))


# -- 4. leftovers are reported, and removed by the next run --------------------


def test_leftovers_of_a_run_killed_before_its_journal_are_removed(
    small_tool, small_target, patch_set, tmp_path
):
    pristine = tree_digest(small_target)
    argv = ["--patch-set", str(patch_set), "apply", "--target", str(small_target)]
    outcome = faults.run(argv, 5, "kill", tmp_path / "log")
    assert outcome.code == -9
    state = small_target / ".k3_sppp"
    assert not (state / "journal.json").exists()
    (state / "NOTES").write_text("mine\n")
    proc = small_tool("status")
    assert proc.returncode == apply.EXIT_INTERRUPTED, proc.stdout
    assert f"LEFT  {state / 'lock'}" in proc.stdout
    assert "LEFT  " + str(state) + "/stage-" in proc.stdout
    assert f"ALIEN {state / 'NOTES'}" in proc.stdout
    proc = ok(small_tool("revert"))
    assert "removing 1 leftover(s)" in proc.stdout
    assert sorted(p.name for p in state.iterdir()) == ["NOTES"]
    (state / "NOTES").unlink()
    state.rmdir()
    assert tree_digest(small_target) == pristine


# -- 5. revert across a vLLM upgrade ---------------------------------------------


def test_revert_refuses_when_vllm_was_upgraded_under_the_patch_set(
    small_tool, small_target
):
    ok(small_tool("apply"))
    set_version(small_target, UNKEPT)
    proc = refused(small_tool, small_target, apply.EXIT_DRIFT, "revert", "--force")
    assert (
        f"vLLM {UNKEPT} is installed, but the patch set was applied to vLLM {BASE}"
    ) in proc.stderr
    assert "--any-version" in proc.stderr
    ok(small_tool("revert", "--any-version"))
    assert not (small_target / ".k3_sppp").exists()


# -- 6. bad input: a message naming the file, never a traceback -----------------


def test_patch_with_bytes_that_are_not_utf8_is_named(
    small_tool, small_target, patch_set
):
    patch = patch_set / "patches" / FIRST
    patch.write_bytes(patch.read_bytes().replace(b"two vLLM", b"two \xff vLLM"))
    proc = refused(small_tool, small_target, apply.EXIT_ERROR, "apply")
    assert f"{patch}:4: byte 0xff" in proc.stderr
    assert "is not UTF-8" in proc.stderr


def test_malformed_manifest_line_is_named(small_tool, small_target, patch_set):
    manifest = patch_set / "patches/base.sha256"
    manifest.write_text(manifest.read_text() + "deadbeef\n")
    proc = refused(small_tool, small_target, apply.EXIT_ERROR, "apply")
    assert f"{manifest}:7: not a `SHA-256  path` line: 'deadbeef'" in proc.stderr


def test_patch_with_crlf_line_endings_says_line_endings(
    small_tool, small_target, patch_set
):
    patch = patch_set / "patches" / FIRST
    patch.write_bytes(patch.read_bytes().replace(b"\n", b"\r\n"))
    proc = refused(small_tool, small_target, apply.EXIT_ERROR, "apply")
    assert f"{patch}: has CRLF (Windows) line endings" in proc.stderr


@pytest.mark.parametrize(
    "journal, problem",
    [
        ("[1, 2]", "not a JSON object"),
        ('{"format": 1, "state": "done"}', "unknown state 'done'"),
        ("\xff{", "not JSON"),
    ],
)
def test_journal_this_tool_did_not_write_is_refused(
    small_tool, small_target, journal, problem
):
    state = small_target / ".k3_sppp"
    state.mkdir()
    (state / "journal.json").write_bytes(journal.encode("latin-1"))
    for command in ("status", "revert", "apply"):
        proc = refused(small_tool, small_target, apply.EXIT_ERROR, command)
        assert f"{state / 'journal.json'}: {problem}" in proc.stderr


def test_journal_naming_a_file_outside_vllm_is_refused(small_tool, small_target):
    ok(small_tool("apply"))
    path = small_target / ".k3_sppp/journal.json"
    journal = json.loads(path.read_text())
    journal["overlay"][0]["path"] = "../../etc/passwd"
    path.write_text(json.dumps(journal))
    proc = refused(small_tool, small_target, apply.EXIT_ERROR, "revert", "--force")
    assert "a file entry outside vllm/" in proc.stderr


def test_target_path_with_a_colon_inside_a_git_repository(
    pristine_cache, patch_set, tmp_path
):
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    target = copy_small(pristine_cache, tmp_path / "a:b" / "site-packages")
    ok(run_tool(patch_set, "apply", "--target", str(target)))
    assert 'K3_SPPP_PROBE = "second"' in (target / "vllm/version.py").read_text()


# -- 7. the interpreter ------------------------------------------------------------


@pytest.mark.parametrize("version", ["3.9", "3.10"])
def test_apply_and_revert_run_on_older_pythons(
    version, patch_set, small_target, pristine_cache
):
    interpreter = python(version)
    if interpreter is None:
        pytest.skip(f"no python{version} on this machine")
    pristine = tree_digest(small_target)
    for command in ("apply", "status", "revert"):
        proc = subprocess.run(
            [
                interpreter,
                str(PROJECT_DIR / "apply.py"),
                "--patch-set",
                str(patch_set),
                command,
                "--target",
                str(small_target),
            ],
            capture_output=True,
            text=True,
        )
        assert proc.returncode == 0, proc.stdout + proc.stderr
    assert tree_digest(small_target) == pristine


def test_python_older_than_39_is_refused_before_any_write(small_target, patch_set):
    interpreter = python("3.8")
    command = [
        str(PROJECT_DIR / "apply.py"),
        "--patch-set",
        str(patch_set),
        "apply",
        "--target",
        str(small_target),
    ]
    if interpreter is None:  # fake the version on this interpreter instead
        interpreter = sys.executable
        command = [
            "-c",
            "import sys, runpy; sys.version_info = (3, 8, 18); "
            f"sys.argv = {command!r}; runpy.run_path(sys.argv[0], run_name='__main__')",
        ]
    before = tree_digest(small_target)
    proc = subprocess.run([interpreter, *command], capture_output=True, text=True)
    assert proc.returncode == 1
    assert "apply.py needs Python 3.9 or newer" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert tree_digest(small_target) == before


def test_patched_files_compile_with_the_targets_interpreter(
    small_target, patch_set, tmp_path
):
    venv = tmp_path / "venv"
    site = venv / "lib/python3.11/site-packages"
    site.parent.mkdir(parents=True)
    small_target.rename(site)
    (venv / "pyvenv.cfg").write_text("version = 3.11.7\n")
    (venv / "bin").mkdir()
    calls = tmp_path / "calls"
    wrapper = venv / "bin/python3.11"
    wrapper.write_text(f'#!/bin/sh\necho "$@" >> {calls}\nexec {sys.executable} "$@"\n')
    wrapper.chmod(0o755)
    ok(run_tool(patch_set, "apply", "--target", str(venv)))
    assert PROBE in calls.read_text()
    ok(run_tool(patch_set, "revert", "--target", str(venv)))


# -- 8. smaller ------------------------------------------------------------------


def test_revert_brings_back_a_symlinked_file_as_a_symlink(small_tool, small_target):
    real = small_target.parent / "logger-real.py"
    shutil.move(small_target / "vllm/logger.py", real)
    (small_target / "vllm/logger.py").symlink_to("../../logger-real.py")
    original = real.read_bytes()
    ok(small_tool("apply"))
    assert not (small_target / "vllm/logger.py").is_symlink()
    assert real.read_bytes() == original, "apply wrote through the link"
    ok(small_tool("revert"))
    link = small_target / "vllm/logger.py"
    assert link.is_symlink() and os.readlink(link) == "../../logger-real.py"
    assert real.read_bytes() == original


@pytest.mark.parametrize("config", ["version = 3.11.7\n", "home = /usr/bin\n"])
def test_venv_with_two_pythons_is_read_at_its_own_python(
    pristine_cache, patch_set, tmp_path, config
):
    venv = tmp_path / "venv"
    for version in ("3.9", "3.11"):
        copy_small(pristine_cache, venv / f"lib/python{version}/site-packages")
    (venv / "pyvenv.cfg").write_text(config)
    proc = run_tool(patch_set, "status", "--target", str(venv))
    assert f"target:   {venv / 'lib/python3.11/site-packages'}" in proc.stdout


def test_check_on_another_vllm_names_the_version(small_tool, small_target):
    set_version(small_target, UNKEPT)
    proc = refused(small_tool, small_target, apply.EXIT_DRIFT, "check")
    assert f"`apply` will refuse:\n  vLLM {UNKEPT} is installed" in proc.stdout


def test_status_waits_for_a_run_in_progress(small_tool, small_target, patch_set):
    ok(small_tool("apply"))
    logger = small_target / "vllm/logger.py"
    applied = logger.read_bytes()
    with open(small_target / ".k3_sppp/lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        logger.write_bytes(b"half-way through a run\n")
        status = subprocess.Popen(
            [
                sys.executable,
                str(PROJECT_DIR / "apply.py"),
                "--patch-set",
                str(patch_set),
                "status",
                "--target",
                str(small_target),
            ],
            stdout=subprocess.PIPE,
            text=True,
        )
        time.sleep(0.5)
        assert status.poll() is None, "status did not wait for the lock"
        logger.write_bytes(applied)
        (small_target / ".k3_sppp/lock").unlink()  # as a finishing run does
    out, _ = status.communicate(timeout=30)
    assert status.returncode == apply.EXIT_OK, out
    assert "DRIFT" not in out


def test_make_takes_a_vllm_path_with_spaces(small_target, tmp_path):
    spaced = tmp_path / "a path with spaces"
    small_target.rename(spaced)
    proc = subprocess.run(
        ["make", "-s", "status", f"VLLM={spaced}"],
        cwd=PROJECT_DIR,
        capture_output=True,
        text=True,
    )
    assert f"target:   {spaced} (vLLM {BASE})" in proc.stdout, proc.stderr


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run as root")
def test_root_run_on_a_users_tree_leaves_it_all_to_the_user(pristine_cache, patch_set):
    shared = Path(tempfile.mkdtemp(prefix="k3-sppp-owner-"))
    try:
        shared.chmod(0o755)
        target = copy_small(pristine_cache, shared / "site-packages")
        shutil.copytree(patch_set, shared / "patchset")
        for path in [shared / "patchset", *(shared / "patchset").rglob("*")]:
            path.chmod(0o755 if path.is_dir() else 0o644)
        for path in [target, *target.rglob("*")]:
            os.chown(path, 65534, 65534)
        pristine = tree_digest(target)
        ok(run_tool(shared / "patchset", "apply", "--target", str(target)))
        owners = {p: p.lstat().st_uid for p in [target, *target.rglob("*")]}
        assert set(owners.values()) == {65534}, [p for p, u in owners.items() if u]
        proc = subprocess.run(
            [
                unprivileged_python(),
                str(PROJECT_DIR / "apply.py"),
                "--patch-set",
                str(shared / "patchset"),
                "revert",
                "--target",
                str(target),
            ],
            user=65534,
            capture_output=True,
            text=True,
        )
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert tree_digest(target) == pristine
    finally:
        shutil.rmtree(shared)
