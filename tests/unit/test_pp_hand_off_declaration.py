# SPDX-License-Identifier: Apache-2.0
"""The model's PP hand-off declaration is taken once, when the model is
loaded: a worker assembled without load_model hands off as vLLM without the
series does, and a stand-in model that only looks like the protocol declares
nothing."""

import contextlib
import sys
import types
from unittest import mock

import pytest
import torch

from tests.sppp_testbed.bases import HAS_LEGACY_RUNNER
from vllm.model_executor.models import interfaces
from vllm.sequence import IntermediateTensors
from vllm.v1.worker import gpu_worker
from vllm.v1.worker.gpu_worker import Worker
from vllm.v1.worker.pp_intermediate_tensors import hand_over_intermediate_tensors

TOKENS = 6
HIDDEN = 4


def intermediate(rows: int) -> IntermediateTensors:
    return IntermediateTensors(
        {k: torch.randn(rows, HIDDEN) for k in ("hidden_states", "residual")}
    )


class PPGroup:
    """A middle PP stage's group: records every receive and send."""

    is_first_rank = False
    is_last_rank = False

    def __init__(self) -> None:
        self.calls: list[tuple[str, dict]] = []

    def irecv_tensor_dict(self, **kwargs):
        self.calls.append(("irecv", kwargs))
        return intermediate(TOKENS).tensors, [], []

    def isend_tensor_dict(self, tensors, **kwargs):
        self.calls.append(("isend", kwargs))
        return [None]


class StubRunner:
    """A runner that hands its input on: no model, no get_model."""

    is_pooling_model = False

    def __init__(self) -> None:
        self.received: list[IntermediateTensors | None] = []

    def execute_model(self, scheduler_output, intermediate_tensors=None):
        self.received.append(intermediate_tensors)
        return intermediate(TOKENS)


@pytest.fixture
def pp_group(monkeypatch) -> PPGroup:
    group = PPGroup()
    monkeypatch.setattr(gpu_worker, "get_pp_group", lambda: group)
    monkeypatch.setattr(gpu_worker, "get_tp_group", lambda: "tp")
    return group


def worker_without_load_model() -> Worker:
    worker = Worker.__new__(Worker)
    worker._pp_send_work = []
    worker.profiler = None
    if HAS_LEGACY_RUNNER:  # 0.34.0 has Model Runner V2 only, and no such switch
        worker.use_v2_model_runner = False
    worker.model_runner = StubRunner()
    worker.vllm_config = types.SimpleNamespace(
        parallel_config=types.SimpleNamespace(distributed_executor_backend="mp")
    )
    return worker


def test_a_worker_without_load_model_hands_off_as_before(pp_group):
    worker = worker_without_load_model()
    step = types.SimpleNamespace(total_num_scheduled_tokens=TOKENS)
    for _ in range(2):
        assert worker.execute_model(step) is None
    # Each step receives, runs, sends; the transport's default both ways.
    assert [name for name, _ in pp_group.calls] == ["irecv", "isend"] * 2
    for _, kwargs in pp_group.calls:
        assert kwargs == {"all_gather_group": "tp", "all_gather_tensors": None}
    assert all(r is not None for r in worker.model_runner.received)


def test_a_worker_sends_and_receives_the_declaration_it_kept(pp_group):
    worker = worker_without_load_model()
    worker._pp_all_gather_tensors = {"hidden_states": False}
    worker.execute_model(types.SimpleNamespace(total_num_scheduled_tokens=TOKENS))
    assert [kwargs["all_gather_tensors"] for _, kwargs in pp_group.calls] == [
        {"hidden_states": False}
    ] * 2


def test_a_magicmock_model_declares_nothing_with_at_most_one_warning(monkeypatch):
    """Python 3.11's protocol check sees a MagicMock's made-up methods (the
    declaration is then refused with a warning); 3.12's looks them up
    statically and finds none. Either way the model declares nothing."""
    warnings = []
    monkeypatch.setattr(
        interfaces.logger, "warning_once", lambda *args: warnings.append(args)
    )
    model = mock.MagicMock()
    looks_the_part = interfaces.supports_pp_all_gather_overrides(model)
    assert looks_the_part == (sys.version_info < (3, 12))
    # What a runner's load_model keeps; steps ask nothing more, and hand over
    # as the runners do.
    declared = interfaces.get_pp_hand_off_declaration(model)
    buffers = intermediate(64)
    for rows in (TOKENS, TOKENS + 2):
        received = intermediate(rows)
        handed = hand_over_intermediate_tensors(buffers, received, TOKENS, declared)
        for key, tensor in handed.items():
            torch.testing.assert_close(tensor, received[key][:TOKENS])
    assert declared == interfaces.PPHandOffDeclaration()
    assert len(warnings) == int(looks_the_part)
    assert all("taken as undeclared" in warning[0] for warning in warnings)


class Declares:
    def __init__(self, overrides: object, rows: object) -> None:
        self.overrides, self.rows = overrides, rows

    def get_pp_intermediate_tensor_all_gather_overrides(self):
        return self.overrides

    def get_pp_intermediate_tensor_num_rows(self, num_tokens):
        return self.rows


@pytest.mark.parametrize(
    "overrides, rows",
    [(["hidden_states"], None), ({"hidden_states": 0}, None), ({}, 1.0), ({}, True)],
)
def test_answers_of_other_types_declare_nothing_with_a_warning(
    overrides, rows, monkeypatch
):
    warnings = []
    monkeypatch.setattr(
        interfaces.logger, "warning_once", lambda *args: warnings.append(args)
    )
    declared = interfaces.get_pp_hand_off_declaration(Declares(overrides, rows))
    assert declared == interfaces.PPHandOffDeclaration()
    assert len(warnings) == 1
    assert "taken as undeclared" in warnings[0][0]
    assert (repr(overrides), repr(rows)) == warnings[0][2:]


def test_a_declaration_of_the_promised_types_is_kept():
    declared = interfaces.get_pp_hand_off_declaration(
        Declares({"hidden_states": False}, 3)
    )
    assert declared.all_gather_tensors == {"hidden_states": False}
    assert declared.expected_rows(17) == 3


class ModelLoaded(Exception):
    """Raised where the V2 runner's load_model goes on to build its model
    state (attention backends, buffers), which needs a GPU."""


def test_the_v2_runner_keeps_the_declaration_its_load_model_takes(monkeypatch):
    from vllm.config import LoadConfig
    from vllm.v1.worker.gpu import model_runner as v2

    def stop(*args):
        raise ModelLoaded

    monkeypatch.setattr(v2, "init_model_state", stop)
    runner = types.SimpleNamespace(
        eplb=types.SimpleNamespace(prepare_load=lambda: None),
        vllm_config=types.SimpleNamespace(load_config=LoadConfig()),
        jit_warmup_registry=types.SimpleNamespace(activate=contextlib.nullcontext),
        lora_config=None,
        use_aux_hidden_state_outputs=False,
        speculator=None,
        encoder_cache=None,
        device=torch.device("cpu"),
        _pp_hand_off=v2.GPUModelRunner._pp_hand_off,  # the class default
    )
    declared = Declares({"hidden_states": False}, 3)
    with pytest.raises(ModelLoaded):
        v2.GPUModelRunner.load_model(runner, model=declared)
    # What execute_model hands over with: the rows of the model's shard.
    assert runner._pp_hand_off.all_gather_tensors == {"hidden_states": False}
    assert runner._pp_hand_off.expected_rows(17) == 3


class TapsAddKeys(torch.nn.Module, interfaces.SupportsEagle3):
    """An EAGLE-3 target whose declared keys grow with the aux layers set on
    it, as Kimi K3's do under SP."""

    def __init__(self) -> None:
        super().__init__()
        self.aux_layers: tuple[int, ...] = ()

    def set_aux_hidden_state_layers(self, layers: tuple[int, ...]) -> None:
        self.aux_layers = layers

    def get_eagle3_default_aux_hidden_state_layers(self) -> tuple[int, ...]:
        return (1,)

    def get_pp_intermediate_tensor_all_gather_overrides(self) -> dict[str, bool]:
        aux = (f"aux_hidden_states_{slot}" for slot in range(len(self.aux_layers)))
        return dict.fromkeys(("hidden_states", *aux), False)

    def get_pp_intermediate_tensor_num_rows(self, num_tokens: int) -> int:
        return -(-num_tokens // 2)


@pytest.mark.skipif(not HAS_LEGACY_RUNNER, reason="vLLM 0.33.0's legacy runner")
def test_the_legacy_runner_takes_the_declaration_after_the_aux_layers(monkeypatch):
    """The legacy runner's own PP send (external launcher) uses the
    declaration its load_model takes: taken before the EAGLE-3 aux layers,
    it would send them as replicas while the worker receives them as
    shards."""
    from vllm.config import LoadConfig
    from vllm.v1.worker import gpu_model_runner as legacy

    def stop(*args):
        raise ModelLoaded

    # What load_model does next: look for the model's MoE layers.
    monkeypatch.setattr(legacy, "get_mixture_of_experts_model", stop)
    runner = object.__new__(legacy.GPUModelRunner)
    runner.__dict__.update(
        model_config=types.SimpleNamespace(model="k3"),
        parallel_config=types.SimpleNamespace(enable_eplb=False),
        load_config=LoadConfig(),
        vllm_config=None,
        jit_warmup_registry=types.SimpleNamespace(activate=contextlib.nullcontext),
        lora_config=None,
        use_aux_hidden_state_outputs=True,
        _get_eagle3_aux_layers_from_config=lambda: (1, 3),
    )
    with pytest.raises(ModelLoaded):
        runner.load_model(model=TapsAddKeys())
    assert runner._pp_hand_off.all_gather_tensors == {
        "hidden_states": False,
        "aux_hidden_states_0": False,
        "aux_hidden_states_1": False,
    }
