# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Each PP stage builds its own VllmConfig from its own command line. Stages
that disagree on how a key travels (SP shards or TP replicas), on the aux
states a boundary carries, on their warm-up steps or on the tokens they pad a
batch to hang, mix rows or fail at the first step: this raises on every
stage first, showing each stage's values and the options behind them."""

import json
import os
import socket
import sys
import time
from bisect import bisect_right
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from itertools import count, pairwise
from typing import Any

import torch.distributed as dist
from torch import nn

from vllm.distributed.parallel_state import get_pp_group
from vllm.logger import init_logger
from vllm.model_executor.models.interfaces import EagleModelMixin, get_pp_num_rows
from vllm.utils.math_utils import cdiv
from vllm.v1.cudagraph_dispatcher import CudagraphDispatcher
from vllm.v1.worker.gpu.cudagraph_utils import CudaGraphManager
from vllm.v1.worker.pp_intermediate_tensors import accepts_hand_off
from vllm.version import __version__

logger = init_logger(__name__)

TIMEOUT_ENV = "VLLM_PP_STAGE_ANNOUNCE_TIMEOUT"
TRANSPORT = "--kernel-config, --enable-expert-parallel, --tensor-parallel-size"
AUX = "--speculative-config (eagle_aux_hidden_state_layer_ids), VLLM_PP_LAYER_PARTITION"
PADDING = (
    "--compilation-config, --max-cudagraph-capture-size, --enforce-eager, "
    "--max-num-seqs, --speculative-config (num_speculative_tokens). If the flags "
    "already match, a stage's attention backends or drafter lowered the CUDA "
    "graph mode it resolved: set a cudagraph_mode every stage supports"
)
WARM_UP = "--kernel-config (enable_jit_warmup), --speculative-config"

_rounds = count()


def stage_build() -> str:
    """What every stage of a deployment must run alike."""
    commit = getattr(sys.modules.get("vllm._version"), "__commit_id__", None)
    return f"vLLM {__version__}" + (f" ({commit})" if commit else "")


def announce_pp_stages(settings: dict[str, Any], timeout: float | None = None) -> None:
    """Announce this stage's build and ``settings`` through the c10d store,
    which answers without the peers, and wait for every other stage's: a
    stage without this check would leave the others in a collective for good."""
    pp = get_pp_group()
    if pp.world_size == 1:
        return
    timeout = timeout or float(os.environ.get(TIMEOUT_ENV) or 120)
    store = dist.distributed_c10d._get_default_store()
    key = f"pp_stage_announce/{'-'.join(map(str, pp.ranks))}/{next(_rounds)}/"
    mine = {"build": stage_build(), "host": socket.gethostname(), **settings}
    store.set(key + str(pp.rank_in_group), json.dumps(mine))
    everyone = {pp.rank_in_group: mine}
    deadline = time.monotonic() + timeout
    while missing := [n for n in range(pp.world_size) if n not in everyone]:
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"PP stage(s) {missing} did not announce themselves within "
                f"{timeout:.0f} s ({TIMEOUT_ENV}): they did not start, or run "
                f"another vLLM build than this stage's {mine['build']}."
            )
        for n in missing:
            if store.check([key + str(n)]):
                raw = store.get(key + str(n))
                try:
                    everyone[n] = dict(json.loads(raw))
                except (ValueError, TypeError):
                    everyone[n] = {"build": f"unreadable {raw[:40]!r}"}
        time.sleep(0.01)
    stages = [everyone[n] for n in range(pp.world_size)]
    if problems := differences(stages, list(settings) + ["build"]):
        raise RuntimeError(
            "PP stages run different builds or settings and would wait on each "
            f"other in a collective ({'; '.join(problems)}). Start every node "
            "with the same vLLM and options."
        )


def differences(stages: list[dict[str, Any]], keys: list[str]) -> list[str]:
    on = [
        f"stage {n}" + (f" on {s['host']}" if "host" in s else "")
        for n, s in enumerate(stages)
    ]
    return [
        f"{key}: "
        + ", ".join(f"{on[n]}={s.get(key, 'none')}" for n, s in enumerate(stages))
        for key in keys
        if any(s.get(key) != stages[0].get(key) for s in stages)
    ]


def gather_from_stages(compute: Callable[[], Any]) -> list[Any]:
    """Every stage's answer; an error (a str) is sent instead, and every stage
    raises at once."""
    pp = get_pp_group()
    failure = None
    try:
        mine = compute()
    except Exception as error:  # sent to the other stages, then raised
        failure, mine = error, f"{type(error).__name__}: {error}"
    everyone: list[Any] = [None] * pp.world_size
    dist.all_gather_object(everyone, mine, group=pp.cpu_group)
    failed = [f"stage {n}: {a}" for n, a in enumerate(everyone) if isinstance(a, str)]
    if failed:
        raise RuntimeError(
            "Pipeline stages could not compare their hand-off settings: "
            + "; ".join(failed)
        ) from failure
    return everyone


@dataclass(frozen=True)
class BatchShape:
    """A batch the scheduler hands every stage alike."""

    num_tokens: int
    num_reqs: int
    uniform_token_count: int | None = None
    max_query_len: int | None = None  # None: a batch with a prefill
    num_active_loras: int = 0

    def __str__(self) -> str:
        if self.uniform_token_count is not None:
            kind = f"a uniform decode of {self.uniform_token_count} per request"
        elif self.max_query_len is not None:
            kind = f"decodes of up to {self.max_query_len} tokens"
        else:
            kind = "with a prefill"
        fewest = cdiv(self.num_tokens, self.max_query_len or self.num_tokens)
        if self.uniform_token_count is None and self.num_reqs > fewest:
            kind += f", {self.num_reqs} requests"
        loras = f", {self.num_active_loras} LoRA(s)" if self.num_active_loras else ""
        return f"a batch of {self.num_tokens} tokens ({kind}{loras})"


def batch_shapes(bounds: list[dict[str, Any]]) -> list[BatchShape]:
    """Every batch whose padding can differ between stages: as many tokens as
    any stage's graphs pad and stage 0's scheduler sends (it runs on the
    engine's node). A graph holds at most its stage's --max-num-seqs
    requests and at least the batch's tokens, so the fewest requests a batch
    can have and one past each stage's limit stand for every count."""
    max_reqs, budget = bounds[0]["max_num_reqs"], bounds[0]["max_num_batched_tokens"]
    max_tokens = min(max(b["max_num_tokens"] for b in bounds), budget)
    max_query_len = max(b["max_query_len"] for b in bounds)
    loras = sorted({n for b in bounds for n in b["lora_counts"]})
    past_limits = sorted({b["max_num_reqs"] + 1 for b in bounds})

    def counts(num_tokens: int, least: int) -> list[int]:
        most = min(num_tokens, max_reqs)
        return [n for n in (least, *past_limits) if least <= n <= most]

    shapes = []
    for num_tokens in range(1, max_tokens + 1):
        for lora in loras:
            for n in counts(num_tokens, 1):
                shapes.append(BatchShape(num_tokens, n, None, None, lora))
            for q in range(1, max_query_len + 1):
                for n in counts(num_tokens, cdiv(num_tokens, q)):
                    shapes.append(BatchShape(num_tokens, n, None, q, lora))
                if num_tokens % q == 0 and num_tokens // q <= max_reqs:
                    shapes.append(BatchShape(num_tokens, num_tokens // q, q, q, lora))
    return shapes


def refusal(problems: list[str], options: str) -> RuntimeError:
    return RuntimeError(
        "Pipeline stages disagree on their hand-off and would hang or mix rows "
        f"at the first one ({'; '.join(problems)}). Start every node with the "
        f"same {options}."
    )


class PPStageCheck:
    """Built before the first PP step (kernel warm-up); ``warm_up`` wraps
    execute_model for the warm-up steps; ``finish`` once graphs are captured."""

    def __init__(
        self,
        vllm_config: Any,
        model: nn.Module,
        model_runner: object,
        all_gather_tensors: dict[str, bool] | None,
    ) -> None:
        self.stages = get_pp_group().world_size
        if self.stages == 1:
            return
        self.model = model
        # How the runner pads a batch, as it resolved its CUDA graph mode
        # (attention backends and a drafter may lower the requested one).
        manager = getattr(model_runner, "cudagraph_manager", None)
        self.manager = manager if isinstance(manager, CudaGraphManager) else None
        dispatcher = getattr(model_runner, "cudagraph_dispatcher", None)
        if not isinstance(dispatcher, CudagraphDispatcher):
            dispatcher = None
        self.dispatcher = dispatcher
        compilation = vllm_config.compilation_config
        mode = compilation.cudagraph_mode
        query_len = 1 + vllm_config.num_speculative_tokens
        if self.manager:
            mode, query_len = self.manager.cudagraph_mode, self.manager.decode_query_len
        elif dispatcher:  # the legacy model runner
            mode = dispatcher.cudagraph_mode
            query_len = dispatcher.uniform_decode_query_len
        lora_config, scheduler = vllm_config.lora_config, vllm_config.scheduler_config
        graph_tokens = (compilation.max_cudagraph_capture_size or 0) if mode else 0
        self.bounds = {
            "max_num_tokens": graph_tokens,
            "max_query_len": query_len,
            "lora_counts": range(lora_config.max_loras + 1 if lora_config else 1),
            "max_num_reqs": scheduler.max_num_seqs,
            "max_num_batched_tokens": scheduler.max_num_batched_tokens,
        }
        self.graphs = (
            f"{mode}, sizes {compilation.cudagraph_capture_sizes}, "
            f"max_num_seqs {scheduler.max_num_seqs}"
        )
        self.warm_up_options = {
            "enable_jit_warmup": vllm_config.kernel_config.enable_jit_warmup,
            "num_speculative_tokens": vllm_config.num_speculative_tokens,
        }
        self.steps = 0
        everyone = gather_from_stages(lambda: self.settings(all_gather_tensors))
        if problems := differences(
            everyone, ["sequence_parallel", "all_gather_tensors"]
        ):
            raise refusal(problems, TRANSPORT)
        if problems := [
            f"aux_hidden_state_slots: stage {n} sends {a['aux_sent']}, stage "
            f"{n + 1} expects {b['aux_received']}"
            for n, (a, b) in enumerate(pairwise(everyone))
            if a["aux_sent"] != b["aux_received"]
        ]:
            raise refusal(problems, AUX)
        if scrambled := [
            f"stage {n}: {', '.join(s['aux_replicated'])}"
            for n, s in enumerate(everyone)
            if s["aux_replicated"]
        ]:
            raise RuntimeError(
                "Pipeline stages would hand aux hidden states over scrambled: "
                f"{'; '.join(scrambled)} cross a stage boundary as TP replicas "
                "while the hidden states are sequence-parallel shards. The model's "
                "get_pp_intermediate_tensor_all_gather_overrides() must map them "
                "to False once the aux layers are set."
            )
        self.sequence_parallel = everyone[0]["sequence_parallel"]
        self.everyone = everyone
        self.shapes = batch_shapes([s["bounds"] for s in everyone])

    def settings(self, all_gather_tensors: dict[str, bool] | None) -> dict:
        """How this stage's hand-offs travel (``all_gather_tensors``: what the
        worker's PP sends and receives pass), and what bounds its padding."""
        pp = get_pp_group()
        overrides = all_gather_tensors or {}
        layers, start, end = (), 0, 0
        for module in self.model.modules():
            if isinstance(module, EagleModelMixin):
                relays = module.supports_aux_hidden_states_over_pp
                layers = tuple(module.aux_hidden_state_layers) if relays else ()
                start = module.start_layer
                end = getattr(module, "end_layer", start)
                break
        aux_key = EagleModelMixin.AUX_HIDDEN_STATE_KEY
        received = 0 if pp.is_first_rank else bisect_right(layers, start)
        sent = 0 if pp.is_last_rank else bisect_right(layers, end)
        # Shards exactly where the model declares keys that are not replicas.
        sequence_parallel = not all(overrides.values())
        crossing = [f"{aux_key}{slot}" for slot in range(max(received, sent))]
        return {
            "sequence_parallel": sequence_parallel,
            "all_gather_tensors": {
                k: v for k, v in overrides.items() if not k.startswith(aux_key)
            },
            "aux_received": received,
            "aux_sent": sent,
            "aux_replicated": [
                k for k in crossing if sequence_parallel and overrides.get(k, True)
            ],
            "bounds": self.bounds,
            "graphs": self.graphs,
        }

    def warm_up(self, execute_model: Callable[[Any], Any]) -> Callable[[Any], Any]:
        """``execute_model`` that compares each warm-up step with every
        stage's before it runs: the steps, not the options that size them."""
        if self.stages == 1:
            return execute_model

        def compared(scheduler_output: Any) -> Any:
            spec = scheduler_output.scheduled_spec_decode_tokens
            requests = Counter(
                (n, len(spec.get(req_id, ())))
                for req_id, n in scheduler_output.num_scheduled_tokens.items()
            )
            self.steps += 1
            self._compare_warm_up(dict(sorted(requests.items())))
            return execute_model(scheduler_output)

        return compared

    def _compare_warm_up(self, step: Any, rows: Any = None) -> list[dict]:
        answer = {"step": (self.steps, step), "rows": rows}
        everyone = gather_from_stages(lambda: answer)
        if any(s["step"] != everyone[0]["step"] for s in everyone):
            runs = [
                f"stage {n} finished after {k} steps"
                if what == "done"
                else f"stage {n} runs step {k}, requests per (tokens, drafts) {what}"
                for n, (k, what) in enumerate(s["step"] for s in everyone)
            ]
            options = gather_from_stages(lambda: self.warm_up_options)
            raise refusal(
                ["warm_up: " + ", ".join(runs)]
                + differences(options, list(self.warm_up_options)),
                WARM_UP,
            )
        return everyone

    def finish(self) -> None:
        """The end of warm-up; then, per batch the scheduler can send, the
        tokens each stage pads it to and its model's rows for them."""
        if self.stages == 1:
            return
        try:
            rows = [
                (tokens, get_pp_num_rows(self.model, tokens))
                for tokens in map(self.padded_num_tokens, self.shapes)
            ]
        except Exception as error:  # shown by every stage
            rows = f"{type(error).__name__}: {error}"
        everyone = [s["rows"] for s in self._compare_warm_up("done", rows)]
        if failed := [
            f"stage {n}: {r}" for n, r in enumerate(everyone) if isinstance(r, str)
        ]:
            message = "; ".join(failed)
            if self.sequence_parallel:
                raise RuntimeError(
                    f"Pipeline stages could not compare their padding: {message}"
                )
            logger.warning("%s; batch padding not compared.", message)
            return
        for i, shape in enumerate(self.shapes):
            for n in range(self.stages - 1):
                sent_tokens, declared = everyone[n][i]
                sent = sent_tokens if declared is None else declared
                tokens, expected = everyone[n + 1][i]
                if accepts_hand_off(sent, tokens, expected):
                    continue
                wants = f"at least {tokens}" if expected is None else expected
                graphs = [
                    f"stage {m}: {self.everyone[m]['graphs']}" for m in (n, n + 1)
                ]
                problem = (
                    f"batch_padding: {shape} is dispatched as {sent_tokens} tokens "
                    f"on stage {n}, which sends {sent} rows, and as {tokens} on "
                    f"stage {n + 1}, which expects {wants}"
                )
                raise refusal([problem, *graphs], PADDING)

    def padded_num_tokens(self, s: BatchShape) -> int:
        """The tokens a batch runs as once graphs are captured."""
        if self.dispatcher is not None:
            _, desc = self.dispatcher.dispatch(
                s.num_tokens,
                uniform_decode=s.uniform_token_count == self.bounds["max_query_len"],
                has_lora=s.num_active_loras > 0,
                num_active_loras=s.num_active_loras,
            )
            return desc.num_tokens
        if self.manager is None:
            return s.num_tokens
        loras, query_len = s.num_active_loras, s.max_query_len
        args = (s.num_reqs, s.num_tokens, s.uniform_token_count, loras, query_len)
        return self.manager.dispatch(*args).num_tokens


def check_aux_layers_on_the_last_stage(model: nn.Module) -> None:
    """The V1 model runner sets aux layers on the last PP stage only: one
    that relays taps and expects some at or before its first layer would fail
    at its first forward ("Missing aux_hidden_states_0")."""
    if get_pp_group().is_first_rank:
        return
    for module in model.modules():
        if isinstance(module, EagleModelMixin):
            if not module.supports_aux_hidden_states_over_pp:
                return
            start = module.start_layer
            upstream = [n for n in module.aux_hidden_state_layers if n <= start]
            break
    else:
        return
    if upstream:
        raise ValueError(
            f"Aux hidden-state layers {upstream} are captured at or before "
            f"layer {start}, where the last PP stage begins, and the V1 model "
            "runner sets aux layers on the last stage only: no stage would "
            "send them. Use the V2 model runner (VLLM_USE_V2_MODEL_RUNNER=1), "
            "whose stages relay them, or choose --speculative-config "
            f"eagle_aux_hidden_state_layer_ids above {start} or another "
            "VLLM_PP_LAYER_PARTITION."
        )
