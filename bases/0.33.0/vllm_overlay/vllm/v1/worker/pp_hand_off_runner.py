# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""What this vLLM's model runners do that a stage's hand-offs depend on: how
they pad a batch, the steps they run through every PP boundary before
serving, and where they set aux layers. The agreement
(``pp_hand_off_agreement``) compares them across stages; they follow the
runners, so they change with them.
"""

from typing import Any

from torch import nn

from vllm.config import VllmConfig
from vllm.distributed.parallel_state import get_pp_group
from vllm.v1.cudagraph_dispatcher import CudagraphDispatcher
from vllm.v1.worker.gpu.cudagraph_utils import CudaGraphManager
from vllm.v1.worker.pp_hand_off_shapes import (
    BatchShape,
    ShapeBounds,
    aux_hidden_state_layers,
)

# The command-line options behind each runner setting, named in the error.
RUNNER_OPTIONS: dict[str, tuple[str, ...]] = {
    "warm_up": (
        "--kernel-config (enable_jit_warmup)",
        "--speculative-config",
    ),
}


class RunnerPadding:
    """How this stage's runner pads a batch: its CUDA graph dispatch, as it
    resolved it (attention backends and a drafter may lower the requested
    mode), known before any graph is captured."""

    def __init__(self, vllm_config: VllmConfig, model_runner: object) -> None:
        compilation_config = vllm_config.compilation_config
        self.cudagraph_mode = compilation_config.cudagraph_mode
        self.decode_query_len = 1 + vllm_config.num_speculative_tokens
        self.manager: CudaGraphManager | None = None
        self.dispatcher: CudagraphDispatcher | None = None
        manager = getattr(model_runner, "cudagraph_manager", None)
        dispatcher = getattr(model_runner, "cudagraph_dispatcher", None)
        if isinstance(manager, CudaGraphManager):  # model runner V2
            self.manager = manager
            self.cudagraph_mode = manager.cudagraph_mode
            self.decode_query_len = manager.decode_query_len
        elif isinstance(dispatcher, CudagraphDispatcher):  # legacy model runner
            self.dispatcher = dispatcher
            self.cudagraph_mode = dispatcher.cudagraph_mode
            self.decode_query_len = dispatcher.uniform_decode_query_len
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
        if self.dispatcher is not None:
            _, desc = self.dispatcher.dispatch(
                shape.num_tokens,
                uniform_decode=shape.uniform_token_count == self.decode_query_len,
                has_lora=shape.num_active_loras > 0,
                num_active_loras=shape.num_active_loras,
            )
            return desc.num_tokens
        return shape.num_tokens


def runner_settings(
    vllm_config: VllmConfig, padding: RunnerPadding, aux_layers: tuple[int, ...]
) -> dict[str, Any]:
    """The runners' part of a stage's hand-off settings. The V2 runner's JIT
    warm-up runs real PP steps through the worker, a second pass of them with
    spec decode, each sized by the decode query length: what decides them
    stands for the steps, compared where some stage runs them. The legacy
    runner sets aux layers on the last stage only (shown)."""
    speculative_config = vllm_config.speculative_config
    warm_up = {
        "enable_jit_warmup": vllm_config.use_v2_model_runner
        and vllm_config.kernel_config.enable_jit_warmup,
        "speculative_decoding": speculative_config is not None,
        "num_speculative_tokens": vllm_config.num_speculative_tokens,
    }
    return {
        "warm_up": warm_up,
        "warm_up_steps": warm_up if warm_up["enable_jit_warmup"] else None,
        "aux_hidden_state_layers": (
            aux_layers if vllm_config.use_v2_model_runner else None
        ),
    }


def check_aux_layers_on_the_last_stage(model: nn.Module) -> None:
    """The V1 model runner sets aux layers on the last PP stage only, so no
    earlier stage captures or relays a tap: a last stage that relays taps and
    expects some at or before its first layer would wait for aux states
    nobody sends and fail at its first forward ("Missing
    aux_hidden_states_0"), the memory profiling run. The worker asks once the
    V1 runner loaded the model."""
    pp_group = get_pp_group()
    if pp_group.is_first_rank:
        return
    layers, start, _ = aux_hidden_state_layers(model)
    upstream = [layer for layer in layers if layer <= start]
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
