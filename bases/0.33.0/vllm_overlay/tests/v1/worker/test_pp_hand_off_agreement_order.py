# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The GPU worker compares PP stages' hand-off settings before the first PP
send or receive: the V2 kernel warm-up runs real PP steps through the
worker's ``execute_model``, so a later check would come after the hang it is
there to prevent. Memory and graph profiling (``profile_run``,
``profile_cudagraph_memory``) run before it, but each stage alone: their
dummy runs neither send nor receive."""

import contextlib
import types

import pytest

from vllm.v1.worker import gpu_worker


class Refused(Exception):
    pass


def test_hand_off_agreement_is_checked_before_the_first_pp_send_or_recv(monkeypatch):
    calls: list[str] = []

    def check(vllm_config, model, model_runner, all_gather_tensors):
        calls.append(
            f"check({vllm_config}, {model}, {model_runner.name}, {all_gather_tensors})"
        )
        raise Refused

    def record(name):
        return lambda *args, **kwargs: calls.append(name)

    monkeypatch.setattr(gpu_worker, "check_pp_hand_off_agreement", check)
    monkeypatch.setattr(gpu_worker, "kernel_warmup", record("kernel_warmup"))
    monkeypatch.setattr(gpu_worker, "warmup_kernels", record("warmup_kernels"))
    runner = types.SimpleNamespace(
        name="runner",
        _dummy_run=record("_dummy_run"),
        capture_model=record("capture_model"),
        get_model=lambda: "model",
    )
    worker = types.SimpleNamespace(
        vllm_config="config",
        model_runner=runner,
        get_model=lambda: "model",
        _pp_all_gather_tensors={"hidden_states": False},
    )
    with pytest.raises(Refused):
        gpu_worker.Worker._compile_or_warm_up_model(worker)
    # With the overrides the worker's own sends and receives use.
    assert calls == ["check(config, model, runner, {'hidden_states': False})"]


@pytest.mark.parametrize("v2", [False, True])
def test_v1_runner_aux_layers_are_checked_when_the_model_is_loaded(monkeypatch, v2):
    """The V1 runner sets aux layers on the last stage only, while it loads
    the model; the worker checks them then, before memory profiling runs the
    first forward. The V2 runner relays taps from every stage: not checked."""
    checked = []
    monkeypatch.setattr(
        gpu_worker, "check_aux_layers_on_the_last_stage", checked.append
    )
    monkeypatch.setattr(gpu_worker, "set_current_vllm_config", contextlib.nullcontext)
    monkeypatch.setattr(gpu_worker, "has_ec_transfer", lambda: False)
    monkeypatch.setattr(gpu_worker, "set_torch_threads_for_runtime", lambda: None)
    loaded = []
    runner = types.SimpleNamespace(
        load_model=lambda **kwargs: loaded.append(kwargs), get_model=lambda: "model"
    )
    worker = types.SimpleNamespace(
        vllm_config=types.SimpleNamespace(weight_transfer_config=None),
        model_runner=runner,
        use_v2_model_runner=v2,
        _maybe_get_memory_pool_context=lambda tag: contextlib.nullcontext(),
        _scoped_allocator_max_split=lambda **kwargs: contextlib.nullcontext(),
    )
    gpu_worker.Worker.load_model(worker)
    assert loaded == [{"load_dummy_weights": False}]
    assert checked == ([] if v2 else ["model"])
