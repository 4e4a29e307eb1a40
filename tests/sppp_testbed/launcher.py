# SPDX-License-Identifier: Apache-2.0
"""TP×PP ranks as real processes over gloo, started once, running many cases.

Ranks are forked from a fork server that has imported the model stack once
for the whole session, so a pool starts in a fraction of a second instead of
each rank paying the (heavy) vLLM imports. ``vllm_root`` makes the ranks import
vLLM from another directory (e.g. a pristine tree, to compare patched and
unpatched runs); each such tree has its own fork server, so two trees never
share a module. ``preload`` names further modules every rank imports at
start-up, before the first case's deadline.

Each rank initialises vLLM's own distributed state
(``init_distributed_environment`` + ``initialize_model_parallel``) on the CPU,
then waits for cases: a picklable top-level function and its arguments. A case
runs in every rank; its per-rank results come back in rank order. A rank that
raises, dies or overruns the deadline fails the case with the rank and its
traceback, and the pool is torn down (its peers may be stuck in a collective)
and started afresh on the next case.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import queue
import socket
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from multiprocessing import forkserver
from typing import Any

import torch.multiprocessing as mp

from eval.mutate_calls import recording

# What a fork server imports once, so forked ranks start with the model
# stack loaded: the test bed's step (vLLM's model, distributed and runner
# modules) and what every rank runs at start-up.
FORK_SERVER_PRELOAD = (
    "torch",
    "vllm.config",
    "vllm.distributed",
    "tests.sppp_testbed.stages",
    "tests.sppp_testbed.loaded_stages",
    "tests.sppp_testbed.frozen_heap",  # last: freezes what the others made
)

START_TIMEOUT_S = 180.0
CASE_TIMEOUT_S = 120.0
ERROR_GRACE_S = 5.0


class RankFailure(AssertionError):
    """A case failed in one or more ranks."""


_fork_servers: dict[str | None, forkserver.ForkServer] = {}


def start_fork_server(vllm_root: str | None = None, output: str | None = None) -> None:
    """Start the fork server of ranks importing vLLM from ``vllm_root``
    (``None``: the installed vLLM) unless it runs already.

    It returns at once: the server imports ``FORK_SERVER_PRELOAD`` in the
    background, and the first rank forked from it waits for that. Called
    early, the import overlaps whatever the caller does next. ``output`` is a
    file for what the server and its ranks print (default: this process's
    stdout and stderr).
    """
    if vllm_root in _fork_servers:
        return
    server = forkserver.ForkServer()
    server.set_forkserver_preload(list(FORK_SERVER_PRELOAD))
    os.environ["VLLM_TARGET_DEVICE"] = "cpu"  # inherited by every rank
    # No background CUDA builds of humming (imported by vLLM) on CPU ranks.
    os.environ["HUMMING_DISABLE_PARALLEL_BUILD"] = "1"
    saved = os.environ.get("PYTHONPATH")
    if vllm_root is not None:  # the server's own imports come from the tree
        os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, (vllm_root, saved)))
    try:
        with printing_to(output):
            server.ensure_running()
    finally:
        if saved is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = saved
    _fork_servers[vllm_root] = server


@contextlib.contextmanager
def printing_to(output: str | None) -> Iterator[None]:
    """This process and the processes started in this block print to
    ``output`` (appended)."""
    if output is None:
        yield
        return
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    fd = os.open(output, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        yield
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for descriptor in (fd, *saved):
            os.close(descriptor)


@contextlib.contextmanager
def _forking_from(vllm_root: str | None) -> Iterator[None]:
    """Processes started in this block fork from ``vllm_root``'s server.

    The standard library keeps one fork server per interpreter and asks it
    through ``multiprocessing.forkserver.connect_to_new_process``; the test
    bed keeps one per vLLM tree, so it points that name at the tree's server
    while starting a pool's ranks.
    """
    start_fork_server(vllm_root)
    default = forkserver.connect_to_new_process
    forkserver.connect_to_new_process = _fork_servers[vllm_root].connect_to_new_process
    try:
        yield
    finally:
        forkserver.connect_to_new_process = default


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(
    rank: int,
    tp: int,
    pp: int,
    port: int,
    preload: tuple[str, ...],
    vllm_root: str | None,
    tasks: mp.Queue,
    results: mp.Queue,
) -> None:
    try:
        if vllm_root is not None:
            sys.path.insert(0, vllm_root)
        import torch

        # tp * pp ranks share a few cores: one intra-op thread each.
        torch.set_num_threads(1)
        for module in preload:
            importlib.import_module(module)
        from vllm.config import ParallelConfig, VllmConfig, set_current_vllm_config
        from vllm.distributed import (
            init_distributed_environment,
            initialize_model_parallel,
        )

        config = VllmConfig(
            parallel_config=ParallelConfig(
                tensor_parallel_size=tp, pipeline_parallel_size=pp
            )
        )
        with set_current_vllm_config(config), recording(None):
            init_distributed_environment(
                world_size=tp * pp,
                rank=rank,
                distributed_init_method=f"tcp://127.0.0.1:{port}",
                local_rank=rank,
                backend="gloo",
            )
            initialize_model_parallel(tp, pp)
        results.put((rank, "ready", None))
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))
        return
    while (task := tasks.get()) is not None:
        func, args, test = task
        try:
            with recording(test):  # for make mutate's test selection
                value = func(*args)
            results.put((rank, "ok", value))
        except BaseException:
            results.put((rank, "error", traceback.format_exc()))


class RankPool:
    """``tp * pp`` rank processes; global rank ``r`` is TP rank ``r % tp`` of
    PP stage ``r // tp``, as vLLM's ``initialize_model_parallel`` lays them out.
    """

    def __init__(
        self,
        tp: int,
        pp: int,
        preload: tuple[str, ...] = (),
        vllm_root: str | None = None,
        stage_vllm_roots: dict[int, str | None] | None = None,
    ) -> None:
        self.tp, self.pp = tp, pp
        self.preload = preload
        self.vllm_root = vllm_root
        # Stages whose ranks import another tree: nodes that differ.
        self.stage_vllm_roots = stage_vllm_roots or {}
        self.world = tp * pp
        self._procs: list[mp.Process] = []

    def __repr__(self) -> str:
        where = f", vLLM from {self.vllm_root}" if self.vllm_root else ""
        for stage, root in self.stage_vllm_roots.items():
            where += f", stage {stage} from {root or 'the installed vLLM'}"
        return f"RankPool(TP{self.tp}xPP{self.pp}{where})"

    def start(self) -> None:
        ctx = mp.get_context("forkserver")
        self._results = ctx.Queue()
        self._tasks = [ctx.Queue() for _ in range(self.world)]
        port = _free_port()
        self._procs = [
            ctx.Process(
                target=_rank_main,
                args=(
                    r,
                    self.tp,
                    self.pp,
                    port,
                    self.preload,
                    self._root_of(r),
                    self._tasks[r],
                    self._results,
                ),
                daemon=True,
            )
            for r in range(self.world)
        ]
        for r, proc in enumerate(self._procs):
            with _forking_from(self._root_of(r)):
                proc.start()
        self._collect("start-up", START_TIMEOUT_S, expect="ready")

    def _root_of(self, rank: int) -> str | None:
        return self.stage_vllm_roots.get(rank // self.tp, self.vllm_root)

    def run(
        self,
        func: Callable[..., Any],
        *args: Any,
        timeout: float = CASE_TIMEOUT_S,
    ) -> list[Any]:
        """Run ``func(*args)`` in every rank; return the results by rank."""
        if not self._procs:
            self.start()
        test = os.environ.get("PYTEST_CURRENT_TEST")
        for task_queue in self._tasks:
            task_queue.put((func, args, test))
        return self._collect(f"{func.__name__}{args!r}", timeout, expect="ok")

    def _collect(self, what: str, timeout: float, expect: str) -> list[Any]:
        deadline = time.monotonic() + timeout
        results: dict[int, Any] = {}
        errors: dict[int, str] = {}
        while len(results) + len(errors) < self.world:
            try:
                rank, status, value = self._results.get(timeout=1.0)
            except queue.Empty:
                dead = [r for r, p in enumerate(self._procs) if not p.is_alive()]
                missing = sorted(
                    set(range(self.world)) - results.keys() - errors.keys()
                )
                if dead and set(missing) <= set(dead):
                    errors.update({r: "the process died" for r in missing})
                elif errors and time.monotonic() > deadline:
                    errors.update(
                        {r: "(no answer: stuck after a peer failed)" for r in missing}
                    )
                elif time.monotonic() > deadline or dead:
                    self.close()
                    raise RankFailure(
                        f"{self!r} {what}: no answer from rank(s) {missing} "
                        f"within {timeout:.0f} s"
                        + (f"; rank(s) {dead} died" if dead else "")
                    ) from None
                continue
            if status == expect:
                results[rank] = value
            else:
                errors[rank] = value
                # Peers may now wait forever in a collective with this rank.
                deadline = min(deadline, time.monotonic() + ERROR_GRACE_S)
        if errors:
            self.close()
            detail = "\n".join(
                f"--- rank {r} (TP {r % self.tp}, PP {r // self.tp}) ---\n{tb}"
                for r, tb in sorted(errors.items())
            )
            raise RankFailure(f"{self!r} {what} failed:\n{detail}")
        return [results[r] for r in range(self.world)]

    def close(self) -> None:
        """Stop every rank. Ranks hold nothing worth a clean exit and may sit
        in a collective, so they are killed, not asked to return."""
        for proc in self._procs:
            proc.kill()
        for proc in self._procs:
            proc.join(timeout=5)
        self._procs = []
