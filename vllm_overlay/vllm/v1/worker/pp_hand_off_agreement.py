# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Pipeline stages must agree on everything their hand-off depends on.

Each stage builds its own ``VllmConfig`` from its own command line (a headless
node is started by hand), and vLLM compares parallel settings across nodes
only for data parallelism. A stage that pads batches to other CUDA graph
sizes, keeps its outputs sequence parallel while its neighbour does not, or
relays another number of aux hidden states posts receives of other shapes
than its neighbour sends: NCCL then hangs or mixes rows. Comparing what each
stage would send and expect across the PP group, before the first hand-off,
turns that into an error on every stage that shows each stage's values.
"""

from typing import Any

import torch.distributed as dist
from torch import nn

from vllm.config import VllmConfig
from vllm.distributed.parallel_state import get_pp_group
from vllm.distributed.pp_sequence_parallel import pp_all_gather_overrides
from vllm.model_executor.models.interfaces import EagleModelMixin

# The command-line options behind each compared value, named in the error.
OPTIONS: dict[str, tuple[str, ...]] = {
    "enforce_eager": ("--enforce-eager",),
    "cudagraph_mode": ("--compilation-config",),
    "cudagraph_capture_sizes": (
        "--max-cudagraph-capture-size",
        "--compilation-config",
    ),
    "enable_expert_parallel": ("--enable-expert-parallel",),
    "moe_backend": ("--kernel-config",),
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
    "aux_hidden_state_layers": (
        "--speculative-config (eagle_aux_hidden_state_layer_ids)",
    ),
}


def aux_hidden_state_layers(model: nn.Module) -> tuple[int, ...]:
    """The model's aux hidden-state layers: one relay slot each."""
    for module in model.modules():
        if isinstance(module, EagleModelMixin):
            return tuple(module.aux_hidden_state_layers)
    return ()


def pp_hand_off_settings(vllm_config: VllmConfig, model: nn.Module) -> dict[str, Any]:
    """What decides the shapes and the transport of this stage's hand-off."""
    compilation_config = vllm_config.compilation_config
    overrides = pp_all_gather_overrides(model)
    return {
        "enforce_eager": vllm_config.model_config.enforce_eager,
        "cudagraph_mode": str(compilation_config.cudagraph_mode),
        "cudagraph_capture_sizes": list(
            compilation_config.cudagraph_capture_sizes or ()
        ),
        "enable_expert_parallel": vllm_config.parallel_config.enable_expert_parallel,
        "moe_backend": vllm_config.kernel_config.moe_backend,
        # A model keeps stage outputs sequence parallel exactly when it
        # declares keys that are TP shards, not replicas.
        "sequence_parallel": any(not gather for gather in (overrides or {}).values()),
        "all_gather_tensors": overrides,
        "aux_hidden_state_layers": aux_hidden_state_layers(model),
    }


def check_pp_hand_off_agreement(vllm_config: VllmConfig, model: nn.Module) -> None:
    """Raise on every stage unless all PP stages would hand off alike."""
    pp_group = get_pp_group()
    if pp_group.world_size == 1:
        return
    settings = pp_hand_off_settings(vllm_config, model)
    everyone: list[dict[str, Any] | None] = [None] * pp_group.world_size
    dist.all_gather_object(everyone, settings, group=pp_group.cpu_group)
    differ = [key for key in settings if any(o[key] != settings[key] for o in everyone)]
    if not differ:
        return
    values = "; ".join(
        f"{key}: "
        + ", ".join(f"stage {stage}={o[key]}" for stage, o in enumerate(everyone))
        for key in differ
    )
    options = ", ".join(dict.fromkeys(name for key in differ for name in OPTIONS[key]))
    raise RuntimeError(
        "Pipeline stages disagree on their hand-off and would hang or mix rows "
        f"at the first one ({values}). Start every node with the same {options}."
    )
