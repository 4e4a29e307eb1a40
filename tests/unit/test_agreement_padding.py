# SPDX-License-Identifier: Apache-2.0
"""The start-up check pads every batch as vLLM 0.34.0's runner will.

``PPStageCheck`` (``pp_hand_off_agreement``) asks the stage's real
``CudaGraphManager`` once graphs are captured, through its ``dispatch``.
Here that is compared with 0.34.0's own ``CudaGraphManager.dispatch`` as the
wheel ships it (the patched file's original, read from apply's journal,
compiled beside the patched module): every batch the check enumerates must
pad to the same tokens, uniform decodes included, whose graph 0.34.0 looks
up by request count in a table of their query length before the
token-keyed graphs: 3 requests of 2 tokens run the 6-token decode graph
where the token-keyed table holds 8 tokens.
"""

from __future__ import annotations

import ast
import textwrap
import types

import pytest

import apply
from tests.sppp_testbed.bases import only_from_0_34
from tests.sppp_testbed.pristine import installed_vllm_root
from tests.unit import agreement_cost

pytestmark = only_from_0_34("the uniform-decode table of CudaGraphManager")

PATCHED_FILE = "vllm/v1/worker/gpu/cudagraph_utils.py"


def shipped_dispatch():
    """``CudaGraphManager.dispatch`` of the wheel's own file, compiled in the
    installed (patched) module's namespace, so it runs on the same manager."""
    from vllm.v1.worker.gpu import cudagraph_utils

    original = apply.original_files(installed_vllm_root())(PATCHED_FILE)
    assert original is not None, PATCHED_FILE
    source = original.read_text()
    tree = ast.parse(source)
    (manager,) = (
        node
        for node in tree.body
        if isinstance(node, ast.ClassDef) and node.name == "CudaGraphManager"
    )
    (dispatch,) = (
        node
        for node in manager.body
        if isinstance(node, ast.FunctionDef) and node.name == "dispatch"
    )
    code = textwrap.dedent(ast.get_source_segment(source, dispatch))
    assert "_decode_descs" in code
    namespace = dict(vars(cudagraph_utils))
    exec(compile(code, str(original), "exec"), namespace)
    return namespace["dispatch"]


@pytest.fixture(scope="module")
def stage():
    """A middle stage with SM100's default graph sizes for 256 requests and
    uniform decodes of 2, 3 and 4 tokens (speculative decoding of 1 to 3
    tokens), as the check sees it once graphs are captured."""
    config, manager = agreement_cost.sm100_manager(
        spec=(1, 2, 3), max_num_seqs=256, max_num_batched_tokens=2048
    )
    manager._graphs_captured = True  # what capture() leaves; no graph is run
    check = agreement_cost.stage_check(config, manager)
    return types.SimpleNamespace(config=config, manager=manager, check=check)


def test_the_check_enumerates_to_the_widest_graph_and_decode_query(stage):
    assert stage.check.bounds["max_num_tokens"] == 2048
    assert stage.check.bounds["max_query_len"] == 4
    assert stage.manager._decode_descs  # the uniform-decode tables are built


def test_every_batch_pads_as_the_shipped_dispatch_pads_it(stage):
    from vllm.v1.worker.pp_hand_off_agreement import batch_shapes

    dispatch = shipped_dispatch()
    check, manager = stage.check, stage.manager
    shapes = batch_shapes([check.bounds])
    wrong, decode_table = [], 0
    for shape in shapes:
        padded = check.padded_num_tokens(shape)
        runs = dispatch(
            manager,
            shape.num_reqs,
            shape.num_tokens,
            shape.uniform_token_count,
            shape.num_active_loras,
            shape.max_query_len,
        ).num_tokens
        if padded != runs:
            wrong.append(f"{shape}: agreement {padded}, runner {runs}")
        if shape.uniform_token_count is not None:
            tokens_only = dispatch(manager, shape.num_reqs, shape.num_tokens, None, 0)
            if tokens_only.num_tokens != runs:
                decode_table += 1
    assert not wrong, "\n".join(wrong[:20])
    # Batches the decode table pads otherwise than the token-keyed graphs
    # were among them (3 requests of 2 tokens: 6, not 8).
    assert decode_table > 0


def test_uniform_decodes_take_their_request_count_graph(stage):
    """The case named above, as the agreement reports it."""
    from vllm.v1.worker.pp_hand_off_agreement import BatchShape

    padded = stage.check.padded_num_tokens
    assert padded(BatchShape(6, 3, 2, 2)) == 6
    assert padded(BatchShape(6, 1)) == 8  # with a prefill
    assert padded(BatchShape(9, 3, 3, 3)) == 9
    assert padded(BatchShape(9, 1)) == 16


def test_the_enumeration_cost_tool_times_what_the_agreement_runs():
    """tests/unit/agreement_cost.py at a small size: the shapes it times are
    the agreement's own enumeration."""
    from vllm.v1.worker.pp_hand_off_agreement import batch_shapes

    result = agreement_cost.measure(
        spec=(1,), max_num_seqs=8, max_num_batched_tokens=64, repeat=1
    )
    assert result["decode_query_len"] == 2
    assert result["shapes"] == len(
        batch_shapes(
            [
                {
                    "max_num_tokens": result["max_cudagraph_capture_size"],
                    "max_query_len": 2,
                    "lora_counts": (0,),
                    "max_num_reqs": 8,
                    "max_num_batched_tokens": 64,
                }
            ]
        )
    )
    assert result["batch_shapes_first_s"] > 0 and result["answer_bytes"] > 0
