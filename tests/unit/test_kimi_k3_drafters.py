# SPDX-License-Identifier: Apache-2.0
"""The Kimi K3 MTP drafter as ``load_eagle_model`` builds it, at stage level.

The V2 speculator builds the draft model with the target's ``VllmConfig``
(its ``parallel_config`` says the target's PP size), with
``--speculative-config``'s ``moe_backend``, when set, laid over the kernel
config. vLLM's own ``KimiK3MultiTokenPredictor`` is built here from such a
config in a one-rank world; the decision reads the config only. Runs on real
ranks are in ``tests/distributed/test_drafters.py``.
"""

from __future__ import annotations

import pytest

from tests.sppp_testbed.tiny_k3 import (
    build_mtp,
    draft_config,
    scenario_config,
    stand_ins,
)


@pytest.mark.parametrize(
    ("tp", "pp", "mega_moe", "draft_moe_backend", "sequence_parallel"),
    [
        # MegaMoE at PP > 1: SP under the series (0.33.0 kept it replicated).
        (2, 2, True, None, True),
        (2, 3, True, None, True),
        # The draft's moe_backend overridden: 0.33.0's replicated layout.
        (2, 2, True, "triton", False),
        # Other backends at PP > 1, and TP = 1: replicated, as in 0.33.0.
        (2, 2, False, None, False),
        (1, 2, True, None, False),
        # PP = 1: 0.33.0's rule, unchanged.
        (2, 1, True, None, True),
        (2, 1, True, "triton", False),
    ],
)
def test_mtp_block_follows_the_one_decision_on_the_drafters_config(
    single_rank_world, tp, pp, mega_moe, draft_moe_backend, sequence_parallel
):
    config = draft_config(scenario_config(tp, pp, sp=mega_moe), draft_moe_backend)
    with stand_ins():
        drafter = build_mtp(config)
    (layer,) = drafter.layers.values()
    assert layer.mtp_block.use_sequence_parallel is sequence_parallel
    # The block's attention output stays unreduced under SP: the layer
    # reduce-scatters it instead.
    assert layer.mtp_block.self_attn.o_proj.reduce_results is not sequence_parallel
