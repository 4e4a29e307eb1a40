# SPDX-License-Identifier: Apache-2.0
"""One forward of the tiny Kimi K3 across PP stages, chained as vLLM's worker
chains them (``GPUWorker.execute_model``): non-first stages ``irecv`` into an
``AsyncIntermediateTensors``, non-last stages ``isend`` their output, both
with the TP group as ``all_gather_group`` and the model's transport
overrides as ``all_gather_tensors`` when it has them (DESIGN contract 4).
"""

from __future__ import annotations

import torch
from vllm.config import set_current_vllm_config
from vllm.distributed.parallel_state import get_pp_group, get_tp_group
from vllm.sequence import IntermediateTensors
from vllm.v1.worker.gpu_worker import AsyncIntermediateTensors

from tests.sppp_testbed.tiny_k3 import VOCAB, build_model, scenario_config


def transport_overrides(model: torch.nn.Module) -> dict[str, bool] | None:
    overrides = getattr(model, "get_pp_intermediate_tensor_all_gather_overrides", None)
    return overrides() if overrides is not None else None


def token_ids(num_tokens: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (num_tokens,), generator=generator)


def forward_stages(
    sp: bool, num_tokens: int, attn_res: bool = False, seed: int = 0
) -> dict:
    """Run in every rank; the last stage returns the model's output."""
    tp_group, pp_group = get_tp_group(), get_pp_group()
    config = scenario_config(
        tp_group.world_size, pp_group.world_size, sp=sp, attn_res=attn_res
    )
    model = build_model(config, seed)
    overrides = transport_overrides(model)
    positions = torch.arange(num_tokens)
    with set_current_vllm_config(config), torch.no_grad():
        intermediate = None
        if not pp_group.is_first_rank:
            tensors, handles, postprocess = pp_group.irecv_tensor_dict(
                all_gather_group=tp_group, all_gather_tensors=overrides
            )
            intermediate = AsyncIntermediateTensors(
                tensors, comm_handles=handles, comm_postprocess=postprocess
            )
            intermediate.wait_for_comm()
        output = model(token_ids(num_tokens, seed), positions, intermediate)
        if not pp_group.is_last_rank:
            assert isinstance(output, IntermediateTensors)
            for handle in pp_group.isend_tensor_dict(
                output.tensors, all_gather_group=tp_group, all_gather_tensors=overrides
            ):
                if handle is not None:
                    handle.wait()
            return {"sequence_parallel": model.use_sequence_parallel, "output": None}
    return {"sequence_parallel": model.use_sequence_parallel, "output": output}
