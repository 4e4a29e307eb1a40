# SPDX-License-Identifier: Apache-2.0
"""Distributed tests run vLLM's distributed layer on the CPU, over gloo.

Ranks are forked from a fork server per vLLM tree that imports the model
stack once; in one pytest process the servers start while the tests are
collected, and this package's tests run last, so the imports overlap the
other tests. Under pytest-xdist (`make test`) the package goes whole to one
worker, first (the root conftest), and that worker starts the servers with
its first test of the package. Pools
live as long as this package's tests, one per topology (tests pick theirs
with ``topologies``), with at most ``MAX_LIVE_RANKS`` rank processes alive at
once. The single-process reference is memoised per scenario.
"""

import dataclasses
import os
import shutil
import tempfile
from pathlib import Path

# Before any vLLM import, here and in every rank (which inherits it).
os.environ["VLLM_TARGET_DEVICE"] = "cpu"

import pytest  # noqa: E402

from tests.sppp_testbed.launcher import RankPool, start_fork_server  # noqa: E402
from tests.sppp_testbed.pristine import link_pristine_vllm  # noqa: E402
from tests.sppp_testbed.stages import Scenario, StageResult, run_step  # noqa: E402

PRISTINE_VLLM = pytest.StashKey[str]()
PRISTINE_NEEDED = pytest.StashKey[bool]()
# What the ranks print (vLLM's start-up lines, a crash's last words): one
# file for the session, named in the summary when a test failed.
RANK_OUTPUT = os.path.join(tempfile.gettempdir(), f"k3-sppp-ranks-{os.getpid()}.log")


# In a pytest-xdist worker the fork servers start with the worker's first test
# of this package instead: the root conftest deals the whole package to one
# worker, and the other would import vLLM twice more for nothing.
IN_XDIST_WORKER = "PYTEST_XDIST_WORKER" in os.environ


def pytest_configure(config):
    """Start the fork server now: it imports while the tests are collected."""
    if not config.option.collectonly and not IN_XDIST_WORKER:
        start_fork_server(output=RANK_OUTPUT)


def pytest_runtest_setup(item):
    """In an xdist worker, the fork servers start here (once)."""
    if IN_XDIST_WORKER:
        start_fork_server(output=RANK_OUTPUT)
        if item.config.stash.get(PRISTINE_NEEDED, False):
            start_pristine_fork_server(item.config)


def pytest_terminal_summary(terminalreporter, exitstatus):
    if not os.path.exists(RANK_OUTPUT):
        return
    if exitstatus:
        terminalreporter.write_line(f"rank processes printed to {RANK_OUTPUT}")
    else:
        os.remove(RANK_OUTPUT)


def pytest_collection_modifyitems(config, items):
    """Run this package's tests after the others, so the fork servers import
    while those run; if a selected test compares with pristine vLLM, link
    that tree and start its fork server now too."""
    if config.option.collectonly:
        return
    here = Path(__file__).parent
    items.sort(key=lambda item: here in item.path.parents)  # stable
    if any("pristine_vllm" in item.fixturenames for item in items):
        config.stash[PRISTINE_NEEDED] = True
        if not IN_XDIST_WORKER:
            start_pristine_fork_server(config)


def start_pristine_fork_server(config) -> None:
    """Link the pristine tree and start its fork server, once."""
    if PRISTINE_VLLM in config.stash:
        return
    root = tempfile.mkdtemp(prefix="k3-sppp-pristine-vllm-")
    config.add_cleanup(lambda: shutil.rmtree(root, ignore_errors=True))
    config.stash[PRISTINE_VLLM] = str(link_pristine_vllm(Path(root)))
    start_fork_server(config.stash[PRISTINE_VLLM], output=RANK_OUTPUT)


@pytest.fixture(scope="session")
def pristine_vllm(request) -> str:
    """The installed vLLM release as it was before the patch set (linked, not
    copied)."""
    start_pristine_fork_server(request.config)  # once: in a worker, not yet
    return request.config.stash[PRISTINE_VLLM]


PRELOAD = ("tests.sppp_testbed.stages",)


def topologies(*shapes: tuple[int, int]):
    """Parametrize a test over TP×PP pools: ``@topologies((2, 2), (1, 2))``.

    Module-scoped parameters make pytest run each pool's tests together.
    """
    ids = [f"TP{tp}xPP{pp}" for tp, pp in shapes]
    return pytest.mark.parametrize(
        "pool", shapes, ids=ids, indirect=True, scope="module"
    )


MAX_LIVE_RANKS = 12


# Package scope: the ranks are gone before the evaluation tests run.
@pytest.fixture(scope="package")
def pools():
    live: dict[tuple[int, int, str | None, tuple[str, ...]], RankPool] = {}

    def get(
        tp: int,
        pp: int,
        vllm_root: str | None = None,
        preload: tuple[str, ...] = PRELOAD,
    ) -> RankPool:
        """The pool of that shape; ranks that preload other modules (which
        may change their process, as vLLM's CPU worker does) are a pool of
        their own."""
        key = (tp, pp, vllm_root, preload)
        if key not in live:
            while (
                live and sum(p.world for p in live.values()) + tp * pp > MAX_LIVE_RANKS
            ):
                live.pop(next(iter(live))).close()  # the oldest
            live[key] = RankPool(tp, pp, preload=preload, vllm_root=vllm_root)
        return live[key]

    yield get
    for pool in live.values():
        pool.close()


@pytest.fixture(scope="module")
def pool(request, pools) -> RankPool:
    return pools(*request.param)


@pytest.fixture(scope="package")
def reference():
    """The TP1×PP1 result of a scenario (SP is meaningless there, and the
    production flags change how ranks split the work, not the result)."""
    pool = RankPool(tp=1, pp=1, preload=PRELOAD)
    results: dict[Scenario, StageResult] = {}

    def result(scenario: Scenario) -> StageResult:
        key = dataclasses.replace(
            scenario,
            sp=False,
            fault="",
            runner="",
            production_flags=False,
            packed_gather_max_bytes=None,
            handoff="sharded",
        )
        if key not in results:
            (results[key],) = pool.run(run_step, key)
        return results[key]

    yield result
    pool.close()
