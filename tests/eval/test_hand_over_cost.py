# SPDX-License-Identifier: Apache-2.0
"""The hand-over cost tool times what it says, through the real helpers."""

from eval import hand_over_cost


def test_each_measurement_is_a_time_per_call(capsys):
    assert hand_over_cost.main(["--number", "20", "--repeat", "1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    names = [line.split(" us  ", 1)[1] for line in lines]
    assert names[:5] == [
        "expected_rows, per step, kept from the K3 multimodal wrapper",
        "expected_rows, per step, kept from the K3 causal LM",
        "expected_rows, per step, kept from a model that declares nothing",
        "accepts_hand_off, per step",
        "get_pp_hand_off_declaration, once at load, K3 multimodal wrapper",
    ]
    assert names[5].startswith("hand_over_intermediate_tensors, whole call (8 rows")
    assert all(float(line.split(" us  ")[0]) > 0 for line in lines)


def test_the_tool_leaves_the_model_module_as_it_found_it():
    from vllm.models.kimi_k3.nvidia import model as k3

    before = k3.get_tensor_model_parallel_world_size
    hand_over_cost.measurements(tokens=17, tp=4, number=1, repeat=1)
    assert k3.get_tensor_model_parallel_world_size is before
