# SPDX-License-Identifier: Apache-2.0
"""One project, a series per vLLM release: apply.py picks the series by the
target's vLLM version (``patches/`` for the default, ``bases/VERSION/
patches/`` for another), composes the overlay for it (a base's own files in
place of the shared ones), refuses a vLLM it keeps no series for without
writing, lints every base on its own vLLM, and names what does not carry
over when a series is moved onto a newer release.

The project's own series run on pristine trees of both releases
(``pristine_caches``: from .venv, and from .venv-0.33.0 or the 0.33.0
wheel's sources that `make pristine` unpacks); without either a test that
needs that base is skipped, naming `make pristine`, which `make test` runs.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import apply
from _apply import parse_patch
from tests.tooling.conftest import (
    BASE,
    BASES,
    PROJECT_DIR,
    UNKEPT,
    composed_overlay,
    copy_project,
    file_signatures,
    linked_copy,
    need_bases,
    run_tool,
    series_dir,
    set_version,
    tree_digest,
)
from tests.tooling.upstream_edits import series

DEFAULT, *OTHERS = BASES
# The PP stage check, which asks each release's runners how they pad: a file
# per base.
AGREEMENT = "vllm/v1/worker/pp_hand_off_agreement.py"
# A file the 0.33.0 series patches that vLLM 0.34.0 removed (the legacy runner).
GONE = "vllm/v1/worker/gpu_model_runner.py"


def tree_of(caches: dict[str, Path], version: str, dest: Path) -> Path:
    """A pristine vLLM ``version`` tree of its own at ``dest``."""
    need_bases(caches, version)
    return linked_copy(caches[version], dest)


def without_bytecode(root: Path) -> dict[str, str]:
    return {k: v for k, v in tree_digest(root).items() if "__pycache__" not in k}


def status_json(target: Path, patch_set: Path = PROJECT_DIR) -> dict:
    proc = run_tool(patch_set, "status", "--json", "--target", str(target))
    return json.loads(proc.stdout)


def test_the_project_keeps_a_series_per_release_as_setup_cfg_lists_them():
    listed = re.search(
        r"^vllm_bases = (.+)$", (PROJECT_DIR / "setup.cfg").read_text(), re.M
    ).group(1)
    assert sorted(BASES) == sorted(listed.split())
    assert BASES[DEFAULT] == PROJECT_DIR / "patches"
    for version in OTHERS:
        assert BASES[version] == PROJECT_DIR / "bases" / version / "patches"


# -- the series is chosen by the target's vLLM ----------------------------------


@pytest.mark.parametrize("version", list(BASES))
def test_each_vllm_gets_the_series_kept_for_it(pristine_caches, tmp_path, version):
    """Without --patch-set or --target naming a series, a tree of each
    release is compared with, applied with and recorded as its own series."""
    target = tree_of(pristine_caches, version, tmp_path / "site-packages")
    report = status_json(target)
    assert (report["vllm_version"], report["base_version"]) == (version, version)
    assert report["series"] == str(BASES[version])
    assert report["exit_code"] == apply.EXIT_NOT_APPLIED, report
    applied = run_tool(PROJECT_DIR, "apply", "--target", str(target))
    assert applied.returncode == 0, applied.stderr
    name = BASES[version].relative_to(PROJECT_DIR)
    assert f"the vLLM {version} series ({name})" in applied.stdout
    journal = json.loads((target / apply.STATE_DIR / "journal.json").read_text())
    assert (journal["base_version"], journal["series"]) == (version, str(name))
    report = status_json(target)
    assert report["exit_code"] == apply.EXIT_OK, report
    assert report["revision"] == report["patch_set_revision"] == journal["revision"]
    text = run_tool(PROJECT_DIR, "status", "--target", str(target)).stdout
    assert f"series:   {name} of {PROJECT_DIR}, for vLLM {version}" in text


def test_a_checkout_that_states_no_version_gets_the_series_its_files_match(
    pristine_caches, tmp_path
):
    """No vllm/_version.py, no dist-info (a bare source checkout): the
    series whose pinned originals the files are is taken, and applies."""
    need_bases(pristine_caches, *BASES)
    for version in BASES:
        target = tree_of(pristine_caches, version, tmp_path / version)
        (target / "vllm/_version.py").unlink()
        for info in target.glob("vllm-*.dist-info"):
            shutil.rmtree(info)
        report = status_json(target)
        assert report["vllm_version"] is None
        assert (report["series"], report["exit_code"]) == (
            str(BASES[version]),
            apply.EXIT_NOT_APPLIED,
        ), report
        applied = run_tool(PROJECT_DIR, "apply", "--target", str(target))
        assert applied.returncode == 0, applied.stderr
        assert f"the vLLM {version} series" in applied.stdout


def test_the_two_releases_get_different_revisions(pristine_caches, tmp_path):
    """Stages on different releases announce different revisions: the
    revision hashes the series and the overlay as composed for it."""
    need_bases(pristine_caches, *BASES)
    revisions = {
        version: status_json(tree_of(pristine_caches, version, tmp_path / version))[
            "patch_set_revision"
        ]
        for version in BASES
    }
    assert len(set(revisions.values())) == len(BASES), revisions


@pytest.mark.parametrize("version", list(BASES))
def test_apply_and_revert_are_byte_for_byte_on_each_release(
    pristine_caches, tmp_path, version
):
    target = tree_of(pristine_caches, version, tmp_path / "site-packages")
    before = without_bytecode(target)
    applied = run_tool(PROJECT_DIR, "apply", "--target", str(target))
    assert applied.returncode == 0, applied.stderr
    results = (BASES[version] / "patched.sha256").read_text().splitlines()
    for line in (ln for ln in results if ln[:1] != "#"):
        digest, rel = line.split("  ", 1)
        assert tree_digest(target)[rel] == digest, rel
    reverted = run_tool(PROJECT_DIR, "revert", "--target", str(target))
    assert reverted.returncode == 0, reverted.stderr
    name = BASES[version].relative_to(PROJECT_DIR)
    assert f"back to vLLM {version}; revision " in reverted.stdout
    assert f"of the vLLM {version} series ({name}) was applied" in reverted.stdout
    assert without_bytecode(target) == before


def test_a_base_installs_its_own_overlay_file_in_place_of_the_shared_one(
    pristine_caches, tmp_path
):
    """0.33.0 keeps its own PP stage check (the legacy runner's dispatcher
    and aux layers); 0.34.0 gets the shared one; every other overlay file is
    the shared one on both."""
    need_bases(pristine_caches, *BASES)
    own = {
        version: PROJECT_DIR / "bases" / version / "vllm_overlay" for version in OTHERS
    }
    assert [f for f in own["0.33.0"].rglob("*.py") if "tests" not in f.parts] == [
        own["0.33.0"] / AGREEMENT
    ]
    for version in BASES:
        target = tree_of(pristine_caches, version, tmp_path / version)
        applied = run_tool(PROJECT_DIR, "apply", "--target", str(target))
        assert applied.returncode == 0, applied.stderr
        for rel, src in composed_overlay(PROJECT_DIR, version).items():
            if rel.startswith("vllm/"):
                assert (target / rel).read_bytes() == src.read_bytes(), rel
        wanted = own.get(version, PROJECT_DIR / "vllm_overlay") / AGREEMENT
        assert (target / AGREEMENT).read_bytes() == wanted.read_bytes(), version
    shared = (PROJECT_DIR / "vllm_overlay" / AGREEMENT).read_bytes()
    assert (own["0.33.0"] / AGREEMENT).read_bytes() != shared


def test_a_base_keeps_only_the_overlay_files_that_differ():
    for version in OTHERS:
        own = PROJECT_DIR / "bases" / version / "vllm_overlay"
        for path in (p for p in own.rglob("*") if p.is_file()):
            rel = path.relative_to(own)
            shared = PROJECT_DIR / "vllm_overlay" / rel
            assert not shared.is_file() or shared.read_bytes() != path.read_bytes(), rel


# -- a vLLM no series is kept for ------------------------------------------------


@pytest.mark.parametrize("unkept", [UNKEPT, "0.35.0"])
def test_another_vllm_is_refused_naming_its_version_and_the_kept_ones(
    pristine_cache, tmp_path, unkept
):
    """A tree that says a version the project keeps no series for (its
    files are the tests' base's, so any series would apply) is refused by
    every verb that writes, naming the version, the files that say it and
    the versions kept; not one file changes, in the tree or the project."""
    target = linked_copy(pristine_cache, tmp_path / "site-packages")
    set_version(target, unkept)
    before = file_signatures(target)
    project = file_signatures(PROJECT_DIR / "patches") | file_signatures(
        PROJECT_DIR / "bases"
    )
    kept = " and ".join(
        f"{v} ({(d / 'base.version').relative_to(PROJECT_DIR)})"
        for v, d in BASES.items()
    )
    said = (
        f"vLLM {unkept} (so say {target.resolve() / 'vllm/_version.py'} and "
        f"{target.resolve() / f'vllm-{BASE}.dist-info/METADATA'})"
    )
    out = tmp_path / "out"
    for args in (
        ["apply"],
        ["manifest"],
        ["export", "-o", str(out / "series.diff")],
        ["export", "--pulls", str(out / "pr")],
        ["devtree", str(out / "devtree")],
    ):
        proc = run_tool(PROJECT_DIR, *args[:1], "--target", str(target), *args[1:])
        assert proc.returncode == apply.EXIT_DRIFT, (args, proc.stderr)
        assert f"{target.resolve()}: {said}; the patch set {PROJECT_DIR} keeps a " in (
            proc.stderr
        )
        assert f"keeps a series only for vLLM {kept}, so nothing was written" in (
            proc.stderr
        )
        assert f"pip install vllm=={DEFAULT}" in proc.stderr
    assert file_signatures(target) == before
    assert not out.exists()
    after = file_signatures(PROJECT_DIR / "patches") | file_signatures(
        PROJECT_DIR / "bases"
    )
    assert after == project
    status = run_tool(PROJECT_DIR, "status", "--target", str(target))
    assert status.returncode == apply.EXIT_DRIFT
    assert f"series:   none for vLLM {unkept} in {PROJECT_DIR}, which keeps " in (
        status.stdout
    )
    assert file_signatures(target) == before


def test_a_base_directory_is_not_a_patch_set_of_its_own(small_target):
    for version in OTHERS:
        for given in (PROJECT_DIR / "bases" / version, Path("bases") / version):
            proc = subprocess.run(
                [sys.executable, str(PROJECT_DIR / "apply.py"), "--patch-set"]
                + [str(given), "status", "--target", str(small_target)],
                capture_output=True,
                text=True,
                cwd=PROJECT_DIR,
            )
            assert proc.returncode == apply.EXIT_ERROR, proc.stdout
            assert (
                f"{PROJECT_DIR / 'bases' / version}: the vLLM {version} part of "
                f"the patch set {PROJECT_DIR}, not a patch set of its own"
            ) in proc.stderr


TOOL_FILES = ("apply.py", "_apply.py", "_cli.py", "_upstream.py")


def project_with_venvs(caches: dict[str, Path], dest: Path) -> Path:
    """A copy of this project (the tool and its patch set) at ``dest`` with a
    venv of its own per base, named as `make setup` names them (``.venv``,
    ``.venv-VERSION``): this interpreter's Python, and the pristine tree of
    that base's vLLM in its site-packages. Not this project's venvs: a fresh
    clone's `make test` has ``.venv`` alone."""
    project = copy_project(dest)
    for name in TOOL_FILES:
        shutil.copy2(PROJECT_DIR / name, project / name)
    python = f"python{sys.version_info.major}.{sys.version_info.minor}"
    for version in BASES:
        venv = project / (".venv" if version == DEFAULT else f".venv-{version}")
        subprocess.run(
            [sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True
        )
        site_packages = venv / "lib" / python / "site-packages"
        site_packages.rmdir()  # empty: the venv's Python has no packages
        linked_copy(caches[version], site_packages)
    return project


def test_without_target_the_python_that_runs_apply_names_its_venv(
    pristine_caches, tmp_path
):
    """``.venv-0.33.0/bin/python apply.py status`` asks about .venv-0.33.0
    (and so does code importing apply in it), plain python3 about .venv."""
    need_bases(pristine_caches, *BASES)
    project = project_with_venvs(pristine_caches, tmp_path / "k3-sppp")
    for version in BASES:
        venv = project / (".venv" if version == DEFAULT else f".venv-{version}")
        root = next(venv.glob("lib/python*/site-packages"))
        for python in (venv / "bin" / "python", Path(sys.executable)):
            if version != DEFAULT and python == Path(sys.executable):
                continue  # another Python than the venv's asks about .venv
            proc = subprocess.run(
                [str(python), str(project / "apply.py"), "status", "--json"],
                capture_output=True,
                text=True,
            )
            report = json.loads(proc.stdout)
            assert report["target"] == str(root.resolve()), (python, report)
            assert report["vllm_version"] == version


def test_commands_name_a_base_venv_by_its_make_variable(pristine_caches, tmp_path):
    need_bases(pristine_caches, *BASES)
    project = project_with_venvs(pristine_caches, tmp_path / "k3-sppp")
    names = {}
    for version in BASES:
        venv = project / (".venv" if version == DEFAULT else f".venv-{version}")
        names[version] = next(venv.glob("lib/python*/site-packages"))
    ask = (
        "import json, sys; from _apply import command_line as c; "
        "roots = json.loads(sys.argv[1]); print(json.dumps({v: [c(None, r, "
        "'revert'), c(None, r, 'revert', '--force')] for v, r in roots.items()}))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", ask, json.dumps({v: str(r) for v, r in names.items()})],
        capture_output=True,
        text=True,
        cwd=project,
    )
    assert proc.returncode == 0, proc.stderr
    commands = json.loads(proc.stdout)
    for version in BASES:
        make = "" if version == DEFAULT else f" BASE={version}"
        assert commands[version] == [
            f"make revert{make}",
            f"make revert FORCE=1{make}",
        ]


# -- lint: every series on its own vLLM -----------------------------------------


def lint(project: Path, caches: dict[str, Path]) -> subprocess.CompletedProcess:
    targets = [arg for v in BASES for arg in ("--target", str(caches[v]))]
    return run_tool(project, "lint", *targets)


def test_lint_checks_every_series_on_its_own_vllm(pristine_caches, tmp_path):
    need_bases(pristine_caches, *BASES)
    project = copy_project(tmp_path / "k3-sppp")
    proc = lint(project, pristine_caches)
    assert proc.returncode == 0, proc.stderr
    for version, patch_dir in BASES.items():
        name = patch_dir.relative_to(PROJECT_DIR)
        assert f"the vLLM {version} series ({name}), on {pristine_caches[version]}" in (
            proc.stdout
        )
    # A patch of another base's series that no longer applies to its vLLM.
    for version in OTHERS:
        last = series(series_dir(project, version))[-1]
        text = last.read_text()
        body = text.split("\n@@ ", 1)[1].split("\n")[1:]
        line = next(ln for ln in body if ln.startswith(" ") and ln.strip())
        last.write_text(text.replace(line, line + "  # moved", 1))
        proc = lint(project, pristine_caches)
        assert proc.returncode == apply.EXIT_ERROR, proc.stdout
        assert f"the vLLM {version} series (bases/{version}/patches), on " in (
            proc.stderr
        )
        assert f"do not apply to vLLM {version}" in proc.stderr


def test_lint_refuses_a_base_overlay_file_that_is_the_shared_one(
    pristine_caches, tmp_path
):
    need_bases(pristine_caches, *BASES)
    project = copy_project(tmp_path / "k3-sppp")
    for version in OTHERS:
        rel = "vllm/v1/worker/pp_intermediate_tensors.py"
        copy = project / "bases" / version / "vllm_overlay" / rel
        shutil.copy2(project / "vllm_overlay" / rel, copy)
        proc = lint(project, pristine_caches)
        assert proc.returncode == apply.EXIT_ERROR
        assert f"{copy}: the same as {project / 'vllm_overlay' / rel}; delete it" in (
            proc.stderr
        )


def test_lint_wants_each_base_version_where_its_directory_and_setup_cfg_say(
    pristine_caches, tmp_path
):
    need_bases(pristine_caches, *BASES)
    project = copy_project(tmp_path / "k3-sppp")
    for version in OTHERS:
        path = series_dir(project, version) / "base.version"
        path.write_text("0.33.1\n")
        proc = lint(project, pristine_caches)
        assert proc.returncode == apply.EXIT_ERROR
        assert (
            f"{path}: says 0.33.1, but the series is kept in "
            f"{project / 'bases' / version} for vLLM {version}; make them agree"
        ) in proc.stderr
        path.write_text(f"{version}\n")
    config = project / "setup.cfg"
    config.write_text(config.read_text().replace(f" {OTHERS[0]}", ""))
    proc = lint(project, pristine_caches)
    assert proc.returncode == apply.EXIT_ERROR
    assert f"{config}: vllm_bases = {DEFAULT}, but {project} keeps a series for " in (
        proc.stderr
    )


def test_lint_names_the_venv_a_base_lacks(tmp_path):
    """Without a tree of a base's vLLM, lint says what builds one: its venv
    or its wheel's sources."""
    project = copy_project(tmp_path / "k3-sppp")
    (project / "setup.cfg").unlink()
    shutil.copytree(series_dir(project), project / "bases/9.9.9/patches")
    (project / "bases/9.9.9/patches/base.version").write_text("9.9.9\n")
    proc = run_tool(project, "lint", "--target", str(apply.venv(DEFAULT)))
    assert proc.returncode == apply.EXIT_ERROR
    assert (
        "lint checks every series against a pristine tree of its vLLM; missing:"
    ) in proc.stderr
    assert (
        f"vLLM 9.9.9 ({project / 'bases/9.9.9/patches'}): no vLLM 9.9.9 venv at "
        f"{PROJECT_DIR / '.venv-9.9.9'} (`make setup BASE=9.9.9` builds it), no "
        f"sources of its wheel at {PROJECT_DIR / '.cache/pristine-vllm-9.9.9'} "
        "(`make pristine` unpacks them)"
    ) in proc.stderr


# -- rebase onto a real release ---------------------------------------------------


def test_rebase_onto_a_release_without_a_patched_file_names_each_of_its_hunks(
    pristine_caches, tmp_path
):
    """The 0.33.0 series moved onto 0.34.0, which removed the legacy runner:
    every hunk of every patch to that file is named, with the code it
    changed, and nothing is written."""
    need_bases(pristine_caches, "0.33.0", "0.34.0")
    onto = tree_of(pristine_caches, "0.34.0", tmp_path / "vllm-0.34.0")
    out = tmp_path / "rebased"
    proc = run_tool(
        PROJECT_DIR,
        "rebase",
        "--target",
        str(pristine_caches["0.33.0"]),
        "--onto",
        str(onto),
        "--out",
        str(out),
    )
    assert proc.returncode == apply.EXIT_ERROR, proc.stdout
    assert not out.exists()
    assert not any(p.name.startswith(".rebased-") for p in tmp_path.iterdir())
    named = 0
    for patch in series(BASES["0.33.0"]):
        headers = parse_patch(patch).hunks.get(GONE, [])
        if not headers:
            continue
        report = proc.stderr.split(f"{patch.name} does not apply to {onto}")[1]
        report = report.split(".patch does not apply to ")[0]
        for number, header in enumerate(headers, 1):
            assert re.search(
                rf"  GONE {GONE} hunk #{number} \({re.escape(header)}\) "
                rf"(in [\w.]+|at module level): not in {re.escape(str(onto))}\n",
                report,
            ), (patch.name, number)
            named += 1
    assert named >= 2
    assert "in GPUModelRunner." in proc.stderr
    assert f"{named} GONE" in proc.stderr
    assert "hunk(s) of the vLLM 0.33.0 series (bases/0.33.0/patches)" in proc.stderr
    assert "nothing was written" in proc.stderr


# -- the overlay tests each base runs -------------------------------------------


def test_each_base_collects_the_overlay_tests_composed_for_it(tmp_path):
    """The project's conftest has pytest collect, on vLLM 0.33.0, its own
    copy of an overlay test in place of the shared one, and neither base
    another base's copies."""
    from conftest import overlay_test_ignored

    root = tmp_path / "k3-sppp"
    shared = root / "vllm_overlay/tests/v1/worker"
    own = root / "bases/0.33.0/vllm_overlay/tests/v1/worker"
    for path in (shared / "test_a.py", shared / "test_b.py", own / "test_a.py"):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("def test_x():\n    pass\n")
    collected = {
        version: sorted(
            str(p.relative_to(root))
            for p in root.rglob("test_*.py")
            if not any(overlay_test_ignored(q, root, version) for q in (p, *p.parents))
        )
        for version in ("0.34.0", "0.33.0")
    }
    assert collected == {
        "0.34.0": [
            "vllm_overlay/tests/v1/worker/test_a.py",
            "vllm_overlay/tests/v1/worker/test_b.py",
        ],
        "0.33.0": [
            "bases/0.33.0/vllm_overlay/tests/v1/worker/test_a.py",
            "vllm_overlay/tests/v1/worker/test_b.py",
        ],
    }
