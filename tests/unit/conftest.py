# SPDX-License-Identifier: Apache-2.0
"""Unit tests run in this process, on the CPU, with fakes for what a test
does not exercise. Model tests build the tiny Kimi K3 of the test bed in a
one-rank gloo world and emulate other TP sizes and PP stages with fakes."""

import os

# Before any vLLM import.
os.environ["VLLM_TARGET_DEVICE"] = "cpu"

import socket  # noqa: E402

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def single_rank_world():
    """vLLM's TP, PP and world groups over gloo, with one rank."""
    from vllm.config import ParallelConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed import (
        init_distributed_environment,
        initialize_model_parallel,
        model_parallel_is_initialized,
    )

    if not model_parallel_is_initialized():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        with set_current_vllm_config(VllmConfig(parallel_config=ParallelConfig())):
            init_distributed_environment(
                world_size=1,
                rank=0,
                local_rank=0,
                distributed_init_method=f"tcp://127.0.0.1:{port}",
                backend="gloo",
            )
            initialize_model_parallel(1, 1)
