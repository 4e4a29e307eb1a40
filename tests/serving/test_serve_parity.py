# SPDX-License-Identifier: Apache-2.0
"""Greedy completions through ``vllm serve``: the sequence-parallel layout at
TP2xPP2 (MegaMoE, EP) against TP1xPP1 and the replicated layout (another MoE
backend at TP2xPP2), token for token, as vLLM's
tests/distributed/test_pipeline_parallel.py compares parallel settings."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.serving.conftest import free_port
from tests.serving.server import Server
from tests.serving.worker import STAGE1_MOE_BACKEND

TP2PP2 = ["-tp", "2", "-pp", "2", "--enable-expert-parallel"]
LAYOUTS = {
    "TP1xPP1": [],
    "TP2xPP2 SP (MegaMoE, EP)": [*TP2PP2, "--moe-backend", "deep_gemm_mega_moe"],
    "TP2xPP2 replicated (triton, EP)": [*TP2PP2, "--moe-backend", "triton"],
}
# Prompt lengths 1 (< TP), 3 and 11 (not divisible by TP), 44; every decode
# step of a lone request dispatches a single token.
ALONE = ["a", "abc", "Hello world", "The quick brown fox jumps over the lazy dog."]
# Sent at once: the scheduler mixes prefills with decodes of the others.
TOGETHER = ["x" * 5, "Question: 2 + 3 = ?", "q", "0123456789" * 3, "Mixed batch."]
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def completions(model_dir, tmp_path_factory):
    """Every layout's completions; the servers start at once and stop after."""
    logs = tmp_path_factory.mktemp("serve-logs")
    servers = {
        name: Server(model_dir, free_port(), args, log=logs / f"{i}.log")
        for i, (name, args) in enumerate(LAYOUTS.items())
    }
    results, startup = {}, {}
    try:
        for name, server in servers.items():
            startup[name] = server.wait_ready()
        for name, server in servers.items():
            alone = [server.complete(p, MAX_TOKENS) for p in ALONE]
            with ThreadPoolExecutor(len(TOGETHER)) as pool:
                futures = [
                    pool.submit(server.complete, p, MAX_TOKENS) for p in TOGETHER
                ]
                together = [future.result() for future in futures]
            results[name] = dict(zip(ALONE + TOGETHER, alone + together, strict=False))
    finally:
        for server in servers.values():
            server.stop()
    print("\nstart-up (s): " + ", ".join(f"{n} {t:.0f}" for n, t in startup.items()))
    return results


def parity_table(results: dict[str, dict[str, str]]) -> str:
    reference = results["TP1xPP1"]
    names = list(results)
    lines = [
        "| prompt | " + " | ".join(names) + " |",
        "| --- |" + " --- |" * len(names),
    ]
    for prompt, expected in reference.items():
        cells = [repr(expected)] + [
            "equal"
            if results[n][prompt] == expected
            else f"DIFFERS {results[n][prompt]!r}"
            for n in names[1:]
        ]
        lines.append(f"| {prompt[:24]!r} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


@pytest.mark.parametrize("layout", list(LAYOUTS)[1:])
def test_layout_matches_tp1_pp1_token_for_token(completions, layout):
    print("\n" + parity_table(completions))
    assert all(len(text) == MAX_TOKENS for text in completions["TP1xPP1"].values())
    assert completions[layout] == completions["TP1xPP1"]


def test_stage_disagreement_fails_vllm_serve_at_start_up(model_dir, tmp_path):
    """Stage 1 builds its model with another MoE backend, as a node started
    with other flags would: the agreement refuses before any hand-off, and
    ``vllm serve`` exits with the message in its log."""
    server = Server(
        model_dir,
        free_port(),
        LAYOUTS["TP2xPP2 SP (MegaMoE, EP)"],
        env={STAGE1_MOE_BACKEND: "triton"},
        log=tmp_path / "refused.log",
    )
    started = time.monotonic()
    try:
        with pytest.raises(RuntimeError, match="vllm serve exited") as failure:
            server.wait_ready(timeout=300)
    finally:
        server.stop()
    elapsed = time.monotonic() - started
    log = server.log.read_text()
    refusal = [line for line in log.splitlines() if "Pipeline stages disagree" in line]
    print(
        f"\nexit {server.process.returncode} after {elapsed:.0f} s:\n"
        + refusal[0][:1200]
    )
    assert server.process.returncode != 0
    assert "sequence_parallel: stage 0=True, stage 1=False" in refusal[0]
    assert "Pipeline stages disagree" in str(failure.value)
