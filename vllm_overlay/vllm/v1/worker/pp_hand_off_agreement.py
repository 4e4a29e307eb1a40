# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Pipeline stages must agree on what their hand-offs depend on.

Each stage builds its own ``VllmConfig`` from its own command line (a headless
node is started by hand), and vLLM compares parallel settings across nodes
only for data parallelism. Stages that disagree on the transport of a key, on
the aux states that cross a boundary, on the warm-up steps they run, or on
how many rows a batch's hand-off holds post transfers of other shapes than
their neighbours: NCCL then hangs, mixes rows, or the runner fails at the
first step. Before the first hand-off every stage gathers what the others
would send and expect; what would break raises on every stage, showing each
stage's values and the options behind them. Any other difference is logged on
every stage and changes nothing: a model that keeps no stage output sequence
parallel starts wherever it started before.
"""

from bisect import bisect_right
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch.distributed as dist
from torch import nn

from vllm.config import VllmConfig
from vllm.distributed.parallel_state import get_pp_group
from vllm.logger import init_logger
from vllm.model_executor.models.interfaces import (
    EagleModelMixin,
    get_pp_all_gather_overrides,
    get_pp_num_rows,
)
from vllm.utils.math_utils import cdiv
from vllm.v1.worker.gpu.cudagraph_utils import CudaGraphManager
from vllm.v1.worker.pp_intermediate_tensors import accepts_hand_off
from vllm.v1.worker.pp_stage_announcement import announce_and_wait

logger = init_logger(__name__)

# The command-line options behind each value, named in the error.
OPTIONS: dict[str, tuple[str, ...]] = {
    "sequence_parallel": (
        "--kernel-config",
        "--enable-expert-parallel",
        "--tensor-parallel-size",
    ),
    "all_gather_tensors": (
        "--kernel-config",
        "--enable-expert-parallel",
        "--tensor-parallel-size",
    ),
    "aux_hidden_state_slots": (
        "--speculative-config (eagle_aux_hidden_state_layer_ids)",
        "VLLM_PP_LAYER_PARTITION",
    ),
    "warm_up": (
        "--kernel-config (enable_jit_warmup)",
        "--enable-extensible-kv-cache (--kv-cache-memory-bytes)",
        "--speculative-config",
        "--max-num-batched-tokens",
        "--max-num-seqs",
    ),
    "kv_cache_sizing": (
        "--enable-extensible-kv-cache (--kv-cache-memory-bytes)",
        "--max-model-len",
        "--max-logprobs",
    ),
    "warm_up_steps": ("--speculative-config",),
    "batch_padding": (
        "--compilation-config",
        "--max-cudagraph-capture-size",
        "--enforce-eager",
        "--speculative-config (num_speculative_tokens)",
    ),
    "cudagraph_mode": ("--compilation-config",),
    "cudagraph_capture_sizes": (
        "--max-cudagraph-capture-size",
        "--compilation-config",
    ),
    "enforce_eager": ("--enforce-eager",),
    "max_num_seqs": ("--max-num-seqs",),
    "max_num_batched_tokens": ("--max-num-batched-tokens",),
    "moe_backend": ("--kernel-config",),
    "enable_expert_parallel": ("--enable-expert-parallel",),
    "aux_hidden_state_layers": (
        "--speculative-config (eagle_aux_hidden_state_layer_ids)",
    ),
}

# Compared as they are: a difference breaks the hand-off.
REFUSED = ("sequence_parallel", "all_gather_tensors")

# Shown where they differ, never refused on their own: the hand-off depends on
# them only through the rows each stage pads a batch to, which is compared
# itself ("batch_padding"), or through the aux slots, compared per boundary;
# each stage's EP group is its own.
SHOWN = (
    "cudagraph_mode",
    "cudagraph_capture_sizes",
    "enforce_eager",
    "max_num_seqs",
    "max_num_batched_tokens",
    "moe_backend",
    "enable_expert_parallel",
    "aux_hidden_state_layers",
)


# Equal flags can pad alike or not: a stage's attention backends, or the
# drafter on the last stage, may lower the CUDA graph mode it resolves.
CUDAGRAPH_MODE_HINT = (
    " If the flags already match, a stage's attention backends or drafter "
    "lowered the CUDA graph mode it resolved: set a cudagraph_mode every "
    "stage supports."
)


@dataclass(frozen=True)
class BatchShape:
    """A batch the scheduler hands every stage alike."""

    num_tokens: int
    num_reqs: int
    # Tokens per request of a uniform decode batch.
    uniform_token_count: int | None = None
    # The longest request's tokens; None for a batch that holds a prefill.
    max_query_len: int | None = None
    num_active_loras: int = 0

    def __str__(self) -> str:
        if self.uniform_token_count is not None:
            kind = f"a uniform decode of {self.uniform_token_count} per request"
        elif self.max_query_len is not None:
            kind = f"decodes of up to {self.max_query_len} tokens"
        else:
            kind = "with a prefill"
        if self.uniform_token_count is None and self.num_reqs > cdiv(
            self.num_tokens, self.max_query_len or self.num_tokens
        ):
            kind += f", {self.num_reqs} requests"
        loras = f", {self.num_active_loras} LoRA(s)" if self.num_active_loras else ""
        return f"a batch of {self.num_tokens} tokens ({kind}{loras})"


@dataclass(frozen=True)
class ShapeBounds:
    """What bounds the batches one stage's runner pads."""

    # CUDA graphs pad no batch above this many tokens (0: no graphs).
    max_num_tokens: int
    # The runner's decode query length.
    max_query_len: int
    lora_counts: tuple[int, ...]
    # The most requests its graphs hold (--max-num-seqs). Stage 0 runs on
    # the engine's node (rank 0): there also the most requests its scheduler
    # puts in a batch, and the token budget the most tokens any step holds
    # (the scheduler's batches and the warm-up and KV-sizing steps).
    max_num_reqs: int
    max_num_batched_tokens: int


def batch_shapes(bounds: list[ShapeBounds]) -> list[BatchShape]:
    """Every batch whose padding can differ between the stages of
    ``bounds``: as many tokens as any stage's graphs pad and the scheduler
    sends, and requests as the scheduler sends. A graph that bounds its
    requests holds min(its tokens, its stage's max_num_seqs), and its tokens
    are at least the batch's: only a stage's max_num_seqs decides whether a
    batch's requests fit, so the fewest requests a batch can have and one
    past each stage's limit stand for every request count."""
    scheduler = bounds[0]
    max_num_tokens = min(
        max(b.max_num_tokens for b in bounds), scheduler.max_num_batched_tokens
    )
    max_query_len = max(b.max_query_len for b in bounds)
    lora_counts = sorted({count for b in bounds for count in b.lora_counts})
    past_limits = sorted({b.max_num_reqs + 1 for b in bounds})

    def request_counts(num_tokens: int, least: int) -> list[int]:
        most = min(num_tokens, scheduler.max_num_reqs)
        return [n for n in (least, *past_limits) if least <= n <= most]

    return [
        shape
        for num_tokens in range(1, max_num_tokens + 1)
        for loras in lora_counts
        for shape in (
            *(
                BatchShape(num_tokens, n, None, None, loras)
                for n in request_counts(num_tokens, 1)
            ),
            *(
                BatchShape(num_tokens, n, None, q, loras)
                for q in range(1, max_query_len + 1)
                for n in request_counts(num_tokens, cdiv(num_tokens, q))
            ),
            *(
                BatchShape(num_tokens, num_tokens // q, q, q, loras)
                for q in range(1, max_query_len + 1)
                if num_tokens % q == 0 and num_tokens // q <= scheduler.max_num_reqs
            ),
        )
    ]


class RunnerPadding:
    """How this stage's runner pads a batch: its CUDA graph dispatch, as it
    resolved it (attention backends and a drafter may lower the requested
    mode), known before any graph is captured."""

    def __init__(self, vllm_config: VllmConfig, model_runner: object) -> None:
        compilation_config = vllm_config.compilation_config
        self.cudagraph_mode = compilation_config.cudagraph_mode
        self.decode_query_len = 1 + vllm_config.num_speculative_tokens
        self.manager: CudaGraphManager | None = None
        manager = getattr(model_runner, "cudagraph_manager", None)
        if isinstance(manager, CudaGraphManager):
            self.manager = manager
            self.cudagraph_mode = manager.cudagraph_mode
            self.decode_query_len = manager.decode_query_len
        scheduler_config = vllm_config.scheduler_config
        lora_config = vllm_config.lora_config
        self.bounds = ShapeBounds(
            max_num_tokens=(
                compilation_config.max_cudagraph_capture_size or 0
                if self.cudagraph_mode
                else 0
            ),
            max_query_len=self.decode_query_len,
            lora_counts=tuple(range(lora_config.max_loras + 1 if lora_config else 1)),
            max_num_reqs=scheduler_config.max_num_seqs,
            max_num_batched_tokens=scheduler_config.max_num_batched_tokens,
        )

    def padded_num_tokens(self, shape: BatchShape) -> int:
        if self.manager is not None:
            desc = self.manager.find_candidate(
                shape.num_reqs,
                shape.num_tokens,
                shape.uniform_token_count,
                shape.num_active_loras,
                shape.max_query_len,
            )
            return shape.num_tokens if desc is None else desc.num_tokens
        return shape.num_tokens


def aux_hidden_state_layers(model: nn.Module) -> tuple[tuple[int, ...], int, int]:
    """The aux hidden-state layers that cross this stage's boundaries, and
    its layer range. A model that does not relay taps across stages
    (``supports_aux_hidden_states_over_pp``) captures its first one from what
    it received and sends none, so none cross."""
    for module in model.modules():
        if isinstance(module, EagleModelMixin):
            relays = module.supports_aux_hidden_states_over_pp
            return (
                tuple(module.aux_hidden_state_layers) if relays else (),
                module.start_layer,
                getattr(module, "end_layer", module.start_layer),
            )
    return (), 0, 0


def pp_hand_off_settings(
    vllm_config: VllmConfig, model: nn.Module, padding: RunnerPadding
) -> dict[str, Any]:
    """What decides the shapes and the transport of this stage's hand-offs."""
    pp_group = get_pp_group()
    overrides = get_pp_all_gather_overrides(model) or {}
    layers, start, end = aux_hidden_state_layers(model)
    aux_key = EagleModelMixin.AUX_HIDDEN_STATE_KEY
    speculative_config = vllm_config.speculative_config
    scheduler_config = vllm_config.scheduler_config
    return {
        # A model keeps stage outputs sequence parallel exactly when it
        # declares keys that are TP shards, not replicas.
        "sequence_parallel": any(not gather for gather in overrides.values()),
        # Aux slots are compared per boundary, below.
        "all_gather_tensors": {
            key: gather
            for key, gather in overrides.items()
            if not key.startswith(aux_key)
        },
        # What decides the warm-up steps, shown where the steps differ.
        "warm_up": {
            "enable_jit_warmup": vllm_config.kernel_config.enable_jit_warmup,
            "enable_extensible_kv_cache": (
                vllm_config.cache_config.enable_extensible_kv_cache
            ),
            "speculative_decoding": speculative_config is not None,
            "num_speculative_tokens": vllm_config.num_speculative_tokens,
            "max_num_batched_tokens": scheduler_config.max_num_batched_tokens,
            "max_num_seqs": scheduler_config.max_num_seqs,
        },
        "kv_cache_sizing": {
            "max_model_len": vllm_config.model_config.max_model_len,
            "max_logprobs": vllm_config.model_config.max_logprobs,
        },
        # The steps themselves: compared.
        "warm_up_steps": warm_up_steps(vllm_config, padding.decode_query_len),
        # A stage relays every aux state captured up to its last boundary and
        # expects those captured up to its first.
        "aux_slots_received": (
            0 if pp_group.is_first_rank else bisect_right(layers, start)
        ),
        "aux_slots_sent": 0 if pp_group.is_last_rank else bisect_right(layers, end),
        "batch_shapes": padding.bounds,
        "cudagraph_mode": str(padding.cudagraph_mode),
        "cudagraph_capture_sizes": list(
            vllm_config.compilation_config.cudagraph_capture_sizes or ()
        ),
        "enforce_eager": vllm_config.model_config.enforce_eager,
        "max_num_seqs": vllm_config.scheduler_config.max_num_seqs,
        "max_num_batched_tokens": vllm_config.scheduler_config.max_num_batched_tokens,
        "moe_backend": vllm_config.kernel_config.moe_backend,
        "enable_expert_parallel": vllm_config.parallel_config.enable_expert_parallel,
        "aux_hidden_state_layers": layers,
    }


def warm_up_steps(
    vllm_config: VllmConfig, decode_query_len: int
) -> dict[str, Any] | None:
    """The warm-up steps this stage runs through the worker, and so through
    every PP boundary, before serving (``gpu/warmup.py``): the kernel
    warm-up (JIT warm-up or the extensible KV cache; a second, greedy pass
    with spec decode) as its passes, requests and the runner's decode query
    length, which fix its steps, and the extensible KV cache's sizing steps
    as the tokens each request schedules. Stages that run other steps send
    what no neighbour receives. The caps by KV blocks are left out: vLLM
    takes them alike on every rank (the engine's block count,
    ``_min_across_ranks``)."""
    cache_config = vllm_config.cache_config
    extensible = cache_config.enable_extensible_kv_cache
    if not (vllm_config.kernel_config.enable_jit_warmup or extensible):
        return None
    scheduler_config = vllm_config.scheduler_config
    speculative_config = vllm_config.speculative_config
    budget = scheduler_config.max_num_batched_tokens
    max_num_reqs = scheduler_config.max_num_seqs
    draft_slots = (
        0
        if speculative_config is None
        else speculative_config.max_num_new_slots_for_drafting
    )
    steps: dict[str, Any] = {
        "kernel_warm_up": (
            1 + (speculative_config is not None),
            min(max_num_reqs, budget // (decode_query_len + 1 + draft_slots)),
            decode_query_len,
        )
    }
    if not extensible:
        return steps
    model_config = vllm_config.model_config
    max_model_len = model_config.max_model_len
    sizing = []
    max_prompt_len = min(budget, max_model_len)
    if model_config.max_logprobs != 0 and max_prompt_len < budget and max_num_reqs > 1:
        sizing.append(max_prompt_len)
    sizing.append(budget)
    steps["kv_cache_sizing"] = [
        _sizing_step(vllm_config, num_tokens, decode_query_len, draft_slots)
        for num_tokens in sizing
    ]
    if model_config.use_mla:
        steps["kv_cache_sizing"].append(
            _context_prefill_step(vllm_config, decode_query_len + 1, draft_slots)
        )
    return steps


def _sizing_step(
    vllm_config: VllmConfig, num_tokens: int, decode_query_len: int, draft_slots: int
) -> tuple[int, ...]:
    """The tokens each request schedules in a mixed prefill and decode
    sizing step of ``num_tokens`` (``run_mixed_prefill_decode_warmup``, with
    its prefill-only fallback): prompts of at most ``max_model_len - 1``,
    a decode beside them where a request slot is left."""
    max_num_reqs = vllm_config.scheduler_config.max_num_seqs
    max_prefill_len = vllm_config.model_config.max_model_len - 1
    if vllm_config.speculative_config is None:
        decode_query_len = 1
    with_decode = (
        max_num_reqs >= 2
        and cdiv(num_tokens - decode_query_len, max_prefill_len) < max_num_reqs
    )
    decode_tokens = decode_query_len if with_decode else 0
    num_prefills = min(
        cdiv(num_tokens - decode_tokens, max_prefill_len),
        max_num_reqs - with_decode,
    )
    num_tokens = min(num_tokens, decode_tokens + num_prefills * max_prefill_len)
    if vllm_config.speculative_config is not None:
        num_tokens = min(
            num_tokens,
            vllm_config.scheduler_config.max_num_batched_tokens
            - (with_decode + num_prefills) * draft_slots,
        )
    if num_tokens < 3:
        return ()
    prefill_tokens = num_tokens - decode_tokens
    return (decode_tokens,) * with_decode + tuple(
        min(max_prefill_len, prefill_tokens - start)
        for start in range(0, prefill_tokens, max_prefill_len)
    )


def _context_prefill_step(
    vllm_config: VllmConfig, query_len: int, draft_slots: int
) -> tuple[int, ...]:
    """MLA's context-prefill sizing step (``run_context_prefill_warmup``):
    requests of ``query_len`` tokens over one chunked-context workspace."""
    from vllm.model_executor.layers.attention.mla_attention import (
        MLACommonMetadataBuilder,
    )

    workspace = MLACommonMetadataBuilder.determine_chunked_prefill_workspace_size(
        vllm_config
    )
    context_len = min(vllm_config.model_config.max_model_len - query_len - 1, workspace)
    if context_len <= 0:
        return ()
    num_reqs = min(
        cdiv(workspace, context_len),
        vllm_config.scheduler_config.max_num_seqs,
        vllm_config.scheduler_config.max_num_batched_tokens
        // (query_len + draft_slots),
    )
    return (query_len,) * num_reqs


def hand_off_rows(
    model: nn.Module, padding: RunnerPadding, shapes: list[BatchShape]
) -> list[tuple[int, int | None]]:
    """Per batch: the tokens this stage dispatches, and the rows the model
    declares for them (``None``: replicas of every dispatched row)."""
    declared: dict[int, int | None] = {}
    rows = []
    for shape in shapes:
        num_tokens = padding.padded_num_tokens(shape)
        if num_tokens not in declared:
            declared[num_tokens] = get_pp_num_rows(model, num_tokens)
        rows.append((num_tokens, declared[num_tokens]))
    return rows


@dataclass(frozen=True)
class StageError:
    """A stage that could not compute its part, sent in its place."""

    message: str


Answer = TypeVar("Answer")


class StagesCouldNotAnswer(RuntimeError):
    """Some stage could not compute its part; every stage raises it."""


def gather_from_stages(compute: Callable[[], Answer]) -> list[Answer]:
    """Every stage's answer. A stage whose own computation raises sends its
    error instead, so every stage raises at once, none waits on the rest."""
    pp_group = get_pp_group()
    failure: Exception | None = None
    try:
        mine: Answer | StageError = compute()
    except Exception as error:  # sent to the other stages, then raised
        failure = error
        mine = StageError(f"{type(error).__name__}: {error}")
    everyone: list[Any] = [None] * pp_group.world_size
    dist.all_gather_object(everyone, mine, group=pp_group.cpu_group)
    failed = [(n, a) for n, a in enumerate(everyone) if isinstance(a, StageError)]
    if failed:
        raise StagesCouldNotAnswer(
            "Pipeline stages could not compare their hand-off settings: "
            + "; ".join(f"stage {n}: {answer.message}" for n, answer in failed)
        ) from failure
    return everyone


def differences(everyone: list[dict[str, Any]], keys: tuple[str, ...]) -> list[str]:
    return [
        f"{key}: " + ", ".join(f"stage {n}={s[key]}" for n, s in enumerate(everyone))
        for key in keys
        if any(s[key] != everyone[0][key] for s in everyone)
    ]


def aux_slot_problems(everyone: list[dict[str, Any]]) -> list[str]:
    problems = []
    for stage in range(len(everyone) - 1):
        sent = everyone[stage]["aux_slots_sent"]
        expected = everyone[stage + 1]["aux_slots_received"]
        if sent != expected:
            problems.append(
                f"aux_hidden_state_slots: stage {stage} sends {sent}, "
                f"stage {stage + 1} expects {expected}"
            )
    return problems


def warm_up_problems(everyone: list[dict[str, Any]]) -> list[str]:
    """Warm-up steps that differ, shown by what decides them."""
    steps = [s["warm_up_steps"] for s in everyone]
    if all(step == steps[0] for step in steps):
        return []
    sizing = any(step and "kv_cache_sizing" in step for step in steps)
    keys = ("warm_up", "kv_cache_sizing") if sizing else ("warm_up",)
    return differences(everyone, keys) or differences(everyone, ("warm_up_steps",))


def padding_problem(
    shapes: list[BatchShape], rows: list[list[tuple[int, int | None]]]
) -> str | None:
    """The first batch one stage hands on in rows the next refuses: the
    runner's own rule (``accepts_hand_off``), for every batch it dispatches."""
    for i, shape in enumerate(shapes):
        for stage in range(len(rows) - 1):
            sent_tokens, declared = rows[stage][i]
            sent = sent_tokens if declared is None else declared
            num_tokens, expected = rows[stage + 1][i]
            if not accepts_hand_off(sent, num_tokens, expected):
                wants = f"at least {num_tokens}" if expected is None else expected
                return (
                    f"batch_padding: {shape} is dispatched as {sent_tokens} "
                    f"tokens on stage {stage}, which sends {sent} rows, and as "
                    f"{num_tokens} on stage {stage + 1}, which expects {wants}"
                )
    return None


def check_pp_hand_off_agreement(
    vllm_config: VllmConfig, model: nn.Module, model_runner: object
) -> None:
    """Raise on every stage unless all PP stages would hand off alike; log
    the differences that cannot break a hand-off."""
    if get_pp_group().world_size == 1:
        return
    # A silent or foreign stage would leave the rounds below waiting.
    announce_and_wait()
    paddings: list[RunnerPadding] = []

    def settings() -> dict[str, Any]:
        paddings.append(RunnerPadding(vllm_config, model_runner))
        return pp_hand_off_settings(vllm_config, model, paddings[0])

    everyone = gather_from_stages(settings)
    shapes = batch_shapes([s["batch_shapes"] for s in everyone])
    sequence_parallel = any(s["sequence_parallel"] for s in everyone)
    try:
        rows = gather_from_stages(lambda: hand_off_rows(model, paddings[0], shapes))
    except StagesCouldNotAnswer as error:
        if sequence_parallel:
            raise
        # Without SP a runner whose padding cannot be asked (an out-of-tree
        # graph manager) starts as it did before, when nothing was compared.
        logger.warning("%s; batch padding not compared.", error)
        rows = None

    problems = differences(everyone, REFUSED) + aux_slot_problems(everyone)
    problems += warm_up_problems(everyone)
    if not problems and rows and (problem := padding_problem(shapes, rows)):
        problems.append(problem)
    shown = differences(everyone, SHOWN)
    if not problems:
        if shown:
            logger.warning(
                "Pipeline stages differ in %s; their hand-offs still agree.",
                "; ".join(shown),
            )
        return
    keys = [text.split(":", 1)[0] for text in problems + shown]
    options = ", ".join(dict.fromkeys(name for key in keys for name in OPTIONS[key]))
    hint = CUDAGRAPH_MODE_HINT if "batch_padding" in keys else ""
    raise RuntimeError(
        "Pipeline stages disagree on their hand-off and would hang or mix rows "
        f"at the first one ({'; '.join(problems + shown)}). Start every node "
        f"with the same {options}.{hint}"
    )
