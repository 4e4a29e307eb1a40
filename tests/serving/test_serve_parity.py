# SPDX-License-Identifier: Apache-2.0
"""Greedy completions through ``vllm serve``: the sequence-parallel layout at
TP2xPP2 (MegaMoE, EP; Rust frontend) against TP1xPP1 and the replicated
layout (another MoE backend at TP2xPP2; Python frontend), token for token,
as vLLM's tests/distributed/test_pipeline_parallel.py compares parallel
settings; and a start-up the stages' agreement refuses."""

from __future__ import annotations

import contextlib
import http.client
import json
import re
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from tests.serving.conftest import LAYOUTS, REFERENCE, REFUSED, SP_PP3, free_port
from tests.serving.worker import EXTRA_ROW_MARK
from tests.sppp_testbed import k3_checkpoint
from tests.sppp_testbed.bases import only_from_0_34

# Prompt lengths 1 (< TP), 3 and 11 (not divisible by TP), 44; every decode
# step of a lone request dispatches a single token.
ALONE = ["a", "abc", "Hello world", "The quick brown fox jumps over the lazy dog."]
# Sent at once: the scheduler mixes prefills with decodes of the others.
TOGETHER = ["x" * 5, "Question: 2 + 3 = ?", "q", "0123456789" * 3, "Mixed batch."]
MAX_TOKENS = 8
# Every layout that starts, against TP1xPP1.
# (The layouts that start alone are compared with their own reference by
# test_serve_drafter.py.)
COMPARED = [
    name
    for name, layout in LAYOUTS.items()
    if layout.starts and not layout.alone and name != REFERENCE
]


def each(layouts: list[str]) -> list:
    """``layouts`` as parameters, each marked with what it asks ``servers``."""
    return [
        pytest.param(name, marks=pytest.mark.layouts(REFERENCE, name), id=name)
        for name in layouts
    ]


@pytest.fixture(scope="package")
def completions(servers):
    """Each layout's completions and chat answers, asked once per run."""
    found: dict[str, dict[str, dict[str, str]]] = {}

    def of(name: str) -> dict[str, dict[str, str]]:
        if name not in found:
            server = servers[name]
            alone = [server.complete(p, MAX_TOKENS) for p in ALONE]
            with ThreadPoolExecutor(len(TOGETHER)) as pool:
                together = list(
                    pool.map(lambda p: server.complete(p, MAX_TOKENS), TOGETHER)
                )
                chat = list(pool.map(lambda p: server.chat(p, MAX_TOKENS), ALONE))
            prompts = ALONE + TOGETHER
            found[name] = {
                "completions": dict(zip(prompts, alone + together, strict=True)),
                "chat": dict(zip(ALONE, chat, strict=True)),
            }
        return found[name]

    return of


def parity_table(reference: dict[str, str], results: dict[str, str]) -> str:
    lines = ["| prompt | TP1xPP1 | layout |", "| --- | --- | --- |"]
    for prompt, expected in reference.items():
        got = results[prompt]
        cell = "equal" if got == expected else f"DIFFERS {got!r}"
        lines.append(f"| {prompt[:24]!r} | {expected!r} | {cell} |")
    return "\n".join(lines)


@pytest.mark.parametrize("layout", each(COMPARED))
def test_layout_matches_tp1_pp1_token_for_token(completions, layout):
    reference = completions(REFERENCE)["completions"]
    results = completions(layout)["completions"]
    print(f"\n{layout} ({LAYOUTS[layout].frontend} frontend), /v1/completions:")
    print(parity_table(reference, results))
    assert all(len(text) == MAX_TOKENS for text in reference.values())
    assert results == reference


@pytest.mark.parametrize("layout", each(COMPARED))
def test_chat_completions_match_tp1_pp1(completions, layout):
    """``/v1/chat/completions`` renders the chat template, then runs the
    same engine path: the rendered prompt's completion, on every layout."""
    reference = completions(REFERENCE)
    results = completions(layout)["chat"]
    print(f"\n{layout} ({LAYOUTS[layout].frontend} frontend), /v1/chat/completions:")
    print(parity_table(reference["chat"], results))
    assert results == reference["chat"]
    assert len(set(results.values())) > 1  # not one constant answer


@pytest.mark.layouts(REFERENCE)
def test_chat_answer_is_the_rendered_prompts_completion(servers, completions):
    server = servers[REFERENCE]
    chat = completions(REFERENCE)["chat"]
    assert {p: server.complete(p + "\n", MAX_TOKENS) for p in ALONE} == chat


@pytest.mark.layouts(REFUSED)
def test_stage_disagreement_fails_vllm_serve_at_start_up(servers):
    """Stage 1 builds its model with another MoE backend, as a node started
    with other flags would: the agreement refuses before any hand-off, and
    ``vllm serve`` exits with the message in its log."""
    server = servers.start(REFUSED)
    with pytest.raises(RuntimeError, match="vllm serve exited") as failure:
        server.wait_ready(timeout=300)
    elapsed = server.seconds_to_exit()
    log = server.log.read_text()
    refusal = [line for line in log.splitlines() if "Pipeline stages disagree" in line]
    assert refusal, (
        f"vllm serve exited {server.process.returncode} after {elapsed:.0f} s "
        "without the agreement's message; its errors:\n" + "\n".join(server.errors())
    )
    print(
        f"\nexit {server.process.returncode} after {elapsed:.0f} s:\n"
        + refusal[0][:1200]
    )
    assert server.process.returncode != 0
    assert elapsed < 180  # a refusal, not gloo's 30-minute wait
    assert "sequence_parallel: stage 0=True, stage 1=False" in refusal[0]
    assert "Pipeline stages disagree" in str(failure.value)


@pytest.mark.parametrize("name", each(COMPARED))
def test_each_layout_is_served_by_its_frontend(servers, name):
    """The frontend is chosen at run time (``VLLM_USE_RUST_FRONTEND``), in a
    fork of a process that imported vLLM without it."""
    launched = "Launching Rust frontend" in servers[name].log.read_text()
    assert launched == (LAYOUTS[name].frontend == "rust")


def rank_count(args: list[str]) -> int:
    sizes = {"-tp": 1, "-pp": 1}
    for flag in sizes:
        if flag in args:
            sizes[flag] = int(args[args.index(flag) + 1])
    return sizes["-tp"] * sizes["-pp"]


@only_from_0_34("vLLM 0.34.0's servers run Model Runner V2; 0.33.0's the stand-in")
@pytest.mark.parametrize("name", each(COMPARED))
def test_every_rank_runs_vllms_model_runner_v2(servers, name):
    """Each rank's model runner is vLLM's ``CPUModelRunner`` (Model Runner
    V2, tests/serving/v2_runner.py): its own ``load_model`` logged the load,
    and the model it built runs sequence parallel exactly where the layout
    asks for it."""
    args = LAYOUTS[name].args
    log = servers[name].log.read_text()
    loads = re.findall(
        r"\((Worker\S*) pid=\d+\).*\[model_runner\.py:\d+\] Model loading", log
    )
    built = re.findall(
        r"V2 runner: PP stage \d+, (\w+) built by vLLM, .*sequence parallel: (\w+)",
        log,
    )
    assert len(set(loads)) == rank_count(args), loads
    sp = "deep_gemm_mega_moe" in args
    assert built == [("KimiK3ForConditionalGeneration", str(sp))] * rank_count(args)


@only_from_0_34("vLLM 0.34.0's servers serve the Kimi K3 checkpoint")
@pytest.mark.layouts(REFERENCE, *COMPARED)
def test_the_servers_serve_every_architecture_name_of_kimi_k3(servers):
    """The served checkpoints carry the architecture names of K3 and K3.1
    checkpoints (each that vLLM's registry maps), one or the other per
    layout; vLLM resolves each layout's name, and every name is served by a
    layout whose parity the tests above compare."""
    served = {}
    for name, layout in LAYOUTS.items():
        if not layout.starts or layout.alone:  # alone: K3's name, tests last
            continue
        log = servers[name].log.read_text()
        resolved = re.findall(r"Resolved architecture: (\w+)", log)
        served[name] = resolved[0]
        assert served[name] == (layout.architecture or k3_checkpoint.ARCHITECTURES[0])
    print("\n" + "\n".join(f"{n}: {a}" for n, a in served.items()))
    assert set(served.values()) == set(k3_checkpoint.ARCHITECTURES)


@pytest.fixture(scope="module")
def recomputed(model_dir):
    """Greedy completions of the served class with no runner, no KV cache
    and no paged attention: ``KimiK3ForConditionalGeneration`` built by
    vLLM's ``initialize_model`` from the served checkpoint's config, with the
    test bed's stand-ins (attention over the whole sequence,
    ``tiny_k3.SequenceMixer``) and the servers' seeded weights, recomputed
    over each prompt and every token generated so far, in a one-rank gloo
    world of this process."""
    from tests.serving.k3_standins import SEED
    from tests.sppp_testbed import loaded_stages, tiny_k3
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import (
        init_distributed_environment,
        initialize_model_parallel,
        model_parallel_is_initialized,
    )
    from vllm.model_executor.model_loader.utils import initialize_model

    if not model_parallel_is_initialized():
        with set_current_vllm_config(VllmConfig()):
            init_distributed_environment(
                world_size=1,
                rank=0,
                local_rank=0,
                distributed_init_method=f"tcp://127.0.0.1:{free_port()}",
                backend="gloo",
            )
            initialize_model_parallel(1, 1)
    config = loaded_stages.engine_config(str(model_dir), None, 1, 1, sp=False)
    dtype = torch.get_default_dtype()
    with set_current_vllm_config(config), tiny_k3.stand_ins(), torch.no_grad():
        torch.set_default_dtype(tiny_k3.DTYPE)
        try:
            model = initialize_model(vllm_config=config)
            tiny_k3.load_seeded_weights(model, SEED)
        finally:
            torch.set_default_dtype(dtype)

        def complete(prompt: str) -> str:
            ids = [ord(c) for c in prompt]  # the tests' character tokenizer
            for _ in range(MAX_TOKENS):
                hidden = model(torch.tensor(ids), torch.arange(len(ids)), None)
                logits = model.compute_logits(hidden[-1:])
                ids.append(int(torch.argmax(logits[0])))
            return "".join(map(chr, ids[len(prompt) :]))

        return {prompt: complete(prompt) for prompt in ALONE + TOGETHER}


@only_from_0_34("vLLM 0.34.0's servers run Model Runner V2; 0.33.0's the stand-in")
@pytest.mark.layouts(REFERENCE)
def test_v2_runner_answers_as_the_model_recomputed_over_each_sequence(
    completions, recomputed
):
    """TP1xPP1 through vLLM's V2 runner (its input batch, block tables, slot
    mappings and sampler on the stand-in kernels, attention reading each
    request's history from the paged KV cache, prefills mixed with decodes)
    gives the tokens of the model recomputed without any of them: parity
    with TP1xPP1 is then parity with the model, not with a shared mistake."""
    served = completions(REFERENCE)["completions"]
    print("\nTP1xPP1 through the V2 runner, against the recomputed model:")
    print(parity_table(recomputed, served))
    assert served == recomputed


# Last in this file: the refusal stops the TP2xPP3 server's engine.
@only_from_0_34("the row check of vLLM 0.34.0's V2 runner in a server")
@pytest.mark.layouts(SP_PP3)
def test_runner_refuses_a_hand_off_of_other_rows_before_the_copy(servers):
    """Stage 0 hands on a row more than its shard (3 rows for a step of 3
    tokens at TP2, whose shard is 2) for a prompt that begins with
    ``EXTRA_ROW_MARK``: stage 1's runner refuses the hand-off before it
    copies a row, naming both counts, and the request gets no completion
    instead of one made of the rows. (A refusal on a middle stage leaves the
    request unanswered: the last stage waits for a send that never comes.)"""
    server = servers[SP_PP3]
    answers: list[object] = []
    # A connection of the test's own: the request never gets an answer, and
    # the server stops only once no connection is open (uvicorn waits 30 s
    # for one, then is killed), so the test hangs up when it is done.
    host, port = server.url.removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=60)
    body = json.dumps(
        {
            "model": server.model,
            "prompt": EXTRA_ROW_MARK + "bc",
            "max_tokens": 2,
            "temperature": 0,
        }
    )

    def ask() -> None:
        try:
            connection.request(
                "POST", "/v1/completions", body, {"Content-Type": "application/json"}
            )
            answer = connection.getresponse()
            text = answer.read().decode()
            answers.append(text if answer.status == 200 else RuntimeError(text))
        except (OSError, http.client.HTTPException) as error:  # no answer
            answers.append(error)

    asking = threading.Thread(target=ask, daemon=True)
    asking.start()
    refusal = (
        "Received PP intermediate tensors of 3 rows for a step of 3 tokens "
        "where this stage expects 2"
    )
    try:
        deadline = time.monotonic() + 60
        while refusal not in server.log.read_text() and time.monotonic() < deadline:
            time.sleep(0.5)
        assert refusal in server.log.read_text()
        time.sleep(1)
        assert not any(isinstance(answer, str) for answer in answers), answers
    finally:
        with contextlib.suppress(OSError, AttributeError):
            connection.sock.shutdown(socket.SHUT_RDWR)
        asking.join(10)
        connection.close()
