# SPDX-License-Identifier: Apache-2.0
"""Issue 34: what a second hostile run of apply.py broke, item by item."""

from __future__ import annotations

import json
import os
import shlex
import stat
import subprocess
import sys
from pathlib import Path

import pytest

import apply
from tests.tooling.conftest import (
    BASE,
    PROJECT_DIR,
    UNKEPT,
    copy_small,
    run_tool,
    set_version,
    tree_digest,
)

PROBE = "vllm/k3_sppp_probe/__init__.py"


def ok(proc: subprocess.CompletedProcess[str]) -> subprocess.CompletedProcess[str]:
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


def quoted_command(text: str, start: str) -> str:
    """The shell command between the backtick before ``start`` and the first
    backtick outside quotes after it, as a user copies it."""
    begin = text.index("`" + start) + 1
    quote = None
    for i in range(begin, len(text)):
        char = text[i]
        if quote is not None:
            quote = None if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char == "`":
            return text[begin:i]
    raise AssertionError(f"no closing backtick in {text!r}")


# -- 1. a printed command runs exactly on the tree it names -------------------

HOSTILE = "a `touch tick` $(touch dollar) $HOME 'q\" \n-rf x"


def test_printed_revert_command_acts_on_its_tree_and_runs_nothing(
    pristine_cache, patch_set, tmp_path
):
    target = copy_small(pristine_cache, tmp_path / HOSTILE / "site-packages")
    pristine = tree_digest(target)
    ok(run_tool(patch_set, "apply", "--target", str(target)))
    logger = target / "vllm/logger.py"
    logger.write_text(logger.read_text() + "# edit\n")
    proc = run_tool(patch_set, "revert", "--target", str(target))
    assert proc.returncode == apply.EXIT_DRIFT, proc.stderr
    command = quoted_command(proc.stderr, "python3 ")
    env = dict(os.environ, HOME=str(tmp_path / "home"))
    run = subprocess.run(  # where it was printed: apply.py's directory
        ["bash", "-c", command.replace("python3", sys.executable, 1)],
        cwd=PROJECT_DIR,
        env=env,
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, command + run.stderr
    for name in ("tick", "dollar"):  # no `touch` ran, here or there
        assert not (PROJECT_DIR / name).exists()
        assert not (tmp_path / name).exists()
    assert not (tmp_path / "home").exists()
    kept = target / "vllm/logger.py.k3-sppp-drift"
    assert kept.read_text().endswith("# edit\n")
    kept.unlink()
    assert tree_digest(target) == pristine


def test_make_is_printed_only_for_a_path_make_carries():
    from _apply import command_line

    safe = command_line(None, Path("/srv/venv-1"), "status")
    assert "make" in safe and "VLLM=/srv/venv-1" in safe
    for path in ("/srv/a b", "/srv/$(x)", "/srv/`x`", "/srv/a'b", "/srv/a\nb"):
        line = command_line(None, Path(path), "status")
        assert not line.startswith("make") and "make -C" not in line, line
        assert shlex.split(line)[-2:] == ["--target", path]


# -- 2. revert --force checks every path before its first write ----------------


def test_forced_revert_over_a_directory_changes_nothing(small_tool, small_target):
    ok(small_tool("apply"))
    version = small_target / "vllm/version.py"
    version.unlink()
    version.mkdir()
    before = tree_digest(small_target)
    proc = small_tool("revert", "--force")
    assert proc.returncode == apply.EXIT_ERROR, proc.stdout + proc.stderr
    assert f"{version}: a directory where a file belongs" in proc.stderr
    assert "nothing was changed" in proc.stderr
    assert tree_digest(small_target) == before


def test_revert_with_backups_it_cannot_delete_changes_nothing(
    small_tool, small_target, patch_set, monkeypatch
):
    """A read-only backups directory, as ``os.access`` reports it (root can
    write in one, so the answer is planted where the tool asks)."""
    import _apply

    ok(small_tool("apply"))
    backups = small_target.resolve() / ".k3_sppp/backups"
    before = tree_digest(small_target)
    real = os.access
    monkeypatch.setattr(
        _apply.os,
        "access",
        lambda path, mode: Path(path) != backups and real(path, mode),
    )
    args = ["--patch-set", str(patch_set), "revert", "--target", str(small_target)]
    assert apply.main(args) == apply.EXIT_ERROR
    assert tree_digest(small_target) == before


# -- 3. no behaviour depends on docstrings -----------------------------------


@pytest.mark.parametrize(
    "args", [["--help"], ["status"], ["apply"], ["revert"], ["check"]]
)
def test_every_verb_runs_under_python_OO(args, patch_set, small_target):
    command = [sys.executable, "-OO", str(PROJECT_DIR / "apply.py")]
    command += ["--patch-set", str(patch_set), *args]
    if args != ["--help"]:
        command += ["--target", str(small_target)]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert "Traceback" not in proc.stderr, proc.stderr
    assert proc.returncode in (0, apply.EXIT_NOT_APPLIED), proc.stderr
    if args == ["--help"]:
        assert "Exit codes:" in proc.stdout


# -- 4. status says what apply and revert will do ------------------------------


def test_status_on_an_applied_tree_of_another_version_says_revert_refuses(
    small_tool, small_target
):
    ok(small_tool("apply"))
    set_version(small_target, UNKEPT)
    status = small_tool("status")
    assert status.returncode == apply.EXIT_DRIFT, status.stdout
    assert f"vLLM {UNKEPT} is installed, the patch set was applied to {BASE}" in (
        status.stdout
    )
    assert small_tool("revert").returncode == apply.EXIT_DRIFT


def test_apply_on_another_version_exits_as_status_does(small_tool, small_target):
    set_version(small_target, UNKEPT)
    before = tree_digest(small_target)
    assert small_tool("status").returncode == apply.EXIT_DRIFT
    proc = small_tool("apply")
    assert proc.returncode == apply.EXIT_DRIFT, proc.stderr
    assert tree_digest(small_target) == before


# -- 5. smaller ones ---------------------------------------------------------


def test_a_deleted_overlay_file_is_refused_as_status_reports_it(
    small_tool, small_target
):
    ok(small_tool("apply"))
    (small_target / PROBE).unlink()
    assert small_tool("status").returncode == apply.EXIT_DRIFT
    proc = small_tool("revert")
    assert proc.returncode == apply.EXIT_DRIFT, proc.stdout + proc.stderr
    assert f"deleted since apply, refusing to overwrite: {PROBE}" in proc.stderr
    ok(small_tool("revert", "--force"))
    assert not (small_target / ".k3_sppp").exists()


@pytest.mark.parametrize("broken", ["metadata", "version_file"])
def test_version_sources_that_disagree_or_break_are_refused(
    small_tool, small_target, broken
):
    if broken == "metadata":
        (metadata,) = small_target.glob("vllm-*.dist-info/METADATA")
        metadata.write_text(
            metadata.read_text().replace(
                f"\nVersion: {BASE}\n", f"\nVersion: {UNKEPT}\n"
            )
        )
        expected = "the vLLM version files disagree"
    else:
        (small_target / "vllm/_version.py").write_text("syntax error(\n")
        expected = "_version.py: names no __version__"
    before = tree_digest(small_target)
    for verb in ("apply", "status"):
        proc = small_tool(verb)
        assert proc.returncode == apply.EXIT_ERROR, proc.stdout + proc.stderr
        assert expected in proc.stderr
    assert tree_digest(small_target) == before


def test_state_is_private_whatever_the_umask(patch_set, small_target):
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            "import os, sys; os.umask(0); sys.argv = sys.argv[1:]; "
            "sys.path.insert(0, os.path.dirname(sys.argv[0])); "
            "import apply; sys.exit(apply.main(sys.argv[1:]))",
            str(PROJECT_DIR / "apply.py"),
            "--patch-set",
            str(patch_set),
            "apply",
            "--target",
            str(small_target),
        ],
        capture_output=True,
        text=True,
    )
    ok(proc)
    state = small_target / ".k3_sppp"
    for path, mode in (
        (state, 0o700),
        (state / "backups", 0o700),
        (state / "journal.json", 0o600),
    ):
        assert stat.S_IMODE(path.stat().st_mode) == mode, path
    assert json.loads((state / "journal.json").read_text())["state"] == "applied"


def test_a_stopped_devtree_names_how_to_clean_it(small_tool, tmp_path):
    tree = tmp_path / "dev $(touch x) tree"
    (tree / "vllm").mkdir(parents=True)  # what a killed devtree leaves
    (tree / "vllm" / "__init__.py").write_text("")
    proc = small_tool("devtree", str(tree))
    assert proc.returncode == apply.EXIT_ERROR
    command = quoted_command(proc.stderr, "rm -rf")
    subprocess.run(["bash", "-c", command], cwd=tmp_path, check=True)
    assert not tree.exists() and not (tmp_path / "x").exists()
    ok(small_tool("devtree", str(tree)))


def test_a_symlink_in_place_of_a_patched_file_is_named_on_revert(
    small_tool, small_target, tmp_path
):
    ok(small_tool("apply"))
    logger = small_target / "vllm/logger.py"
    elsewhere = tmp_path / "my-logger.py"
    elsewhere.write_bytes(logger.read_bytes())
    logger.unlink()
    logger.symlink_to(elsewhere)
    patched = elsewhere.read_bytes()
    proc = ok(small_tool("revert"))
    assert not logger.is_symlink() and logger.is_file()
    assert (
        f"vllm/logger.py was a symbolic link of yours (-> {elsewhere}); vLLM's "
        "original file replaces the link, its target is untouched"
    ) in proc.stderr
    assert elsewhere.read_bytes() == patched
