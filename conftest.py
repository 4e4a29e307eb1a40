# SPDX-License-Identifier: Apache-2.0
"""Every test here runs on the CPU: vLLM must pick its CPU platform before
its first import, in this process and in every rank process it spawns. The
upstream-bound tests under vllm_overlay/tests rely on this too; they use no
device, so in vLLM's own CI they run on whatever platform it has."""

import importlib.metadata
import os
from pathlib import Path

import pytest

os.environ["VLLM_TARGET_DEVICE"] = "cpu"
# Importing vLLM imports humming, which starts two interpreters in the
# background to pre-build its CUDA launcher: on a CPU they only take cores
# from the tests (every process importing vLLM starts its own two).
os.environ["HUMMING_DISABLE_PARALLEL_BUILD"] = "1"
# vLLM's few torch.compile'd helpers (the vocab-parallel embedding mask,
# SiluAndMul's native path) would compile in every rank process: on 2 CPU
# cores that doubled the distributed tests' time (79 s against 35 s) and says
# nothing of the GPU graphs. They run eagerly here; TORCHDYNAMO_DISABLE=0
# compiles them again.
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")


def pytest_runtest_setup(item):
    """The upstream-bound tests (vllm_overlay/tests, and a release's own copy
    under bases/) build VllmConfigs, which vLLM 0.34.0's CPU platform refuses
    on x86 without Triton's CPU backend; in vLLM's CI they run where it is
    not refused. Answer that one check for them as the test bed does
    (tests/sppp_testbed/cpu_platform.py); they import vLLM anyway."""
    if "vllm_overlay" in item.path.parts:
        from tests.sppp_testbed.cpu_platform import accept_x86_without_triton

        accept_x86_without_triton()


# Each vLLM base runs the overlay tests composed for it, as apply composes the
# overlay: vllm_overlay/tests/ is shared; bases/VERSION/vllm_overlay/tests/
# holds only the tests that VERSION needs otherwise, each in place of the
# shared file of the same path. The base is the vLLM this interpreter has
# (`make test BASE=0.33.0` runs .venv-0.33.0's).
ROOT = Path(__file__).resolve().parent


def running_vllm() -> str | None:
    try:
        return importlib.metadata.version("vllm").split("+")[0]
    except importlib.metadata.PackageNotFoundError:
        return None


def overlay_test_ignored(path: Path, root: Path, version: str | None) -> bool:
    """Whether ``path`` is an overlay test of another base than ``version``,
    or a shared one that ``version``'s own copy replaces."""
    bases = root / "bases"
    if bases in path.parents:
        parts = path.relative_to(bases).parts
        return (
            len(parts) > 2
            and parts[1:3] == ("vllm_overlay", "tests")
            and (parts[0] != version)
        )
    shared = root / "vllm_overlay"
    if shared / "tests" in path.parents and version is not None:
        return (bases / version / "vllm_overlay" / path.relative_to(shared)).is_file()
    return False


def pytest_ignore_collect(collection_path: Path, config) -> bool | None:
    if overlay_test_ignored(collection_path.resolve(), ROOT, running_vllm()):
        return True
    return None


# `make test` runs the tests other than the serving ones in pytest-xdist
# workers, `--dist loadfile`: each test file whole to one worker, so its module
# fixtures are built once. Two changes to how the files are dealt out:
#
# - tests/distributed is one unit, not one per file: its tests share rank
#   pools, the single-process reference and the fork servers that import vLLM
#   and the test bed for the ranks (about 13 CPU-s each, one for the installed
#   vLLM and one for the pristine tree), all per worker. Split over two
#   workers, each built its own of every one.
# - The longest units go first (measured in CPU-s, `make test` of 2026-12-07:
#   docs/testing.md, "Where the rest's CPU goes"), so that no long file starts
#   last while the other worker sits idle; the rest keep xdist's order
#   (most tests first).
LONGEST_FIRST = (
    "tests/distributed",
    "tests/eval/test_gsm8k.py",
    "tests/eval/test_bench.py",
    "tests/tooling/test_apply.py",
    "tests/tooling/test_faults.py",
    "tests/eval/test_nccl_bench.py",
    "tests/eval/test_mutate.py",
    "tests/tooling/test_bases.py",
)


def work_unit(nodeid: str) -> str:
    """The unit a test is dealt out in: its file, or tests/distributed."""
    path = nodeid.split("::", 1)[0]
    if path.startswith(LONGEST_FIRST[0] + "/"):
        return LONGEST_FIRST[0]
    return path


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook: absent without it
def pytest_xdist_make_scheduler(config, log):
    if config.getoption("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class LongestFirstByFile(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return work_unit(nodeid)

        def _assign_work_unit(self, node) -> None:
            # The earliest of LONGEST_FIRST still queued goes next.
            def rank(unit: str) -> int:
                return LONGEST_FIRST.index(unit) if unit in LONGEST_FIRST else 99

            self.workqueue.move_to_end(min(self.workqueue, key=rank), last=False)
            super()._assign_work_unit(node)

    return LongestFirstByFile(config, log)
