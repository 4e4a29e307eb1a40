# SPDX-License-Identifier: Apache-2.0
"""What the make targets say on a fresh node: a missing or old Python named
with the fix before anything is built or started, and `make status` answering
without make's error line unless the state is a real problem."""

from __future__ import annotations

import os
import re
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

import apply

PROJECT_DIR = Path(apply.__file__).resolve().parent
DEFAULT, *OTHERS = apply.bases()
# Each base's make arguments, venv and vLLM: the default's in .venv.
BASES = [([], ".venv", DEFAULT)] + [([f"BASE={v}"], f".venv-{v}", v) for v in OTHERS]


def python_3_10(tmp_path: Path) -> Path:
    """An interpreter that is Python 3.10 to the program it runs, as Ubuntu
    22.04's python3: it reports 3.10.12 and has no tomllib."""
    site = tmp_path / "py310"
    site.mkdir()
    (site / "sitecustomize.py").write_text(
        "import sys\n"
        "sys.version_info = (3, 10, 12, 'final', 0)\n"
        "sys.version = '3.10.12 (main, Nov 20 2023, 15:14:05) [GCC 11.4.0]'\n"
        "class NoTomllib:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'tomllib':\n"
        "            raise ModuleNotFoundError(\"No module named 'tomllib'\")\n"
        "sys.meta_path.insert(0, NoTomllib())\n"
    )
    script = site / "python3"
    script.write_text(f'#!/bin/sh\nPYTHONPATH={site} exec {sys.executable} "$@"\n')
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return script


def make(
    *args: str,
    cwd: Path = PROJECT_DIR,
    path: str | None = None,
    extra_env: dict[str, str] | None = None,
):
    # Not the settings of a make these tests run under: `make test BASE=...
    # TEST_PATHS=...` puts its variables in the environment of every make
    # below it, and in MAKEFLAGS.
    given = {
        word.split("=", 1)[0]
        for word in os.environ.get("MAKEFLAGS", "").split()
        if "=" in word
    }
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in {"MAKEFLAGS", "MFLAGS", "MAKELEVEL", "MAKEOVERRIDES", *given}
    }
    if path is not None:
        env["PATH"] = f"{path}{os.pathsep}{env['PATH']}"
    env.update(extra_env or {})
    return subprocess.run(
        ["make", "-s", *args], capture_output=True, text=True, cwd=cwd, env=env
    )


def test_make_serve_on_python_3_10_says_what_it_needs(tmp_path):
    python = python_3_10(tmp_path)
    result = make(
        "serve",
        "ARM=fi-noep",
        "NODE_RANK=0",
        "MODEL=/m",
        "HOST_IP=h",
        "MASTER_ADDR=m",
        f"SERVE_PYTHON={python}",
    )
    assert result.returncode != 0 and result.stdout == ""
    line = result.stderr.splitlines()[0]
    # Named by the interpreter the stub runs, which reports 3.10.12.
    assert line.startswith(
        "eval.serve needs Python 3.11 or newer, as vLLM 0.33.0 and 0.34.0 do"
    )
    assert line.endswith(
        " is 3.10.12. Run it with the python of the environment that serves "
        "vLLM: `make serve SERVE_PYTHON=/path/to/bin/python` (default: this "
        "checkout's .venv)."
    )


def test_make_serve_without_its_python_says_how_to_get_one(tmp_path):
    missing = tmp_path / "venv" / "bin" / "python"
    result = make("serve", "ARM=fi-noep", f"SERVE_PYTHON={missing}")
    assert result.stderr.startswith(
        f"make serve: no python at SERVE_PYTHON={missing}: run `make apply`"
    )
    assert result.returncode != 0


@pytest.fixture
def fresh_clone(tmp_path: Path) -> Path:
    """What `make setup` reads of a clone that has no .venv yet."""
    clone = tmp_path / "clone"
    clone.mkdir()
    for name in ("Makefile", "setup.cfg"):
        shutil.copy(PROJECT_DIR / name, clone / name)
    return clone


@pytest.mark.parametrize(("args", "venv", "version"), BASES)
def test_make_apply_without_python_3_11_says_how_to_install_it(
    fresh_clone, args, venv, version
):
    result = make("apply", *args, "PYTHON=python3.11-not-installed", cwd=fresh_clone)
    assert result.returncode != 0
    assert result.stderr.splitlines()[0] == (
        f"make setup: python3.11-not-installed is not on PATH; vLLM {version} needs "
        "Python 3.11 or newer. Install it (Ubuntu 22.04: sudo apt install "
        "python3.11 python3.11-venv; or uv python install 3.11) or point PYTHON= "
        "at one: make apply PYTHON=/path/to/python3.11"
    )
    assert not (fresh_clone / venv).exists()


@pytest.mark.parametrize(("args", "venv", "version"), BASES)
def test_make_apply_with_an_older_python_names_its_version(
    fresh_clone, tmp_path, args, venv, version
):
    result = make("apply", *args, f"PYTHON={python_3_10(tmp_path)}", cwd=fresh_clone)
    assert result.returncode != 0
    assert f"is Python 3.10.12, vLLM {version} needs 3.11 or newer" in result.stderr
    assert not (fresh_clone / venv).exists()


@pytest.mark.parametrize(("args", "venv", "version"), BASES)
def test_make_apply_on_a_full_disk_says_so_before_pip(fresh_clone, args, venv, version):
    """Where the venv cannot fit, no venv is made and pip never starts: the
    message names the free space, the need and the directory."""
    need = shutil.disk_usage(fresh_clone).free // 2**30 + 100
    result = make(
        "apply",
        *args,
        f"PYTHON={sys.executable}",
        f"SETUP_FREE_GIB={need}",
        cwd=fresh_clone,
    )
    assert result.returncode != 0
    assert re.fullmatch(
        rf"make setup: \d+ GiB free on the disk of {re.escape(str(fresh_clone))}; "
        rf"{re.escape(venv)} \(vLLM {re.escape(version)}, torch 2\.14\.0 with its "
        rf"CUDA libraries\) needs about {need} GiB\. Free space there, or clone "
        "k3-sppp onto a larger disk",
        result.stderr.splitlines()[0],
    )
    assert not (fresh_clone / venv).exists()


def test_make_refuses_a_base_the_series_is_not_kept_for(fresh_clone):
    result = make("apply", "BASE=0.32.0", cwd=fresh_clone)
    assert result.returncode != 0
    assert (
        f"BASE=0.32.0: the series is kept for vLLM {' '.join(apply.bases())} "
        "(setup.cfg vllm_bases)"
    ) in result.stderr


@pytest.mark.parametrize(("args", "venv", "version"), BASES)
def test_make_targets_act_on_the_venv_of_their_base(fresh_clone, args, venv, version):
    """apply.py gets the base's venv as its target (none: .venv, its
    default) and never a --patch-set: the venv's vLLM picks the series."""
    target = "" if venv == ".venv" else f" --target={venv}"
    for verb, line in (
        ("apply", f"python3 apply.py apply{target}"),
        ("revert", f"python3 apply.py revert{target}"),
        ("check", f"python3 apply.py check{target}"),
        ("manifest", f"python3 apply.py manifest{target}"),
        ("pr-diff", f"python3 apply.py export{target} --pulls build/pr"),
    ):
        out = " ".join(make("-n", verb, *args, cwd=fresh_clone).stdout.split(" "))
        out = out.replace("  ", " ")
        assert line in out, out
        assert "--patch-set" not in out
    out = make("-n", "pr-diff", *args, cwd=fresh_clone).stdout
    assert out.rstrip().endswith(
        "build/pr" + ("" if venv == ".venv" else f"-{version}")
    )


def test_make_lint_builds_the_venv_of_every_base(fresh_clone):
    out = make("-n", "lint", cwd=fresh_clone).stdout
    for version in apply.bases():
        assert f'"vllm=={version}"' in out, version
    assert "python3 apply.py lint\n" in out


def test_make_help_says_what_base_does():
    text = make("help").stdout
    assert "BASE=0.33.0 works on vLLM 0.33.0 instead of the default" in text
    assert "(BASE=0.33.0: build/pr-0.33.0/, that base's series)" in text


def apply_py_answering(tmp_path: Path, code: int) -> str:
    """A directory whose python3 runs any apply.py as one that prints a state
    and exits ``code``."""
    stub = tmp_path / "bin"
    stub.mkdir()
    python3 = stub / "python3"
    python3.write_text(f"#!/bin/sh\necho 'state:    stub {code}'\nexit {code}\n")
    python3.chmod(python3.stat().st_mode | stat.S_IEXEC)
    return str(stub)


@pytest.mark.parametrize(
    "code",
    [
        apply.EXIT_OK,
        apply.EXIT_NOT_APPLIED,
        apply.EXIT_DRIFT,
        apply.EXIT_OTHER_REVISION,
    ],
)
def test_make_status_reports_a_state_without_a_make_error(tmp_path, code):
    result = make("status", path=apply_py_answering(tmp_path, code))
    assert (result.returncode, result.stdout) == (0, f"state:    stub {code}\n")
    assert result.stderr == ""


@pytest.mark.parametrize("code", [apply.EXIT_ERROR, apply.EXIT_INTERRUPTED])
def test_make_status_fails_on_a_real_problem(tmp_path, code):
    result = make("status", path=apply_py_answering(tmp_path, code))
    assert result.returncode != 0
    assert f"Error {code}" in result.stderr


def test_make_help_names_every_target_that_vllm_points(tmp_path):
    makefile = (PROJECT_DIR / "Makefile").read_text()
    recipes = re.findall(r"^([\w-]+):[^\n]*\n((?:\t[^\n]*\n)+)", makefile, re.M)
    pointed = [target for target, recipe in recipes if "$(TARGET)" in recipe]
    assert {"apply", "status", "pr-diff"} <= set(pointed)
    text = make("help").stdout
    paragraph = text[text.index("VLLM=/path") :].split(" instead of ")[0]
    assert [t for t in pointed if t not in paragraph] == []


def clone_for_make_test(clone: Path, interpreter: str, venv: str = ".venv") -> None:
    """``clone`` as `make test` finds a set-up one: ``venv``'s python runs the
    shell script ``interpreter`` in pytest's place, and apply.py does nothing
    but note its arguments in ``apply.log``."""
    venv_bin = clone / venv / "bin"
    venv_bin.mkdir(parents=True)
    stub = venv_bin / "python"
    stub.write_text(f"#!/bin/sh\n{interpreter}")
    stub.chmod(stub.stat().st_mode | stat.S_IEXEC)
    (clone / venv / ".k3-sppp-setup").touch()
    for version in (DEFAULT, *OTHERS):  # `make pristine` has nothing to do
        (clone / ".cache" / f"pristine-vllm-{version}").mkdir(parents=True)
    (clone / "apply.py").write_text(
        "import sys\n"
        f"with open({str(clone / 'apply.log')!r}, 'a') as f:\n"
        "    f.write(' '.join(sys.argv[1:]) + '\\n')\n"
    )


@pytest.mark.parametrize(("args", "venv", "version"), BASES)
def test_make_test_unpacks_each_other_base_that_has_neither_venv_nor_sources(
    fresh_clone, tmp_path, args, venv, version
):
    """`make test` runs `make pristine` first: for each other base without a
    venv or an unpacked tree, the wheel pip downloads (no dependencies) is
    unpacked into .cache/pristine-vllm-VERSION by _pristine.py, and the
    download is removed; a base that has either is left alone, and a failed
    unpacking fails make test before any test runs."""
    calls = tmp_path / "calls"
    clone_for_make_test(
        fresh_clone,
        f'echo "$@" >> {calls}\n'
        'if [ "$1 $2 $3" = "-m pip download" ]; then\n'
        '  for a; do dir=$a; done; touch "$dir/vllm-${6#vllm==}-py3-none-any.whl"; fi\n'
        'case "$1" in _pristine.py) exit ${UNPACK_EXIT:-0} ;; esac\n',
        venv,
    )
    others = [v for v in (DEFAULT, *OTHERS) if v != version]
    for other in others:
        (fresh_clone / ".cache" / f"pristine-vllm-{other}").rmdir()
    result = make("test", *args, "TEST_PATHS=tests/unit", cwd=fresh_clone)
    assert result.returncode == 0, result.stdout + result.stderr
    lines = calls.read_text().splitlines()
    unpacked = []
    for other in others:
        download = next(ln for ln in lines if f"vllm=={other}" in ln)
        assert download.startswith("-m pip download --quiet --no-deps ")
        wheel_dir = download.split(" -d ")[1]
        assert not (fresh_clone / wheel_dir).exists()  # removed after
        unpacked.append(
            f"_pristine.py {wheel_dir}/vllm-{other}-py3-none-any.whl "
            f".cache/pristine-vllm-{other}"
        )
    assert [ln for ln in lines if ln.startswith("_pristine.py")] == unpacked
    assert lines[-1] == "-m pytest tests/unit"

    # Each other base with a tree of its own (its venv, or its unpacked
    # sources): nothing is downloaded.
    calls.unlink()
    for other in others:
        (fresh_clone / ".cache" / f"pristine-vllm-{other}").mkdir()
    assert make("test", *args, "TEST_PATHS=tests/unit", cwd=fresh_clone).returncode == 0
    assert calls.read_text().splitlines() == ["-m pytest tests/unit"]

    # A wheel that does not unpack: make test fails before pytest.
    calls.unlink()
    for other in others:
        (fresh_clone / ".cache" / f"pristine-vllm-{other}").rmdir()
    env_result = make(
        "test",
        *args,
        "TEST_PATHS=tests/unit",
        cwd=fresh_clone,
        extra_env={"UNPACK_EXIT": "1"},
    )
    assert env_result.returncode != 0
    assert "-m pytest tests/unit" not in calls.read_text().splitlines()
    assert not list((fresh_clone / ".cache").glob("wheel-*"))


@pytest.mark.parametrize("code", [0, 1])
def test_make_test_removes_its_temporary_directory_only_after_a_pass(
    fresh_clone, tmp_path, code
):
    """`make test` gives pytest a TMPDIR of its own: gone after a passing run,
    kept and named after a failing one (the ranks' output is in it)."""
    seen = tmp_path / "tmpdir-seen"
    clone_for_make_test(
        fresh_clone, f'echo "$TMPDIR" > {seen}\ntouch "$TMPDIR/rank.log"\nexit {code}\n'
    )
    result = make("test", cwd=fresh_clone)
    tmpdir = Path(seen.read_text().strip())
    assert tmpdir.name.startswith("k3-sppp-test-")
    if code == 0:
        assert result.returncode == 0
        assert not tmpdir.exists()
    else:
        assert result.returncode != 0
        assert f"make test: temporary files kept in {tmpdir}" in result.stdout
        assert (tmpdir / "rank.log").exists()
        shutil.rmtree(tmpdir)


@pytest.mark.parametrize(
    ("serving", "rest", "passes"),
    [
        (0, 0, True),
        (1, 0, False),
        (0, 1, False),
        (5, 0, True),
        (0, 5, True),
        (5, 5, False),
    ],
)
def test_make_test_runs_the_serving_tests_alone_then_the_rest_in_workers(
    fresh_clone, tmp_path, serving, rest, passes
):
    """The servers' spinning ranks would slow what runs beside them: the
    serving tests run first in a pytest of their own, the rest in xdist
    workers after them; a step left without tests (exit 5) fails the run
    only if the other has none either."""
    calls = tmp_path / "calls"
    clone_for_make_test(
        fresh_clone,
        f'echo "$@" >> {calls}\n'
        f'case " $* " in *" tests/serving "*) exit {serving} ;; esac\nexit {rest}\n',
    )
    result = make("test", "PYTEST_ARGS=-x", cwd=fresh_clone)
    assert calls.read_text().splitlines() == [
        "-m pytest tests/serving -x",
        "-m pytest -n 2 --dist loadfile --ignore=tests/serving -x",
    ]
    assert (result.returncode == 0) == passes, result.stdout + result.stderr

    calls.unlink()
    result = make("test", "TEST_PATHS=tests/unit", "TEST_JOBS=0", cwd=fresh_clone)
    assert calls.read_text().splitlines() == ["-m pytest tests/unit"]


@pytest.mark.parametrize(("args", "venv", "version"), BASES[1:])
def test_make_test_of_a_base_applies_and_runs_in_its_venv(
    fresh_clone, tmp_path, args, venv, version
):
    """`make test BASE=0.33.0`: apply.py's status and apply on .venv-0.33.0,
    then pytest by that venv's python (its conftest picks the overlay tests
    of that vLLM)."""
    calls = tmp_path / "calls"
    clone_for_make_test(fresh_clone, f'echo "$0 $@" >> {calls}\nexit 0\n', venv)
    result = make("test", *args, "TEST_PATHS=tests/unit", cwd=fresh_clone)
    assert result.returncode == 0, result.stdout + result.stderr
    assert (fresh_clone / "apply.log").read_text().splitlines() == [
        f"status --target={venv}",
        f"apply --target={venv}",
    ]
    assert calls.read_text().splitlines() == [f"{venv}/bin/python -m pytest tests/unit"]


def test_ci_begins_with_the_readmes_two_commands_on_the_fresh_clone():
    """The README promises that `make apply` then `make test` pass on a fresh
    clone: CI runs exactly those first, before any other target (`make lint`
    builds .venv-0.33.0, which `make test` must not need)."""
    readme = (PROJECT_DIR / "README.md").read_text()
    setup = readme.split("\n## Set up\n", 1)[1].split("\n## ", 1)[0]
    promised = [ln.strip() for ln in setup.splitlines() if ln.startswith("    make ")]
    assert promised == ["make apply", "make test"]
    ci = (PROJECT_DIR / ".ci" / "run").read_text()
    makes = [ln.strip() for ln in ci.splitlines() if ln.split()[:1] == ["make"]]
    assert makes[:2] == promised, makes


def test_the_rest_deals_tests_distributed_whole_to_one_worker_longest_first():
    """conftest.py's xdist scheduling: every test of tests/distributed is one
    unit (its pools and fork servers built once), any other test's unit is
    its file, and each unit LONGEST_FIRST names exists, so a renamed file is
    not silently dealt out last."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "k3_sppp_root_conftest", PROJECT_DIR / "conftest.py"
    )
    root_conftest = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(root_conftest)
    unit = root_conftest.work_unit
    assert unit("tests/distributed/test_launcher.py::test_a[TP2xPP2]") == (
        "tests/distributed"
    )
    assert unit("tests/distributed/test_drafters.py::test_b") == "tests/distributed"
    assert unit("tests/eval/test_bench.py::test_c[x::y]") == "tests/eval/test_bench.py"
    assert (
        unit("tests/distributedx/test_d.py::test_e") == "tests/distributedx/test_d.py"
    )
    assert root_conftest.LONGEST_FIRST[0] == "tests/distributed"
    for path in root_conftest.LONGEST_FIRST:
        assert (PROJECT_DIR / path).exists(), path
