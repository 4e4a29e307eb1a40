# SPDX-License-Identifier: Apache-2.0
"""What the start-up agreement's enumeration costs on vLLM 0.34.0.

Each PP stage lists every batch its runner can dispatch up to the widest CUDA
graph (``batch_shapes``) and asks its graph manager how it
pads each once graphs are captured (``PPStageCheck``, which asks
``CudaGraphManager.dispatch``). This builds a real 0.34.0
``CudaGraphManager`` on the CPU with the graph sizes vLLM resolves on an
SM100 GPU by default (``VllmConfig._split_cudagraph_capture_sizes`` with the
device family answered as 100: prefill graphs up to 8192 tokens, decode
graphs of up to ``--max-num-seqs`` requests within 8192 tokens) for uniform
decodes of each speculative query length, and times both calls (the first
run, which a stage pays once at start-up, and the best of ``--repeat``), with
the size of the answer a stage sends the others.

    .venv/bin/python -m tests.unit.agreement_cost [--spec 1 2 3]
        [--max-num-seqs 1024] [--max-num-batched-tokens 8192] [--repeat 3]
"""

from __future__ import annotations

import argparse
import os
import pickle
import time
import types
from collections.abc import Sequence

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")


class ShardedModel:
    """Declares its hand-off as TP shards, as Kimi K3 under SP at TP8."""

    def __init__(self, tp: int = 8) -> None:
        self.tp = tp

    def get_pp_intermediate_tensor_all_gather_overrides(self) -> dict[str, bool]:
        return {"hidden_states": False, "residual": False}

    def get_pp_intermediate_tensor_num_rows(self, num_tokens: int) -> int:
        return -(-num_tokens // self.tp)


def sm100_manager(
    spec: Sequence[int],
    max_num_seqs: int,
    max_num_batched_tokens: int,
    mode: str = "FULL_AND_PIECEWISE",
):
    """A middle stage's VllmConfig and graph manager with SM100's default
    graph sizes, uniform decodes of ``1 + k`` tokens for each ``k`` in
    ``spec``, each up to ``max_num_seqs`` requests."""
    from tests.sppp_testbed.cpu_platform import accept_x86_without_triton

    accept_x86_without_triton()
    from vllm.config import CUDAGraphMode, VllmConfig
    from vllm.platforms import current_platform
    from vllm.v1.worker.gpu import cudagraph_utils

    config = VllmConfig()
    config.scheduler_config.max_num_seqs = max_num_seqs
    config.scheduler_config.max_num_batched_tokens = max_num_batched_tokens
    compilation = config.compilation_config
    compilation.cudagraph_mode = CUDAGraphMode[mode]
    compilation.cudagraph_capture_sizes = []
    compilation.max_cudagraph_capture_size = None
    query_lens = {1 + k: max_num_seqs for k in spec}
    saved = (
        current_platform.is_device_capability_family,
        current_platform.get_global_graph_pool,
        cudagraph_utils.get_pp_group,
    )
    current_platform.is_device_capability_family = lambda family: family == 100
    current_platform.get_global_graph_pool = lambda: None
    cudagraph_utils.get_pp_group = lambda: types.SimpleNamespace(
        is_first_rank=False, is_last_rank=False
    )
    try:
        config._split_cudagraph_capture_sizes(False, query_lens)
        manager = cudagraph_utils.CudaGraphManager(
            config, torch_cpu(), compilation.cudagraph_mode, query_lens
        )
    finally:
        (
            current_platform.is_device_capability_family,
            current_platform.get_global_graph_pool,
            cudagraph_utils.get_pp_group,
        ) = saved
    return config, manager


def stage_check(config, manager):
    """The stage's ``PPStageCheck`` over this manager, built as the worker
    builds it, its stage round answered by itself (a middle stage of two)."""
    from unittest import mock

    import torch

    from vllm.v1.worker import pp_hand_off_agreement as agreement

    group = types.SimpleNamespace(world_size=2, is_first_rank=False, is_last_rank=False)
    if config.model_config is None:  # what the warm-up options read of it
        model_config = types.SimpleNamespace(max_model_len=0, max_logprobs=0)
        object.__setattr__(config, "model_config", model_config)
    with (
        mock.patch.object(agreement, "get_pp_group", lambda: group),
        mock.patch.object(agreement, "gather_from_stages", lambda f: [f(), f()]),
    ):
        return agreement.PPStageCheck(
            config,
            torch.nn.Module(),
            types.SimpleNamespace(cudagraph_manager=manager),
            None,
        )


def torch_cpu():
    import torch

    return torch.device("cpu")


def measure(
    spec: Sequence[int],
    max_num_seqs: int,
    max_num_batched_tokens: int,
    repeat: int,
) -> dict[str, float | int]:
    from vllm.model_executor.models.interfaces import get_pp_num_rows
    from vllm.v1.worker.pp_hand_off_agreement import batch_shapes

    config, manager = sm100_manager(spec, max_num_seqs, max_num_batched_tokens)
    padding = stage_check(config, manager)
    manager._graphs_captured = True  # the check asks dispatch once captured
    model = ShardedModel()
    shapes_s = rows_s = float("inf")
    first: tuple[float, float] | None = None
    for _ in range(repeat):
        start = time.perf_counter()
        shapes = batch_shapes([padding.bounds])
        middle = time.perf_counter()
        rows = [
            (tokens, get_pp_num_rows(model, tokens))
            for tokens in map(padding.padded_num_tokens, shapes)
        ]
        end = time.perf_counter()
        first = first or (middle - start, end - middle)
        shapes_s = min(shapes_s, middle - start)
        rows_s = min(rows_s, end - middle)
    return {
        "max_cudagraph_capture_size": padding.bounds["max_num_tokens"],
        "decode_query_len": padding.bounds["max_query_len"],
        "prefill_graphs": len(
            config.compilation_config.prefill_cudagraph_capture_token_sizes
        ),
        "decode_request_sizes": len(
            config.compilation_config.decode_cudagraph_capture_request_sizes
        ),
        "shapes": len(shapes),
        # A stage enumerates once, at start-up: the first run is what it pays.
        "batch_shapes_first_s": first[0],
        "hand_off_rows_first_s": first[1],
        "batch_shapes_best_s": shapes_s,
        "hand_off_rows_best_s": rows_s,
        "answer_bytes": len(pickle.dumps(rows)),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spec", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--max-num-seqs", type=int, default=1024)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args(argv)
    result = measure(
        args.spec, args.max_num_seqs, args.max_num_batched_tokens, args.repeat
    )
    for key, value in result.items():
        print(f"{key}: {value:.3f}" if isinstance(value, float) else f"{key}: {value}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
