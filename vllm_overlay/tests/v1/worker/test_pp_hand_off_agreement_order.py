# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Where the GPU worker checks its PP stages: their settings before kernel
warm-up, which runs the first real PP steps through the worker's
``execute_model``; each warm-up step as it runs; the padding of every batch
once graphs are captured (``dispatch`` pads nothing before). Memory and graph
profiling run earlier, each stage alone: their dummy runs neither send nor
receive."""

import types

import pytest

from vllm.v1.worker import gpu_worker, pp_hand_off_agreement
from vllm.v1.worker.pp_hand_off_agreement import BatchShape, batch_shapes


class Finished(Exception):
    pass


def test_stages_are_checked_around_warm_up_and_capture(monkeypatch):
    calls: list[str] = []

    class Check:
        def __init__(self, vllm_config, model, model_runner, all_gather_tensors):
            calls.append(f"check({model}, {model_runner.name}, {all_gather_tensors})")

        def warm_up(self, execute_model):
            return lambda output: calls.append(f"compared {output}")

        def finish(self):
            calls.append("finish")
            raise Finished

    def record(name):
        return lambda *args, **kwargs: calls.append(name)

    def warm_up(name):
        return lambda runner, execute_model, sample_tokens: execute_model(name)

    monkeypatch.setattr(gpu_worker, "PPStageCheck", Check)
    monkeypatch.setattr(gpu_worker, "kernel_warmup", record("kernel_warmup"))
    monkeypatch.setattr(gpu_worker, "warmup_kernels", warm_up("warmup_kernels"))
    runner = types.SimpleNamespace(
        name="runner",
        _dummy_run=record("_dummy_run"),
        capture_model=record("capture_model"),
        get_model=lambda: "model",
        maybe_remove_all_loras=lambda lora_config: None,
        lora_config=None,
    )
    config = types.SimpleNamespace(
        compilation_config=types.SimpleNamespace(mode=None),
        kernel_config=types.SimpleNamespace(enable_jit_warmup=True),
    )
    worker = types.SimpleNamespace(
        vllm_config=config,
        model_runner=runner,
        get_model=lambda: "model",
        execute_model=record("execute_model"),
        sample_tokens=None,
        _pp_all_gather_tensors={"hidden_states": False},
        cache_config=types.SimpleNamespace(enable_extensible_kv_cache=False),
        model_config=types.SimpleNamespace(enforce_eager=False),
        _get_cudagraph_capture_context=lambda: pytest.MonkeyPatch.context(),
    )
    with pytest.raises(Finished):
        gpu_worker.Worker._compile_or_warm_up_model(worker)
    # With the overrides the worker's own sends and receives use.
    assert calls == [
        "check(model, runner, {'hidden_states': False})",
        "kernel_warmup",
        "compared warmup_kernels",
        "capture_model",
        "finish",
    ]


def bounds(max_num_reqs: int) -> dict:
    return {
        "max_num_tokens": 8,
        "max_query_len": 1,
        "lora_counts": (0,),
        "max_num_reqs": max_num_reqs,
        "max_num_batched_tokens": 64,
    }


def test_batches_one_request_past_each_stages_limit_are_compared():
    """A FULL graph holds at most its stage's --max-num-seqs requests: with
    8 on stage 0 and 3 on stage 1, 5 tokens from 4 requests pad to 8 on
    stage 0 and run as they come on stage 1, so that batch is compared."""
    shapes = batch_shapes([bounds(8), bounds(3)])
    assert BatchShape(5, 4) in shapes
    # Stage 0's scheduler sends no more than its own limit.
    assert all(shape.num_reqs <= 8 for shape in shapes)
    assert not [s for s in batch_shapes([bounds(3), bounds(8)]) if s.num_reqs > 3]


def test_a_stage_build_names_vllm():
    assert pp_hand_off_agreement.stage_build().startswith("vLLM ")
