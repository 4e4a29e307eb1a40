# SPDX-License-Identifier: Apache-2.0
"""The checks the GPU bundle runs on the lent GPU (``run.py CHECK``).

- ``tiny-k3``: the test bed's tiny Kimi K3 (vLLM's own model classes, the
  bed's stand-ins for KDA, MLA and MegaMoE) on CUDA, one rank, against the
  same model on the CPU.
- ``graphs``: vLLM's V2 ``ModelCudaGraphManager`` captures FULL CUDA graphs
  of a middle PP stage whose model keeps its hand-off sequence parallel at a
  declared TP size of 2, and every replay returns exactly the rows recorded
  for its descriptor, holding what that step computed, while the runner's
  hand-over writes into the same leading rows of the persistent buffers.
- ``execute-model``: the V2 runner's ``execute_model`` (unbound, on a fake
  runner that holds the real graph manager, stage model and buffers) on
  FULL-graph replay steps, and a copy of it with the hand-over skipped on
  the FULL path, which must fail.

One process holds one GPU, so what a single GPU cannot run is replaced, and
each check says so: the TP size is declared to the series' row rule
(``get_tensor_model_parallel_world_size`` in the K3 SP module returns 2; no
TP collective runs), and the PP position is declared to the graph manager
(a middle stage; no PP send or receive runs). The tiny stage model has no
attention layers, so no attention metadata is built for capture.

The same functions run on the CPU in ``make test`` (tests/unit), where
:func:`capture_graphs` replays by re-running the captured forward; there it
also captures a last stage (:class:`LastStage`), whose graphs keep hidden
states instead of a hand-off.
"""

from __future__ import annotations

import contextlib
import inspect
import textwrap
import types
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from tests.sppp_testbed.bases import HAS_LEGACY_RUNNER
from vllm.config import CompilationConfig, CUDAGraphMode, VllmConfig
from vllm.models.common.ops.sequence_parallel import sp_shard_rows
from vllm.sequence import IntermediateTensors

DECLARED_TP = 2
HIDDEN = 32
CAPACITY = 64  # the runner's max_num_tokens
# The persistent receive buffers' rows: the declared shard of the capacity.
BUFFER_ROWS = -(-CAPACITY // DECLARED_TP)
CAPTURE_SIZES = [1, 2, 4, 8, 16, 32]
# Real steps: token counts and what the dispatcher pads them to.
STEP_TOKENS = [1, 3, 5, 8, 13, 32, 13]


class ShardedStage(nn.Module):
    """A middle PP stage whose hand-off is sequence parallel.

    It checks what the runner hands it with the series' own
    ``check_sequence_parallel_rows`` (``ceil(N / TP)`` rows), mixes
    every earlier local row into each row (a prefix sum, so a stale or
    misplaced row changes all later ones) and returns as many rows. It
    declares its hand-off as the K3 model does.
    """

    def __init__(self) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(31)
        self.weight = nn.Parameter(
            torch.randn(HIDDEN, HIDDEN, generator=generator) / HIDDEN**0.5
        )

    def get_pp_intermediate_tensor_all_gather_overrides(self) -> dict[str, bool]:
        return {"hidden_states": False, "residual": False}

    def get_pp_intermediate_tensor_num_rows(self, num_tokens: int) -> int:
        return sp_shard_rows(num_tokens, DECLARED_TP)

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        intermediate_tensors: IntermediateTensors | None = None,
        inputs_embeds: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> IntermediateTensors:
        from vllm.models.kimi_k3.nvidia.sequence_parallel import (
            check_sequence_parallel_rows,
        )

        assert intermediate_tensors is not None
        local = check_sequence_parallel_rows(intermediate_tensors, positions.shape[0])
        hidden, residual = local["hidden_states"], local["residual"]
        mixed = torch.cumsum(torch.tanh(hidden @ self.weight), dim=0)
        return IntermediateTensors(
            {"hidden_states": mixed + residual, "residual": residual + hidden}
        )


class LastStage(nn.Module):
    """The last PP stage of a replicated model: the ``N`` rows it received
    in, ``N`` rows of hidden states out, each mixing every earlier row."""

    def __init__(self) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(37)
        self.weight = nn.Parameter(
            torch.randn(HIDDEN, HIDDEN, generator=generator) / HIDDEN**0.5
        )

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        intermediate_tensors: IntermediateTensors | None = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        assert intermediate_tensors is not None
        num_tokens = positions.shape[0]
        hidden = intermediate_tensors["hidden_states"][:num_tokens]
        residual = intermediate_tensors["residual"][:num_tokens]
        return torch.cumsum(torch.tanh(hidden @ self.weight), dim=0) + residual


@contextlib.contextmanager
def declared_topology(last_stage: bool = False) -> Iterator[None]:
    """TP size 2 for the row rule, a middle (or the last) PP stage for the
    graph manager: what one GPU in one process cannot be, declared instead."""
    from vllm.models.kimi_k3.nvidia import sequence_parallel as k3_sp
    from vllm.v1.worker.gpu import cudagraph_utils

    saved = (k3_sp.get_tensor_model_parallel_world_size, cudagraph_utils.get_pp_group)
    k3_sp.get_tensor_model_parallel_world_size = lambda: DECLARED_TP
    cudagraph_utils.get_pp_group = lambda: types.SimpleNamespace(
        is_first_rank=False, is_last_rank=last_stage
    )
    try:
        yield
    finally:
        (k3_sp.get_tensor_model_parallel_world_size, cudagraph_utils.get_pp_group) = (
            saved
        )


class _ReplayByRerun:
    """A 'graph' for the CPU: replay re-runs the captured forward, which
    reads and writes the same persistent buffers a CUDA graph would."""

    def __init__(self, forward_fn: Callable[[CUDAGraphMode], None]) -> None:
        self.forward_fn = forward_fn

    def replay(self) -> None:
        self.forward_fn(CUDAGraphMode.NONE)


def _capture_by_rerun(manager, create_forward_fn, progress_bar_desc="") -> None:
    for desc in manager._capture_descs[CUDAGraphMode.FULL]:
        create_forward_fn(desc, warmup=True)(CUDAGraphMode.NONE)
        forward_fn = create_forward_fn(desc, warmup=False)
        forward_fn(CUDAGraphMode.NONE)
        manager.graphs[desc] = _ReplayByRerun(forward_fn)
    manager._graphs_captured = True


class Stage(types.SimpleNamespace):
    """What a check needs of one middle stage: the graph manager, the stage
    model, the runner's persistent receive buffers and its input buffers."""


def graph_config() -> VllmConfig:
    config = VllmConfig(compilation_config=CompilationConfig(cudagraph_mode="FULL"))
    # After VllmConfig's own resolution (which drops graphs on the CPU).
    compilation = config.compilation_config
    compilation.cudagraph_capture_sizes = list(CAPTURE_SIZES)
    compilation.max_cudagraph_capture_size = max(CAPTURE_SIZES)
    if not HAS_LEGACY_RUNNER:
        # vLLM 0.34.0's graph manager takes prefill token sizes (FULL: every
        # batch takes them) and decode request sizes instead.
        compilation.prefill_cudagraph_capture_token_sizes = list(CAPTURE_SIZES)
        compilation.decode_cudagraph_capture_request_sizes = []
    return config


def decode_query_lens(query_len: int) -> dict[str, Any]:
    """The graph manager's decode query length, as this vLLM takes it: 0.33.0
    one ``decode_query_len``, 0.34.0 each length with its most requests."""
    if HAS_LEGACY_RUNNER:
        return {"decode_query_len": query_len}
    return {"decode_query_lens": {query_len: CAPACITY}}


def capture_graphs(device: torch.device, model: nn.Module | None = None) -> Stage:
    """Capture FULL graphs of ``model`` (a :class:`ShardedStage` by default)
    for every capture size with vLLM's V2 graph manager (call under
    :func:`declared_topology`)."""
    from vllm.model_executor.models.interfaces import get_pp_hand_off_declaration
    from vllm.platforms import current_platform
    from vllm.v1.worker.gpu import cudagraph_utils

    config = graph_config()
    saved_pool = current_platform.get_global_graph_pool
    if device.type != "cuda":  # no graph pool on the CPU
        current_platform.get_global_graph_pool = lambda: None
    try:
        manager = cudagraph_utils.ModelCudaGraphManager(
            config, device, CUDAGraphMode.FULL, **decode_query_lens(1)
        )
    finally:
        current_platform.get_global_graph_pool = saved_pool
    from vllm.v1.worker.pp_intermediate_tensors import hand_off_rows

    model = (model or ShardedStage()).to(device)
    hand_off = get_pp_hand_off_declaration(model)
    # Sized as the runner sizes them: the declared rows of its capacity.
    buffers = IntermediateTensors(
        {
            key: torch.zeros(hand_off_rows(CAPACITY, hand_off), HIDDEN, device=device)
            for key in ("hidden_states", "residual")
        }
    )
    input_buffers = types.SimpleNamespace(
        input_ids=torch.zeros(CAPACITY, dtype=torch.long, device=device),
        positions=torch.zeros(CAPACITY, dtype=torch.long, device=device),
        is_padding=torch.zeros(CAPACITY, dtype=torch.bool, device=device),
    )
    # No attention layers in the stage: no metadata to build for capture.
    saved_prepare = cudagraph_utils.prepare_inputs_to_capture
    cudagraph_utils.prepare_inputs_to_capture = (
        lambda *args, **kwargs: cudagraph_utils.AttentionState(None, {})
    )
    saved_capture = cudagraph_utils.CudaGraphManager.capture
    if device.type != "cuda":
        cudagraph_utils.CudaGraphManager.capture = _capture_by_rerun
    try:
        manager.capture(
            model,
            types.SimpleNamespace(prepare_dummy_inputs=lambda num_reqs, n: {}),
            input_buffers,
            buffers,
            block_tables=None,
            attn_groups=[],
            kv_cache_config=types.SimpleNamespace(kv_cache_groups=[]),
            pp_hand_off=hand_off,
        )
    finally:
        cudagraph_utils.prepare_inputs_to_capture = saved_prepare
        cudagraph_utils.CudaGraphManager.capture = saved_capture
    return Stage(
        config=config,
        manager=manager,
        model=model,
        buffers=buffers,
        input_buffers=input_buffers,
        device=device,
    )


def received_shard(rows: int, seed: int, device: torch.device) -> IntermediateTensors:
    generator = torch.Generator().manual_seed(seed)
    return IntermediateTensors(
        {
            key: torch.randn(rows, HIDDEN, generator=generator).to(device)
            for key in ("hidden_states", "residual")
        }
    )


def eager_output(stage: Stage, received: IntermediateTensors, num_tokens: int):
    """What the stage computes from ``received``, run eagerly, apart."""
    copies = IntermediateTensors({k: v.clone() for k, v in received.items()})
    positions = torch.zeros(num_tokens, dtype=torch.long, device=stage.device)
    with torch.inference_mode():
        return stage.model(None, positions, copies)


def pointers(tensors: IntermediateTensors) -> dict[str, int]:
    return {key: tensor.data_ptr() for key, tensor in tensors.items()}


def same_values(a: IntermediateTensors, b: IntermediateTensors) -> bool:
    return a.tensors.keys() == b.tensors.keys() and all(
        a[k].shape == b[k].shape and torch.allclose(a[k], b[k], rtol=1e-5, atol=1e-5)
        for k in a.tensors
    )


def check_graph_replay(stage: Stage, log: Callable[[str], None]) -> list[str]:
    """Replay steps through the runner's hand-over and the manager's replay;
    return every way they went wrong."""
    from vllm.model_executor.models.interfaces import get_pp_hand_off_declaration
    from vllm.v1.worker.pp_intermediate_tensors import hand_over_intermediate_tensors

    problems: list[str] = []
    manager, buffers = stage.manager, stage.buffers
    hand_off = get_pp_hand_off_declaration(stage.model)
    captured = manager.captured_token_counts()
    if captured != CAPTURE_SIZES:
        problems.append(f"captured {captured}, expected {CAPTURE_SIZES}")
    for desc in manager.graphs:
        want = sp_shard_rows(desc.num_tokens, DECLARED_TP)
        if manager.intermediate_rows.get(desc) != want:
            problems.append(
                f"graph N={desc.num_tokens} recorded "
                f"{manager.intermediate_rows.get(desc)} rows, expected {want}"
            )
    log(
        f"captured FULL graphs for N={captured}; rows recorded: "
        + ", ".join(f"{d.num_tokens}:{r}" for d, r in manager.intermediate_rows.items())
    )
    before = pointers(buffers)
    for step, num_tokens in enumerate(STEP_TOKENS):
        desc = manager.dispatch(1, num_tokens, None, 0)
        if desc.cg_mode != CUDAGraphMode.FULL:
            problems.append(f"N={num_tokens} dispatched {desc.cg_mode}, not FULL")
            continue
        padded = desc.num_tokens
        rows = sp_shard_rows(padded, DECLARED_TP)
        received = received_shard(rows, seed=100 + step, device=stage.device)
        handed = hand_over_intermediate_tensors(buffers, received, padded, hand_off)
        output = manager.run_fullgraph(desc)
        expected = eager_output(stage, received, padded)
        # What capture recorded: the stage on the buffers' zeros.
        captured_data = eager_output(
            stage,
            IntermediateTensors({k: torch.zeros_like(v) for k, v in received.items()}),
            padded,
        )
        if pointers(handed) != before or pointers(buffers) != before:
            problems.append(f"N={num_tokens}: hand-over moved the persistent buffers")
        if {t.shape[0] for t in buffers.tensors.values()} != {BUFFER_ROWS}:
            problems.append(f"N={num_tokens}: buffers lost their capacity")
        shapes = {t.shape[0] for t in output.tensors.values()}
        if shapes != {rows}:
            problems.append(f"N={num_tokens} (graph {padded}): replay rows {shapes}")
        elif same_values(output, captured_data):
            problems.append(f"N={num_tokens}: replay returned the capture's data")
        elif not same_values(output, expected):
            problems.append(
                f"N={num_tokens} (graph {padded}): replay does not hold what this "
                "step computed from the rows received"
            )
        if pointers(output) != pointers(manager.intermediate_tensors):
            problems.append(f"N={num_tokens}: replay is not the captured output")
        log(
            f"step {step}: N={num_tokens} -> graph N={padded}, received {rows} rows, "
            f"replay returned {sorted(shapes)} rows, "
            f"matches eager: {shapes == {rows} and same_values(output, expected)}"
        )
    return problems


class FakeV2Runner(types.SimpleNamespace):
    """What the V2 runner's ``execute_model`` reads of ``self`` on a middle
    PP stage's real step with one request, no LoRA, no encoder, no
    attention: the real graph manager, stage model and persistent buffers;
    no-ops for request bookkeeping, connectors and timing."""

    def __init__(self, stage: Stage) -> None:
        from vllm.model_executor.models.interfaces import get_pp_hand_off_declaration
        from vllm.v1.worker.gpu.pp_utils import PPHandler

        noop = lambda *args, **kwargs: None  # noqa: E731
        relay = types.SimpleNamespace(aux_hidden_state_relay_keys=())
        super().__init__(
            model=stage.model,
            _pp_hand_off=get_pp_hand_off_declaration(stage.model),
            intermediate_tensors=stage.buffers,
            input_buffers=stage.input_buffers,
            cudagraph_manager=stage.manager,
            vllm_config=stage.config,
            parallel_config=stage.config.parallel_config,
            model_config=None,
            observability_config=types.SimpleNamespace(cudagraph_metrics=False),
            is_first_pp_rank=False,
            is_last_pp_rank=False,
            pp_handler=types.SimpleNamespace(
                relay_aux_hidden_states=lambda inputs, output: (
                    PPHandler.relay_aux_hidden_states(relay, inputs, output)
                )
            ),
            encoder_cache=None,
            aux_output_connector=None,
            pcp_manager=None,
            lora_config=None,
            is_encoder_decoder=False,
            ubatch_runner=None,
            dp_size=1,
            dp_rank=0,
            dcp_size=1,
            decode_query_len=1,
            uses_inputs_embeds=False,
            attn_groups=[],
            kv_cache_config=types.SimpleNamespace(kv_cache_groups=[]),
            block_tables=types.SimpleNamespace(apply_staged_writes=noop),
            model_state=types.SimpleNamespace(
                preprocess_state=noop,
                prepare_attn=noop,
                prepare_inputs=lambda input_batch, req_states: {},
            ),
            req_states=types.SimpleNamespace(
                num_computed_tokens=types.SimpleNamespace(gpu=None)
            ),
            eplb=types.SimpleNamespace(prepare_forward=noop),
            step_timing=types.SimpleNamespace(record_batch=noop, forward_start=noop),
            kv_connector=types.SimpleNamespace(pre_forward=noop, finish_forward=noop),
            update_pp_decode_requests=noop,
            draft_tokens_handler=types.SimpleNamespace(begin_step=noop),
            finish_requests=noop,
            free_states=noop,
            add_requests=noop,
            update_requests=noop,
            prepare_attn=lambda input_batch: ([], []),
        )

    def gather_batch_req_state(self, scheduler_output, dummy_run):
        tokens = scheduler_output.total_num_scheduled_tokens
        state = types.SimpleNamespace(
            num_tokens=tokens, has_prefill=True, decode_graph_eligible=False
        )
        return state, None

    def prepare_inputs(self, scheduler_output, batch_req_state, batch_desc, loras):
        padded = batch_desc.num_tokens
        return types.SimpleNamespace(
            num_tokens=batch_req_state.num_tokens,
            num_tokens_after_padding=padded,
            input_ids=self.input_buffers.input_ids[:padded],
            positions=self.input_buffers.positions[:padded],
            is_padding=self.input_buffers.is_padding[:padded],
        )


def scheduled(num_tokens: int) -> types.SimpleNamespace:
    """A scheduler output of one request of ``num_tokens`` new tokens."""
    return types.SimpleNamespace(
        total_num_scheduled_tokens=num_tokens,
        num_scheduled_tokens={"request-0": num_tokens},
        finished_req_ids=set(),
        skip_drafts=False,
        num_spec_tokens_to_schedule=0,
        scheduled_encoder_inputs={},
        encoder_input_updates={},
    )


HAND_OVER_CALL = (
    'model_inputs["intermediate_tensors"] = hand_over_intermediate_tensors('
)


def execute_model_skipping_full_hand_over() -> Callable[..., Any]:
    """The planted fault: V2 ``execute_model`` as it would be if its FULL
    replay path skipped the hand-over (no row check, no copy) and replayed
    on the persistent buffers as they were."""
    from vllm.v1.worker.gpu import model_runner

    source = textwrap.dedent(
        inspect.getsource(model_runner.GPUModelRunner.execute_model)
    )
    assert source.count(HAND_OVER_CALL) == 1, "execute_model's hand-over moved"
    planted = source.replace(
        HAND_OVER_CALL,
        'model_inputs["intermediate_tensors"] = (_skip_on_full if batch_desc.cg_mode'
        " == CUDAGraphMode.FULL else hand_over_intermediate_tensors)(",
    )
    namespace = dict(vars(model_runner))
    namespace["_skip_on_full"] = lambda buffers, received, n, model: buffers[:n]
    exec(compile(planted, model_runner.__file__, "exec"), namespace)
    return namespace["execute_model"]


def check_execute_model(
    stage: Stage, execute_model: Callable[..., Any], log: Callable[[str], None]
) -> list[str]:
    """Real steps through ``execute_model`` that replay FULL graphs; return
    every way the stage's output or the row check went wrong."""
    problems: list[str] = []
    runner = FakeV2Runner(stage)
    manager = stage.manager
    replays: list[int] = []
    replay = manager.run_fullgraph
    manager.run_fullgraph = lambda desc: (
        replays.append(desc.num_tokens),
        replay(desc),
    )[1]
    try:
        before = pointers(stage.buffers)
        for step, num_tokens in enumerate(STEP_TOKENS):
            padded = manager.dispatch(1, num_tokens, None, 0).num_tokens
            rows = sp_shard_rows(padded, DECLARED_TP)
            received = received_shard(rows, seed=200 + step, device=stage.device)
            count = len(replays)
            output = execute_model(runner, scheduled(num_tokens), received)
            expected = eager_output(stage, received, padded)
            if len(replays) != count + 1:
                problems.append(f"N={num_tokens}: no FULL graph replay")
            if not isinstance(output, IntermediateTensors):
                problems.append(f"N={num_tokens}: returned {type(output).__name__}")
                continue
            ok = same_values(output, expected)
            if not ok:
                problems.append(
                    f"N={num_tokens} (graph {padded}): execute_model returned other "
                    "rows than this step computes from what it received"
                )
            if pointers(stage.buffers) != before:
                problems.append(f"N={num_tokens}: persistent buffers moved")
            log(
                f"execute_model step {step}: N={num_tokens} -> FULL graph "
                f"N={padded}, {rows} rows in, "
                f"{sorted({t.shape[0] for t in output.tensors.values()})} rows out, "
                f"matches eager: {ok}"
            )
        # Stages that padded differently: one row too many, before the replay.
        wrong = received_shard(sp_shard_rows(8, DECLARED_TP) + 1, 7, stage.device)
        count = len(replays)
        try:
            execute_model(runner, scheduled(8), wrong)
        except ValueError as refused:
            log(
                f"execute_model refused {wrong['hidden_states'].shape[0]} rows: "
                f"{str(refused).splitlines()[0][:120]}"
            )
        else:
            problems.append("a hand-off of other rows than the shard was not refused")
        if len(replays) != count:
            problems.append("a refused hand-off still replayed its graph")
    finally:
        manager.run_fullgraph = replay
    return problems


def strong_ref_tensors(tensors: Any) -> Any:
    """Stand-in for ``weak_ref_tensors`` (``torch.ops._C.weak_ref_tensor``
    is compiled): the same storage, held by an ordinary view. A replay
    returns the same tensors either way; only their lifetime differs."""
    if isinstance(tensors, IntermediateTensors):
        return IntermediateTensors({k: v.view(v.shape) for k, v in tensors.items()})
    return tensors.view(tensors.shape)


def capture_legacy_graphs(device: torch.device) -> Stage:
    """Capture FULL graphs of :class:`ShardedStage` with the legacy runner's
    ``CUDAGraphWrapper``, as its ``_dummy_run`` does: vLLM's
    ``CudagraphDispatcher`` picks each capture size's descriptor, the runner's
    hand-over gives the shard-sized buffers' leading ``ceil(N / TP)`` rows
    (no tensors received), as a real step does (call under
    :func:`declared_topology`)."""
    from vllm.compilation import cuda_graph
    from vllm.forward_context import set_forward_context
    from vllm.model_executor.models.interfaces import get_pp_hand_off_declaration
    from vllm.v1.cudagraph_dispatcher import CudagraphDispatcher
    from vllm.v1.worker.pp_intermediate_tensors import hand_over_intermediate_tensors

    cuda_graph.weak_ref_tensors = strong_ref_tensors
    print("[k3-sppp stand-in] vllm.compilation.cuda_graph.weak_ref_tensors")
    config = graph_config()
    dispatcher = CudagraphDispatcher(config)
    dispatcher.initialize_cudagraph_keys(CUDAGraphMode.FULL, 1)
    model = ShardedStage().to(device)
    wrapper = cuda_graph.CUDAGraphWrapper(model, config, CUDAGraphMode.FULL)
    buffers = IntermediateTensors(
        {
            key: torch.zeros(BUFFER_ROWS, HIDDEN, device=device)
            for key in ("hidden_states", "residual")
        }
    )
    positions = torch.zeros(CAPACITY, dtype=torch.long, device=device)
    hand_off = get_pp_hand_off_declaration(model)
    for num_tokens in reversed(CAPTURE_SIZES):  # largest first, as the runner
        mode, desc = dispatcher.dispatch(num_tokens)
        for run_mode in (CUDAGraphMode.NONE, mode):  # warm-up, then capture
            with (
                set_forward_context(
                    None,
                    config,
                    num_tokens=num_tokens,
                    cudagraph_runtime_mode=run_mode,
                    batch_descriptor=desc,
                ),
                torch.inference_mode(),
            ):
                wrapper(
                    None,
                    positions[:num_tokens],
                    hand_over_intermediate_tensors(buffers, None, num_tokens, hand_off),
                )
    return Stage(
        config=config,
        dispatcher=dispatcher,
        wrapper=wrapper,
        model=model,
        buffers=buffers,
        positions=positions,
        device=device,
    )


def check_legacy_graph_replay(
    stage: Stage,
    log: Callable[[str], None],
    hand_over: Callable[..., IntermediateTensors] | None = None,
) -> list[str]:
    """Real steps as the legacy runner runs them on a middle stage: dispatch,
    hand-over of the received shard into the persistent buffers (the
    series' ``hand_over_intermediate_tensors`` unless another is given),
    replay of the ``CUDAGraphWrapper``; return every way they went wrong."""
    from vllm.forward_context import set_forward_context
    from vllm.model_executor.models.interfaces import get_pp_hand_off_declaration
    from vllm.v1.worker.pp_intermediate_tensors import hand_over_intermediate_tensors

    hand_over = hand_over or hand_over_intermediate_tensors

    problems: list[str] = []
    wrapper, buffers = stage.wrapper, stage.buffers
    hand_off = get_pp_hand_off_declaration(stage.model)
    entries = wrapper.concrete_cudagraph_entries
    captured = sorted(d.num_tokens for d, e in entries.items() if e.cudagraph)
    if captured != CAPTURE_SIZES:
        problems.append(f"captured {captured}, expected {CAPTURE_SIZES}")
    rows_recorded = {
        d.num_tokens: {t.shape[0] for t in e.output.tensors.values()}
        for d, e in entries.items()
    }
    for num_tokens, rows in rows_recorded.items():
        if rows != {sp_shard_rows(num_tokens, DECLARED_TP)}:
            problems.append(f"graph N={num_tokens} captured an output of {rows} rows")
    log(
        f"legacy CUDAGraphWrapper captured FULL graphs for N={captured}; output rows: "
        + ", ".join(f"{n}:{sorted(r)[0]}" for n, r in sorted(rows_recorded.items()))
    )
    before = pointers(buffers)
    for step, num_tokens in enumerate(STEP_TOKENS):
        mode, desc = stage.dispatcher.dispatch(num_tokens)
        if mode != CUDAGraphMode.FULL:
            problems.append(f"N={num_tokens} dispatched {mode}, not FULL")
            continue
        padded = desc.num_tokens
        rows = sp_shard_rows(padded, DECLARED_TP)
        received = received_shard(rows, seed=300 + step, device=stage.device)
        handed = hand_over(buffers, received, padded, hand_off)
        with (
            set_forward_context(
                None,
                stage.config,
                num_tokens=padded,
                cudagraph_runtime_mode=mode,
                batch_descriptor=desc,
            ),
            torch.inference_mode(),
        ):
            output = wrapper(None, stage.positions[:padded], handed)
        torch.cuda.synchronize()
        expected = eager_output(stage, received, padded)
        if pointers(handed) != before or pointers(buffers) != before:
            problems.append(f"N={num_tokens}: hand-over moved the persistent buffers")
        shapes = {t.shape[0] for t in output.tensors.values()}
        if shapes != {rows}:
            problems.append(f"N={num_tokens} (graph {padded}): replay rows {shapes}")
        elif not same_values(output, expected):
            problems.append(
                f"N={num_tokens} (graph {padded}): replay does not hold what this "
                "step computed from the rows received"
            )
        if pointers(output) != pointers(entries[desc].output):
            problems.append(f"N={num_tokens}: replay is not the captured output")
        log(
            f"legacy step {step}: N={num_tokens} -> graph N={padded}, received {rows} "
            f"rows, replay returned {sorted(shapes)} rows, "
            f"matches eager: {shapes == {rows} and same_values(output, expected)}"
        )
    return problems
