# SPDX-License-Identifier: Apache-2.0
"""A tiny Kimi K3 built from vLLM's own classes, runnable on the CPU.

``KimiLinearModel`` and ``KimiDecoderLayer`` are constructed and run by their
real ``__init__`` and ``forward``: embeddings, norms, dense ``KimiMLP`` with
TP-sharded weights, ``make_layers``' PP split and every SP collective are
vLLM's. Only the classes whose kernels need a GPU are replaced, in the model
module's namespace, for the duration of the build:

- attention (KDA and MLA): :class:`SequenceMixer`, a causal weighted prefix
  mean over the whole sequence followed by a real ``RowParallelLinear``
  ``o_proj``, so a wrong row order, a missing gather or a double shard
  changes the output, and the layer's own ``reduce_results``/reduce-scatter
  logic applies unchanged;
- DSA attention (vLLM 0.34.0's ``KimiK3DSAAttention``, on the layers
  ``dsa_config`` names): :class:`SparseSequenceMixer`, which mixes into each
  token only the earlier tokens an indexer scores highest, through the
  model-level ``topk_indices_buffer`` as the DSA indexer and the sparse
  attention backend share it (the CPU platform refuses sparse attention);
- MoE: :class:`TokenwiseExperts`, a per-token map with replicated weights,
  which refuses a batch larger than MegaMoE's symmetric buffer would hold;
- ``attn_res`` (Triton or SM100-native only): :func:`attn_res_reference`;
- the MTP layer's ``fused_mtp_input`` (Triton): :func:`fused_mtp_input_reference`.

Weights are drawn from a seed per parameter name at full size and loaded
through each parameter's own ``weight_loader``, so every rank holds its shard
of the same full model. Everything runs in float64: results differ from the
single-process reference only by summation order across TP shards.
"""

from __future__ import annotations

import contextlib
import copy
import types
import zlib
from collections.abc import Callable, Iterator

import torch
from torch import nn

import vllm
from tests.sppp_testbed.bases import VLLM_VERSION
from tests.sppp_testbed.cpu_platform import accept_x86_without_triton
from vllm.config import (
    CompilationConfig,
    KernelConfig,
    ParallelConfig,
    VllmConfig,
    replace,
    set_current_vllm_config,
)
from vllm.distributed import (
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
    tensor_model_parallel_all_reduce,
)
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.linear import (
    LinearBase,
    ReplicatedLinear,
    RowParallelLinear,
)
from vllm.model_executor.layers.rotary_embedding import get_rope
from vllm.model_executor.layers.vocab_parallel_embedding import (
    VocabParallelEmbedding,
)
from vllm.model_executor.models import llama
from vllm.models.kimi_k3.nvidia import dspark_mla
from vllm.models.kimi_k3.nvidia import model as k3
from vllm.models.kimi_k3.nvidia import mtp as k3_mtp
from vllm.models.kimi_k3.nvidia.dspark_mla import K3DSparkModel
from vllm.transformers_utils.configs.kimi_linear import KimiLinearConfig
from vllm.utils.math_utils import cdiv

try:
    from vllm.models.kimi_k3.nvidia import sequence_parallel as k3_sp
except ImportError:  # pristine vLLM (non-regression runs): no overlay modules
    k3_sp = None

accept_x86_without_triton()

DTYPE = torch.float64
HIDDEN = 64
VOCAB = 128
NUM_LAYERS = 4
# The scheduler's token budget (--max-num-batched-tokens): the most tokens a
# step dispatches, what MegaMoE's buffer and the DSA top-k buffer are sized
# by. Odd, so that its shard rows ceil(N/TP) differ from N // TP.
MAX_NUM_BATCHED_TOKENS = 127
# The longest request (--max-model-len).
MAX_MODEL_LEN = 1024
# Tokens each DSA query attends to (dsa_config.index_topk; 2048 in K3.1).
DSA_INDEX_TOPK = 4
# Whether this vLLM builds Kimi K3's DSA layers (0.34.0 does).
HAS_DSA = hasattr(k3, "KimiK3DSAAttention")


class SequenceMixer(nn.Module):
    """Attention stand-in: mixes every earlier token into each token."""

    def __init__(self, config: KimiLinearConfig, *args, prefix: str = "", **kwargs):
        super().__init__()
        hidden = config.hidden_size
        self.value = nn.Parameter(torch.empty(hidden, hidden))
        self.o_proj = RowParallelLinear(
            hidden, hidden, bias=False, prefix=f"{prefix}.o_proj"
        )

    def forward(self, hidden_states: torch.Tensor, positions: torch.Tensor):
        rows = hidden_states.shape[0]
        assert positions.shape[0] == rows, "attention sees the whole sequence"
        weight = 1.0 + 0.01 * torch.arange(rows, dtype=hidden_states.dtype)
        count = torch.arange(1, rows + 1, dtype=hidden_states.dtype)
        mixed = torch.cumsum(hidden_states * weight[:, None], dim=0) / count[:, None]
        mixed = mixed @ self.value
        tp_size = get_tensor_model_parallel_world_size()
        width = mixed.shape[1] // tp_size
        start = get_tensor_model_parallel_rank() * width
        output, _ = self.o_proj(mixed[:, start : start + width].contiguous())
        return output


class SparseSequenceMixer(SequenceMixer):
    """DSA attention stand-in (``KimiK3DSAAttention``): each token mixes only
    the ``index_topk`` earlier tokens an indexer scores highest.

    As in the real layer, the indexer writes the top-k of the step's rows into
    the model-level ``topk_indices_buffer`` (``max_num_batched_tokens`` rows,
    -1 where a token has fewer earlier tokens), and the sparse attention reads
    the indices from there. Attention sees the whole sequence (under SP the
    decoder layer gathers before it), so a wrong order, a missing gather or a
    batch larger than the buffer changes the answer or fails.
    """

    def __init__(
        self,
        config: KimiLinearConfig,
        *args,
        topk_indices_buffer: torch.Tensor | None = None,
        prefix: str = "",
        **kwargs,
    ):
        super().__init__(config, prefix=prefix)
        if config.dsa_config is None:
            raise ValueError("dsa_config is required for KimiK3DSAAttention")
        # KimiLinearModel always passes its buffer (the real layer would
        # allocate a private one, with a warning, for a host that does not).
        assert topk_indices_buffer is not None, "no model-level top-k buffer"
        self.topk_indices_buffer = topk_indices_buffer
        self.index_topk = config.dsa_config.index_topk
        hidden = config.hidden_size
        self.index_query = nn.Parameter(torch.empty(hidden, hidden))

    def pack_projections(self) -> None:
        """The real layer packs its projections after loading (the text
        model's ``process_weights_after_loading``); the stand-in has none."""

    def forward(self, hidden_states: torch.Tensor, positions: torch.Tensor):
        rows = hidden_states.shape[0]
        assert positions.shape[0] == rows, "attention sees the whole sequence"
        capacity = self.topk_indices_buffer.shape[0]
        if rows > capacity:
            raise ValueError(
                f"DSA got {rows} tokens, but the top-k indices buffer holds "
                f"{capacity} (max_num_batched_tokens)."
            )
        # The indexer: causal scores, the top k per query into the buffer.
        scores = (hidden_states @ self.index_query) @ hidden_states.T
        scores = scores / hidden_states.shape[1] ** 0.5
        causal = torch.ones(rows, rows, dtype=torch.bool).tril()
        scores = scores.masked_fill(~causal, float("-inf"))
        k = min(self.index_topk, rows)
        top = scores.topk(k, dim=1)
        chosen = torch.where(top.values.isinf(), -1, top.indices)
        self.topk_indices_buffer[:rows].fill_(-1)
        self.topk_indices_buffer[:rows, :k] = chosen.to(self.topk_indices_buffer.dtype)
        # The sparse attention: what the buffer says, nothing else.
        indices = self.topk_indices_buffer[:rows, :k].long()
        valid = indices >= 0
        logits = torch.gather(scores, 1, indices.clamp(min=0))
        logits = logits.masked_fill(~valid, float("-inf"))
        weights = logits.softmax(dim=1) * valid
        picked = hidden_states[indices.clamp(min=0)]  # (rows, k, hidden)
        mixed = (weights[..., None] * picked).sum(dim=1) @ self.value
        tp_size = get_tensor_model_parallel_world_size()
        width = mixed.shape[1] // tp_size
        start = get_tensor_model_parallel_rank() * width
        output, _ = self.o_proj(mixed[:, start : start + width].contiguous())
        return output


class CausalAttention(nn.Module):
    """Attention stand-in for an EAGLE-3 drafter's layers (vLLM
    ``Attention``'s arguments, in the Llama drafter's ``LlamaAttention``):
    causal softmax attention over the rows it is given, as one sequence."""

    def __init__(self, num_heads: int, head_size: int, scale: float,
                 num_kv_heads: int | None = None, *args, prefix: str = "",
                 **kwargs):  # fmt: skip
        super().__init__()
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = scale
        self.num_kv_heads = num_kv_heads or num_heads
        self.layer_name = prefix

    def attend(self, q, keys, values, first: int) -> torch.Tensor:
        """Queries at positions ``first, first + 1, ...`` over keys and
        values at positions ``0 .. len(keys) - 1``."""
        group = self.num_heads // self.num_kv_heads
        keys = keys.repeat_interleave(group, dim=1)
        values = values.repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, keys) * self.scale
        query_pos = first + torch.arange(q.shape[0])[:, None]
        future = torch.arange(keys.shape[0])[None, :] > query_pos
        scores = scores.masked_fill(future, float("-inf"))
        return torch.einsum("hqk,khd->qhd", scores.softmax(-1), values)

    def forward(self, query, key, value, output_shape=None) -> torch.Tensor:
        q = query.view(-1, self.num_heads, self.head_size)
        k = key.view(-1, self.num_kv_heads, self.head_size)
        v = value.view(-1, self.num_kv_heads, self.head_size)
        return self.attend(q, k, v, 0).reshape(q.shape[0], -1)


class ContextAttention(nn.Module):
    """Attention stand-in for K3's DSpark draft layers (``dspark_mla``'s
    ``MultiHeadLatentAttention``): softmax attention of every token of the
    draft block over the context latents (``context``, what the drafter's
    ``context_kv_proj`` made of the target's combined aux states: vLLM's
    ``precompute_and_store_context_kv`` stores them in the draft KV cache)
    and over the block's own tokens, non-causally as DSpark drafts. A wrong
    aux row changes the context, and so every draft.

    Keeps the latent geometry the drafter reads after loading
    (``q_lora_rank``, ``kv_lora_rank``, ``qk_rope_head_dim``,
    ``kv_a_layernorm``, ``kv_cache_dtype``, the rotary embedding); its
    output is row-parallel and left unreduced, as the drafter's next norm
    reduces it."""

    kv_cache_dtype = "auto"

    def __init__(self, config, hidden_size: int, *args, kv_lora_rank: int,
                 qk_rope_head_dim: int, q_lora_rank: int | None = None,
                 prefix: str = "", **kwargs):  # fmt: skip
        super().__init__()
        self.q_lora_rank = q_lora_rank
        self.kv_lora_rank = kv_lora_rank
        self.qk_rope_head_dim = qk_rope_head_dim
        self.layer_name = prefix
        width = kv_lora_rank + qk_rope_head_dim
        self.kv_a_layernorm = RMSNorm(kv_lora_rank, eps=config.rms_norm_eps)
        self.rotary_emb = get_rope(
            qk_rope_head_dim,
            max_position=config.max_position_embeddings,
            rope_parameters=config.rope_parameters,
            is_neox_style=False,
        )
        self._k_scale = torch.tensor(1.0)
        self.query = nn.Parameter(torch.empty(hidden_size, width))
        self.key = nn.Parameter(torch.empty(hidden_size, width))
        self.value = nn.Parameter(torch.empty(width, hidden_size))
        self.o_proj = RowParallelLinear(
            hidden_size, hidden_size, bias=False, prefix=f"{prefix}.o_proj"
        )
        self.context: torch.Tensor | None = None

    def attend(self, hidden_states: torch.Tensor, latents: torch.Tensor):
        """The rows ``hidden_states`` over ``latents``, non-causally."""
        query = hidden_states @ self.query
        scores = query @ latents.T / latents.shape[1] ** 0.5
        return scores.softmax(-1) @ latents @ self.value

    def project(self, mixed: torch.Tensor) -> torch.Tensor:
        width = mixed.shape[1] // get_tensor_model_parallel_world_size()
        start = get_tensor_model_parallel_rank() * width
        output, _ = self.o_proj(mixed[:, start : start + width].contiguous())
        return output

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor):
        latents = hidden_states @ self.key
        if self.context is not None:
            latents = torch.cat([self.context, latents])
        return self.project(self.attend(hidden_states, latents))


def mega_moe_max_num_tokens(
    vllm_config: VllmConfig, use_sequence_parallel: bool
) -> int:
    """The most tokens MegaMoE's symmetric buffer holds, as vLLM's own
    ``KimiMoE.__init__`` sizes it (``models/kimi_k3/nvidia/model.py``): the
    scheduler's ``max_num_batched_tokens``; from vLLM 0.34.0, under SP, this
    rank's shard of it, ``cdiv(max_num_batched_tokens, TP)`` ("The layer only
    sees this rank's shard of the batch"). 0.33.0 sized it for the whole
    budget in every layout."""
    max_num_tokens = vllm_config.scheduler_config.max_num_batched_tokens
    if use_sequence_parallel and VLLM_VERSION >= (0, 34, 0):
        max_num_tokens = cdiv(max_num_tokens, get_tensor_model_parallel_world_size())
    return max_num_tokens


class TokenwiseExperts(nn.Module):
    """MoE stand-in: routed experts as a per-token map, the same on every
    rank, plus the real shared expert (``KimiMLP``) built as ``KimiMoE``
    builds it, so its sequence-parallel sharding
    (``VLLM_KIMI_K3_SHARD_SP_SHARED_EXPERT``) runs vLLM's code.

    With the MegaMoE backend it keeps MegaMoE's bound: ``KimiMoE`` sizes the
    symmetric buffer (:func:`mega_moe_max_num_tokens`), and
    ``DeepGemmMegaMoEExperts.forward`` refuses a batch of more tokens with
    the same message; ``most_tokens`` records the largest batch it ran.
    """

    def __init__(
        self,
        config: KimiLinearConfig,
        vllm_config: VllmConfig,
        *args,
        use_sequence_parallel: bool,
        prefix: str = "",
        **kwargs,
    ):
        super().__init__()
        self.use_sequence_parallel = use_sequence_parallel
        self.max_num_tokens: int | None = None
        if vllm_config.kernel_config.moe_backend == "deep_gemm_mega_moe":
            self.max_num_tokens = mega_moe_max_num_tokens(
                vllm_config, use_sequence_parallel
            )
        self.most_tokens = 0
        self.weight = nn.Parameter(torch.empty(config.hidden_size, config.hidden_size))
        self.shared_experts = k3.KimiMLP(
            hidden_size=config.hidden_size,
            intermediate_size=config.moe_intermediate_size * config.num_shared_experts,
            hidden_act=config.hidden_act,
            reduce_results=False,
            use_sequence_parallel=use_sequence_parallel,
            can_shard_sequence_parallel=k3.can_shard_sequence_parallel_shared_expert(
                vllm_config
            ),
            prefix=f"{prefix}.shared_experts",
        )

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        num_tokens = hidden_states.shape[0]
        if self.max_num_tokens is not None and num_tokens > self.max_num_tokens:
            raise ValueError(
                f"MegaMoE got {num_tokens} tokens, but the symmetric buffer was "
                f"sized for {self.max_num_tokens}."
            )
        self.most_tokens = max(self.most_tokens, num_tokens)
        shared = self.shared_experts(hidden_states)
        if not self.use_sequence_parallel:
            # TP-sharded without SP: KimiMoE sums the partials with the routed
            # output's all-reduce.
            shared = tensor_model_parallel_all_reduce(shared)
        return torch.tanh(hidden_states @ self.weight) + shared


def attn_res_reference(
    prefix: torch.Tensor,
    delta: torch.Tensor | None,
    blocks: torch.Tensor,
    norm_weight: torch.Tensor,
    qk_weight: torch.Tensor,
    output_norm_weight: torch.Tensor | None,
    num_blocks: int,
    block_write_idx: int,
    eps: float,
    output_norm_eps: float,
) -> torch.Tensor:
    """Pure-torch ``attn_res`` (the op is Triton or SM100-native only).

    Per token: ``prefix += delta`` in place; optionally store it as block
    ``block_write_idx``; softmax-mix the first ``num_blocks`` blocks and the
    prefix by RMS-normalised logits against ``norm_weight * qk_weight``; then
    an optional output RMSNorm.
    """
    if delta is not None:
        prefix.add_(delta)
    if block_write_idx >= 0:
        blocks[:, block_write_idx].copy_(prefix)
    if num_blocks == 0:
        mixed = prefix.clone()
    else:
        sources = torch.cat([blocks[:, :num_blocks], prefix[:, None]], dim=1)
        rms = torch.rsqrt(sources.pow(2).mean(dim=-1) + eps)
        logits = (sources * (norm_weight * qk_weight)).sum(dim=-1) * rms
        mixed = (logits.softmax(dim=1)[..., None] * sources).sum(dim=1)
    if output_norm_weight is None:
        return mixed
    rms = torch.rsqrt(mixed.pow(2).mean(dim=-1, keepdim=True) + output_norm_eps)
    return mixed * rms * output_norm_weight


def fused_mtp_input_reference(
    positions: torch.Tensor,
    inputs_embeds: torch.Tensor,
    previous_hidden_states: torch.Tensor,
    enorm_weight: torch.Tensor,
    hnorm_weight: torch.Tensor,
    eps: float,
) -> torch.Tensor:
    """Pure-torch ``fused_mtp_input`` (the op is a Triton kernel).

    Per token: the embedding, zeroed at position 0, RMS-normalised with
    ``enorm_weight``, beside the previous hidden state RMS-normalised with
    ``hnorm_weight``: ``eh_proj``'s ``2 * hidden`` input.
    """

    def rms_norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps) * weight

    embeds = inputs_embeds * (positions != 0)[:, None]
    return torch.cat(
        [
            rms_norm(embeds, enorm_weight),
            rms_norm(previous_hidden_states, hnorm_weight),
        ],
        dim=-1,
    )


STAND_INS = {
    "KimiK3DeltaAttention": SequenceMixer,
    "KimiLinearGatedDeltaNetAttention": SequenceMixer,
    "MultiHeadLatentAttention": SequenceMixer,
    "KimiMoE": TokenwiseExperts,
    "attn_res": attn_res_reference,
}
if HAS_DSA:
    STAND_INS["KimiK3DSAAttention"] = SparseSequenceMixer


def tiny_config(
    attn_res: bool = False,
    num_layers: int = NUM_LAYERS,
    dsa: bool = False,
    width: int = 4,
) -> KimiLinearConfig:
    """KDA and MLA alternate, as in K3; one MTP layer follows the last. With
    ``dsa``, every full-attention layer is a DSA layer, as in K3.1. ``width``
    attention heads and routed experts: 4, or the TP size above TP4 (TP8 is
    the production shape), which splits both."""
    full_attn_layers = list(range(2, num_layers + 1, 2))
    dsa_config = None
    if dsa:
        if not HAS_DSA:
            raise ValueError(f"vLLM {vllm.__version__} builds no DSA layers")
        dsa_config = {
            "dsa_layers": full_attn_layers,
            "index_topk": DSA_INDEX_TOPK,
            "index_head_dim": 16,
            "index_num_heads": 2,
        }
    return KimiLinearConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=96,
        num_hidden_layers=num_layers,
        num_nextn_predict_layers=1,
        num_attention_heads=width,
        num_experts=width,
        num_experts_per_token=2,
        num_shared_experts=1,
        moe_intermediate_size=32,
        first_k_dense_replace=1,
        linear_attn_config={
            "kda_layers": list(range(1, num_layers + 1, 2)),
            "full_attn_layers": full_attn_layers,
            "use_full_rank_gate": True,
        },
        **({"dsa_config": dsa_config} if dsa else {}),
        attn_res_block_size=2 if attn_res else None,
        mla_use_nope=True,
        qk_nope_head_dim=16,
        qk_rope_head_dim=0,
        v_head_dim=16,
        kv_lora_rank=32,
    )


def scenario_config(
    tp: int,
    pp: int,
    *,
    sp: bool,
    attn_res: bool = False,
    num_layers: int = NUM_LAYERS,
    dsa: bool = False,
) -> VllmConfig:
    """A VllmConfig whose options ask for SP (EP, TP>1, MegaMoE) or not, with
    the test bed's token budget (``MAX_NUM_BATCHED_TOKENS``)."""
    config = VllmConfig(
        parallel_config=ParallelConfig(
            tensor_parallel_size=tp,
            pipeline_parallel_size=pp,
            enable_expert_parallel=sp,
        ),
        kernel_config=KernelConfig(moe_backend="deep_gemm_mega_moe" if sp else "auto"),
        compilation_config=CompilationConfig(custom_ops=["none"]),
    )
    config.scheduler_config.max_num_batched_tokens = MAX_NUM_BATCHED_TOKENS
    hf_config = tiny_config(attn_res, num_layers, dsa, width=max(4, tp))
    # No checkpoint to read: the model (and the start-up check) only ask
    # its ModelConfig for these; max_logprobs is vLLM's default, and Kimi K3
    # attends with MLA.
    object.__setattr__(
        config,
        "model_config",
        types.SimpleNamespace(
            hf_text_config=hf_config,
            hf_config=hf_config,
            dtype=DTYPE,
            head_dtype=DTYPE,
            max_model_len=MAX_MODEL_LEN,
            max_logprobs=20,
            use_mla=True,
        ),
    )
    return config


@contextlib.contextmanager
def stand_ins() -> Iterator[None]:
    """Swap the GPU-only classes in, and restore the modules afterwards
    (including ``sp_all_gather``, the later stages' row check, the MTP layer's
    SP ops and the packed-gather limit, which fault injections and scenarios
    may replace)."""
    # What faults replace: the gather, and the row check of later stages.
    replaceable = ("sp_all_gather", "check_sequence_parallel_rows")
    saved = {
        name: getattr(k3, name)
        for name in (*STAND_INS, *replaceable)
        if hasattr(k3, name)  # pristine vLLM has no row check
    }
    saved_mtp = {
        name: getattr(k3_mtp, name)
        for name in ("fused_mtp_input", "sp_shard", "sp_all_gather")
    }
    saved_sp = {
        name: getattr(k3_sp, name)
        for name in ("sp_all_gather", "PACKED_GATHER_MAX_BYTES")
        if k3_sp is not None
    }
    saved_stream = torch.cuda.Stream
    saved_dspark = dspark_mla.MultiHeadLatentAttention
    saved_llama = llama.Attention
    try:
        for name, cls in STAND_INS.items():
            setattr(k3, name, cls)
        dspark_mla.MultiHeadLatentAttention = ContextAttention
        llama.Attention = CausalAttention
        k3_mtp.fused_mtp_input = fused_mtp_input_reference
        torch.cuda.Stream = lambda *args, **kwargs: None  # no CUDA streams on CPU
        yield
    finally:
        for name, cls in saved.items():
            setattr(k3, name, cls)
        for name, value in saved_sp.items():
            setattr(k3_sp, name, value)
        for name, value in saved_mtp.items():
            setattr(k3_mtp, name, value)
        torch.cuda.Stream = saved_stream
        dspark_mla.MultiHeadLatentAttention = saved_dspark
        llama.Attention = saved_llama


def full_weight(name: str, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """The full-size tensor for ``name``: the same in every rank and stage."""
    generator = torch.Generator().manual_seed(
        seed * 1_000_003 + zlib.crc32(name.encode())
    )
    values = torch.randn(shape, generator=generator, dtype=DTYPE)
    if name.endswith("norm.weight"):
        return 1.0 + 0.1 * values
    return values / shape[-1] ** 0.5


def load_seeded_weights(
    model: nn.Module,
    seed: int,
    weight: Callable[[str, tuple[int, ...], int], torch.Tensor] = full_weight,
    loaded: Callable[[str], None] | None = None,
) -> None:
    """Give every parameter its slice of the seeded full model (``weight``'s
    tensor for its name and full shape) through its own ``weight_loader``;
    ``loaded`` is told each name once it is loaded, as vLLM's loaders tell a
    model of each checkpoint weight."""
    for module_name, module in model.named_modules():
        for param_name, param in module.named_parameters(recurse=False):
            name = f"{module_name}.{param_name}" if module_name else param_name
            loader = getattr(param, "weight_loader", None)
            if isinstance(module, LinearBase) and param_name == "weight":
                shape = (module.output_size, module.input_size)
            elif isinstance(module, VocabParallelEmbedding):
                shape = (module.org_vocab_size, module.embedding_dim)
            else:
                shape, loader = tuple(param.shape), None
            tensor = weight(name, shape, seed)
            if loader is None:
                param.data.copy_(tensor)
            else:
                loader(param, tensor)
            if loaded is not None:
                loaded(name)
    for module in model.modules():
        quant_method = getattr(module, "quant_method", None)
        if quant_method is not None:
            quant_method.process_weights_after_loading(module)


def build_model(config: VllmConfig, seed: int = 0) -> k3.KimiLinearModel:
    """Build under :func:`stand_ins`, which must also cover the forward."""
    torch.set_default_dtype(DTYPE)
    with set_current_vllm_config(config):
        model = k3.KimiLinearModel(vllm_config=config, prefix="model")
    load_seeded_weights(model, seed)
    return model.eval()


def build_mtp(config: VllmConfig, seed: int = 0) -> k3_mtp.KimiK3MultiTokenPredictor:
    """vLLM's MTP drafter (its own embedding and one
    ``KimiK3MultiTokenPredictorLayer``), built from the target's
    ``VllmConfig`` as ``load_eagle_model`` builds it, under
    :func:`stand_ins`. Its embedding is seeded as the target's is."""
    torch.set_default_dtype(DTYPE)
    with set_current_vllm_config(config):
        drafter = k3_mtp.KimiK3MultiTokenPredictor(vllm_config=config, prefix="model")
    load_seeded_weights(drafter, seed)
    return drafter.eval()


def draft_config(config: VllmConfig, moe_backend: str | None) -> VllmConfig:
    """The drafter's config as ``load_eagle_model`` makes it: the target's,
    with ``--speculative-config``'s ``moe_backend``, when set, laid over the
    kernel config (``SpeculativeConfig.apply_draft_overrides``, whose
    ``replace`` of the whole ``VllmConfig`` wants a real ``ModelConfig``, so
    the copy is made here)."""
    if moe_backend is None:
        return config
    draft = copy.copy(config)
    kernel_config = replace(config.kernel_config, moe_backend=moe_backend)
    object.__setattr__(draft, "kernel_config", kernel_config)
    return draft


class DSparkContext(nn.Module):
    """What of K3's DSpark drafter first reads the target's aux states:
    ``context_proj`` and ``context_norm``, applied by vLLM's own
    ``K3DSparkModel.combine_hidden_states``."""

    combine_hidden_states = K3DSparkModel.combine_hidden_states

    def __init__(self, num_taps: int):
        super().__init__()
        self.context_proj = ReplicatedLinear(
            HIDDEN * num_taps, HIDDEN, bias=False, return_bias=False
        )
        self.context_norm = RMSNorm(HIDDEN, eps=1e-6)


def build_dspark_context(num_taps: int, seed: int = 0) -> DSparkContext:
    torch.set_default_dtype(DTYPE)
    context = DSparkContext(num_taps)
    load_seeded_weights(context, seed)
    return context.eval()
