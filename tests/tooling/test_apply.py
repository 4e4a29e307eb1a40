# SPDX-License-Identifier: Apache-2.0
"""apply.py on pristine vLLM copies (the base the tests run on), with the
tests' own patch set."""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

import apply
from tests.tooling.conftest import (
    BASE,
    PROJECT_DIR,
    UNKEPT,
    linked_copy,
    run_tool,
    set_version,
    tree_digest,
)

PROBE = "vllm/k3_sppp_probe/__init__.py"
FIRST = "0001-Tooling-probe-mark-two-vLLM-modules.patch"


def read(target: Path, rel: str) -> str:
    return (target / rel).read_text()


def assert_ok(proc: subprocess.CompletedProcess[str]) -> None:
    assert proc.returncode == 0, proc.stdout + proc.stderr


# -- the happy paths ---------------------------------------------------------


def test_apply_installs_series_in_order_and_overlay(tool, target):
    proc = tool("apply")
    assert_ok(proc)
    assert "2 patch(es), 2 file(s) patched, 1 overlay file(s)" in proc.stdout
    assert 'K3_SPPP_PROBE = "second"' in read(target, "vllm/version.py")
    assert 'K3_SPPP_PROBE = "logger"' in read(target, "vllm/logger.py")
    assert 'PROBE = "overlay"' in read(target, PROBE)
    assert not (target / "tests").exists(), "upstream tests are export-only"
    journal = json.loads((target / ".k3_sppp/journal.json").read_text())
    assert journal["state"] == "applied"
    assert [e["path"] for e in journal["files"]] == [
        "vllm/logger.py",
        "vllm/version.py",
    ]
    assert journal["created_dirs"] == ["vllm/k3_sppp_probe"]


def test_second_apply_says_already_applied_and_writes_nothing(tool, target):
    assert_ok(tool("apply"))
    before = tree_digest(target)
    proc = tool("apply")
    assert_ok(proc)
    assert "already applied" in proc.stdout
    assert tree_digest(target) == before


def test_revert_restores_the_whole_package_byte_for_byte(tool, target):
    before = tree_digest(target)
    assert_ok(tool("apply"))
    assert tree_digest(target) != before
    proc = tool("revert")
    assert_ok(proc)
    assert f"3 file(s) back to vLLM {BASE}" in proc.stdout
    assert tree_digest(target) == before
    assert not (target / ".k3_sppp").exists()


def test_apply_clears_stale_bytecode_of_touched_modules(tool, target):
    cache = target / "vllm/__pycache__"
    cache.mkdir()
    stale = cache / "version.cpython-311.pyc"
    other = cache / "envs.cpython-311.pyc"
    stale.write_bytes(b"stale")
    other.write_bytes(b"untouched")
    assert_ok(tool("apply"))
    assert not stale.exists()
    assert other.read_bytes() == b"untouched"


def test_status_names_state_files_and_drift(tool, target):
    proc = tool("status")
    assert proc.returncode == apply.EXIT_NOT_APPLIED, proc.stdout
    assert "not applied; base matches the pin" in proc.stdout
    assert_ok(tool("apply"))
    proc = tool("status")
    assert_ok(proc)
    assert "ok    patched vllm/version.py" in proc.stdout
    assert f"ok    new     {PROBE}" in proc.stdout
    with open(target / "vllm/logger.py", "a") as f:
        f.write("# local edit\n")
    proc = tool("status")
    assert proc.returncode == apply.EXIT_DRIFT
    assert "DRIFT patched vllm/logger.py" in proc.stdout


def test_status_reports_a_newer_revision_of_the_patch_set(tool, target, patch_set):
    assert_ok(tool("apply"))
    with open(patch_set / "vllm_overlay" / PROBE, "a") as f:
        f.write("# edited after apply\n")
    proc = tool("status")
    assert proc.returncode == apply.EXIT_OTHER_REVISION
    revert = f"revert --target {target}`, then `"
    assert revert in proc.stdout
    proc = tool("apply")
    assert proc.returncode == apply.EXIT_ERROR
    assert f"revert --target {target}` first" in proc.stderr


def test_check_passes_on_pristine_and_on_applied_targets(tool):
    proc = tool("check")
    assert_ok(proc)
    assert f"ok   {FIRST}" in proc.stdout
    assert_ok(tool("apply"))
    assert_ok(tool("check"))  # checks against the journal's originals


def test_export_is_one_diff_that_git_applies_to_pristine_sources(
    tool, target, pristine_cache, tmp_path
):
    out = tmp_path / "pr.diff"
    assert_ok(tool("export", "-o", str(out)))
    text = out.read_text()
    assert text.count("diff --git a/vllm/version.py") == 1, "one diff a file"
    assert "+++ b/tests/k3_sppp_probe/test_probe.py" in text
    assert "--- /dev/null" in text
    tree = tmp_path / "vllm-src"
    shutil.copytree(pristine_cache / "vllm", tree / "vllm")
    env = dict(os.environ, GIT_CEILING_DIRECTORIES=str(tmp_path))
    for args in (["--check"], []):
        proc = subprocess.run(
            ["git", "apply", *args, str(out)],
            cwd=tree,
            env=env,
            capture_output=True,
            text=True,
        )
        assert proc.returncode == 0, proc.stderr
    assert_ok(tool("apply"))
    for rel in ("vllm/version.py", "vllm/logger.py", PROBE):
        assert (tree / rel).read_bytes() == (target / rel).read_bytes()


def test_manifest_is_what_the_wheel_record_says(patch_set, target):
    manifest = (patch_set / "patches/base.sha256").read_text()
    record = apply.record_hashes(target)
    assert f"{record['vllm/version.py']}  vllm/version.py" in manifest
    proc = subprocess.run(
        ["sha256sum", "-c", str(patch_set / "patches/base.sha256")],
        cwd=target,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_git_apply_is_not_skipped_inside_an_enclosing_repository(
    tool, target, tmp_path
):
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    assert_ok(tool("apply"))
    assert 'K3_SPPP_PROBE = "second"' in read(target, "vllm/version.py")


def test_target_may_be_the_vllm_package_or_a_checkout_root(patch_set, target):
    assert_ok(run_tool(patch_set, "apply", "--target", str(target / "vllm")))
    proc = run_tool(patch_set, "status", "--target", str(target))
    assert_ok(proc)


def test_devtree_and_refresh_round_trip_and_take_new_patches(
    tool, patch_set, target, tmp_path
):
    original = {p.name: p.read_bytes() for p in (patch_set / "patches").iterdir()}
    dev = tmp_path / "dev"
    assert_ok(tool("devtree", str(dev)))
    assert_ok(tool("refresh", str(dev)))
    after = {p.name: p.read_bytes() for p in (patch_set / "patches").iterdir()}
    assert after == original
    with open(dev / "vllm/envs.py", "a") as f:
        f.write("\nK3_SPPP_PROBE = 'envs'\n")
    message = (
        "Tooling probe: mark envs\n\nDescription: a third patch.\n"
        "Forwarded: not-needed\nDrop-When: never\n"
        "Last-Update: 2026-11-29\n"
    )
    env = dict(os.environ, GIT_CEILING_DIRECTORIES=str(tmp_path))
    subprocess.run(
        ["git", "-c", "user.name=t", "-c", "user.email=t@localhost"]
        + ["commit", "-qam", message],
        cwd=dev,
        check=True,
        env=env,
    )
    assert_ok(tool("refresh", str(dev)))
    series = (patch_set / "patches/series").read_text().split()
    assert series[-1] == "0003-Tooling-probe-mark-envs.patch"
    assert "vllm/envs.py" in (patch_set / "patches/base.sha256").read_text()
    assert_ok(tool("apply"))
    assert "K3_SPPP_PROBE = 'envs'" in read(target, "vllm/envs.py")


# -- bad input: a clear error, and not one byte changed ----------------------


def fails_cleanly(
    tool, target, command, *expected, code=apply.EXIT_ERROR, **kwargs
) -> subprocess.CompletedProcess[str]:
    before = tree_digest(target)
    proc = tool(command, **kwargs)
    assert proc.returncode == code, proc.stdout + proc.stderr
    for text in expected:
        assert text in proc.stderr + proc.stdout
    assert tree_digest(target) == before
    return proc


def test_wrong_vllm_version_is_refused(tool, target):
    set_version(target, UNKEPT)
    fails_cleanly(
        tool,
        target,
        "apply",
        f"vLLM {UNKEPT} (so say {target.resolve() / 'vllm/_version.py'} and ",
        f"keeps a series only for vLLM {BASE} (patches/base.version), so "
        "nothing was written",
        code=apply.EXIT_DRIFT,
    )


def test_base_hash_mismatch_is_refused_naming_the_file(tool, target):
    with open(target / "vllm/logger.py", "a") as f:
        f.write("# drift\n")
    fails_cleanly(
        tool,
        target,
        "apply",
        "vllm/logger.py: SHA-256",
        f"is not pristine vLLM {BASE}",
        code=apply.EXIT_DRIFT,
    )


def test_missing_target_file_is_refused(tool, target):
    (target / "vllm/version.py").unlink()
    fails_cleanly(
        tool,
        target,
        "apply",
        "vllm/version.py: missing from the target",
        code=apply.EXIT_DRIFT,
    )


def test_existing_overlay_destination_is_refused(tool, target):
    (target / PROBE).parent.mkdir()
    (target / PROBE).write_text("# someone else's module\n")
    fails_cleanly(
        tool,
        target,
        "apply",
        f"{PROBE}: exists, but the patch set adds it",
        code=apply.EXIT_DRIFT,
    )


def test_directory_without_vllm_is_refused(patch_set, tmp_path):
    proc = run_tool(patch_set, "apply", "--target", str(tmp_path))
    assert proc.returncode == apply.EXIT_ERROR
    assert f"{tmp_path}: no vllm/ package here" in proc.stderr


def unprivileged_python() -> str:
    """An interpreter that user nobody may run (apply.py needs only stdlib)."""
    for candidate in ("/usr/bin/python3", "/usr/local/bin/python3", sys.executable):
        proc = subprocess.run(
            [candidate, "-c", "pass"], user=65534, capture_output=True
        )
        if proc.returncode == 0:
            return candidate
    pytest.fail("no Python interpreter that user nobody can run")


def test_unwritable_target_is_refused(pristine_cache, patch_set):
    shared = Path(tempfile.mkdtemp(prefix="k3-sppp-ro-"))
    try:
        shared.chmod(0o755)  # readable, not writable, by others
        target = shared / "site-packages"
        linked_copy(pristine_cache, target)
        shutil.copytree(patch_set, shared / "patchset")
        for path in (target, shared / "patchset"):
            path.chmod(0o755)
        before = tree_digest(target)
        command = [
            str(PROJECT_DIR / "apply.py"),
            "--patch-set",
            str(shared / "patchset"),
            "apply",
            "--target",
            str(target),
        ]
        if os.geteuid() == 0:  # root writes anywhere: drop to nobody
            proc = subprocess.run(
                [unprivileged_python(), *command],
                user=65534,
                capture_output=True,
                text=True,
            )
        else:
            target.chmod(0o555)
            proc = subprocess.run(
                [sys.executable, *command], capture_output=True, text=True
            )
            target.chmod(0o755)
        assert proc.returncode == apply.EXIT_ERROR, proc.stdout + proc.stderr
        assert f"{target}: not writable by this user" in proc.stderr
        assert tree_digest(target) == before
    finally:
        shutil.rmtree(shared)


def test_patch_that_no_longer_applies_names_patch_and_hunk(tool, target, patch_set):
    first = patch_set / "patches" / FIRST
    first.write_text(
        first.read_text().replace(" import datetime\n", " import datetime  # 0.34\n")
    )
    proc = fails_cleanly(
        tool,
        target,
        "apply",
        f"patches/{FIRST} does not apply",
        "vllm/logger.py hunk #1 (@@ -2,6 +2,8 @@)",
    )
    assert "vllm/version.py" not in proc.stderr.split("does not apply")[1]
    proc = fails_cleanly(
        tool,
        target,
        "check",
        f"FAIL {FIRST}",
        "vllm/logger.py hunk #1 (@@ -2,6 +2,8 @@) does not apply",
    )


def test_check_reports_hunks_against_a_newer_vllm(tool, target):
    set_version(target, UNKEPT)
    logger = target / "vllm/logger.py"
    logger.write_text(
        read(target, "vllm/logger.py").replace(
            "import datetime\n", "import datetime as dt\n"
        )
    )
    proc = fails_cleanly(
        tool, target, "check", "vllm/logger.py hunk #1 (@@ -2,6 +2,8 @@)"
    )
    assert "ok   0002-" in proc.stdout


def test_result_that_does_not_compile_is_refused(tool, target, patch_set):
    (patch_set / "vllm_overlay" / PROBE).write_text("def broken(:\n")
    fails_cleanly(
        tool, target, "apply", f"{PROBE}:1: the patched file does not compile"
    )


def test_concurrent_apply_is_refused_while_the_lock_is_held(tool, target):
    state = target / ".k3_sppp"
    state.mkdir()
    with open(state / "lock", "w") as lock:
        lock.write(f"{os.getpid()}\n")
        lock.flush()
        fcntl.flock(lock, fcntl.LOCK_EX)
        fails_cleanly(
            tool,
            target,
            "apply",
            f"another k3-sppp run holds this target (pid {os.getpid()})",
        )


def test_failure_during_the_swap_rolls_everything_back(
    patch_set, target, monkeypatch, capsys
):
    before = tree_digest(target)
    real_replace = os.replace
    swapped = []

    def replace_then_fail(src, dst):
        if "/stage-" in str(src):
            swapped.append(dst)
            if len(swapped) == 2:
                raise OSError(28, "No space left on device", str(dst))
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", replace_then_fail)
    code = apply.main(["--patch-set", str(patch_set), "apply", "--target", str(target)])
    assert code == apply.EXIT_ERROR
    assert "No space left on device" in capsys.readouterr().err
    assert swapped, "the failure must hit after a file was swapped in"
    assert tree_digest(target) == before


INTERRUPT = """
import os, sys
sys.path.insert(0, {project!r})
import apply
real_replace = os.replace
calls = []
def replace_then_die(src, dst):
    if "/stage-" in str(src):
        calls.append(dst)
        if len(calls) == 2:
            os._exit(9)
    real_replace(src, dst)
os.replace = replace_then_die
apply.main(["--patch-set", {patch_set!r}, "apply", "--target", {target!r}])
"""


@pytest.mark.parametrize("recover_with", ["apply", "revert"])
def test_apply_killed_halfway_is_recovered_from_the_journal(
    tool, target, patch_set, recover_with
):
    before = tree_digest(target)
    script = INTERRUPT.format(
        project=str(PROJECT_DIR), patch_set=str(patch_set), target=str(target)
    )
    proc = subprocess.run([sys.executable, "-c", script], timeout=60)
    assert proc.returncode == 9
    assert tree_digest(target) != before, "one file was swapped in"
    status = tool("status")
    assert status.returncode == apply.EXIT_INTERRUPTED, status.stdout
    assert "interrupted applying" in status.stdout
    proc = tool(recover_with)
    assert_ok(proc)
    if recover_with == "apply":
        assert "recovered from an interrupted applying" in proc.stdout
        assert_ok(tool("status"))
        assert_ok(tool("revert"))
    assert tree_digest(target) == before


def test_revert_refuses_a_file_edited_since_apply(tool, target):
    assert_ok(tool("apply"))
    with open(target / "vllm/version.py", "a") as f:
        f.write("# my fix\n")
    fails_cleanly(
        tool,
        target,
        "revert",
        "changed or deleted since apply, refusing to overwrite: vllm/version.py",
        "revert --force",
        code=apply.EXIT_DRIFT,
    )


def test_revert_force_restores_and_keeps_the_edit(tool, target, pristine_cache):
    assert_ok(tool("apply"))
    with open(target / "vllm/version.py", "a") as f:
        f.write("# my fix\n")
    edited = (target / "vllm/version.py").read_bytes()
    assert_ok(tool("revert", "--force"))
    kept = target / "vllm/version.py.k3-sppp-drift"
    assert kept.read_bytes() == edited
    kept.unlink()
    assert tree_digest(target) == tree_digest(pristine_cache)


def test_revert_force_restores_a_patched_file_that_was_deleted(
    tool, target, pristine_cache
):
    assert_ok(tool("apply"))
    (target / "vllm/logger.py").unlink()
    fails_cleanly(
        tool,
        target,
        "revert",
        "refusing to overwrite: vllm/logger.py",
        code=apply.EXIT_DRIFT,
    )
    assert_ok(tool("revert", "--force"))
    assert tree_digest(target) == tree_digest(pristine_cache)


@pytest.mark.parametrize(
    "breakage, message",
    [
        (
            lambda p: (p / "patches/series").write_text(
                (p / "patches/series").read_text() + "0003-missing.patch\n"
            ),
            "lists 0003-missing.patch, which does not exist",
        ),
        (
            lambda p: (p / "patches/0003-stray.patch").write_text("x\n"),
            "0003-stray.patch: not listed in",
        ),
        (
            lambda p: (p / "patches/series").write_text(
                (p / "patches/series").read_text() + FIRST + "\n"
            ),
            f"{FIRST} is listed more than once",
        ),
        (
            lambda p: (p / "patches" / FIRST).write_text(
                (p / "patches" / FIRST).read_text().replace("Drop-When:", "Drop:")
            ),
            "DEP-3 header lacks Drop-When",
        ),
        (
            lambda p: (p / "patches" / FIRST).write_text(
                (p / "patches" / FIRST).read_text().replace("Forwarded:", "Sent:")
            ),
            "DEP-3 header lacks Forwarded",
        ),
        (
            lambda p: (p / "vllm_overlay/NOTES.md").write_text("x\n"),
            "NOTES.md: overlay files live under vllm/ (installed) or tests/",
        ),
        (
            lambda p: (p / "patches/base.sha256").unlink(),
            "base.sha256: out of date (lacks vllm/logger.py, vllm/version.py)",
        ),
        (
            lambda p: (p / "patches/patched.sha256").unlink(),
            "patched.sha256: out of date (lacks vllm/k3_sppp_probe/__init__.py, "
            "vllm/logger.py, vllm/version.py)",
        ),
    ],
)
def test_inconsistent_series_is_refused(tool, target, patch_set, breakage, message):
    breakage(patch_set)
    fails_cleanly(tool, target, "apply", "the patch set is inconsistent", message)
    proc = tool("lint")
    assert proc.returncode == apply.EXIT_ERROR and message in proc.stderr


def test_project_patch_set_is_consistent():
    proc = subprocess.run(
        [sys.executable, str(PROJECT_DIR / "apply.py"), "lint"],
        capture_output=True,
        text=True,
    )
    assert_ok(proc)
