# SPDX-License-Identifier: Apache-2.0
"""eval.mutate on a tiny planted patch set: one overlay module, one test that
kills some of its mutants, the tree restored after every mutant."""

import hashlib
import json
import subprocess
import textwrap
from pathlib import Path

import pytest

from eval import mutate


@pytest.fixture(autouse=True)
def pytest_without_plugins(monkeypatch):
    """The tool decides each mutant by a pytest process on the planted tree,
    whose one test needs no plugin: without the installed ones (xdist, anyio)
    each starts in 0.24 CPU-s instead of 0.56 (this file: 21.0 CPU-s before,
    10.7 after). What the tool reads, pytest's exit status and report, is the
    same."""
    monkeypatch.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")


MODULE = textwrap.dedent(
    '''\
    """Probe."""


    def rows(n: int, tp: int) -> int:
        return (n + tp - 1) // tp


    def unused(flag: bool) -> bool:
        return flag and True
    '''
)
TEST = textwrap.dedent(
    """\
    import importlib.util

    def test_rows():
        spec = importlib.util.spec_from_file_location(
            "probe", "{target}/vllm/probe.py"
        )
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        assert mod.rows(5, 2) == 3
    """
)


def _tree(tmp_path: Path) -> tuple[Path, Path]:
    root, target = tmp_path / "set", tmp_path / "site"
    (root / "patches").mkdir(parents=True)
    (root / "patches" / "series").write_text("")
    (root / "vllm_overlay" / "vllm").mkdir(parents=True)
    (root / "vllm_overlay" / "vllm" / "probe.py").write_text(MODULE)
    (target / "vllm").mkdir(parents=True)
    (target / "vllm" / "probe.py").write_text(MODULE)
    digest = hashlib.sha256(MODULE.encode()).hexdigest()
    (root / "patches" / "patched.sha256").write_text(f"{digest}  vllm/probe.py\n")
    (root / "tests").mkdir()
    (root / "tests" / "test_probe.py").write_text(TEST.format(target=target))
    return root, target


def test_planted_mutants_are_killed_or_survive_and_the_tree_is_restored(tmp_path):
    root, target = _tree(tmp_path)
    results = tmp_path / "results"
    argv = ["--patch-set", str(root), "--target", str(target)]
    argv += ["--tests", "tests", "--results", str(results)]
    assert mutate.main(argv) == 0
    recs = [json.loads(x) for x in (results / "mutants.jsonl").read_text().splitlines()]
    by_kind = {(r["file"], r["kind"]): r for r in recs}
    assert by_kind[("vllm/probe.py:5", "+/-")]["status"] == "killed"
    assert "test_rows" in by_kind[("vllm/probe.py:5", "+/-")]["killed_by"]
    assert by_kind[("vllm/probe.py:5", "+/-")]["selected"] == ["tests/test_probe.py"]
    # No test calls unused(): a survivor decided without running a test.
    unused = by_kind[("vllm/probe.py:9", "and/or")]
    assert (unused["status"], unused["selected"], unused["seconds"]) == (
        "survived",
        [],
        0.0,
    )
    assert (target / "vllm" / "probe.py").read_text() == MODULE
    # Resumable: a second run decides nothing again.
    assert mutate.main(argv) == 0
    assert len((results / "mutants.jsonl").read_text().splitlines()) == len(recs)
    # Changed tests try the survivors again, but for one shown equivalent.
    survivors = [r["id"] for r in recs if r["status"] == "survived"]
    assert len(survivors) >= 2
    (results / "equivalent.json").write_text(json.dumps({survivors[0]: "why"}))
    test_file = root / "tests" / "test_probe.py"
    test_file.write_text(test_file.read_text() + "\n# changed\n")
    assert mutate.main(argv) == 0
    lines = (results / "mutants.jsonl").read_text().splitlines()
    assert sorted(json.loads(x)["id"] for x in lines[len(recs) :]) == sorted(
        survivors[1:]
    )


def test_lines_limit_a_run_to_the_mutants_on_those_lines(tmp_path):
    root, target = _tree(tmp_path)
    results = tmp_path / "results"
    argv = ["--patch-set", str(root), "--target", str(target), "--tests", "tests"]
    argv += ["--results", str(results), "--files", "vllm/probe.py"]
    assert mutate.main([*argv, "--lines", "9-9"]) == 0
    recs = [json.loads(x) for x in (results / "mutants.jsonl").read_text().splitlines()]
    assert recs and {r["file"] for r in recs} == {"vllm/probe.py:9"}
    try:
        mutate.main([*argv, "--lines", "9"])
    except SystemExit as exit_:
        assert exit_.code == 2  # argparse names the form it wants
    else:
        raise AssertionError("--lines 9 was accepted")


def test_a_mutant_left_by_a_killed_run_is_restored_at_start(tmp_path):
    root, target = _tree(tmp_path)
    digest = hashlib.sha256(MODULE.encode()).hexdigest()
    installed = mutate.Installed(
        target, root / "build" / "mutate", {"vllm/probe.py": digest}
    )
    installed.write("vllm/probe.py", b"broken = (\n")
    mutate.Installed(
        target, root / "build" / "mutate", {"vllm/probe.py": digest}
    ).recover()
    assert (target / "vllm" / "probe.py").read_text() == MODULE


def test_jobs_decide_as_one_process_does_in_copies_of_the_tree(tmp_path, monkeypatch):
    """``--jobs 2``: each worker mutates its own copy (first on PYTHONPATH,
    where the test imports ``vllm.probe`` from); the results equal one
    process's and the target itself is never written."""
    root, target = _tree(tmp_path)
    (target / "vllm" / "__init__.py").write_text("")
    (target / "vllm" / "other.py").write_text("OTHER = 1\n")
    (root / "tests" / "test_probe.py").write_text(
        "import vllm.probe\n\n\n"
        "def test_rows():\n    assert vllm.probe.rows(5, 2) == 3\n"
    )
    monkeypatch.setenv("PYTHONPATH", str(target))
    before = (target / "vllm" / "probe.py").stat().st_mtime_ns
    statuses = {}
    for jobs in (1, 2):
        results = tmp_path / f"results-{jobs}"
        argv = ["--patch-set", str(root), "--target", str(target), "--tests", "tests"]
        argv += ["--results", str(results), "--jobs", str(jobs), "--all-tests"]
        if jobs == 2:
            before = (target / "vllm" / "probe.py").stat().st_mtime_ns
        assert mutate.main(argv) == 0
        lines = (results / "mutants.jsonl").read_text().splitlines()
        statuses[jobs] = {r["id"]: r["status"] for r in map(json.loads, lines)}
    assert statuses[2] == statuses[1]
    assert "killed" in statuses[1].values() and "survived" in statuses[1].values()
    assert (target / "vllm" / "probe.py").stat().st_mtime_ns == before
    worker = root / "build" / "mutate" / "worker-1" / "site" / "vllm"
    assert not (worker / "probe.py").is_symlink()  # mutated there, a copy
    assert (worker / "other.py").is_symlink()


def test_a_worker_that_starts_late_decides_its_own_share(tmp_path, monkeypatch):
    """The workers of ``--jobs 2`` run one after the other, the worst case of
    their start-up race: the second starts once the first has appended all
    its results. Each mutant is still decided once, and every one is."""
    root, target = _tree(tmp_path)
    (target / "vllm" / "__init__.py").write_text("")
    (root / "tests" / "test_probe.py").write_text(
        "import vllm.probe\n\n\n"
        "def test_rows():\n    assert vllm.probe.rows(5, 2) == 3\n"
    )
    monkeypatch.setenv("PYTHONPATH", str(target))

    start = subprocess.Popen

    def one_after_the_other(cmd, **kwargs):
        """A worker runs to its end before the next one starts."""
        process = start(cmd, **kwargs)
        if "--shard" in cmd:
            process.wait()
        return process

    monkeypatch.setattr(mutate.subprocess, "Popen", one_after_the_other)
    results = tmp_path / "results"
    argv = ["--patch-set", str(root), "--target", str(target), "--tests", "tests"]
    argv += ["--results", str(results), "--jobs", "2", "--all-tests"]
    assert mutate.main(argv) == 0
    recs = (results / "mutants.jsonl").read_text().splitlines()
    ids = [json.loads(x)["id"] for x in recs]
    source = (target / "vllm" / "probe.py").read_text()
    lines = mutate.added_lines(root)["vllm/probe.py"]
    digest = hashlib.sha256(source.encode()).hexdigest()
    every = {m.key(digest) for m in mutate.mutants_of("vllm/probe.py", source, lines)}
    assert sorted(ids) == sorted(every)


def test_calls_are_recorded_through_a_linked_tree(tmp_path):
    """A clone whose .venv links another's imports the series' files under
    the link's name; the traced run still finds which test calls them."""
    root, target = _tree(tmp_path)
    link = tmp_path / "linked-site"
    link.symlink_to(target)
    (root / "tests" / "test_probe.py").write_text(TEST.format(target=link))
    results = tmp_path / "results"
    argv = ["--patch-set", str(root), "--target", str(target)]
    assert mutate.main([*argv, "--tests", "tests", "--results", str(results)]) == 0
    recs = [json.loads(x) for x in (results / "mutants.jsonl").read_text().splitlines()]
    killed = [r for r in recs if r["file"] == "vllm/probe.py:5"]
    assert killed and all(r["selected"] == ["tests/test_probe.py"] for r in killed)
