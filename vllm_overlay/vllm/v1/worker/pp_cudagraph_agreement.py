# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Pipeline stages must replay CUDA graphs for the same batch shapes.

A stage that captured other sizes, or none, pads a batch differently from its
neighbours; the PP hand-off then waits for a shape that never comes, and the
server hangs at its first step. Comparing the settings across the PP group
at start-up turns that hang into an error that shows every stage's settings.
"""

import torch.distributed as dist

from vllm.config import VllmConfig
from vllm.distributed.parallel_state import get_pp_group


def cudagraph_settings(vllm_config: VllmConfig) -> dict[str, object]:
    """What decides the batch shapes a stage replays."""
    compilation_config = vllm_config.compilation_config
    return {
        "enforce_eager": vllm_config.model_config.enforce_eager,
        "cudagraph_mode": str(compilation_config.cudagraph_mode),
        "cudagraph_capture_sizes": list(
            compilation_config.cudagraph_capture_sizes or ()
        ),
    }


def check_pp_cudagraph_agreement(vllm_config: VllmConfig) -> None:
    """Raise on every stage unless all PP stages share their graph settings."""
    pp_group = get_pp_group()
    if pp_group.world_size == 1:
        return
    settings = cudagraph_settings(vllm_config)
    everyone: list[dict[str, object] | None] = [None] * pp_group.world_size
    dist.all_gather_object(everyone, settings, group=pp_group.cpu_group)
    if any(other != settings for other in everyone):
        stages = "; ".join(
            f"stage {stage}: "
            + ", ".join(f"{key}={value}" for key, value in (other or {}).items())
            for stage, other in enumerate(everyone)
        )
        raise RuntimeError(
            "Pipeline stages disagree on CUDA graph settings and would hang at "
            f"the first hand-off ({stages}). Start every node with the same "
            "--compilation-config, --max-cudagraph-capture-size and "
            "--enforce-eager."
        )
