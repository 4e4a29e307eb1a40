# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Pipeline stages must agree on everything their hand-off depends on.

Each stage builds its own ``VllmConfig`` from its own command line (a headless
node is started by hand), and vLLM compares parallel settings across nodes
only for data parallelism. A stage that pads batches to other CUDA graph
sizes, keeps its outputs sequence parallel while its neighbour does not, or
sends another number of aux hidden states than its neighbour expects posts
transfers of other shapes than its neighbour: NCCL then hangs or mixes rows.
Comparing what each stage would send and expect across the PP group, before
the first hand-off, turns that into an error on every stage that shows each
stage's values.
"""

from bisect import bisect_right
from typing import Any

import torch.distributed as dist
from torch import nn

from vllm.config import VllmConfig
from vllm.distributed.parallel_state import get_pp_group
from vllm.model_executor.models.interfaces import (
    EagleModelMixin,
    get_pp_all_gather_overrides,
)

# The command-line options behind each value, named in the error.
OPTIONS: dict[str, tuple[str, ...]] = {
    "enforce_eager": ("--enforce-eager",),
    "cudagraph_mode": ("--compilation-config",),
    "cudagraph_capture_sizes": (
        "--max-cudagraph-capture-size",
        "--compilation-config",
    ),
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
    "moe_backend": ("--kernel-config",),
    "enable_expert_parallel": ("--enable-expert-parallel",),
    "aux_hidden_state_layers": (
        "--speculative-config (eagle_aux_hidden_state_layer_ids)",
    ),
}

# Shown when they differ, to point at the option, but not refused on their
# own: the hand-off does not depend on them directly (the legacy runner sets
# aux layers on the last stage only, and each stage's EP group is its own).
CONTEXT = ("moe_backend", "enable_expert_parallel", "aux_hidden_state_layers")

# A resolved cudagraph_mode can differ with equal flags: each stage lowers the
# requested mode to what its attention backends (and drafter) support.
CUDAGRAPH_MODE_HINT = (
    " If the flags already match, a stage's attention backends or drafter "
    "lowered the mode it resolved to: set a cudagraph_mode every stage supports."
)


def aux_hidden_state_layers(model: nn.Module) -> tuple[tuple[int, ...], int, int]:
    """The model's aux hidden-state layers and the layer range of this stage."""
    for module in model.modules():
        if isinstance(module, EagleModelMixin):
            return (
                tuple(module.aux_hidden_state_layers),
                module.start_layer,
                getattr(module, "end_layer", module.start_layer),
            )
    return (), 0, 0


def pp_hand_off_settings(vllm_config: VllmConfig, model: nn.Module) -> dict[str, Any]:
    """What decides the shapes and the transport of this stage's hand-offs."""
    pp_group = get_pp_group()
    compilation_config = vllm_config.compilation_config
    overrides = get_pp_all_gather_overrides(model) or {}
    layers, start, end = aux_hidden_state_layers(model)
    aux_key = EagleModelMixin.AUX_HIDDEN_STATE_KEY
    return {
        "enforce_eager": vllm_config.model_config.enforce_eager,
        "cudagraph_mode": str(compilation_config.cudagraph_mode),
        "cudagraph_capture_sizes": list(
            compilation_config.cudagraph_capture_sizes or ()
        ),
        # A model keeps stage outputs sequence parallel exactly when it
        # declares keys that are TP shards, not replicas.
        "sequence_parallel": any(not gather for gather in overrides.values()),
        # Aux slots are compared per boundary, below.
        "all_gather_tensors": {
            key: gather
            for key, gather in overrides.items()
            if not key.startswith(aux_key)
        },
        # A stage relays every aux state captured up to its last boundary and
        # expects those captured up to its first.
        "aux_slots_received": (
            0 if pp_group.is_first_rank else bisect_right(layers, start)
        ),
        "aux_slots_sent": 0 if pp_group.is_last_rank else bisect_right(layers, end),
        "moe_backend": vllm_config.kernel_config.moe_backend,
        "enable_expert_parallel": vllm_config.parallel_config.enable_expert_parallel,
        "aux_hidden_state_layers": layers,
    }


def disagreements(everyone: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """What differs between stages: the setting, and every stage's value."""
    problems = []
    for key in everyone[0]:
        if key.startswith("aux_slots") or all(
            other[key] == everyone[0][key] for other in everyone
        ):
            continue
        values = ", ".join(f"stage {n}={s[key]}" for n, s in enumerate(everyone))
        problems.append((key, f"{key}: {values}"))
    for stage in range(len(everyone) - 1):
        sent = everyone[stage]["aux_slots_sent"]
        expected = everyone[stage + 1]["aux_slots_received"]
        if sent != expected:
            problems.append(
                (
                    "aux_hidden_state_slots",
                    f"aux_hidden_state_slots: stage {stage} sends {sent}, "
                    f"stage {stage + 1} expects {expected}",
                )
            )
    return problems


def check_pp_hand_off_agreement(vllm_config: VllmConfig, model: nn.Module) -> None:
    """Raise on every stage unless all PP stages would hand off alike."""
    pp_group = get_pp_group()
    if pp_group.world_size == 1:
        return
    settings = pp_hand_off_settings(vllm_config, model)
    everyone: list[dict[str, Any]] = [{}] * pp_group.world_size
    dist.all_gather_object(everyone, settings, group=pp_group.cpu_group)
    problems = disagreements(everyone)
    keys = [key for key, _ in problems]
    if all(key in CONTEXT for key in keys):
        return
    options = ", ".join(dict.fromkeys(name for key in keys for name in OPTIONS[key]))
    raise RuntimeError(
        "Pipeline stages disagree on their hand-off and would hang or mix rows "
        f"at the first one ({'; '.join(text for _, text in problems)}). Start "
        "every node with the "
        f"same {options}." + (CUDAGRAPH_MODE_HINT if "cudagraph_mode" in keys else "")
    )
