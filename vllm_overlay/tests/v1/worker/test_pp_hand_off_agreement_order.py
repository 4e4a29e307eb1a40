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

from vllm.model_executor.model_loader.weight_cache.utils import ExternalWeightCharges
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


class DeclaresShards:
    """A model whose PP hand-offs are TP shards (as Kimi K3 under SP)."""

    def get_pp_intermediate_tensor_all_gather_overrides(self) -> dict[str, bool]:
        return {"hidden_states": False, "residual": False}

    def get_pp_intermediate_tensor_num_rows(self, num_tokens: int) -> int:
        return -(-num_tokens // 2)


@pytest.mark.parametrize("model", [DeclaresShards(), object()])
def test_load_model_keeps_the_models_transport_overrides(monkeypatch, model):
    """The worker keeps, once the runner loaded the model, the overrides its
    execute_model passes to every PP receive and send (None, the transport's
    default, for a model that declares nothing). Model Runner V2 is the only
    runner: load_model asks nothing of another (this worker has no
    use_v2_model_runner to ask)."""
    monkeypatch.setattr(gpu_worker, "set_current_vllm_config", contextlib.nullcontext)
    monkeypatch.setattr(gpu_worker, "has_ec_transfer", lambda: False)
    monkeypatch.setattr(gpu_worker, "set_torch_threads_for_runtime", lambda: None)
    loaded = []
    runner = types.SimpleNamespace(
        load_model=lambda **kwargs: loaded.append(kwargs), get_model=lambda: model
    )
    worker = object.__new__(gpu_worker.Worker)
    worker.vllm_config = types.SimpleNamespace(weight_transfer_config=None)
    worker.model_runner = runner
    worker._external_weight_charges = ExternalWeightCharges()
    monkeypatch.setattr(
        worker, "_maybe_get_memory_pool_context", lambda tag: contextlib.nullcontext()
    )
    monkeypatch.setattr(
        worker, "_scoped_allocator_max_split", lambda **kw: contextlib.nullcontext()
    )
    assert worker._pp_all_gather_tensors is None  # before load_model
    worker.load_model()
    assert loaded == [{"load_dummy_weights": False}]
    if isinstance(model, DeclaresShards):
        assert worker._pp_all_gather_tensors == {
            "hidden_states": False,
            "residual": False,
        }
    else:
        assert worker._pp_all_gather_tensors is None
