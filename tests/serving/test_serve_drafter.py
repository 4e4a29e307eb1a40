# SPDX-License-Identifier: Apache-2.0
"""An EAGLE-3 drafter through ``vllm serve``: vLLM's own V2 speculator
(``EagleSpeculator``) on the last PP stage of the TP2xPP3 sequence-parallel
server, reading the target's aux hidden states, which cross both PP
boundaries as SP shards (stage 0's tap relayed by the middle stage's runner,
``PPHandler.relay_aux_hidden_states``), against the same drafter at TP1xPP1.

Greedy verification makes the completions the target's whatever the drafter
proposes, so token parity cannot see a wrong aux row. The drafts can: they
are a function of the aux states (``combine_hidden_states`` of the taps is
the drafter's first input), so each request's verified drafts, step by step,
and vLLM's own spec-decode counters (drafts, draft tokens, accepted tokens
per position) must equal TP1xPP1's; and on each server the accepted drafts
must be those the completion confirms. The drafter is tiny and seeded alike
on every rank (tests/serving/eagle3.py), with a few weights set so that some
of its drafts are accepted (10 of 124 at this writing).

Every test runs once per drafter method Kimi K3 deploys at PP > 1
(``DRAFTER_LAYOUTS``): EAGLE-3, Kimi K3's MTP layer and its DSpark drafter
(``K3DSparkModel``, which reads EAGLE-3's taps), each at TP2xPP3 SP against
itself at TP1xPP1."""

from __future__ import annotations

import json
import re
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.serving.conftest import DRAFTER_LAYOUTS
from tests.serving.eagle3 import DRAFTS_LOG, METHODS, NUM_SPECULATIVE_TOKENS, RELAY_LOG
from tests.sppp_testbed.bases import only_from_0_34

pytestmark = only_from_0_34("vLLM 0.34.0's V2 runner and speculator serve the drafter")

# Sent one at a time: 1 token (< TP), 3, 7 and 23 (not divisible by TP);
# each decode step then runs 1 + 2 draft tokens, 3 rows, odd as well.
ALONE = ["z", "xyz", "Seven!!", "Relay the taps, please."]
# Sent at once: prefills mixed with decodes of the others.
TOGETHER = ["Draft", "k" * 9, "Aux states cross stages.", "?!"]
MAX_TOKENS = 10
REFERENCE, PP3 = "reference", "TP2xPP3"


def spec_decode_counters(url: str) -> dict[str, float]:
    """vLLM's spec-decode counters from ``/metrics``, by name and position."""
    with urllib.request.urlopen(url + "/metrics", timeout=30) as response:
        text = response.read().decode()
    counters = {}
    for line in text.splitlines():
        match = re.match(r"(vllm:spec_decode_\w+_total)(\{[^}]*\})? (\S+)$", line)
        if match:
            position = re.search(r'position="(\d+)"', match.group(2) or "")
            name = match.group(1) + (f"[{position.group(1)}]" if position else "")
            counters[name] = counters.get(name, 0.0) + float(match.group(3))
    return counters


def logged_drafts(lines: list[str]) -> dict[str, list[list[int]]]:
    """Each request's drafts, step by step, by prompt (tests/serving/eagle3.py
    logs them on the last stage's first TP rank)."""
    drafts: dict[str, list[list[int]]] = {}
    for line in lines:
        if DRAFTS_LOG in line:
            record = json.loads(line.split(DRAFTS_LOG, 1)[1])
            drafts.setdefault(record["prompt"], []).append(record["drafts"])
    return drafts


@pytest.fixture(
    scope="module",
    params=[
        pytest.param(m, marks=pytest.mark.layouts(*DRAFTER_LAYOUTS[m]), id=m)
        for m in METHODS
    ],
)
def served(servers, request):
    """Per drafter method, for its TP1xPP1 reference and its TP2xPP3 SP
    layout: completions, each request's drafts and the counters' increase
    over these requests."""
    found = {"method": request.param}
    for role, name in zip(
        (REFERENCE, PP3), DRAFTER_LAYOUTS[request.param], strict=True
    ):
        server = servers[name]
        before = spec_decode_counters(server.url)
        start = len(server.log.read_text(errors="replace").splitlines())
        texts = [server.complete(prompt, MAX_TOKENS) for prompt in ALONE]
        with ThreadPoolExecutor(len(TOGETHER)) as pool:
            texts += pool.map(server.complete, TOGETHER, [MAX_TOKENS] * len(TOGETHER))
        after = spec_decode_counters(server.url)
        lines = server.log.read_text(errors="replace").splitlines()
        found[role] = {
            "completions": dict(zip(ALONE + TOGETHER, texts, strict=True)),
            "drafts": logged_drafts(lines[start:]),
            "counters": {k: after[k] - before.get(k, 0.0) for k in after},
            "log": lines,
        }
    return found


def test_completions_match_tp1_pp1_token_for_token(served):
    reference = served[REFERENCE]["completions"]
    assert all(len(text) == MAX_TOKENS for text in reference.values())
    assert served[PP3]["completions"] == reference


def test_the_middle_stage_relays_stage_0s_tap_on_every_tp_rank(served):
    """The relay runs where the drafter reads aux states: with EAGLE-3 and
    DSpark (both tap layers 1, 2 and 4) the middle stage's PP handler relays
    the slot of the tap stage 0 sends (layer 1), on both TP ranks; the first
    and last stages relay nothing (vLLM's ``aux_hidden_state_relay_keys``).
    MTP reads no aux state: no stage relays."""
    relays = sorted(
        re.findall(rf"{RELAY_LOG} (\d) relays (\[.*\])", "\n".join(served[PP3]["log"]))
    )
    reads_aux = served["method"] in ("eagle3", "dspark")
    middle = "['aux_hidden_states_0']" if reads_aux else "[]"
    assert relays == [
        ("0", "[]"),
        ("0", "[]"),
        ("1", middle),
        ("1", middle),
        ("2", "[]"),
        ("2", "[]"),
    ]


def verify(completion: str, steps: list[list[int]]) -> tuple[list[int], int, list[int]]:
    """Greedy verification recounted from outside the server: walking a
    request's drafts, step by step, along its completion (one character a
    token; the prefill samples the first), each step accepts its leading
    drafts that equal the tokens that follow and samples one token more.
    Returns the drafts accepted per draft position and how many steps' drafts
    were verified before the completion ended (the drafts of the step that
    sampled the last token, and of a step async scheduling may run past it,
    whose output is dropped, are never verified). Also returns, per draft
    position, the drafts that reach past the completion's end after drafts
    that matched: vLLM may have accepted them (and counted them) before
    ``max_tokens`` cut the completion."""
    tokens = [ord(c) for c in completion]
    accepted = [0] * NUM_SPECULATIVE_TOKENS
    past_end = [0] * NUM_SPECULATIVE_TOKENS
    position, verified = 1, 0
    for drafts in steps:
        if position >= len(tokens):
            break
        k = 0
        while k < len(drafts) and position + k < len(tokens):
            if drafts[k] != tokens[position + k]:
                break
            accepted[k] += 1
            k += 1
        if k < len(drafts) and position + k == len(tokens):
            for j in range(k, len(drafts)):
                past_end[j] += 1
        position += k + 1
        verified += 1
    return accepted, verified, past_end


def test_drafts_match_tp1_pp1_request_by_request(served):
    """Each request's verified drafts, step by step, equal TP1xPP1's: the
    drafter read the same aux rows, the relayed tap among them. (Greedy
    verification gives both servers the same completions whatever the
    drafts; a wrong aux row shows here.)"""
    reference = served[REFERENCE]
    drafts = served[PP3]["drafts"]
    assert set(reference["drafts"]) == set(drafts) == set(ALONE + TOGETHER)
    compared = []
    for prompt, steps in reference["drafts"].items():
        _, verified, _ = verify(reference["completions"][prompt], steps)
        print(f"\n{prompt!r}: drafts of {verified} steps {steps[:verified]}")
        assert drafts[prompt][:verified] == steps[:verified], prompt
        compared += [token for step in steps[:verified] for token in step]
    assert -1 not in compared
    assert len(compared) >= NUM_SPECULATIVE_TOKENS * len(ALONE + TOGETHER) * 3
    assert len(set(compared)) > 10  # drafts, not one constant token


def test_spec_decode_counters_match_tp1_pp1(served):
    """vLLM's own counters (``/metrics``): as many drafts, draft tokens and
    accepted tokens per position as at TP1xPP1, some of them accepted."""
    reference = served[REFERENCE]["counters"]
    print(f"\nspec-decode counters over these requests: {reference}")
    assert reference["vllm:spec_decode_num_drafts_total"] > 0
    assert reference["vllm:spec_decode_num_accepted_tokens_total"] > 0
    assert served[PP3]["counters"] == reference


def test_accepted_drafts_are_those_the_completions_confirm(served):
    """On both servers, independently of the rejection sampler's stand-in
    kernels: the drafts that match the completion (which the parity tests
    tie to the model recomputed over each sequence) are the ones vLLM's
    counters report accepted, position by position (plus at most the drafts
    that reach past a completion's end, which ``max_tokens`` cut); each
    request drafted in every step it took (and at most one more: async
    scheduling may run a step past the last token)."""
    for name in (REFERENCE, PP3):
        accepted = [0] * NUM_SPECULATIVE_TOKENS
        past_end = [0] * NUM_SPECULATIVE_TOKENS
        for prompt, completion in served[name]["completions"].items():
            steps = served[name]["drafts"][prompt]
            per_position, verified, beyond = verify(completion, steps)
            accepted = [a + b for a, b in zip(accepted, per_position, strict=True)]
            past_end = [a + b for a, b in zip(past_end, beyond, strict=True)]
            assert verified + 1 <= len(steps) <= verified + 2, (name, prompt)
        counters = served[name]["counters"]
        reported = [
            counters[f"vllm:spec_decode_num_accepted_tokens_per_pos_total[{i}]"]
            for i in range(NUM_SPECULATIVE_TOKENS)
        ]
        print(f"\n{name}: recounted {accepted}, past the end {past_end}")
        assert all(
            a <= r <= a + p
            for a, r, p in zip(accepted, reported, past_end, strict=True)
        ), (name, accepted, reported, past_end)
