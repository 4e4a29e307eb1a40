# SPDX-License-Identifier: Apache-2.0
"""Mutation testing of the lines the series installs into vLLM.

    .venv/bin/python -m eval.mutate [--limit N] [--tests PATH ...]

(``make mutate`` runs this.) Every line the series adds (the overlay modules
under ``vllm_overlay/vllm`` and the ``+`` lines of each patch, followed through
the later patches of the series) is a mutation site in the installed file. One
mutant at a time is written there (comparison flipped, ``and``/``or`` swapped,
``not`` dropped, integer or boolean constant changed, statement dropped,
keyword argument left out, ``+``/``-`` swapped), the runtime tests that can
see it run with ``-x`` (first, on its own, the test file that killed most
mutants of the same file),
and the original bytes go back and are checked against
``patches/patched.sha256``.

Which tests can see a mutant: once per state of the tests and the installed
bytes, the runtime suite runs with ``eval.mutate_calls``, which records every
call into the series' files with the test that made it, in the pytest
process, its threads and every test-bed rank (``build/mutate/calls.json``). A
mutant inside a function body changes nothing until that function's code
runs, so only the test files that called it are run; a mutant outside any
function body (module or class level, a default value, a decorator) runs
when the module is imported, so every runtime test is run; so is any
function called outside a test (collection, a rank's start-up). A function
no test calls is recorded as a survivor without running anything. The
selection therefore cannot hide a killer, as long as the runtime tests run
the series only in those processes (they do: ``tests/serving``, whose
``vllm serve`` processes are not traced, is not among them).

Our own driver, not mutmut or cosmic-ray: mutmut 3 copies the sources into
``mutants/`` and rewrites every function with trampolines, which the rank
processes that import vLLM from site-packages never see; cosmic-ray mutates
whole modules (thousands of mutants in ``gpu_model_runner.py`` for the few
lines the series adds), runs one test command for all of them and records no
killing test.

The original of a mutated file is saved under ``build/mutate/`` before the
mutant is written, so an interrupted run (Ctrl-C, kill) is put right by the
handler or, after SIGKILL, by the next start. Results go to
``results/mutation/mutants.jsonl`` (one decided mutant a line; a mutant
decided for the same installed bytes is skipped, a survivor is tried again
when the tests changed unless ``equivalent.json`` gives the reason it cannot
change behaviour) and ``results/mutation/summary.md``.
"""

from __future__ import annotations

import argparse
import ast
import copy
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from apply import STATE_DIR
from eval.mutate_calls import EVERY_TEST

PROJECT_DIR = Path(__file__).resolve().parent.parent
RUNTIME_TESTS = ("tests/unit", "tests/distributed", "vllm_overlay/tests")
HUNK = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")
FLIP = {
    ast.Eq: ast.NotEq,
    ast.NotEq: ast.Eq,
    ast.Lt: ast.GtE,
    ast.GtE: ast.Lt,
    ast.Gt: ast.LtE,
    ast.LtE: ast.Gt,
    ast.Is: ast.IsNot,
    ast.IsNot: ast.Is,
    ast.In: ast.NotIn,
    ast.NotIn: ast.In,
}


@dataclass(frozen=True)
class Mutant:
    rel: str  # path under the target, e.g. vllm/v1/worker/gpu_worker.py
    line: int
    kind: str
    start: tuple[int, int]  # (line, byte column) of the replaced segment
    end: tuple[int, int]
    text: str  # what replaces it

    def key(self, base_sha: str) -> str:
        raw = f"{self.rel}:{self.start}:{self.end}:{self.kind}:{self.text}:{base_sha}"
        return hashlib.sha256(raw.encode()).hexdigest()[:16]


def added_lines(patch_set: Path) -> dict[str, set[int]]:
    """Line numbers, in the fully patched files, that the series adds."""
    added: dict[str, set[int]] = {}
    series = (patch_set / "patches" / "series").read_text().split()
    for name in series:
        lines = (patch_set / "patches" / name).read_text().splitlines()
        i, rel = 0, None
        hunks: dict[str, list[tuple[int, int, int, list[str]]]] = {}
        while i < len(lines):
            if lines[i].startswith("+++ b/"):
                rel = lines[i][6:]
            m = HUNK.match(lines[i])
            if m and rel:
                old_n = int(m.group(2) or 1)
                new_n = int(m.group(4) or 1)
                body, o, n = [], 0, 0
                while o < old_n or n < new_n:
                    i += 1
                    tag = lines[i][:1] or " "
                    body.append(tag)
                    o += tag in " -"
                    n += tag in " +"
                hunks.setdefault(rel, []).append(
                    (int(m.group(1)), old_n, int(m.group(3)), body)
                )
            i += 1
        for rel, file_hunks in hunks.items():
            mapping: dict[int, int | None] = {}
            new_added: set[int] = set()
            for _old_start, _old_n, new_start, body in file_hunks:
                o, n = _old_start, new_start
                for tag in body:
                    if tag == " ":
                        mapping[o] = n
                    elif tag == "-":
                        mapping[o] = None
                    o += tag in " -"
                    if tag == "+":
                        new_added.add(n)
                    n += tag in " +"

            def moved(line: int, hunks=file_hunks, mapping=mapping) -> int | None:
                if line in mapping:
                    return mapping[line]
                shift = sum(
                    b.count("+") - b.count("-")
                    for o_, o_n, _, b in hunks
                    if o_ + o_n <= line
                )
                return line + shift

            kept = {moved(x) for x in added.get(rel, set())}
            added[rel] = {x for x in kept if x is not None} | new_added
    for path in sorted((patch_set / "vllm_overlay" / "vllm").rglob("*.py")):
        rel = path.relative_to(patch_set / "vllm_overlay").as_posix()
        added[rel] = set(range(1, len(path.read_text().splitlines()) + 1))
    return added


def _segment(node: ast.AST) -> tuple[tuple[int, int], tuple[int, int]]:
    return (node.lineno, node.col_offset), (node.end_lineno, node.end_col_offset)


def mutants_of(rel: str, source: str, lines: set[int]) -> list[Mutant]:
    """The mutants of ``source`` whose segment lies on added lines."""
    tree = ast.parse(source)
    docstrings = {
        id(body[0])
        for node in ast.walk(tree)
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef)
        and (body := node.body)
        and isinstance(body[0], ast.Expr)
        and isinstance(body[0].value, ast.Constant)
    }
    skip: set[int] = set()
    for node in ast.walk(tree):
        for sub in _annotations(node):
            skip.update(id(x) for x in ast.walk(sub))
    out: list[Mutant] = []

    def add(node: ast.AST, kind: str, new: ast.AST, stmt: bool = False) -> None:
        if id(node) in skip or not hasattr(node, "lineno"):
            return
        if node.lineno not in lines or node.end_lineno not in lines:
            return
        text = ast.unparse(new) if stmt else f"({ast.unparse(new)})"
        start, end = _segment(node)
        out.append(Mutant(rel, node.lineno, kind, start, end, text))

    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            for k, op in enumerate(node.ops):
                if type(op) in FLIP:
                    new = copy.deepcopy(node)
                    new.ops[k] = FLIP[type(op)]()
                    add(node, f"flip {type(op).__name__}", new)
        elif isinstance(node, ast.BoolOp):
            new = copy.deepcopy(node)
            new.op = ast.Or() if isinstance(node.op, ast.And) else ast.And()
            add(node, "and/or", new)
        elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
            add(node, "drop not", node.operand)
        elif isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add | ast.Sub):
            new = copy.deepcopy(node)
            new.op = ast.Sub() if isinstance(node.op, ast.Add) else ast.Add()
            add(node, "+/-", new)
        elif isinstance(node, ast.Constant) and type(node.value) in (bool, int):
            value = not node.value if isinstance(node.value, bool) else node.value + 1
            add(node, "constant", ast.Constant(value))
        elif isinstance(node, ast.Call):
            for k in range(len(node.keywords)):
                new = copy.deepcopy(node)
                dropped = new.keywords.pop(k)
                if dropped.arg:
                    add(node, f"drop {dropped.arg}=", new)
            # A keyword the series added to a call that starts on an
            # unchanged line: "**{}" in its place passes nothing.
            for kw in node.keywords:
                if (
                    kw.arg
                    and {node.lineno, node.end_lineno} - lines
                    and {kw.lineno, kw.end_lineno} <= lines
                ):
                    start, end = _segment(kw)
                    out.append(
                        Mutant(rel, kw.lineno, f"drop {kw.arg}=", start, end, "**{}")
                    )
        if (
            isinstance(
                node, ast.Expr | ast.Assign | ast.AugAssign | ast.Assert | ast.Raise
            )
            and id(node) not in docstrings
        ):
            add(node, "drop statement", ast.Pass(), stmt=True)
        elif isinstance(node, ast.Return) and node.value is not None:
            add(node, "return None", ast.Return(ast.Constant(None)), stmt=True)
    # JoinedStr parts cannot be parenthesized; mutants that do not compile or
    # change nothing are not mutants.
    good = []
    for m in out:
        try:
            mutated = apply_mutant(source.encode(), m)
            if ast.dump(ast.parse(mutated)) != ast.dump(tree):
                good.append(m)
        except SyntaxError:
            pass
    return sorted(set(good), key=lambda m: (m.start, m.kind, m.text))


def _annotations(node: ast.AST) -> list[ast.AST]:
    if isinstance(node, ast.arg) and node.annotation:
        return [node.annotation]
    if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.returns:
        return [node.returns]
    if isinstance(node, ast.AnnAssign):
        return [node.annotation]
    return []


def apply_mutant(data: bytes, m: Mutant) -> bytes:
    lines = data.splitlines(keepends=True)
    (sl, sc), (el, ec) = m.start, m.end
    head = b"".join(lines[: sl - 1]) + lines[sl - 1][:sc]
    tail = lines[el - 1][ec:] + b"".join(lines[el:])
    return head + m.text.encode() + tail


class Installed:
    """One mutant in the installed tree, undone on exit whatever happens."""

    def __init__(self, target: Path, state: Path, expected: dict[str, str]) -> None:
        self.target, self.state, self.expected = target, state, expected
        self.pending = state / "pending.json"

    def recover(self) -> None:
        if self.pending.exists():
            info = json.loads(self.pending.read_text())
            self._put_back(info["rel"], bytes.fromhex(info["original"]))
            print(f"mutate: restored {info['rel']} left by an interrupted run")

    def _put_back(self, rel: str, original: bytes) -> None:
        path = self.target / rel
        path.write_bytes(original)
        got = hashlib.sha256(path.read_bytes()).hexdigest()
        if got != self.expected.get(rel):
            sys.exit(f"mutate: {rel} is not at patched.sha256 after restore")
        self.pending.unlink(missing_ok=True)

    def write(self, rel: str, mutated: bytes) -> None:
        path = self.target / rel
        original = path.read_bytes()
        self.state.mkdir(parents=True, exist_ok=True)
        self.pending.write_text(json.dumps({"rel": rel, "original": original.hex()}))
        path.write_bytes(mutated)

    def restore(self) -> None:
        if self.pending.exists():
            info = json.loads(self.pending.read_text())
            self._put_back(info["rel"], bytes.fromhex(info["original"]))


def function_first_line(tree: ast.AST, m: Mutant) -> int | None:
    """``co_firstlineno`` of the innermost function whose body holds the
    mutant's segment; ``None`` at module or class level."""
    best = None
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            body = node.body
            first = min([d.lineno for d in node.decorator_list] + [node.lineno])
        elif isinstance(node, ast.Lambda):
            body, first = [node.body], node.lineno
        else:
            continue
        (start, _), (_, end) = _segment(body[0]), _segment(body[-1])
        if start <= m.start and m.end <= end and (best is None or start > best[0]):
            best = (start, first)
    return None if best is None else best[1]


def calls_map(
    python: str,
    root: Path,
    target: Path,
    tests: list[str],
    expected: dict[str, str],
    state: Path,
) -> dict[str, dict[str, list[str]]]:
    """``{installed file: {function's first line: [test files that call
    it]}}``, from a traced run of the runtime suite (reused while the tests,
    the installed bytes and the tracer are the same)."""
    tracer = (PROJECT_DIR / "eval" / "mutate_calls.py").read_bytes()
    key = hashlib.sha256(
        json.dumps([tests_digest(root, tests), expected]).encode() + tracer
    ).hexdigest()[:16]
    path = state / "calls.json"
    if path.exists() and (saved := json.loads(path.read_text()))["key"] == key:
        return saved["calls"]
    out = state / "calls"
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("*.jsonl"):
        old.unlink()
    env = dict(
        os.environ,
        PYTHONDONTWRITEBYTECODE="1",
        K3_SPPP_MUTATE_CALLS=str(out),
        K3_SPPP_MUTATE_FILES=os.pathsep.join(str(target / rel) for rel in expected),
        PYTHONPATH=os.pathsep.join(
            filter(None, (str(PROJECT_DIR), os.environ.get("PYTHONPATH")))
        ),
    )
    print("mutate: recording which test calls which function (one traced run)")
    start = time.monotonic()
    cmd = [python, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
    proc = subprocess.run([*cmd, "-p", "eval.mutate_calls", *tests], cwd=root, env=env)
    if proc.returncode:
        sys.exit("mutate: the runtime tests fail without a mutant; fix them first")
    calls: dict[str, dict[str, set[str]]] = {}
    prefix = os.path.realpath(target) + os.sep
    for part in out.glob("*.jsonl"):
        for line in part.read_text().splitlines():
            rec = json.loads(line)
            for filename, first in rec["calls"]:
                rel = filename.removeprefix(prefix)
                calls.setdefault(rel, {}).setdefault(str(first), set()).add(rec["test"])
    if not calls:
        sys.exit(
            f"mutate: the traced run recorded no call into the series' files "
            f"under {target}: do the tests import vLLM from there?"
        )
    result = {
        rel: {line: sorted(t) for line, t in lines.items()}
        for rel, lines in calls.items()
    }
    path.write_text(json.dumps({"key": key, "calls": result}))
    print(f"mutate: traced run took {time.monotonic() - start:.0f} s")
    return result


def select_tests(
    calls: dict[str, dict[str, list[str]]], m: Mutant, tree: ast.AST, every: list[str]
) -> list[str]:
    """The runtime test files that can see ``m`` (see the module docstring)."""
    first = function_first_line(tree, m)
    if first is None:
        return every
    callers = calls.get(m.rel, {}).get(str(first), [])
    return every if EVERY_TEST in callers else callers


def read_manifest(path: Path) -> dict[str, str]:
    out = {}
    for line in path.read_text().splitlines():
        if line and not line.startswith("#"):
            digest, rel = line.split(maxsplit=1)
            out[rel] = digest
    return out


def tests_digest(root: Path, tests: list[str]) -> str:
    h = hashlib.sha256()
    for t in tests:
        for p in sorted((root / t).rglob("*.py")):
            h.update(p.read_bytes())
    return h.hexdigest()[:16]


def run_tests(python: str, root: Path, tests: list[str], timeout: float) -> tuple:
    env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1")
    cmd = [python, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *tests]
    start = time.monotonic()
    proc = subprocess.Popen(
        cmd,
        cwd=root,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        return "killed", "timeout", time.monotonic() - start
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    elapsed = time.monotonic() - start
    if proc.returncode == 0:
        return "survived", None, elapsed
    failed = re.search(r"^(?:FAILED|ERROR) (\S+)", out, re.M)
    return "killed", failed.group(1) if failed else f"exit {proc.returncode}", elapsed


def decide(python: str, root: Path, batches: list[list[str]], timeout: float) -> tuple:
    """Run the batches of test files in turn until one kills the mutant: the
    file that killed most of its neighbours alone first, as collecting every
    selected file costs more than most killing tests take."""
    status, by, secs = "survived", None, 0.0
    for tests in filter(None, batches):
        status, by, spent = run_tests(python, root, tests, timeout - secs)
        secs += spent
        if status == "killed":
            break
    return status, by, secs


def decided(db_path: Path) -> dict[str, dict]:
    """The results file's mutants by id; a later line for a mutant wins."""
    lines = db_path.read_text().splitlines() if db_path.exists() else []
    return {rec["id"]: rec for rec in map(json.loads, lines)}


def worker_tree(target: Path, dest: Path, expected: dict[str, str]) -> Path:
    """A copy of ``target``'s vLLM for one ``--jobs`` worker to mutate: real
    directories, real copies of the files the series installs (mutants are
    written into them), and links for every other file and each
    ``__pycache__``, so its imports cost what the target's do and the
    target itself is never written."""
    shutil.rmtree(dest, ignore_errors=True)
    tops = ["vllm", STATE_DIR, *(p.name for p in target.glob("vllm-*.dist-info"))]
    for top in tops:
        for directory, subdirs, files in os.walk(target / top):
            here = Path(directory)
            out = dest / here.relative_to(target)
            out.mkdir(parents=True, exist_ok=True)
            if "__pycache__" in subdirs:
                subdirs.remove("__pycache__")
                (out / "__pycache__").symlink_to(here / "__pycache__")
            for name in files:
                if str((here / name).relative_to(target)) in expected:
                    shutil.copy2(here / name, out / name)
                else:
                    (out / name).symlink_to(here / name)
    return dest


def run_jobs(
    args: argparse.Namespace, expected: dict[str, str], state: Path, todo: list[str]
) -> int:
    """``--jobs N``: N workers, each deciding every N-th of ``todo`` (the
    mutant ids this process found undecided, written to the worker's
    ``todo.json``) in its own :func:`worker_tree` (first on ``PYTHONPATH``,
    so the tests and their ranks import it), appending to the one results
    file. Dealt here, not by each worker reading that file again: a worker
    started after another has appended would find fewer mutants undecided
    and take a different share, deciding some twice and others never."""
    shared = ["--patch-set", str(args.patch_set), "--results", str(args.results)]
    shared += ["--timeout", str(args.timeout), "--tests", *args.tests]
    shared += ["--files", *args.files] if args.files else []
    shared += ["--lines", "-".join(map(str, args.lines))] if args.lines else []
    shared += ["--all-tests"] if args.all_tests else []
    shared += ["--limit", str(args.limit)] if args.limit is not None else []
    workers = []
    for i in range(args.jobs):
        home = state / f"worker-{i}"
        site = worker_tree(args.target, home / "site", expected)
        if (state / "calls.json").exists():
            shutil.copy2(state / "calls.json", home / "calls.json")
        path = (str(site), str(PROJECT_DIR), os.environ.get("PYTHONPATH"))
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, path)))
        (home / "todo.json").write_text(json.dumps(todo[i :: args.jobs]))
        own = ["--target", str(site), "--state", str(home)]
        own += ["--shard", f"{i}/{args.jobs}"]
        cmd = [sys.executable, "-m", "eval.mutate", *shared, *own]
        workers.append(subprocess.Popen(cmd, cwd=PROJECT_DIR, env=env))
    try:
        codes = [w.wait() for w in workers]
    except KeyboardInterrupt:
        for w in workers:
            w.send_signal(signal.SIGTERM)
        for w in workers:
            w.wait()
        print("mutate: interrupted; the workers' trees are throwaway", file=sys.stderr)
        return 130
    if any(codes):
        print(f"mutate: workers exited {codes}", file=sys.stderr)
        return 1
    return 0


def line_range(text: str) -> tuple[int, int]:
    """``START-END`` (inclusive), as ``--lines`` takes it."""
    start, sep, end = text.partition("-")
    if not (sep and start.isdigit() and end.isdigit() and int(start) <= int(end)):
        raise argparse.ArgumentTypeError(f"{text!r}: want START-END, e.g. 140-210")
    return int(start), int(end)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--patch-set", type=Path, default=PROJECT_DIR)
    p.add_argument("--target", type=Path, help="default: apply.py status's")
    p.add_argument("--tests", nargs="+", default=list(RUNTIME_TESTS))
    p.add_argument("--results", type=Path, default=PROJECT_DIR / "results/mutation")
    p.add_argument("--limit", type=int, help="decide at most N mutants this run")
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--files", nargs="+", default=[], help="only these installed files")
    p.add_argument(
        "--lines",
        type=line_range,
        help="only mutants on lines START-END of the files (with --files)",
    )
    p.add_argument(
        "--all-tests",
        action="store_true",
        help="run every runtime test for every mutant (no selection)",
    )
    p.add_argument(
        "--jobs",
        type=int,
        default=1,
        help="decide mutants in N processes, each in its own copy of the tree",
    )
    p.add_argument("--state", type=Path, help=argparse.SUPPRESS)  # a worker's
    p.add_argument("--shard", help=argparse.SUPPRESS)  # I/N: a worker's share
    args = p.parse_args(argv)
    root = args.patch_set.resolve()
    status = subprocess.run(
        [sys.executable, str(PROJECT_DIR / "apply.py"), "--patch-set", str(root)]
        + ["status", "--json"]
        + ([] if args.target is None else ["--target", str(args.target)]),
        capture_output=True,
        text=True,
    )
    report = json.loads(status.stdout)
    if args.target is None:
        args.target = Path(report["target"])
    # The series apply.py picks for the target's vLLM: patches/, or a base's.
    series = Path(report.get("series") or root / "patches")
    expected = read_manifest(series / "patched.sha256")
    state = args.state or root / "build" / "mutate"
    installed = Installed(args.target, state, expected)
    installed.recover()
    for rel, digest in expected.items():
        path = args.target / rel
        if hashlib.sha256(path.read_bytes()).hexdigest() != digest:
            sys.exit(f"mutate: {rel} is not as the series installs it: make apply")
    args.results.mkdir(parents=True, exist_ok=True)
    db_path = args.results / "mutants.jsonl"
    done = decided(db_path)
    tdig = tests_digest(root, args.tests)
    # A survivor shown equivalent (for these bytes: the id says which) cannot
    # be killed by any test; the others are tried again when the tests change.
    equivalent = equivalent_ids(args.results)
    todo, all_ids, mutants = [], [], {}
    trees: dict[str, ast.AST] = {}
    for rel, lines in sorted(added_lines(root).items()):
        source = (args.target / rel).read_text()
        trees[rel] = ast.parse(source)
        if args.files and rel not in args.files:
            continue
        if args.lines:
            lines = {n for n in lines if args.lines[0] <= n <= args.lines[1]}
        for m in mutants_of(rel, source, lines):
            mid = m.key(expected[rel])
            all_ids.append(mid)
            mutants[mid] = m
            rec = done.get(mid)
            if rec and (
                rec["status"] == "killed" or rec["tests"] == tdig or mid in equivalent
            ):
                continue
            todo.append((mid, m))
    if args.limit is not None:
        todo = todo[: args.limit]
    calls = {}
    if todo and not args.all_tests:
        calls = calls_map(
            sys.executable, root, args.target, args.tests, expected, installed.state
        )
    if args.jobs > 1 and todo:
        code = run_jobs(args, expected, installed.state, [mid for mid, _ in todo])
        done = decided(db_path)
        write_summary(
            args.results, [done[i] for i in all_ids if i in done], len(all_ids)
        )
        return code
    label = ""
    if args.shard:
        dealt = json.loads((args.state / "todo.json").read_text())
        todo = [(mid, mutants[mid]) for mid in dealt]
        label = f"[worker {args.shard.split('/')[0]}] "

    def stop(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)
    start = time.monotonic()
    print(f"{label}mutate: {len(all_ids)} mutants, {len(todo)} to decide")
    try:
        for k, (mid, m) in enumerate(todo, 1):
            killers = [
                r["killed_by"].split("::")[0]
                for r in done.values()
                if r["file"].startswith(m.rel + ":") and r["killed_by"]
            ]
            first = sorted(set(killers), key=killers.count, reverse=True)
            selected = (
                args.tests
                if args.all_tests
                else select_tests(calls, m, trees[m.rel], args.tests)
            )
            likely = [
                t
                for t in first
                if (root / t).exists() and (selected is args.tests or t in selected)
            ][:1]
            rest = [t for t in selected if t not in likely]
            if not (likely or rest):  # no test calls the function: nothing can kill it
                status, by, secs = "survived", None, 0.0
            else:
                installed.write(
                    m.rel, apply_mutant((args.target / m.rel).read_bytes(), m)
                )
                try:
                    status, by, secs = decide(
                        sys.executable, root, [likely, rest], args.timeout
                    )
                finally:
                    installed.restore()
            rec = {
                "id": mid,
                "file": f"{m.rel}:{m.line}",
                "kind": m.kind,
                "mutant": m.text[:200],
                "status": status,
                "killed_by": by,
                "seconds": round(secs, 1),
                "tests": tdig,
                "selected": "all" if selected is args.tests else selected,
            }
            done[mid] = rec
            with db_path.open("a") as f:
                f.write(json.dumps(rec) + "\n")
            left = (time.monotonic() - start) / k * (len(todo) - k)
            print(
                f"{label}[{k}/{len(todo)}] {rec['file']} {m.kind}: {status}"
                f"{' by ' + by if by else ''}"
                f" ({secs:.0f} s; ~{left / 60:.0f} min left)",
                flush=True,
            )
    except KeyboardInterrupt:
        installed.restore()
        print("mutate: interrupted; the installed tree is restored", file=sys.stderr)
        return 130
    if not args.shard:  # the parent of --jobs workers writes it
        write_summary(
            args.results, [done[i] for i in all_ids if i in done], len(all_ids)
        )
    return 0


def equivalent_ids(results: Path) -> dict[str, str]:
    """``equivalent.json``: survivor id -> why it cannot change behaviour."""
    eq_path = results / "equivalent.json"
    return json.loads(eq_path.read_text()) if eq_path.exists() else {}


def write_summary(results: Path, recs: list[dict], total: int) -> None:
    equivalent = equivalent_ids(results)
    killed = sum(r["status"] == "killed" for r in recs)
    survivors = [r for r in recs if r["status"] == "survived"]
    eq = [r for r in survivors if r["id"] in equivalent]
    scored = len(recs) - len(eq)
    score = 100.0 * killed / scored if scored else 0.0
    lines = [
        "# Mutation testing of the series",
        "",
        f"Command: `{' '.join(['python -m eval.mutate', *sys.argv[1:]])}`",
        f"Python {sys.version.split()[0]}",
        f"Mutants: {total}; decided {len(recs)}; killed {killed}; "
        f"equivalent {len(eq)}; score {score:.1f} % of non-equivalent decided",
        "",
        "## Survivors",
        "",
    ]
    for r in survivors:
        why = equivalent.get(r["id"], "open")
        lines.append(f"- `{r['id']}` {r['file']} {r['kind']} `{r['mutant']}`: {why}")
    (results / "summary.md").write_text("\n".join(lines) + "\n")
    print(f"mutate: score {score:.1f} % ({killed}/{scored})")


if __name__ == "__main__":
    sys.exit(main())
