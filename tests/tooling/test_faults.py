# SPDX-License-Identifier: Apache-2.0
"""apply and revert with a fault at each file operation they reach, in turn.

For every N and every fault kind (EIO, Ctrl-C, SIGKILL) the run is repeated
on a fresh copy.  Afterwards the tree must be exactly pristine or exactly
applied, or ``status`` exits 5 and the commands it names reach their state;
every vLLM file is always its original or its patched self, with its mode,
and a user's edit survives somewhere, byte for byte.  The sweeps go through
the patched-manifest check (apply), mode preservation under umask 077
(apply), and the revert of a tree whose journal was lost.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import shutil
from collections import Counter
from pathlib import Path

import apply
from tests.tooling import faults
from tests.tooling.conftest import PROJECT_DIR, tree_digest

PATCHED = ("vllm/logger.py", "vllm/version.py")
PROBE = "vllm/k3_sppp_probe/__init__.py"
EDITED = "vllm/logger.py"
EXPECTED_CODE = {"eio": {0, 1, 5}, "ctrl-c": {130}, "kill": {-9}}


def run_main(*argv: str) -> tuple[int, str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        code = apply.main(list(argv))
    return code, out.getvalue()


def mode(path: Path) -> str:
    return f"{path.stat().st_mode & 0o7777:o}"


def package(root: Path) -> dict[str, str]:
    """Every file (SHA-256 and mode) and directory (mode) of the tree, state
    dir excluded."""
    listing = {
        str(p.relative_to(root)): f"dir {mode(p)}"
        for p in root.rglob("*")
        if p.is_dir() and apply.STATE_DIR not in p.relative_to(root).parts
    }
    listing.update(
        (rel, f"{digest} {mode(root / rel)}")
        for rel, digest in tree_digest(root).items()
        if not rel.startswith(apply.STATE_DIR + "/")
    )
    return listing


def without_drift(listing: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in listing.items() if apply.DRIFT_SUFFIX not in k}


def fresh(src: Path, dst: Path) -> Path:
    shutil.rmtree(dst, ignore_errors=True)
    shutil.copytree(src, dst, symlinks=True)
    return dst


def state_signature(root: Path, patch_set: Path) -> tuple:
    """What a recovery depends on: the package, the state dir's shape and the
    journal's state."""
    state = root / apply.STATE_DIR
    names = (
        sorted(
            {
                "stage-*" if rel.startswith("stage-") else rel
                for rel in (str(p.relative_to(state)) for p in state.iterdir())
            }
            | {str(p.relative_to(state)) for p in state.glob("backups/*")}
        )
        if state.is_dir()
        else None
    )
    return (
        tuple(sorted(package(root).items())),
        str(names),
        apply.status(root, patch_set)["state"],
    )


class Sweep:
    """Runs one command with each fault; checks and tallies the end states."""

    def __init__(
        self,
        tmp: Path,
        patch_set: Path,
        start: Path,
        command: list[str],
        umask: int = 0o022,
    ):
        self.tmp = tmp
        self.patch_set = patch_set
        self.start = start
        self.command = command
        self.umask = umask
        self.tally: Counter[tuple[str, str]] = Counter()
        self.recovered: set[tuple] = set()

    def argv(self, root: Path, *command: str) -> list[str]:
        return [
            "--patch-set",
            str(self.patch_set),
            command[0],
            "--target",
            str(root),
            *command[1:],
        ]

    def operations(self) -> list[str]:
        root = fresh(self.start, self.tmp / "count")
        outcome = faults.run(
            self.argv(root, *self.command), 0, "eio", self.tmp / "log", self.umask
        )
        assert outcome.code == 0, outcome.output
        return outcome.ops

    def run(self, check, first: str | None = None) -> list[str]:
        """Fault each operation in turn, from the first ``first`` one on
        (default: from the start)."""
        ops = self.operations()
        start = ops.index(first) + 1 if first else 1
        for n in range(start, len(ops) + 1):
            for kind in faults.KINDS:
                root = fresh(self.start, self.tmp / "run")
                before = package(root)
                outcome = faults.run(
                    self.argv(root, *self.command),
                    n,
                    kind,
                    self.tmp / "log",
                    self.umask,
                )
                where = f"{kind} at operation {n} ({ops[n - 1]}): {outcome.output}"
                assert "Traceback" not in outcome.output, where
                assert outcome.code in EXPECTED_CODE[kind], where
                if outcome.code == apply.EXIT_ERROR:
                    assert package(root) == before, "exit 1 changed the tree: " + where
                state = check(root, where)
                self.tally[kind, state] += 1
        return ops

    def status(self, root: Path) -> int:
        return run_main(*self.argv(root, "status"))[0]

    def recover(self, root: Path, steps, where: str) -> None:
        """Run ``steps`` on a copy, once per distinct stopped state."""
        signature = state_signature(root, self.patch_set)
        if signature in self.recovered:
            return
        self.recovered.add(signature)
        for name, step in steps.items():
            copy = fresh(root, self.tmp / f"recover-{name}")
            step(copy, f"{name} after {where}")


def assert_files_whole(listing, pristine, applied, edited=None) -> None:
    """Each vLLM file is its original or its result (or the user's edit)."""
    for rel, digest in without_drift(listing).items():
        allowed = {pristine.get(rel), applied.get(rel)}
        if rel == EDITED and edited is not None:
            allowed.add(edited)
        assert digest in allowed, f"{rel}: neither original nor patched"
    for rel in pristine:
        assert rel in listing, f"{rel}: lost"


def test_apply_reaches_a_named_state_after_a_fault_at_each_operation(
    small_target, patch_set, tmp_path
):
    start = small_target
    pristine = package(start)
    reference = fresh(start, tmp_path / "reference")
    assert run_main("--patch-set", str(patch_set), "apply", "--target", str(reference))[
        0
    ] == (apply.EXIT_OK)
    applied = package(reference)
    # Under umask 077 every file and directory still gets the modes of the
    # reference run (umask 022): the originals' and their siblings'.
    sweep = Sweep(tmp_path, patch_set, start, ["apply"], umask=0o077)

    def exactly_pristine(root: Path, where: str) -> None:
        assert package(root) == pristine, where
        assert not (root / apply.STATE_DIR).exists(), where

    def revert(root: Path, where: str) -> None:
        code, out = run_main(*sweep.argv(root, "revert"))
        assert code == apply.EXIT_OK, where + out
        exactly_pristine(root, where)

    def apply_then_revert(root: Path, where: str) -> None:
        code, out = run_main(*sweep.argv(root, "apply"))
        assert code == apply.EXIT_OK, where + out
        assert sweep.status(root) == apply.EXIT_OK, where
        assert package(root) == applied, where
        revert(root, where)

    def check(root: Path, where: str) -> str:
        listing = package(root)
        assert_files_whole(listing, pristine, applied)
        status = sweep.status(root)
        if status == apply.EXIT_NOT_APPLIED:
            exactly_pristine(root, where)
            return "pristine"
        if status == apply.EXIT_OK:
            assert listing == applied, where
            return "applied"
        assert status == apply.EXIT_INTERRUPTED, f"status {status}: {where}"
        sweep.recover(root, {"revert": revert, "apply": apply_then_revert}, where)
        return "status 5"

    ops = sweep.run(check)
    assert_swept(ops, sweep, {"pristine", "applied", "status 5"})


def test_revert_force_keeps_the_edit_after_a_fault_at_each_operation(
    small_target, patch_set, tmp_path
):
    pristine = package(small_target)
    argv = ["--patch-set", str(patch_set)]
    assert run_main(*argv, "apply", "--target", str(small_target))[0] == 0
    applied = package(small_target)
    with open(small_target / EDITED, "ab") as f:
        f.write(b"# my local fix\n")
    edit_bytes = (small_target / EDITED).read_bytes()
    edited = f"{hashlib.sha256(edit_bytes).hexdigest()} {mode(small_target / EDITED)}"
    sweep = Sweep(tmp_path, patch_set, small_target, ["revert", "--force"])

    def edit_kept(root: Path, where: str) -> None:
        copies = sorted(root.glob(EDITED + apply.DRIFT_SUFFIX + "*"))
        for copy in copies:
            assert copy.read_bytes() == edit_bytes, f"{copy} is not the edit: {where}"
        holds_edit = (root / EDITED).is_file() and (
            root / EDITED
        ).read_bytes() == edit_bytes
        assert copies or holds_edit, "the user's edit is lost: " + where

    def pristine_with_edit_kept(root: Path, where: str) -> None:
        assert without_drift(package(root)) == pristine, where
        assert not (root / apply.STATE_DIR).exists(), where
        assert list(root.glob(EDITED + apply.DRIFT_SUFFIX + "*")), where
        edit_kept(root, where)

    def revert_force(root: Path, where: str) -> None:
        code, out = run_main(*sweep.argv(root, "revert", "--force"))
        assert code == apply.EXIT_OK, where + out
        pristine_with_edit_kept(root, where)

    def apply_then_revert(root: Path, where: str) -> None:
        code, out = run_main(*sweep.argv(root, "apply"))
        assert code == apply.EXIT_OK, where + out
        assert without_drift(package(root)) == applied, where
        edit_kept(root, where)
        code, out = run_main(*sweep.argv(root, "revert"))
        assert code == apply.EXIT_OK, where + out
        pristine_with_edit_kept(root, where)

    def check(root: Path, where: str) -> str:
        listing = package(root)
        assert_files_whole(listing, pristine, applied, edited)
        edit_kept(root, where)
        status = sweep.status(root)
        if status == apply.EXIT_NOT_APPLIED:
            pristine_with_edit_kept(root, where)
            return "pristine"
        if status == apply.EXIT_DRIFT:  # as it was: applied, with the edit
            assert listing == package(small_target), where
            sweep.recover(root, {"revert": revert_force}, where)
            return "as it was"
        assert status == apply.EXIT_INTERRUPTED, f"status {status}: {where}"
        report = apply.status(root, patch_set)
        if report["state"] == "applied":  # stopped before it changed a file
            assert listing == package(small_target), where
            assert "revert --force" in report["finish"], where
            sweep.recover(
                root, {"revert": revert_force, "apply": apply_refuses_the_edit}, where
            )
            return "as it was, and what it left"
        sweep.recover(root, {"revert": revert_force, "apply": apply_then_revert}, where)
        return "status 5"

    def apply_refuses_the_edit(root: Path, where: str) -> None:
        before = package(root)
        code, out = run_main(*sweep.argv(root, "apply"))
        assert code == apply.EXIT_DRIFT, where + out
        assert package(root) == before, where
        revert_force(root, where)

    ops = sweep.run(check)
    assert_swept(
        ops,
        sweep,
        {"as it was", "as it was, and what it left", "pristine", "status 5"},
    )


def test_revert_without_a_journal_reaches_a_named_state_after_a_fault_at_each_operation(
    small_target, patch_set, tmp_path
):
    """The journal of an applied tree is lost: revert restores from the
    backups; stopped anywhere, the backups that still matter survive and the
    next revert finishes it.  Its lock and staging are the calls the revert
    --force sweep faults already, so this sweep starts at its first write
    into vllm/ (an overlay file's ``unlink``)."""
    pristine = package(small_target)
    assert run_main(*Sweep(tmp_path, patch_set, small_target, []).argv(
        small_target, "apply"
    ))[0] == apply.EXIT_OK  # fmt: skip
    applied = package(small_target)
    (small_target / apply.STATE_DIR / "journal.json").unlink()
    sweep = Sweep(tmp_path, patch_set, small_target, ["revert"])

    def exactly_pristine(root: Path, where: str) -> None:
        assert package(root) == pristine, where
        assert not (root / apply.STATE_DIR).exists(), where

    def revert(root: Path, where: str) -> None:
        code, out = run_main(*sweep.argv(root, "revert"))
        assert code == apply.EXIT_OK, where + out
        exactly_pristine(root, where)

    def check(root: Path, where: str) -> str:
        assert_files_whole(package(root), pristine, applied)
        status = sweep.status(root)
        assert status == apply.EXIT_INTERRUPTED, f"status {status}: {where}"
        state = apply.status(root, patch_set)["state"]
        assert state in ("journal-lost", "not-applied"), where
        sweep.recover(root, {"revert": revert}, where)
        return state

    ops = sweep.run(check, first="unlink")
    assert ops[ops.index("unlink") - 1] == "chmod", "the first write is not first"
    assert_swept(ops, sweep, {"journal-lost", "not-applied"})


def assert_swept(ops: list[str], sweep: Sweep, states: set[str]) -> None:
    """The sweep reached every end state in ``states``, and every fault kind
    stopped a run part-way (status 5) at least once."""
    summary = (
        f"{len(ops)} operations ({dict(Counter(ops))}) x {len(faults.KINDS)} "
        f"fault kinds; end states by kind {dict(sweep.tally)}"
    )
    assert {state for _, state in sweep.tally} == states, summary
    stopped = {kind for kind, state in sweep.tally if state in states - {"pristine"}}
    assert stopped == set(faults.KINDS), "a fault kind never landed mid-run: " + summary


def test_real_series_killed_mid_transaction_is_reverted_to_pristine(target, tmp_path):
    """The project's own series, once: SIGKILL at its middle ``os.replace``."""
    pristine = tree_digest(target)
    count = fresh(target, tmp_path / "count")
    argv = ["--patch-set", str(PROJECT_DIR), "apply", "--target"]
    ops = faults.run([*argv, str(count)], 0, "eio", tmp_path / "log").ops
    replaces = [n for n, op in enumerate(ops, 1) if op == "replace"]
    outcome = faults.run(
        [*argv, str(target)], replaces[len(replaces) // 2], "kill", tmp_path / "log"
    )
    assert outcome.code == -9
    status = ["--patch-set", str(PROJECT_DIR), "status", "--target", str(target)]
    assert run_main(*status)[0] == apply.EXIT_INTERRUPTED
    code, out = run_main(*[*status[:2], "revert", *status[3:]])
    assert code == apply.EXIT_OK, out
    assert tree_digest(target) == pristine
