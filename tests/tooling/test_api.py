# SPDX-License-Identifier: Apache-2.0
"""apply.py's declared interface: ``status --json``, the names in
``__all__`` (the same answers as the CLI), and the base version a patch set
carries in ``patches/base.version``."""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import pytest

import apply
from tests.tooling.conftest import BASE, PROJECT_DIR, UNKEPT, run_tool, tree_digest

PROBE = "vllm/k3_sppp_probe/__init__.py"
SERIES = [
    "0001-Tooling-probe-mark-two-vLLM-modules.patch",
    "0002-Tooling-probe-change-the-version-probe-again.patch",
]
# The schema, in order, as apply.status documents it (schema_version 1).
KEYS = [
    "schema_version",
    "exit_code",
    "state",
    "error",
    "target",
    "vllm_version",
    "patch_set",
    "base_version",
    "revision",
    "patch_set_revision",
    "started",
    "patches",
    "files",
    "drift",
    "leftovers",
    "alien",
    "orphans",
    "finish",
    "applied_to",
    "series",
    "bases",
]


def status_json(tool) -> dict:
    proc = tool("status", "--json")
    report = json.loads(proc.stdout)
    assert list(report) == KEYS
    assert report["schema_version"] == 1
    assert report["exit_code"] == proc.returncode, proc.stderr
    return report


def files(*drift: str | None) -> list[dict]:
    """The tests' series' files in status order, with their ``drift``."""
    paths = [("vllm/logger.py", "patched"), ("vllm/version.py", "patched")]
    paths.append((PROBE, "new"))
    return [
        {"path": path, "kind": kind, "drift": why}
        for (path, kind), why in zip(paths, drift, strict=True)
    ]


def applied_revision(small_tool) -> str:
    proc = small_tool("apply")
    assert proc.returncode == 0, proc.stderr
    return re.search(r"applied revision ([0-9a-f]{12}), ", proc.stdout).group(1)


def test_status_json_of_a_pristine_target(small_tool, small_target, patch_set):
    report = status_json(small_tool)
    assert report | {"patch_set_revision": None} == {
        "schema_version": 1,
        "exit_code": apply.EXIT_NOT_APPLIED,
        "state": "not-applied",
        "error": None,
        "target": str(small_target.resolve()),
        "vllm_version": BASE,
        "patch_set": str(patch_set.resolve()),
        "base_version": BASE,
        "revision": None,
        "patch_set_revision": None,
        "started": None,
        "patches": [],
        "files": files(None, None, None),
        "drift": [],
        "leftovers": [],
        "alien": [],
        "orphans": [],
        "finish": None,
        "applied_to": None,
        "series": str(patch_set.resolve() / "patches"),
        "bases": {BASE: str(patch_set.resolve() / "patches")},
    }
    assert report["patch_set_revision"] == applied_revision(small_tool)


def test_status_json_of_an_applied_target(small_tool):
    revision = applied_revision(small_tool)
    report = status_json(small_tool)
    assert report["exit_code"] == apply.EXIT_OK
    assert report["state"] == "applied"
    assert report["revision"] == report["patch_set_revision"] == revision
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", report["started"])
    assert report["patches"] == SERIES
    assert (report["files"], report["drift"]) == (files(None, None, None), [])


def test_status_json_names_files_changed_since_apply(small_tool, small_target):
    applied_revision(small_tool)
    with open(small_target / "vllm/logger.py", "a") as f:
        f.write("# local edit\n")
    report = status_json(small_tool)
    assert (report["exit_code"], report["state"]) == (apply.EXIT_DRIFT, "applied")
    assert report["files"] == files("changed since apply", None, None)
    assert report["drift"] == ["vllm/logger.py"]


def test_status_json_names_base_files_that_differ_from_the_pin(
    small_tool, small_target
):
    with open(small_target / "vllm/version.py", "a") as f:
        f.write("# drift\n")
    (small_target / PROBE).parent.mkdir()
    (small_target / PROBE).write_text("# someone else's module\n")
    report = status_json(small_tool)
    assert (report["exit_code"], report["state"]) == (apply.EXIT_DRIFT, "not-applied")
    assert report["drift"] == ["vllm/version.py", PROBE]
    logger, version, probe = report["files"]
    assert logger["drift"] is None
    assert re.fullmatch(
        r"SHA-256 [0-9a-f]{12}… is not the pinned [0-9a-f]{12}…", version["drift"]
    )
    assert probe["drift"] == "exists, but the patch set adds it as a new file"


def test_status_json_of_another_revision(small_tool, patch_set):
    revision = applied_revision(small_tool)
    with open(patch_set / "vllm_overlay" / PROBE, "a") as f:
        f.write("# edited after apply\n")
    report = status_json(small_tool)
    assert (report["exit_code"], report["state"]) == (
        apply.EXIT_OTHER_REVISION,
        "applied",
    )
    assert report["revision"] == revision
    assert re.fullmatch(r"[0-9a-f]{12}", report["patch_set_revision"])
    assert report["patch_set_revision"] != revision
    assert report["drift"] == []


def test_status_json_of_a_stopped_run(small_tool, small_target):
    applied_revision(small_tool)
    journal_path = small_target / apply.STATE_DIR / "journal.json"
    journal = json.loads(journal_path.read_text())
    journal_path.write_text(json.dumps(journal | {"state": "applying"}))
    report = status_json(small_tool)
    assert (report["exit_code"], report["state"]) == (
        apply.EXIT_INTERRUPTED,
        "applying",
    )
    assert report["started"] == journal["started"]
    assert (report["files"], report["drift"]) == (files(None, None, None), [])


def test_status_json_lists_leftovers_and_files_of_others(small_tool, small_target):
    applied_revision(small_tool)
    alien = small_target / apply.STATE_DIR / "notes.txt"
    alien.write_text("mine\n")
    report = status_json(small_tool)
    assert (report["exit_code"], report["leftovers"]) == (apply.EXIT_OK, [])
    assert report["alien"] == [str(alien)]
    stage = small_target / apply.STATE_DIR / "stage-x"
    stage.mkdir()
    report = status_json(small_tool)
    assert (report["exit_code"], report["state"]) == (
        apply.EXIT_INTERRUPTED,
        "applied",
    )
    assert report["leftovers"] == [str(stage)]


def test_status_json_of_a_directory_without_vllm(patch_set, tmp_path):
    proc = run_tool(patch_set, "status", "--json", "--target", str(tmp_path))
    report = json.loads(proc.stdout)
    assert proc.returncode == report["exit_code"] == apply.EXIT_ERROR
    assert (report["state"], report["target"]) == ("error", None)
    assert report["error"].startswith(f"{tmp_path}: no vllm/ package here")
    assert f"error: {report['error']}" in proc.stderr


STATES = {
    "pristine": lambda tool, target, patch_set: None,
    "applied": lambda tool, target, patch_set: tool("apply"),
    "drifted": lambda tool, target, patch_set: (
        tool("apply"),
        (target / "vllm/version.py").write_text("# replaced\n"),
    ),
    "other-revision": lambda tool, target, patch_set: (
        tool("apply"),
        (patch_set / "vllm_overlay" / PROBE).write_text("PROBE = 'newer'\n"),
    ),
}


@pytest.mark.parametrize("state", sorted(STATES))
def test_the_api_answers_what_the_cli_prints(
    small_tool, small_target, patch_set, state
):
    STATES[state](small_tool, small_target, patch_set)
    text = small_tool("status")
    cli = json.loads(small_tool("status", "--json").stdout)
    api = apply.status(small_target, patch_set)
    assert api == cli
    assert api["exit_code"] == text.returncode
    assert apply.status_text(api) + "\n" == text.stdout
    assert apply.target_root(small_target / "vllm") == small_target.resolve()


def test_original_files_are_the_backups_while_applied(small_tool, small_target):
    pristine = (small_target / "vllm/logger.py").read_bytes()
    applied_revision(small_tool)
    original = apply.original_files(small_target)
    assert original("vllm/logger.py").read_bytes() == pristine
    assert original("vllm/_version.py") == small_target.resolve() / "vllm/_version.py"
    assert original(PROBE) is None


# -- the base version a patch set carries -------------------------------------


def set_base(patch_set: Path, text: str) -> Path:
    path = patch_set / "patches" / "base.version"
    path.write_text(text)
    return path


def test_a_patch_set_for_another_vllm_is_refused_naming_its_base_file(
    small_tool, small_target, patch_set
):
    set_base(patch_set, f"# ported\n{UNKEPT}\n")
    assert apply.base_version(patch_set) == UNKEPT
    before = tree_digest(small_target)
    proc = small_tool("apply")
    assert proc.returncode == apply.EXIT_DRIFT
    version_file = small_target.resolve() / "vllm/_version.py"
    assert f"{small_target.resolve()}: vLLM {BASE} (so say {version_file} and" in (
        proc.stderr
    )
    assert (
        f"the patch set {patch_set.resolve()} keeps a series only for vLLM "
        f"{UNKEPT} (patches/base.version), so nothing was written"
    ) in proc.stderr
    assert tree_digest(small_target) == before
    proc = small_tool("manifest")
    assert proc.returncode == apply.EXIT_ERROR
    path = patch_set.resolve() / "patches/base.version"
    assert f"generated from vLLM {UNKEPT} ({path}), found {BASE}" in proc.stderr
    report = status_json(small_tool)
    assert (report["base_version"], report["vllm_version"]) == (UNKEPT, BASE)


@pytest.mark.parametrize(
    "text, message",
    [
        (None, "base.version: missing"),
        ("", "base.version: not one version line ([])"),
        ("0.33.0\n0.34.0\n", "base.version: not one version line"),
        ("vllm==0.33.0\n", "base.version: not one version line (['vllm==0.33.0'])"),
    ],
    ids=["missing", "empty", "two-versions", "not-a-version"],
)
def test_a_missing_or_malformed_base_version_is_refused(
    small_tool, small_target, patch_set, text, message
):
    if text is None:
        (patch_set / "patches" / "base.version").unlink()
    else:
        set_base(patch_set, text)
    before = tree_digest(small_target)
    for command in ("apply", "lint"):
        proc = small_tool(command)
        assert proc.returncode == apply.EXIT_ERROR, proc.stdout
        assert "the patch set is inconsistent" in proc.stderr
        assert message in proc.stderr
    assert tree_digest(small_target) == before
    with pytest.raises(apply.ApplyError, match=re.escape(message)):
        apply.base_version(patch_set)
    assert status_json(small_tool)["base_version"] is None


def test_lint_wants_the_setup_cfg_pin_and_the_base_version_to_agree(
    small_tool, patch_set
):
    (patch_set / "setup.cfg").write_text(f"[k3_sppp]\nvllm = {UNKEPT}\n")
    proc = small_tool("lint")
    assert proc.returncode == apply.EXIT_ERROR
    assert (
        f"{patch_set / 'setup.cfg'}: pins vllm = {UNKEPT}, but "
        f"{patch_set / 'patches' / 'base.version'} says {BASE}"
    ) in proc.stderr
    set_base(patch_set, f"{UNKEPT}\n")
    assert small_tool("lint").returncode == apply.EXIT_OK


def test_the_project_states_its_base_as_setup_cfg_pins_it():
    pinned = re.search(
        r"^vllm = (\S+)$", (PROJECT_DIR / "setup.cfg").read_text(), re.M
    ).group(1)
    assert apply.base_version() == pinned


# -- only the declared API -----------------------------------------------------


def uses_of_apply(path: Path) -> list[tuple[int, str]]:
    """Each name a module takes from ``apply`` (``apply.X``, ``from apply
    import X``), with its line."""
    tree = ast.parse(path.read_text(), str(path))
    imported = any(
        isinstance(node, ast.Import) and any(a.name == "apply" for a in node.names)
        for node in ast.walk(tree)
    )
    uses = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == "apply":
            uses += [(node.lineno, alias.name) for alias in node.names]
        elif (
            imported
            and isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id == "apply"
        ):
            uses.append((node.lineno, node.attr))
    return uses


def test_callers_use_only_the_declared_api():
    callers = [
        PROJECT_DIR / "conftest.py",
        *sorted((PROJECT_DIR / "eval").glob("*.py")),
    ]
    callers += sorted((PROJECT_DIR / "tests").rglob("*.py"))
    outside = [
        f"{path.relative_to(PROJECT_DIR)}:{line}: apply.{name}"
        for path in callers
        for line, name in uses_of_apply(path)
        if name not in apply.__all__ and not name.startswith("__")
    ]
    assert outside == [], "names outside apply.__all__"
    assert any(uses_of_apply(PROJECT_DIR / "eval" / "serve.py"))
    assert all(hasattr(apply, name) for name in apply.__all__)
