# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Model Runner V2 takes a model's PP hand-off declaration once, when
load_model is done with everything that changes it: a drafter's aux layers
add the keys of the aux states that cross stages."""

import contextlib
import types

import pytest
import torch

from vllm.models.common.ops.sequence_parallel import sp_shard_rows
from vllm.v1.worker.gpu import model_runner as v2


class AuxLayersAddKeys(torch.nn.Module):
    """A sequence-parallel model whose declared keys grow with the aux layers
    a drafter sets, as Kimi K3's do."""

    def __init__(self) -> None:
        super().__init__()
        self.aux_layers: tuple[int, ...] = ()

    def get_pp_intermediate_tensor_all_gather_overrides(self) -> dict[str, bool]:
        aux = (f"aux_hidden_states_{slot}" for slot in range(len(self.aux_layers)))
        return dict.fromkeys(("hidden_states", *aux), False)

    def get_pp_intermediate_tensor_num_rows(self, num_tokens: int) -> int:
        return sp_shard_rows(num_tokens, 2)


class Loaded(Exception):
    """Raised where load_model goes on to build the model state."""


def test_v2_load_model_takes_the_declaration_after_the_aux_layers(monkeypatch):
    """Every PP send and receive uses the declaration load_model takes: taken
    before the drafter's aux layers are set, it would miss their keys, and
    the transport would take those shards for replicas."""
    model = AuxLayersAddKeys()
    loader = types.SimpleNamespace(load_model=lambda **kwargs: model)
    monkeypatch.setattr(v2, "get_model_loader", lambda load_config: loader)

    def set_aux_layers(model, speculative_config, use_pp):
        model.aux_layers = (1, 3)

    monkeypatch.setattr(v2, "set_eagle3_aux_hidden_state_layers", set_aux_layers)

    def loaded(*args, **kwargs):
        raise Loaded

    monkeypatch.setattr(v2, "init_model_state", loaded)
    runner = object.__new__(v2.GPUModelRunner)
    runner.__dict__.update(
        vllm_config=types.SimpleNamespace(load_config=None, model_config=None),
        load_config=types.SimpleNamespace(load_format="auto"),
        eplb=types.SimpleNamespace(prepare_load=lambda: None),
        jit_warmup_registry=types.SimpleNamespace(activate=contextlib.nullcontext),
        lora_config=None,
        use_aux_hidden_state_outputs=True,
        speculative_config=types.SimpleNamespace(),
        use_pp=True,
        pp_handler=None,
        speculator=None,
        encoder_cache=None,
        device=None,
    )
    with pytest.raises(Loaded):
        runner.load_model()
    assert runner._pp_hand_off.all_gather_tensors == {
        "hidden_states": False,
        "aux_hidden_states_0": False,
        "aux_hidden_states_1": False,
    }
    assert runner._pp_hand_off.expected_rows(17) == 9
