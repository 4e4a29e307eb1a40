# SPDX-License-Identifier: Apache-2.0
"""PP stages started with settings that would break their hand-off are
refused at start-up on every stage, showing each stage's values and the
options to align, instead of hanging or mixing rows at the first step; any
other difference starts, with a warning on every stage. Real ranks, the real
PP group over gloo, and per stage the tiny Kimi K3 built from that stage's own
config, as a headless node builds it from its own command line, with the
runners' own CUDA graph dispatch (the V2 ``CudaGraphManager``; on vLLM 0.33.0
also the legacy runner's ``CudagraphDispatcher``) built from that config.
vLLM 0.34.0 has Model Runner V2 only: there every stage runs it, its graph
sizes resolved by vLLM's own ``_split_cudagraph_capture_sizes`` (prefill
token sizes, decode request sizes)."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import types

import pytest
import torch

from tests.distributed.conftest import topologies
from tests.sppp_testbed.bases import HAS_LEGACY_RUNNER, only_from_0_34, only_on_0_33
from tests.sppp_testbed.tiny_k3 import build_model, scenario_config, stand_ins
from tests.sppp_testbed.warm_up import run_warm_up
from vllm.config import (
    CompilationMode,
    CUDAGraphMode,
    LoRAConfig,
    set_current_vllm_config,
)
from vllm.distributed.parallel_state import get_pp_group, get_tp_group
from vllm.model_executor.models.interfaces import (
    EagleModelMixin,
    get_pp_all_gather_overrides,
)
from vllm.platforms import current_platform
from vllm.v1.worker import pp_hand_off_agreement
from vllm.v1.worker.gpu.cudagraph_utils import CudaGraphManager
from vllm.v1.worker.gpu.lora_utils import get_lora_capture_cases
from vllm.v1.worker.pp_hand_off_agreement import PPStageCheck

if HAS_LEGACY_RUNNER:
    from vllm.v1.cudagraph_dispatcher import CudagraphDispatcher
    from vllm.v1.worker.pp_hand_off_agreement import (
        check_aux_layers_on_the_last_stage,
    )

# The runners this vLLM has: 0.34.0 deleted the legacy one.
RUNNERS = ("legacy", "v2") if HAS_LEGACY_RUNNER else ("v2",)

# A start-up check answers at once: far inside the pool's bound on a hang.
BOUND_S = 30.0
REFUSED = "disagree on their hand-off and would hang or mix rows"
# Stage 0 runs a 3-token decode as it comes, stage 1 pads it to its graph of 4.
PADS_3_TO_4 = (
    "batch_padding: a batch of 3 tokens (a uniform decode of 1 per request) is "
    "dispatched as 3 tokens on stage 0, which sends 3 rows, and as 4 on stage 1, "
    "which expects at least 4"
)


@dataclasses.dataclass(frozen=True)
class StageFlags:
    """What one node's command line sets, as far as the hand-off goes, and
    the CUDA graph mode its runner resolves."""

    moe_backend: str = "deep_gemm_mega_moe"
    aux_layers: tuple[int, ...] = (0, 2, 3)
    enforce_eager: bool = False
    capture_sizes: tuple[int, ...] = (1, 2, 4, 8)
    cudagraph_mode: str = "FULL_DECODE_ONLY"
    # What the runner resolves where its attention backends or a drafter
    # lower the flags' mode; None: the flags' mode.
    resolved_mode: str | None = None
    # "legacy" (0.33.0), "v2", or "none": a runner without CUDA graph
    # dispatch. The release's default runner unless set.
    runner: str = RUNNERS[0]
    # The V2 runner's decode graphs take any mix of query lengths.
    varlen_decode: bool = False
    # The V2 runner's decode query length where its model state samples
    # other than one token per step; None: 1 + num_speculative_tokens.
    decode_query_len: int | None = None
    enable_jit_warmup: bool = False
    num_speculative_tokens: int = 0
    # --max-loras (0: no LoRA), and whether graphs are also captured for
    # batches without LoRA (cudagraph_specialize_lora).
    max_loras: int = 0
    lora_free_graphs: bool = True
    # False: the model captures its taps from what it received and relays
    # none across stages, as Qwen3-MoE and most EAGLE-3 targets in 0.33.0.
    relays_aux: bool = True
    # A model that declares no hand-off and has no EAGLE taps, as most
    # models of 0.33.0.
    plain_model: bool = False
    # The stage cannot compute its rows (a planted error).
    broken: bool = False
    # The stage cannot compute its settings (a planted error).
    broken_settings: bool = False
    # The worker's all_gather_tensors were taken before the aux layers were
    # set (a stale declaration): its transport would treat aux keys as
    # replicas.
    stale_declaration: bool = False
    # The stage's runner dispatches with a signature of its own (an
    # out-of-tree dispatcher): its padding cannot be asked.
    foreign_dispatch: bool = False
    # vLLM 0.34.0's extensible KV cache (on by default on CUDA): kernel
    # warm-up and KV-sizing steps even without JIT warm-up.
    enable_extensible_kv_cache: bool = False
    # --max-num-batched-tokens, --max-num-seqs, --max-model-len,
    # --max-logprobs; None: the test bed's.
    max_num_batched_tokens: int | None = None
    max_num_seqs: int | None = None
    max_model_len: int | None = None
    max_logprobs: int | None = None
    # Whether the model attends with MLA (Kimi K3 does).
    use_mla: bool = True


SP = StageFlags()
NO_SP = dataclasses.replace(SP, moe_backend="auto")


@contextlib.contextmanager
def runner_kind(flags: StageFlags):
    """What ``VllmConfig.use_v2_model_runner`` answers on this node (0.33.0;
    0.34.0 runs V2 only and has no such switch)."""
    if not HAS_LEGACY_RUNNER:
        yield
        return
    saved = os.environ.get("VLLM_USE_V2_MODEL_RUNNER")
    os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1" if flags.runner == "v2" else "0"
    try:
        yield
    finally:
        if saved is None:
            del os.environ["VLLM_USE_V2_MODEL_RUNNER"]
        else:
            os.environ["VLLM_USE_V2_MODEL_RUNNER"] = saved


def relays_aux(model: torch.nn.Module, relays: bool) -> None:
    for module in model.modules():
        if isinstance(module, EagleModelMixin):
            module.supports_aux_hidden_states_over_pp = relays


def stage_runner(config, flags: StageFlags) -> types.SimpleNamespace:
    """The runner's CUDA graph dispatch, as each runner builds it once its
    attention backends resolved the mode (eager resolves to NONE)."""
    if flags.runner == "none":
        return types.SimpleNamespace()
    compilation = config.compilation_config
    mode = compilation.cudagraph_mode
    if flags.resolved_mode is not None:
        mode = CUDAGraphMode[flags.resolved_mode]
    if flags.enforce_eager:
        mode = CUDAGraphMode.NONE
    if mode.has_piecewise_cudagraphs():
        # What piecewise graphs need, set after the model is built: nothing
        # here is compiled.
        compilation.mode = CompilationMode.VLLM_COMPILE
        compilation.splitting_ops = list(compilation._attention_ops)
    if flags.runner == "v2":
        decode_query_len = flags.decode_query_len or 1 + flags.num_speculative_tokens
        if HAS_LEGACY_RUNNER:
            query_lens = {"decode_query_len": decode_query_len}
        else:
            # 0.34.0: each uniform decode query length and its most requests,
            # and vLLM's own split of the capture sizes into prefill token
            # and decode request sizes (VllmConfig resolves them from the
            # target's query lengths, as it would for these flags on a GPU).
            target = config.get_decode_cudagraph_query_lens(decode_query_len)
            config._split_cudagraph_capture_sizes(True, target)
            query_lens = {"decode_query_lens": target}
        # No graph pool on the CPU; dispatch never touches it.
        saved = current_platform.get_global_graph_pool
        current_platform.get_global_graph_pool = lambda: None
        try:
            manager = CudaGraphManager(
                config,
                torch.device("cpu"),
                mode,
                **query_lens,
                # The LoRA counts the V2 runner captures graphs for.
                lora_capture_cases=get_lora_capture_cases(
                    config.lora_config, compilation
                ),
                varlen_decode=flags.varlen_decode,
            )
        finally:
            current_platform.get_global_graph_pool = saved
        return types.SimpleNamespace(cudagraph_manager=manager)
    dispatcher = CudagraphDispatcher(config)
    dispatcher.initialize_cudagraph_keys(mode, 1 + flags.num_speculative_tokens)
    return types.SimpleNamespace(cudagraph_dispatcher=dispatcher)


def start_stage(flags_by_stage: list[StageFlags]) -> tuple[str | None, list[str]]:
    """Build this stage's model and runner dispatch from its flags and run
    the start-up check: its error, if any, and the warnings it logged."""
    flags = flags_by_stage[get_pp_group().rank_in_group]
    config = scenario_config(
        get_tp_group().world_size, get_pp_group().world_size, sp=True
    )
    config.kernel_config.moe_backend = flags.moe_backend
    config.kernel_config.enable_jit_warmup = flags.enable_jit_warmup
    config.model_config.enforce_eager = flags.enforce_eager
    if flags.enable_extensible_kv_cache:
        config.cache_config.enable_extensible_kv_cache = True
    if flags.max_num_batched_tokens is not None:
        config.scheduler_config.max_num_batched_tokens = flags.max_num_batched_tokens
    if flags.max_num_seqs is not None:
        config.scheduler_config.max_num_seqs = flags.max_num_seqs
    if flags.max_model_len is not None:
        config.model_config.max_model_len = flags.max_model_len
    if flags.max_logprobs is not None:
        config.model_config.max_logprobs = flags.max_logprobs
    config.model_config.use_mla = flags.use_mla
    compilation = config.compilation_config
    compilation.cudagraph_capture_sizes = list(flags.capture_sizes)
    compilation.max_cudagraph_capture_size = max(flags.capture_sizes)
    compilation.cudagraph_mode = CUDAGraphMode[flags.cudagraph_mode]
    warnings: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: warnings.append(record.getMessage())
    pp_hand_off_agreement.logger.addHandler(handler)
    try:
        with (
            set_current_vllm_config(config),
            stand_ins(),
            torch.no_grad(),
            runner_kind(flags),
        ):
            if flags.plain_model:
                model = torch.nn.Linear(1, 1)
                all_gather_tensors = get_pp_all_gather_overrides(model)
            else:
                model = build_model(config)
                if flags.stale_declaration:
                    all_gather_tensors = get_pp_all_gather_overrides(model)
                model._set_aux_hidden_state_layers(flags.aux_layers)
                relays_aux(model, flags.relays_aux)
                if not flags.stale_declaration:
                    # What the worker takes once the runner has loaded it.
                    all_gather_tensors = get_pp_all_gather_overrides(model)
            if flags.broken:

                def broken(num_tokens: int) -> int:
                    raise RuntimeError("planted: this stage cannot answer")

                model.get_pp_intermediate_tensor_num_rows = broken
            if flags.broken_settings:

                def modules():
                    raise RuntimeError("planted: this stage cannot answer")

                model.modules = modules
            if flags.num_speculative_tokens:
                # Only the count matters to the hand-off; no drafter is built
                # here. K3's drafter is its one-module MTP (on 0.34.0 its
                # one-token draft decodes get graphs of their own).
                object.__setattr__(
                    config,
                    "speculative_config",
                    types.SimpleNamespace(
                        num_speculative_tokens=flags.num_speculative_tokens,
                        uses_dynamic_speculative_decoding=lambda: False,
                        method="mtp",
                        use_multi_module_mtp=lambda: False,
                        use_gemma4_mtp=lambda: False,
                        enable_adaptive_verification=False,
                        max_num_new_slots_for_drafting=0,
                    ),
                )
            if flags.max_loras:
                object.__setattr__(
                    config, "lora_config", LoRAConfig(max_loras=flags.max_loras)
                )
                compilation.cudagraph_specialize_lora = flags.lora_free_graphs
            runner = stage_runner(config, flags)
            if flags.foreign_dispatch:
                foreign = lambda batch_descriptor: None  # noqa: E731
                if flags.runner == "legacy":
                    runner.cudagraph_dispatcher.dispatch = foreign
                else:  # a graph manager of its own, with another signature
                    runner.cudagraph_manager.dispatch = foreign
            try:
                # As the worker runs it: before kernel warm-up, around each
                # warm-up step, and once graphs are captured.
                check = PPStageCheck(config, model, runner, all_gather_tensors)
                if flags.runner == "v2" or not HAS_LEGACY_RUNNER:
                    run_warm_up(
                        config,
                        check.warm_up(lambda scheduler_output: None),
                        check.bounds["max_query_len"],
                    )
                manager = getattr(runner, "cudagraph_manager", None)
                if manager is not None and not flags.enforce_eager:
                    manager._graphs_captured = True  # what capture_model sets
                check.finish()
            except RuntimeError as error:
                cause = f" [cause: {error.__cause__!r}]" if error.__cause__ else ""
                return f"{error}{cause}", warnings
    finally:
        pp_hand_off_agreement.logger.removeHandler(handler)
    return None, warnings


def run_stages(pool, *flags: StageFlags) -> list[tuple[str | None, list[str]]]:
    return pool.run(start_stage, list(flags), timeout=BOUND_S)


def assert_started_everywhere(results, *warned: str) -> None:
    assert [error for error, _ in results] == [None] * len(results), results
    for _, warnings in results:
        if not warned:
            assert warnings == [], warnings
        for part in warned:
            assert any(part in warning for warning in warnings), (part, warnings)


def assert_refused_everywhere(results, *parts: str) -> list[str]:
    errors = [error for error, _ in results]
    assert all(errors), errors
    for error in errors:
        assert REFUSED in error, error
        for part in parts:
            assert part in error, (part, error)
    return errors


# Zero change where no stage is sequence parallel.


@topologies((2, 2))
def test_without_sp_a_last_stage_that_pads_less_starts_with_a_warning(pool):
    """A drafter's attention backends lower the last stage's CUDA graph mode,
    or its node runs eager: it pads no batch further than stage 0 sends, so
    0.33.0 runs this, and so does the series, with a warning on every stage."""
    for last in (
        dataclasses.replace(NO_SP, cudagraph_mode="NONE"),
        dataclasses.replace(NO_SP, enforce_eager=True),
    ):
        assert_started_everywhere(run_stages(pool, NO_SP, last))


@topologies((2, 2))
def test_without_sp_a_later_stage_that_pads_more_is_refused_naming_the_batch(pool):
    """Eager on the first node only: stage 1 pads 3 tokens to 4 and would
    copy 4 rows out of the 3 stage 0 sends, which fails in 0.33.0 too."""
    for first in (
        dataclasses.replace(NO_SP, enforce_eager=True),
        dataclasses.replace(NO_SP, cudagraph_mode="NONE"),
    ):
        assert_refused_everywhere(
            run_stages(pool, first, NO_SP),
            PADS_3_TO_4,
            "--compilation-config, --max-cudagraph-capture-size, --enforce-eager",
        )


@topologies((2, 2))
def test_a_later_stage_that_pads_speculative_decodes_more_is_refused(pool):
    """One draft token on both nodes, eager on the first only: the legacy
    runner's uniform decodes are of 2 tokens per request, and stage 1 pads
    3 such requests to 8 tokens. The check must ask the dispatcher for
    decodes of that length, not of 1 token."""
    spec = dataclasses.replace(NO_SP, num_speculative_tokens=1)
    assert_refused_everywhere(
        run_stages(pool, dataclasses.replace(spec, enforce_eager=True), spec),
        "batch_padding: a batch of 6 tokens (a uniform decode of 2 per "
        "request) is dispatched as 6 tokens on stage 0, which sends 6 rows, "
        "and as 8 on stage 1, which expects at least 8",
    )


@topologies((2, 2))
def test_a_later_stage_that_pads_only_a_single_token_is_refused(pool):
    """Capture sizes [1, 2, 4, 8] on node 1 and [2, 4, 8] on node 2 differ in
    one batch only, the smallest: stage 1 pads a one-token decode to 2."""
    last = dataclasses.replace(NO_SP, capture_sizes=(2, 4, 8))
    assert_refused_everywhere(
        run_stages(pool, NO_SP, last),
        "batch_padding: a batch of 1 tokens (a uniform decode of 1 per "
        "request) is dispatched as 1 tokens on stage 0, which sends 1 rows, "
        "and as 2 on stage 1, which expects at least 2",
        "stage 0: FULL_DECODE_ONLY, sizes [1, 2, 4, 8], max_num_seqs 128; "
        "stage 1: FULL_DECODE_ONLY, sizes [2, 4, 8], max_num_seqs 128",
    )


@only_on_0_33("the legacy dispatcher's graphs for LoRA batches only")
@topologies((2, 2))
def test_a_later_stage_that_pads_only_batches_with_loras_is_refused(pool):
    """With LoRA graphs only (cudagraph_specialize_lora off) stage 1 runs
    batches without LoRA eagerly, as the eager stage 0 does, and pads those
    with LoRAs: the check asks for each batch's LoRA count as the runner
    dispatches it, and names the first count that pads differently."""
    lora = dataclasses.replace(NO_SP, max_loras=1, lora_free_graphs=False)
    assert_refused_everywhere(
        run_stages(pool, dataclasses.replace(lora, enforce_eager=True), lora),
        "batch_padding: a batch of 3 tokens (a uniform decode of 1 per "
        "request, 1 LoRA(s)) is dispatched as 3 tokens on stage 0, which "
        "sends 3 rows, and as 4 on stage 1, which expects at least 4",
    )
    assert_started_everywhere(run_stages(pool, lora, lora))


@topologies((2, 2))
def test_v2_lora_graphs_pad_batches_with_and_without_loras(pool):
    """Model Runner V2 captures graphs for batches without LoRA too (its LoRA
    cases always hold 0), so next to an eager stage the first batch that
    pads differently has no LoRA; LoRA counts above the captured cases pad
    as the largest (dispatch's map), the same on every stage."""
    lora = dataclasses.replace(NO_SP, runner="v2", max_loras=2, lora_free_graphs=False)
    assert_refused_everywhere(
        run_stages(pool, dataclasses.replace(lora, enforce_eager=True), lora),
        PADS_3_TO_4,
    )
    specialized = dataclasses.replace(lora, lora_free_graphs=True)
    assert_started_everywhere(run_stages(pool, specialized, lora))


@only_from_0_34("the V2 manager's LoRA cases, which pad every LoRA count alike")
@topologies((2, 2))
def test_v2_a_later_stage_that_pads_only_batches_with_loras_is_refused(pool):
    """A V2 stage without LoRA has no graph for a batch with LoRAs and runs
    it as it comes; a later stage with --max-loras 1 pads it (its one count
    maps to a captured LoRA case), while batches without LoRA pad alike:
    the check asks for the one LoRA count there is."""
    v2 = dataclasses.replace(NO_SP, runner="v2")
    assert_refused_everywhere(
        run_stages(pool, v2, dataclasses.replace(v2, max_loras=1)),
        "batch_padding: a batch of 3 tokens (a uniform decode of 1 per "
        "request, 1 LoRA(s)) is dispatched as 3 tokens on stage 0, which "
        "sends 3 rows, and as 4 on stage 1, which expects at least 4",
    )


@topologies((2, 2))
def test_batches_just_below_the_largest_graph_are_compared(pool):
    """Stage 0 also captured 7 tokens, stage 1 pads 7 to its graph of 8:
    every other batch pads alike, so only the batch one below the largest
    capture size of all stages shows the difference."""
    assert_refused_everywhere(
        run_stages(
            pool,
            dataclasses.replace(NO_SP, capture_sizes=(1, 2, 4, 6, 7, 8)),
            dataclasses.replace(NO_SP, capture_sizes=(1, 2, 4, 6, 8)),
        ),
        "batch_padding: a batch of 7 tokens (a uniform decode of 1 per request) "
        "is dispatched as 7 tokens on stage 0, which sends 7 rows, and as 8 on "
        "stage 1, which expects at least 8",
    )


@topologies((2, 2))
def test_with_sp_a_stage_whose_graphs_hold_fewer_requests_is_refused(pool):
    """FULL graphs for every batch hold min(their tokens, --max-num-seqs)
    requests. With 8 on the engine's node (stage 0) and 7 on the other, a
    batch of 9 tokens from 8 requests pads to 16 on stage 0 and runs as it
    comes on stage 1: shards of 8 rows sent, 5 expected. The other way round
    stage 0's scheduler never sends 8 requests, and the stages start."""
    full = dataclasses.replace(
        SP, runner="v2", cudagraph_mode="FULL", capture_sizes=(1, 2, 4, 8, 16)
    )
    assert_refused_everywhere(
        run_stages(
            pool,
            dataclasses.replace(full, max_num_seqs=8),
            dataclasses.replace(full, max_num_seqs=7),
        ),
        "batch_padding: a batch of 9 tokens (with a prefill, 8 requests) is "
        "dispatched as 16 tokens on stage 0, which sends 8 rows, and as 9 on "
        "stage 1, which expects 5",
        "stage 0: FULL, sizes [1, 2, 4, 8, 16], max_num_seqs 8; "
        "stage 1: FULL, sizes [1, 2, 4, ",
        "max_num_seqs 7)",
        "--max-num-seqs",
    )
    assert_started_everywhere(
        run_stages(
            pool,
            dataclasses.replace(full, max_num_seqs=7),
            dataclasses.replace(full, max_num_seqs=8),
        )
    )


@topologies((2, 2))
def test_with_sp_one_request_past_the_smaller_max_num_seqs_is_compared(pool):
    """--max-num-seqs 8 on stage 0 and 3 on stage 1, graphs up to 8 tokens:
    5 tokens from 4 requests pad to 8 on stage 0 (4 shard rows) and run as
    they come on stage 1 (3 rows). Only request counts past the smaller
    limit and below stage 0's show it: 3 and 8 requests pad alike."""
    full = dataclasses.replace(
        SP, runner="v2", cudagraph_mode="FULL", capture_sizes=(1, 2, 4, 8)
    )
    assert_refused_everywhere(
        run_stages(
            pool,
            dataclasses.replace(full, max_num_seqs=8),
            dataclasses.replace(full, max_num_seqs=3),
        ),
        "batch_padding: a batch of 5 tokens (with a prefill, 4 requests) is "
        "dispatched as 8 tokens on stage 0, which sends 4 rows, and as 5 on "
        "stage 1, which expects 3",
    )


@topologies((2, 2))
def test_batches_the_engine_never_schedules_are_not_compared(pool):
    """Stage 0 runs on the engine's node, whose scheduler sends at most its
    --max-num-seqs requests and --max-num-batched-tokens tokens: a later
    stage whose decode graphs take more pads no batch that arrives, and
    vLLM runs it. 9 requests of one token, or 9 tokens, never come here."""
    v2 = dataclasses.replace(NO_SP, runner="v2", capture_sizes=(1, 2, 4, 8, 16))
    assert_started_everywhere(
        run_stages(
            pool,
            dataclasses.replace(v2, max_num_seqs=8),
            dataclasses.replace(v2, max_num_seqs=16),
        )
    )
    assert_started_everywhere(
        run_stages(
            pool,
            dataclasses.replace(
                v2, capture_sizes=(1, 2, 4, 8), max_num_batched_tokens=8
            ),
            v2,
        )
    )
    # Beyond the scheduler's limits nothing is left out: 9 requests arrive.
    assert_refused_everywhere(
        run_stages(
            pool,
            dataclasses.replace(v2, max_num_seqs=9),
            dataclasses.replace(v2, max_num_seqs=16),
        ),
        "batch_padding: a batch of 9 tokens (a uniform decode of 1 per request) "
        "is dispatched as 9 tokens on stage 0, which sends 9 rows, and as 16 on "
        "stage 1, which expects at least 16",
    )


@topologies((2, 2))
def test_refusals_name_the_kind_of_batch_that_pads_differently(pool):
    """Piecewise graphs pad batches with a prefill; the V2 runner's varlen
    decode graphs pad decodes of mixed lengths, a batch that neither a
    prefill nor a uniform decode stands for."""
    eager = dataclasses.replace(NO_SP, enforce_eager=True)
    assert_refused_everywhere(
        run_stages(pool, eager, dataclasses.replace(NO_SP, cudagraph_mode="PIECEWISE")),
        "batch_padding: a batch of 3 tokens (with a prefill) is dispatched as "
        "3 tokens on stage 0, which sends 3 rows, and as 4 on stage 1",
    )
    v2 = dataclasses.replace(NO_SP, runner="v2")
    assert_refused_everywhere(
        run_stages(
            pool,
            dataclasses.replace(v2, enforce_eager=True),
            dataclasses.replace(v2, varlen_decode=True),
        ),
        "batch_padding: a batch of 3 tokens (decodes of up to 1 tokens) is "
        "dispatched as 3 tokens on stage 0, which sends 3 rows, and as 4 on "
        "stage 1",
    )


@topologies((2, 2))
def test_a_runner_without_graph_dispatch_pads_nothing(pool):
    """A runner with neither the legacy dispatcher nor the V2 manager (an
    out-of-tree platform's) runs every batch as it comes: it starts next to
    another such runner, and is refused next to a later stage that pads."""
    bare = dataclasses.replace(NO_SP, runner="none")
    assert_started_everywhere(run_stages(pool, bare, bare))
    assert_refused_everywhere(
        run_stages(pool, bare, NO_SP),
        PADS_3_TO_4,
    )


@only_from_0_34("the warm-up steps stated from the runner's decode query length")
@topologies((2, 2))
def test_a_runner_without_graph_dispatch_warms_up_at_one_token_per_decode(pool):
    """Without a graph manager a stage's decode query length is 1 + draft
    tokens, as the V2 runner's: beside an eager V2 stage it runs the same
    JIT warm-up steps and starts (their modes shown), with a drafter too."""
    for draft_tokens in (0, 1):
        jit = dataclasses.replace(
            NO_SP, enable_jit_warmup=True, num_speculative_tokens=draft_tokens
        )
        assert_started_everywhere(
            run_stages(
                pool,
                dataclasses.replace(jit, runner="none"),
                dataclasses.replace(jit, runner="v2", enforce_eager=True),
            )
        )


@topologies((2, 2))
def test_a_model_that_declares_nothing_and_has_no_taps_is_compared_too(pool):
    """Most models of 0.33.0 declare no hand-off and no EAGLE taps: their
    stages start where they pad alike, and are refused where a later stage
    pads more, which fails at the first step in 0.33.0 as well."""
    plain = dataclasses.replace(NO_SP, plain_model=True)
    assert_started_everywhere(run_stages(pool, plain, plain))
    assert_refused_everywhere(
        run_stages(pool, dataclasses.replace(plain, enforce_eager=True), plain),
        PADS_3_TO_4,
    )


@topologies((2, 2))
def test_v2_decodes_are_asked_at_the_runners_own_query_length(pool):
    """The V2 runner's decode query length is its model state's (draft
    tokens plus the tokens it samples per step), not always 1 + draft
    tokens: with 2 and no drafter, stage 1 pads 3 decodes of 2 tokens to 8
    while the eager stage 0 sends 6 rows."""
    v2 = dataclasses.replace(NO_SP, runner="v2", decode_query_len=2)
    assert_refused_everywhere(
        run_stages(pool, dataclasses.replace(v2, enforce_eager=True), v2),
        "batch_padding: a batch of 6 tokens (a uniform decode of 2 per "
        "request) is dispatched as 6 tokens on stage 0, which sends 6 rows, "
        "and as 8 on stage 1, which expects at least 8",
    )


@topologies((2, 2))
def test_without_sp_other_backends_start_and_are_shown_on_every_stage(pool):
    """The MoE backend alone is not part of the hand-off: without SP on any
    stage, each stage's EP group may run its own backend."""
    flags = [
        dataclasses.replace(NO_SP, moe_backend="auto"),
        dataclasses.replace(NO_SP, moe_backend="flashinfer_cutlass"),
    ]
    assert_started_everywhere(run_stages(pool, *flags))


# Where SP is on, what decides the rows.


@topologies((2, 2))
def test_stages_that_agree_start(pool):
    assert_started_everywhere(run_stages(pool, SP, dataclasses.replace(SP)))
    v2 = dataclasses.replace(SP, runner="v2")
    assert_started_everywhere(run_stages(pool, v2, v2))


@topologies((2, 2))
def test_with_sp_a_lowered_mode_that_pads_every_batch_alike_starts(pool):
    """FULL_AND_PIECEWISE lowered to PIECEWISE on the last stage (a drafter's
    backend): decode graphs and piecewise graphs pad to the same sizes here,
    so every batch maps to the same shard rows."""
    first = dataclasses.replace(SP, cudagraph_mode="FULL_AND_PIECEWISE")
    last = dataclasses.replace(SP, cudagraph_mode="PIECEWISE")
    for runner in RUNNERS:
        assert_started_everywhere(
            run_stages(
                pool,
                dataclasses.replace(first, runner=runner),
                dataclasses.replace(last, runner=runner),
            )
        )


@topologies((2, 2))
def test_with_sp_stages_that_shard_a_batch_differently_are_refused(pool):
    """Under SP the shard rows ceil(N_padded / TP) must agree for every
    batch: a lowered mode or other capture sizes break that at N=5, where
    stage 0 pads to 8 (4 rows) and stage 1 runs 5 (3 rows)."""
    first_n = (
        "batch_padding: a batch of 5 tokens (a uniform decode of 1 per request) "
        "is dispatched as 8 tokens on stage 0, which sends 4 rows, and as 5 on "
        "stage 1, which expects 3"
    )
    for runner in RUNNERS:
        first = dataclasses.replace(SP, runner=runner)
        for last, shown in [
            (
                dataclasses.replace(first, cudagraph_mode="NONE"),
                "stage 1: NONE, sizes [1, 2, 4, 8]",
            ),
            (
                dataclasses.replace(first, capture_sizes=(1, 2, 4)),
                "stage 1: FULL_DECODE_ONLY, sizes [1, 2, 4],",
            ),
            (
                dataclasses.replace(first, enforce_eager=True),
                "stage 1: NONE, sizes [1, 2, 4, 8]",
            ),
        ]:
            assert_refused_everywhere(
                run_stages(pool, first, last),
                first_n,
                shown,
                "--speculative-config (num_speculative_tokens)",
                "lowered the CUDA graph mode it resolved",
            )


@topologies((2, 2))
def test_modes_are_compared_as_the_runners_resolved_them(pool):
    """Equal flags, and the last stage's attention backends lower the mode:
    the check shows the modes the runners resolved, not the flags. Lowered
    to PIECEWISE every batch pads alike and the stages start; lowered to
    NONE a 5-token decode is 4 shard rows on stage 0 and 3 on stage 1, and
    the error says the flags may match."""
    for runner in RUNNERS:
        first = dataclasses.replace(
            SP, runner=runner, cudagraph_mode="FULL_AND_PIECEWISE"
        )
        last = dataclasses.replace(first, resolved_mode="PIECEWISE")
        assert_started_everywhere(run_stages(pool, first, last))
        first = dataclasses.replace(SP, runner=runner)
        last = dataclasses.replace(first, resolved_mode="NONE")
        assert_refused_everywhere(
            run_stages(pool, first, last),
            "batch_padding: a batch of 5 tokens (a uniform decode of 1 per "
            "request) is dispatched as 8 tokens on stage 0",
            "stage 0: FULL_DECODE_ONLY, sizes [1, 2, 4, 8], max_num_seqs 128; "
            "stage 1: NONE, sizes [1, 2, 4, 8]",
            "If the flags already match, a stage's attention backends",
        )


@topologies((2, 2))
def test_a_stage_with_another_moe_backend_fails_on_every_rank(pool):
    other = dataclasses.replace(SP, moe_backend="auto")
    errors = assert_refused_everywhere(
        run_stages(pool, SP, other),
        "sequence_parallel: stage 0=True, stage 1=False",
        "all_gather_tensors: stage 0={'hidden_states': False, 'residual': False}, "
        "stage 1={}",
        "Start every node with the same --kernel-config, "
        "--enable-expert-parallel, --tensor-parallel-size.",
    )
    for error in errors:
        assert "batch_padding" not in error, error


@topologies((2, 2))
def test_a_stage_with_other_aux_layers_fails_on_every_rank(pool):
    """Stage 0 captures taps 0 and 2 and sends two slots; a stage 1 started
    with taps (0, 3) expects one. The V2 runner sets taps on every stage."""
    v2 = dataclasses.replace(SP, runner="v2")
    other = dataclasses.replace(v2, aux_layers=(0, 3))
    errors = assert_refused_everywhere(
        run_stages(pool, v2, other),
        "aux_hidden_state_slots: stage 0 sends 2, stage 1 expects 1",
        "--speculative-config (eagle_aux_hidden_state_layer_ids), "
        "VLLM_PP_LAYER_PARTITION.",
    )
    for error in errors:
        assert "moe_backend" not in error and "cudagraph" not in error, error


@topologies((2, 3))
def test_aux_states_the_transport_would_take_for_replicas_are_refused(pool):
    """Under SP an aux state is a shard: a transport that takes it for a TP
    replica (the overrides taken before the aux layers were set) gives every
    rank the same rows, stitched from a slice of each rank's shard, with the
    right shape. Every stage refuses, naming each key on each stage whose
    transport would scramble it; with the overrides taken after the layers,
    the same stages start."""
    v2 = dataclasses.replace(SP, runner="v2")
    stale = dataclasses.replace(v2, stale_declaration=True)
    errors = [error for error, _ in run_stages(pool, v2, stale, stale)]
    keys = "aux_hidden_states_0, aux_hidden_states_1, aux_hidden_states_2"
    assert errors == [
        "Pipeline stages would hand aux hidden states over scrambled: "
        f"stage 1: {keys}; stage 2: {keys} cross a stage boundary as TP "
        "replicas while "
        "the hidden states are sequence-parallel shards. The model's "
        "get_pp_intermediate_tensor_all_gather_overrides() must map them to "
        "False once the aux layers are set."
    ] * (3 * pool.tp), errors
    assert_started_everywhere(run_stages(pool, v2, v2, v2))
    # Without SP every key is a replica: nothing to refuse.
    no_sp = dataclasses.replace(NO_SP, runner="v2", stale_declaration=True)
    assert_started_everywhere(run_stages(pool, no_sp, no_sp, no_sp))


@topologies((2, 3))
def test_each_boundary_is_compared_with_its_own_neighbours(pool):
    """Three stages of layers [0, 1), [1, 3), [3, 4) and taps (0, 2, 3):
    stage 1 relays all three to stage 2; a stage 2 started with taps (0, 2)
    expects two. Only that boundary is named, with its own two stages; so
    is the one boundary whose stages pad a batch differently."""
    v2 = dataclasses.replace(SP, runner="v2")
    other = dataclasses.replace(v2, aux_layers=(0, 2))
    errors = assert_refused_everywhere(
        run_stages(pool, v2, v2, other),
        "aux_hidden_state_slots: stage 1 sends 3, stage 2 expects 2",
    )
    for error in errors:
        assert "stage 0 sends" not in error, error
    # Likewise the padding: eager stages 0 and 1 agree, stage 2 pads more.
    eager = dataclasses.replace(NO_SP, enforce_eager=True)
    assert_refused_everywhere(
        run_stages(pool, eager, eager, NO_SP),
        "batch_padding: a batch of 3 tokens (a uniform decode of 1 per "
        "request) is dispatched as 3 tokens on stage 1, which sends 3 rows, "
        "and as 4 on stage 2, which expects at least 4",
    )


@only_on_0_33("the legacy model runner, which sets aux layers on the last stage")
@topologies((2, 2))
def test_aux_layers_set_on_the_last_stage_only_start(pool):
    """The legacy runner sets aux layers on the last stage only; with every
    tap on that stage nothing crosses the boundary, as in 0.33.0, and the
    stages' different layers are no news: no warning."""
    first = dataclasses.replace(SP, aux_layers=())
    last = dataclasses.replace(SP, aux_layers=(3,))
    assert_started_everywhere(run_stages(pool, first, last))


@topologies((2, 2))
def test_a_model_that_relays_no_taps_starts_with_one_at_the_boundary(pool):
    """A model that captures its taps from what it received (Qwen3-MoE in
    0.33.0) takes tap 2 at the last stage's first layer itself under the
    legacy runner: 0.33.0 runs it, and so does the series, without a word.
    A model that relays taps would wait for that one, and is refused."""
    first = dataclasses.replace(NO_SP, aux_layers=(), relays_aux=False)
    last = dataclasses.replace(NO_SP, aux_layers=(2, 3), relays_aux=False)
    assert_started_everywhere(run_stages(pool, first, last))
    relaying = [dataclasses.replace(f, relays_aux=True) for f in (first, last)]
    assert_refused_everywhere(
        run_stages(pool, *relaying),
        "aux_hidden_state_slots: stage 0 sends 0, stage 1 expects 1",
    )


# Flags that gate warm-up traffic.


@pytest.mark.parametrize("base", [SP, NO_SP], ids=["sp", "no-sp"])
@topologies((2, 2))
def test_stages_that_would_warm_up_differently_are_refused(pool, base):
    """The V2 JIT warm-up runs real PP steps, twice with spec decode: a stage
    that runs other warm-up steps than its neighbour hangs vLLM too, so this
    is refused for every model."""
    v2 = dataclasses.replace(base, runner="v2", enable_jit_warmup=True)
    for other, shown in [
        (
            dataclasses.replace(v2, enable_jit_warmup=False),
            # 63 requests of 2 tokens on 0.34.0 (its budget's cap), 128 on 0.33.0.
            (
                "warm_up: stage 0 runs step 1, requests per (tokens, drafts) {(2, 0): ",
                "stage 1 finished after 0 steps; enable_jit_warmup: stage 0=True, "
                "stage 1=False",
            ),
        ),
        (
            dataclasses.replace(v2, num_speculative_tokens=1),
            ("num_speculative_tokens: stage 0=0, stage 1=1",),
        ),
    ]:
        assert_refused_everywhere(
            run_stages(pool, v2, other),
            *shown,
            "--kernel-config (enable_jit_warmup), ",
            "--speculative-config",
        )
    # Stage 0 runs none: its steps (none) are compared as any others.
    assert_refused_everywhere(
        run_stages(pool, dataclasses.replace(v2, enable_jit_warmup=False), v2),
        "warm_up: stage 0 finished after 0 steps, stage 1 runs step 1",
        "enable_jit_warmup: stage 0=False, stage 1=True",
        "--kernel-config (enable_jit_warmup)",
    )
    # Without the JIT warm-up (and, on 0.34.0, the extensible KV cache) no
    # stage runs warm-up steps: what would size them may differ.
    quiet = dataclasses.replace(v2, enable_jit_warmup=False)
    assert_started_everywhere(
        run_stages(pool, quiet, dataclasses.replace(quiet, max_num_batched_tokens=255))
    )
    if HAS_LEGACY_RUNNER:  # the legacy runner runs no JIT warm-up
        legacy = dataclasses.replace(base, runner="legacy", enable_jit_warmup=True)
        results = run_stages(
            pool, legacy, dataclasses.replace(legacy, enable_jit_warmup=False)
        )
        assert [error for error, _ in results] == [None] * pool.world, results


@only_from_0_34("the extensible KV cache's warm-up and KV-sizing steps")
@pytest.mark.parametrize("base", [SP, NO_SP], ids=["sp", "no-sp"])
@topologies((2, 2))
def test_stages_whose_extensible_kv_cache_warms_up_differently_are_refused(pool, base):
    """vLLM 0.34.0's extensible KV cache (on by default on CUDA) runs the
    kernel warm-up even without JIT warm-up, then KV-sizing steps of the
    whole budget (prefills of at most --max-model-len tokens, a prompt-
    logprobs step where --max-logprobs asks for one), all through the
    worker's execute_model (gpu_worker.py ``_compile_or_warm_up_model``,
    gpu/warmup.py ``warmup_kernels``, ``run_kv_cache_sizing_warmup``). A
    stage that runs other steps sends what nobody receives: refused for
    every model, with the option named."""
    kv = dataclasses.replace(base, runner="v2", enable_extensible_kv_cache=True)
    for other, shown, option in [
        (
            dataclasses.replace(kv, enable_extensible_kv_cache=False),
            # Refused earlier by the announcement (test_pp_stage_announcement);
            # the steps also differ.
            "warm_up: stage 0 runs step 1",
            "--enable-extensible-kv-cache",
        ),
        (
            dataclasses.replace(kv, max_num_batched_tokens=255),
            "max_num_batched_tokens: stage 0=",
            "--max-num-batched-tokens",
        ),
        (
            dataclasses.replace(kv, max_model_len=64),
            "max_model_len: stage 0=",
            "--max-model-len",
        ),
        # Above the budget: MLA's context-prefill step splits its workspace
        # into requests of the model length.
        (
            dataclasses.replace(kv, max_model_len=512),
            "max_model_len: stage 0=",
            "--max-model-len",
        ),
    ]:
        assert_refused_everywhere(run_stages(pool, kv, other), shown, option)
    # A model length below the budget: a prompt-logprobs step runs first
    # where logprobs are allowed.
    short = dataclasses.replace(kv, max_model_len=64)
    assert_refused_everywhere(
        run_stages(pool, short, dataclasses.replace(short, max_logprobs=0)),
        "max_logprobs: stage 0=",
        "--max-logprobs",
    )
    # The JIT warm-up alone: its number of requests is capped by the budget.
    jit = dataclasses.replace(base, runner="v2", enable_jit_warmup=True)
    assert_refused_everywhere(
        run_stages(pool, jit, dataclasses.replace(jit, max_num_batched_tokens=255)),
        "max_num_batched_tokens: stage 0=",
        "--max-num-batched-tokens",
    )


@only_from_0_34("the JIT kernel warm-up beside the extensible KV cache's sizing")
@topologies((2, 2))
def test_without_sp_what_only_kv_sizing_reads_may_differ_beside_jit_warm_up(pool):
    """Without the extensible KV cache only the kernel warm-up runs, whose
    steps read neither --max-model-len (beyond block counts of its few-token
    requests) nor --max-logprobs (it asks logprobs=5 itself): vLLM 0.34.0
    starts stages that differ in them, and so does the series."""
    jit = dataclasses.replace(NO_SP, runner="v2", enable_jit_warmup=True)
    for other in (
        dataclasses.replace(jit, max_model_len=512),
        dataclasses.replace(jit, max_logprobs=0),
    ):
        assert_started_everywhere(run_stages(pool, jit, other))


@only_from_0_34("the extensible KV cache's KV-sizing steps")
@topologies((2, 2))
def test_without_sp_kv_sizing_that_runs_the_same_steps_starts(pool):
    """The KV-sizing steps split the budget (127 tokens here) into prompts of
    at most --max-model-len - 1 tokens, and run a prompt-logprobs step first
    only where a prompt cannot take the whole budget: model lengths above
    the budget, and logprobs allowed or not beside them, run the same steps
    (gpu/warmup.py ``run_kv_cache_sizing_warmup``,
    ``run_mixed_prefill_decode_warmup``; a model without MLA runs no
    context-prefill step), which vLLM 0.34.0 starts."""
    kv = dataclasses.replace(NO_SP, runner="v2", enable_extensible_kv_cache=True)
    no_mla = dataclasses.replace(kv, use_mla=False)
    for stages in (
        (no_mla, dataclasses.replace(no_mla, max_model_len=512)),
        (kv, dataclasses.replace(kv, max_logprobs=0)),
        (kv, dataclasses.replace(kv, max_logprobs=5)),
    ):
        assert_started_everywhere(run_stages(pool, *stages))


@only_from_0_34("the V2 runner's warm-up steps and the extensible KV cache's")
@pytest.mark.parametrize("base", [SP, NO_SP], ids=["sp", "no-sp"])
@topologies((2, 2))
def test_stages_whose_warm_up_steps_match_start_however_their_inputs_differ(pool, base):
    """What is compared is the steps, not the options that size them: the
    kernel warm-up's requests are capped by the budget (127 tokens here:
    63 requests of 2 tokens) and the extensible KV cache's MLA context step
    by its workspace, so other values past those caps run the same steps,
    which vLLM 0.34.0 starts (gpu/warmup.py ``_cap_num_warmup_reqs``,
    ``run_context_prefill_warmup``)."""
    jit = dataclasses.replace(base, runner="v2", enable_jit_warmup=True)
    few = dataclasses.replace(jit, max_num_seqs=8)
    kv = dataclasses.replace(base, runner="v2", enable_extensible_kv_cache=True)
    for stages in (
        (jit, dataclasses.replace(jit, max_num_seqs=256)),
        (few, dataclasses.replace(few, max_num_batched_tokens=255)),
        (
            dataclasses.replace(kv, max_model_len=200),
            dataclasses.replace(kv, max_model_len=512),
        ),
    ):
        assert_started_everywhere(run_stages(pool, *stages))
    # The same options where they change the steps: refused.
    assert_refused_everywhere(
        run_stages(pool, few, dataclasses.replace(few, max_num_seqs=9)),
        "max_num_seqs: stage 0=",
        "--max-num-seqs",
    )


# Robust.


@topologies((2, 2))
def test_a_stage_that_cannot_answer_fails_every_stage_at_once(pool):
    """A stage whose settings raise sends its error: no stage waits for it
    until the gloo timeout."""
    results = run_stages(pool, SP, dataclasses.replace(SP, broken=True))
    message = (
        "Pipeline stages could not compare their padding: stage 1: "
        "RuntimeError: planted: this stage cannot answer"
    )
    assert [error for error, _ in results] == [message] * pool.world, results
    # Its settings, before kernel warm-up: the same, through the first round;
    # the failing stage raises from its own error, its traceback kept.
    results = run_stages(pool, SP, dataclasses.replace(SP, broken_settings=True))
    message = (
        "Pipeline stages could not compare their hand-off settings: stage 1: "
        "RuntimeError: planted: this stage cannot answer"
    )
    cause = " [cause: RuntimeError('planted: this stage cannot answer')]"
    errors = [error for error, _ in results]
    assert errors == [message] * pool.tp + [message + cause] * pool.tp, errors


@topologies((2, 2))
def test_a_runner_whose_padding_cannot_be_asked_starts_only_without_sp(pool):
    """0.33.0 compares nothing, so without SP such a runner starts, warning
    on every stage that padding went uncompared; under SP the rows depend
    on that padding, so every stage refuses."""
    for base, refused in ((NO_SP, False), (SP, True)):
        results = run_stages(
            pool, base, dataclasses.replace(base, foreign_dispatch=True)
        )
        part = "stage 1: TypeError: "
        if refused:
            assert all(
                error
                and error.startswith(
                    "Pipeline stages could not compare their padding: " + part
                )
                for error, _ in results
            ), results
        else:
            assert_started_everywhere(results, part, "; batch padding not compared.")


# Speculative decoding: the drafter lives on the last stage.

MTP = dataclasses.replace(
    SP, runner="v2", enable_jit_warmup=True, num_speculative_tokens=3
)


@topologies((2, 2))
def test_sp_deployments_with_a_drafter_start(pool):
    """K3 with MTP (3 draft tokens: a decode query of 4 tokens per request)
    and with EAGLE-3/DSpark taps on every stage (the V2 runner sets them on
    each stage and relays them), SP across stages, the JIT warm-up on."""
    assert_started_everywhere(run_stages(pool, MTP, MTP))
    taps = dataclasses.replace(MTP, aux_layers=(0, 1, 2, 4))
    assert_started_everywhere(run_stages(pool, taps, taps))


@topologies((2, 2))
def test_nodes_with_other_num_speculative_tokens_are_refused(pool):
    """With the JIT warm-up the warm-up steps differ; without it, decode
    batches of 4 tokens per request pad to other shard rows."""
    other = dataclasses.replace(MTP, num_speculative_tokens=1)
    assert_refused_everywhere(
        run_stages(pool, MTP, other),
        "warm_up: stage 0 runs step 1",
        "num_speculative_tokens: stage 0=3, stage 1=1",
        "--speculative-config",
    )
    no_warm_up = dataclasses.replace(MTP, enable_jit_warmup=False)
    assert_refused_everywhere(
        run_stages(
            pool, no_warm_up, dataclasses.replace(no_warm_up, num_speculative_tokens=1)
        ),
        "batch_padding: a batch of ",
        "--speculative-config (num_speculative_tokens)",
    )


def last_stage_taps(layers: tuple[int, ...], relays: bool = True) -> str | None:
    """What the worker's check says when the V1 runner set these aux layers
    on the last stage (and only there)."""
    config = scenario_config(
        get_tp_group().world_size, get_pp_group().world_size, sp=True
    )
    with set_current_vllm_config(config), stand_ins(), torch.no_grad():
        model = build_model(config)
        if get_pp_group().is_last_rank:
            model._set_aux_hidden_state_layers(layers)
        relays_aux(model, relays)
        try:
            check_aux_layers_on_the_last_stage(model)
        except ValueError as error:
            return str(error)
    return None


@only_on_0_33("the legacy (V1) model runner's aux-layer check")
@topologies((2, 2))
def test_v1_runner_taps_before_the_last_stage_are_refused_naming_the_options(pool):
    """0.33.0's V1 runner sets aux layers on the last stage only; taps at or
    before its first layer (2) are never sent, and its first forward fails.
    The worker refuses that at model load; taps inside the stage start."""
    errors = pool.run(last_stage_taps, (0, 2, 3), timeout=BOUND_S)
    assert errors[:2] == [None, None], errors
    for error in errors[2:]:
        assert error == (
            "Aux hidden-state layers [0, 2] are captured at or before layer 2, "
            "where the last PP stage begins, and the V1 model runner sets aux "
            "layers on the last stage only: no stage would send them. Use the "
            "V2 model runner (VLLM_USE_V2_MODEL_RUNNER=1), whose stages relay "
            "them, or choose --speculative-config eagle_aux_hidden_state_layer_ids "
            "above 2 or another VLLM_PP_LAYER_PARTITION."
        ), error
    assert pool.run(last_stage_taps, (3,), timeout=BOUND_S) == [None] * pool.world


@only_on_0_33("the legacy (V1) model runner's aux-layer check")
@topologies((2, 2))
def test_v1_runner_taps_from_a_model_that_relays_none_start(pool):
    """Such a model captures tap 2 at the last stage's first layer from what
    it received and never asks for tap 0: 0.33.0 loads it, so does the
    series."""
    results = pool.run(last_stage_taps, (0, 2, 3), False, timeout=BOUND_S)
    assert results == [None] * pool.world
