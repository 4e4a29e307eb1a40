# SPDX-License-Identifier: Apache-2.0
"""Servers shared by every serving test of a run: start-ups are the time
cost, so each layout starts once, all that the selected tests name at once,
and serves parity, chat, GSM8K and the bench sweeps."""

from __future__ import annotations

import contextlib
import socket
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.serving import preloaded_vllm
from tests.serving.eagle3 import speculative_config
from tests.serving.fork_processes import ASYNC_SCHEDULING
from tests.serving.server import (
    OFFLINE,
    Server,
    cache_model_info,
    serve_env,
    write_model_dir,
)
from tests.serving.worker import STAGE0_EXTRA_ROW, STAGE1_MOE_BACKEND
from tests.sppp_testbed import k3_checkpoint
from tests.sppp_testbed.bases import HAS_LEGACY_RUNNER

TP2PP2 = ["-tp", "2", "-pp", "2", "--enable-expert-parallel"]
TP2PP3 = ["-tp", "2", "-pp", "3", "--enable-expert-parallel"]


@dataclass(frozen=True)
class Layout:
    """One server: its parallel layout, the frontend that serves it and the
    arm of eval/arms.toml whose layout it stands for in the evaluation tools."""

    args: list[str]
    frontend: str  # "python" or "rust"
    arm: str | None
    env: dict[str, str] = field(default_factory=dict)
    # False for a server the stages' agreement must refuse at start-up.
    starts: bool = True
    # The --speculative-config method of the tests' drafter
    # (tests/serving/eagle3.py: "eagle3", "mtp" or "dspark"), served with async
    # scheduling, which vLLM needs for a drafter at PP > 1
    # (tests/serving/fork_processes.py says why); None: no drafter.
    drafter: str | None = None
    # The architecture name the served checkpoint's config.json carries
    # (vLLM 0.34.0; None: Kimi K3's). Each name is a directory of its own.
    architecture: str | None = None
    # Started only once the other servers are stopped, its tests last: seven
    # servers at once (some 40 processes) outgrew the 24 GiB machine (a rank
    # killed, exit -9, 2026-12-07).
    alone: bool = False


# The sequence-parallel layout is served by the Rust frontend (as every arm
# of the seed is), the other two by the Python one: both frontends are
# covered by the same three start-ups. The replicated layout serves without
# prefix caching, as the arms do; the others keep vLLM's default (on).
# A start-up is the serving tests' cost, so one server serves every test that
# its layout can: TP1xPP1 is the reference of the completions and, on vLLM
# 0.34.0, with the EAGLE-3 drafter, of the drafts (greedy verification keeps
# its completions the target's; they equal the model recomputed without any
# runner, test_serve_parity.py). A layout is a server only where its
# parallel sizes, flags or drafter differ.
# The drafter of the EAGLE-3 layouts (vLLM 0.34.0's V2 runner; 0.33.0's
# servers run a stand-in runner without a speculator, and no drafter test).
EAGLE3 = None if HAS_LEGACY_RUNNER else "eagle3"
LAYOUTS = {
    "TP1xPP1": Layout([], "python", None, drafter=EAGLE3),
    "TP2xPP2 SP (MegaMoE, EP)": Layout(
        [*TP2PP2, "--moe-backend", "deep_gemm_mega_moe"], "rust", "mega-sp"
    ),
    # Served by K3.1's architecture name where vLLM's registry maps it: the
    # class users load by either name is the one proven.
    "TP2xPP2 replicated (triton, EP)": Layout(
        [*TP2PP2, "--moe-backend", "triton", "--no-enable-prefix-caching"],
        "python",
        "fi-ep",
        architecture=k3_checkpoint.ARCHITECTURES[-1],
    ),
    # Three stages: a middle stage receives shards and hands them on. Its
    # stage 0 hands on a row too many for a prompt that begins with
    # EXTRA_ROW_MARK (the last test of test_serve_parity.py sends one). On
    # vLLM 0.34.0 it serves with the EAGLE-3 drafter: the middle stage's
    # runner relays stage 0's aux state to the last stage, where the drafter
    # reads it (test_serve_drafter.py).
    "TP2xPP3 SP (MegaMoE, EP)": Layout(
        [*TP2PP3, "--moe-backend", "deep_gemm_mega_moe"],
        "python",
        None,
        env={STAGE0_EXTRA_ROW: "1"},
        drafter=EAGLE3,
    ),
    # Kimi K3's own MTP layer and its DSpark drafter (vLLM 0.34.0): a server
    # of its own per layout (one --speculative-config a server), TP1xPP1 its
    # reference; the four start together, after the others. MTP reads the
    # target's final hidden states, no aux state; DSpark reads EAGLE-3's taps.
    **(
        {}
        if HAS_LEGACY_RUNNER
        else {
            "TP1xPP1 MTP": Layout([], "python", None, drafter="mtp", alone=True),
            "TP2xPP3 SP MTP (MegaMoE, EP)": Layout(
                [*TP2PP3, "--moe-backend", "deep_gemm_mega_moe"],
                "python",
                None,
                drafter="mtp",
                alone=True,
            ),
            "TP1xPP1 DSpark": Layout([], "python", None, drafter="dspark", alone=True),
            "TP2xPP3 SP DSpark (MegaMoE, EP)": Layout(
                [*TP2PP3, "--moe-backend", "deep_gemm_mega_moe"],
                "python",
                None,
                drafter="dspark",
                alone=True,
            ),
        }
    ),
    # Stage 1 builds its model with another MoE backend, as a node started
    # with other flags would.
    "TP2xPP2 SP, stage 1 triton": Layout(
        [*TP2PP2, "--moe-backend", "deep_gemm_mega_moe"],
        "python",
        None,
        env={STAGE1_MOE_BACKEND: "triton"},
        starts=False,
    ),
}
REFERENCE = "TP1xPP1"
# The drafts' reference (vLLM 0.34.0's V2 runner; 0.33.0's servers run a
# stand-in runner without a speculator, and no drafter test).
EAGLE3_REFERENCE = REFERENCE
SP = "TP2xPP2 SP (MegaMoE, EP)"
REPLICATED = "TP2xPP2 replicated (triton, EP)"
SP_PP3 = "TP2xPP3 SP (MegaMoE, EP)"
REFUSED = "TP2xPP2 SP, stage 1 triton"
MTP_REFERENCE = "TP1xPP1 MTP"
MTP_PP3 = "TP2xPP3 SP MTP (MegaMoE, EP)"
DSPARK_REFERENCE = "TP1xPP1 DSpark"
DSPARK_PP3 = "TP2xPP3 SP DSpark (MegaMoE, EP)"
# Per drafter method, its reference layout and the TP2xPP3 SP layout.
DRAFTER_LAYOUTS = {
    "eagle3": (EAGLE3_REFERENCE, SP_PP3),
    "mtp": (MTP_REFERENCE, MTP_PP3),
    "dspark": (DSPARK_REFERENCE, DSPARK_PP3),
}


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "layouts(*names): the LAYOUTS the test asks `servers` for"
    )


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Servers:
    """The servers of `tests/serving` by layout name, started on first use."""

    def __init__(self, vllm: Path, root: Path, drafts, logs, wanted) -> None:
        self.vllm, self.root, self.logs = vllm, root, logs
        self.model_dir = self.model_dir_of(None)
        self.drafts = drafts
        self.wanted = wanted
        self.started: dict[str, Server] = {}
        self.startup: dict[str, float] = {}

    def model_dir_of(self, architecture: str | None) -> Path:
        """The served directory for ``architecture``, written once."""
        path = self.root / f"tiny-k3-{architecture or 'default'}"
        if not path.exists():
            write_model_dir(path, architecture)
        return path

    def start(self, name: str) -> Server:
        """The named server, started (not waited for) with every other one
        the selected tests name: the start-ups overlap where they wait
        (imports, the engine's hand-shakes, the ranks' rendezvous)."""
        alone = LAYOUTS[name].alone
        if alone:  # the others' tests have run (pytest_collection_modifyitems)
            for other, server in self.started.items():
                if not LAYOUTS[other].alone:
                    server.stop()
        for other in dict.fromkeys([name, *self.wanted]):
            if LAYOUTS[other].alone != alone:
                continue
            if other not in self.started:
                layout = LAYOUTS[other]
                env, args = dict(layout.env), list(layout.args)
                if layout.frontend == "rust":
                    env["VLLM_USE_RUST_FRONTEND"] = "1"
                if layout.drafter:
                    env[ASYNC_SCHEDULING] = "1"
                    draft = speculative_config(self.drafts, layout.drafter)
                    args += ["--speculative-config", draft, "--async-scheduling"]
                log = f"{list(LAYOUTS).index(other)}-{layout.frontend}.log"
                self.started[other] = Server(
                    self.model_dir_of(layout.architecture),
                    free_port(),
                    args,
                    env=env,
                    log=self.logs / log,
                    vllm=self.vllm,
                )
        return self.started[name]

    def __getitem__(self, name: str) -> Server:
        """The named server, healthy."""
        server = self.start(name)
        # Each start-up timed from its own start, all of them now; one that
        # fails is reported to the tests that ask for it.
        for other, started in self.started.items():
            if (
                other not in self.startup
                and other != name
                and LAYOUTS[other].starts
                and LAYOUTS[other].alone == LAYOUTS[name].alone
            ):
                with contextlib.suppress(RuntimeError, TimeoutError):
                    self.startup[other] = started.wait_ready()
        if name not in self.startup:
            self.startup[name] = server.wait_ready()
        return server

    def stop(self) -> None:
        """All at once: each waits for its own processes to exit."""
        if self.started:
            with ThreadPoolExecutor(len(self.started)) as pool:
                list(pool.map(Server.stop, self.started.values()))


def item_layouts(item: pytest.Item) -> set[str]:
    return {n for m in item.iter_markers("layouts") for n in m.args}


def pytest_collection_modifyitems(session, config, items) -> None:
    """The tests of layouts that start alone run last, after every other."""
    items.sort(
        key=lambda item: any(
            n in LAYOUTS and LAYOUTS[n].alone for n in item_layouts(item)
        )
    )


def wanted_layouts(items: list[pytest.Item]) -> list[str]:
    names = {n for item in items for m in item.iter_markers("layouts") for n in m.args}
    return [name for name in LAYOUTS if name in names]


@pytest.fixture(scope="package")
def servers(request, tmp_path_factory) -> Iterator[Servers]:
    """Started on first use, each a fork of one process that imported vLLM
    (tests/serving/preloaded_vllm.py), which the bench client's runs use
    too; stopped after the package's last test, so that no idle server holds
    memory while the rest of ``make test`` runs."""
    root = tmp_path_factory.mktemp("serving")
    with preloaded_vllm.command(root / "vllm", {**serve_env(), **OFFLINE}) as vllm:
        cache_model_info()  # while the preloaded process imports vLLM
        pool = Servers(
            vllm,
            root,
            {
                "eagle3": k3_checkpoint.write_eagle3_draft(root / "tiny-k3-eagle3"),
                "dspark": k3_checkpoint.write_dspark_draft(root / "tiny-k3-dspark"),
            },
            root,
            wanted_layouts(request.session.items),
        )
        started = time.monotonic()
        try:
            yield pool
        finally:
            stopping = time.monotonic()
            pool.stop()
            request.config.stash[STARTUPS] = (
                "serving start-ups (s, each from its own start, all at once): "
                + ", ".join(f"{n} {t:.0f}" for n, t in pool.startup.items())
                + f"; servers up for {stopping - started:.0f} s, stopped in "
                + f"{time.monotonic() - stopping:.0f} s"
            )


STARTUPS = pytest.StashKey[str]()


def pytest_terminal_summary(terminalreporter, config) -> None:
    """Where the serving tests' time goes, in every run's summary."""
    if STARTUPS in config.stash:
        terminalreporter.write_line(config.stash[STARTUPS])


@pytest.fixture(scope="package")
def model_dir(servers: Servers) -> Path:
    return servers.model_dir
