# SPDX-License-Identifier: Apache-2.0
"""What stands in below Kimi K3's model class in the servers of vLLM 0.34.0.

vLLM's own registry and loader build the class the checkpoint's
``config.json`` names (``KimiK3ForConditionalGeneration``, its K3.1 name
too) inside vLLM's own V2 ``CPUModelRunner``. While the runner loads and
runs it (:func:`serving_stand_ins`), these classes and functions stand in
for what needs a GPU or a CPU kernel the CUDA wheel lacks:

- KDA and MLA attention (``KimiK3DeltaAttention``,
  ``KimiLinearGatedDeltaNetAttention``, ``MultiHeadLatentAttention``):
  :class:`PagedPrefixMixer`, a causal weighted prefix mean whose per-token
  values live in the paged KV cache vLLM allocates for the layer's spec
  (``FullAttentionSpec``: one head of the hidden size, float64). The engine's
  KV cache manager allocates its blocks, the runner binds its cache and
  builds its metadata through :class:`PrefixMixerBackend` (vLLM's
  ``CommonAttentionMetadata`` as it is); a step writes its tokens' values at
  their slots and reads each request's whole history back through the
  request's block-table row, so a wrong row, block, slot or shard in any
  step changes every later token. KDA's recurrent state is held this way
  too: as the history it summarises, in attention pages, not in a
  ``MambaSpec`` state (a spec-decode step's rejected drafts would need
  KDA's per-draft state copies);
- DSA attention (``KimiK3DSAAttention``): :class:`PagedSparseMixer`, which
  mixes into each token only the earlier tokens of its request an indexer
  scores highest (``dsa_config.index_topk``), its hidden states read back
  from the paged KV cache, and writes the step's top-k indices into the
  model-level ``topk_indices_buffer`` as the real indexer does;
- MoE, ``attn_res`` and the MTP layer's ``fused_mtp_input``: the test bed's
  (``tiny_k3.stand_ins``: ``TokenwiseExperts`` keeps MegaMoE's bound);
- the dummy loader's weights: every parameter its slice of one seeded full
  model (``tiny_k3.load_seeded_weights``), so that every layout serves the
  same model (vLLM's dummy loader draws each rank's shard on its own);
- the Triton kernels: ``tests.sppp_testbed.v2_kernel_standins`` and, for
  Kimi K3's hybrid model state (``KimiK3ModelState``, a
  ``MambaHybridModelState``), its two kernels that record how many tokens
  each request accepted (:data:`HYBRID_STATE_STAND_INS`);
- Kimi K3's DSpark drafter (``K3DSparkModel``, vLLM's ``DSparkSpeculator``):
  its MLA draft attention by :class:`PagedContextAttention` (the context
  latents vLLM's precompute stores, and the draft block's, in the paged KV
  cache; non-causal over both), the two ``vllm._C`` ops of its context
  precompute (:data:`DSPARK_OPS`: ``rms_norm``, ``rotary_embedding``), its
  speculator's Triton input preparation (:data:`DSPARK_KERNELS`) and greedy
  argmax (:func:`greedy_argmax`); its Markov head's weights favour
  repeating a token (:func:`dspark_weight`).

The same attention, recomputed over each whole sequence without any KV
cache, is the test bed's ``tiny_k3.SequenceMixer`` / ``SparseSequenceMixer``
(same parameters, same values): ``test_serve_parity.py`` compares the
served tokens with it.
"""

from __future__ import annotations

import contextlib
import importlib
import re
import types
from collections.abc import Iterator

import torch
from torch import nn

from tests.sppp_testbed import tiny_k3, v2_kernel_standins
from vllm.config import get_current_vllm_config
from vllm.distributed import get_tensor_model_parallel_rank
from vllm.forward_context import get_forward_context
from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
from vllm.model_executor.layers.linear import RowParallelLinear
from vllm.v1.attention.backend import AttentionBackend, AttentionMetadataBuilder
from vllm.v1.kv_cache_interface import FullAttentionSpec

SEED = 0


class PrefixMixerMetadataBuilder(AttentionMetadataBuilder):
    """Hands the layer vLLM's ``CommonAttentionMetadata`` as it is."""

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)

    def build(self, common_prefix_len, common_attn_metadata, fast_build=False):
        return common_attn_metadata


class PrefixMixerBackend(AttentionBackend):
    """The attention backend of the stand-ins (no kernels)."""

    @staticmethod
    def get_name() -> str:
        return "K3_SPPP_PREFIX_MIXER"

    @staticmethod
    def get_impl_cls():
        raise NotImplementedError("the prefix mixer computes in its layer")

    @staticmethod
    def get_builder_cls():
        return PrefixMixerMetadataBuilder


def new_token_slots(
    common, block_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """This step's tokens that have a KV cache slot (padding has none): their
    rows, and the block and offset of each slot."""
    slot_mapping = common.slot_mapping[: common.num_actual_tokens]
    rows = torch.nonzero(slot_mapping >= 0).flatten()
    where = slot_mapping[rows]
    return rows, where // block_size, where % block_size


def request_histories(
    common, block_size: int
) -> Iterator[tuple[int, int, torch.Tensor, torch.Tensor]]:
    """Per request with tokens in this step: its rows ``start:end``, and the
    block and offset of each of its positions so far, through its block
    table (this step's tokens included, once :func:`new_token_slots` wrote
    them)."""
    starts = common.query_start_loc_cpu.tolist()
    for b in range(common.num_reqs):
        start, end = starts[b], starts[b + 1]
        if end == start:
            continue
        history = torch.arange(int(common.seq_lens[b]))
        blocks = common.block_table_tensor[b, history // block_size].long()
        yield start, end, blocks, history % block_size


def register_layer(layer: nn.Module, prefix: str) -> None:
    """In vLLM's static forward context, as its attention layers register
    themselves: the runner finds the layer's KV cache spec and binds its
    cache there."""
    context = get_current_vllm_config().compilation_config.static_forward_context
    if prefix in context:
        raise ValueError(f"Duplicate layer name: {prefix}")
    context[prefix] = layer


class PagedPrefixMixer(nn.Module, AttentionLayerBase):
    """KDA and MLA stand-in over vLLM's paged KV cache: the token at
    position ``p`` of a request gets the mean over positions ``0..p`` of that
    request of ``(1 + 0.01 q) h_q``, read from the KV cache through the
    request's block table, times ``value``, then a real
    ``RowParallelLinear`` (``tiny_k3.SequenceMixer`` over a whole sequence)."""

    def __init__(self, config, *args, prefix: str = "", **kwargs):
        super().__init__()
        hidden = config.hidden_size
        self.layer_name = prefix
        self.hidden = hidden
        self.value = nn.Parameter(torch.empty(hidden, hidden))
        self.o_proj = RowParallelLinear(
            hidden, hidden, bias=False, prefix=f"{prefix}.o_proj"
        )
        self.kv_cache: torch.Tensor | None = None
        register_layer(self, prefix)

    def get_attn_backend(self) -> type[AttentionBackend]:
        return PrefixMixerBackend

    def get_kv_cache_spec(self, vllm_config) -> FullAttentionSpec:
        return FullAttentionSpec(
            block_size=vllm_config.cache_config.block_size,
            num_kv_heads=1,
            head_size=self.hidden,
            dtype=tiny_k3.DTYPE,
        )

    def slots(self) -> torch.Tensor:
        """The K half of each slot, ``(blocks, block size, hidden)``: vLLM
        binds a full-attention layer's cache as ``[blocks, heads, block
        size, K|V]``, here one head."""
        return self.kv_cache[:, 0, :, : self.hidden]

    def metadata(self):
        """This layer's ``CommonAttentionMetadata``, or None in runs without
        (the profile run's dummy batch: one sequence)."""
        metadata = get_forward_context().attn_metadata
        if not isinstance(metadata, dict) or self.layer_name not in metadata:
            return None
        return metadata[self.layer_name]

    def histories(self, values: torch.Tensor):
        """Write the step's ``values`` at their slots; per request, its rows
        and its whole history so far, read back through its block table."""
        common, slots = self.metadata(), self.slots()
        rows, blocks, offsets = new_token_slots(common, slots.shape[1])
        slots[blocks, offsets] = values[rows]
        for start, end, blocks, offsets in request_histories(common, slots.shape[1]):
            yield start, end, slots[blocks, offsets]

    def mix(self, values: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        count = positions.to(values.dtype) + 1
        if self.metadata() is None:
            return torch.cumsum(values, 0) / count[:, None]
        out = torch.zeros_like(values)
        for start, end, history in self.histories(values):
            sums = torch.cumsum(history, 0)
            # The step's tokens are the request's last ones (as in vLLM's
            # backends): for the target, their positions; vLLM's MTP draft
            # prefill hands the target's positions with the inputs shifted.
            query = torch.arange(len(history) - (end - start), len(history))
            out[start:end] = sums[query] / (query + 1).to(values.dtype)[:, None]
        return out

    def project(self, mixed: torch.Tensor) -> torch.Tensor:
        mixed = mixed @ self.value
        width = mixed.shape[1] // self.o_proj.tp_size
        start = get_tensor_model_parallel_rank() * width
        output, _ = self.o_proj(mixed[:, start : start + width].contiguous())
        return output

    def forward(self, hidden_states: torch.Tensor, positions: torch.Tensor):
        assert positions.shape[0] == hidden_states.shape[0]
        weight = 1.0 + 0.01 * positions.to(hidden_states.dtype)
        return self.project(self.mix(hidden_states * weight[:, None], positions))


class PagedSparseMixer(PagedPrefixMixer):
    """DSA stand-in over vLLM's paged KV cache (``tiny_k3.SparseSequenceMixer``
    over a whole sequence): the indexer scores each token against the hidden
    states of its request's positions ``0..p``, read from the KV cache, and
    writes the top ``index_topk`` of the step's rows into the model-level
    ``topk_indices_buffer`` (positions within the request, -1 where it has
    fewer); the sparse attention mixes only those."""

    def __init__(self, config, *args, topk_indices_buffer=None, prefix="", **kwargs):
        super().__init__(config, prefix=prefix)
        if config.dsa_config is None:
            raise ValueError("dsa_config is required for KimiK3DSAAttention")
        assert topk_indices_buffer is not None, "no model-level top-k buffer"
        self.topk_indices_buffer = topk_indices_buffer
        self.index_topk = config.dsa_config.index_topk
        self.index_query = nn.Parameter(torch.empty(self.hidden, self.hidden))

    def pack_projections(self) -> None:
        """The real layer packs its projections after loading; none here."""

    def select(self, queries, history, query_positions) -> torch.Tensor:
        """Each query's mix of the top-k of ``history[: p + 1]``."""
        scores = (queries @ self.index_query) @ history.T / self.hidden**0.5
        future = torch.arange(history.shape[0])[None, :] > query_positions[:, None]
        scores = scores.masked_fill(future, float("-inf"))
        k = min(self.index_topk, history.shape[0])
        top = scores.topk(k, dim=1)
        chosen = torch.where(top.values.isinf(), -1, top.indices)
        valid = chosen >= 0
        logits = top.values.masked_fill(~valid, float("-inf"))
        weights = logits.softmax(dim=1) * valid
        return chosen, (weights[..., None] * history[chosen.clamp(min=0)]).sum(1)

    def forward(self, hidden_states: torch.Tensor, positions: torch.Tensor):
        rows = hidden_states.shape[0]
        assert positions.shape[0] == rows
        capacity = self.topk_indices_buffer.shape[0]
        if rows > capacity:
            raise ValueError(
                f"DSA got {rows} tokens, but the top-k indices buffer holds "
                f"{capacity} (max_num_batched_tokens)."
            )
        buffer = self.topk_indices_buffer
        buffer[:rows].fill_(-1)
        mixed = torch.zeros_like(hidden_states)
        if self.metadata() is None:  # one sequence
            parts = [(0, rows, hidden_states)]
        else:
            parts = list(self.histories(hidden_states))
        for start, end, history in parts:
            # The step's tokens are the request's last ones (PagedPrefixMixer).
            last = torch.arange(len(history) - (end - start), len(history))
            chosen, mixed[start:end] = self.select(
                hidden_states[start:end], history, last
            )
            buffer[start:end, : chosen.shape[1]] = chosen.to(buffer.dtype)
        return self.project(mixed)


PAGED_ATTENTION = {
    "KimiK3DeltaAttention": PagedPrefixMixer,
    "KimiLinearGatedDeltaNetAttention": PagedPrefixMixer,
    "MultiHeadLatentAttention": PagedPrefixMixer,
}
if tiny_k3.HAS_DSA:
    PAGED_ATTENTION["KimiK3DSAAttention"] = PagedSparseMixer


# --- Kimi K3's DSpark drafter (models/kimi_k3/nvidia/dspark_mla.py) --------


class PagedContextAttention(tiny_k3.ContextAttention, AttentionLayerBase):
    """DSpark's draft attention over vLLM's paged KV cache: the context
    latents vLLM's ``precompute_and_store_context_kv`` stores at each
    context slot (through the layer's ``impl.do_kv_cache_update``) and the
    block's own, written at the block's slots, read back per request through
    its block table; every block token attends over all of them, non-causally
    (``tiny_k3.ContextAttention``'s attention, its latents paged)."""

    # Not one of dspark_mla's grouped cache dtypes: vLLM then stores each
    # layer's context through ``impl.do_kv_cache_update``, not a CUDA kernel.
    kv_cache_dtype = "float64"

    def __init__(self, *args, prefix: str = "", **kwargs):
        super().__init__(*args, prefix=prefix, **kwargs)
        self.kv_cache: torch.Tensor | None = None
        register_layer(self, prefix)

    @property
    def impl(self) -> PagedContextAttention:
        """Its own attention implementation (vLLM's store hook below)."""
        return self

    def get_attn_backend(self) -> type[AttentionBackend]:
        return PrefixMixerBackend

    def get_kv_cache_spec(self, vllm_config) -> FullAttentionSpec:
        # The target's page (PagedPrefixMixer's), a latent in each K half.
        return FullAttentionSpec(
            block_size=vllm_config.cache_config.block_size,
            num_kv_heads=1,
            head_size=tiny_k3.HIDDEN,
            dtype=tiny_k3.DTYPE,
        )

    def latent_slots(self, kv_cache: torch.Tensor) -> torch.Tensor:
        """``(blocks, block size, latent width)`` of the K halves."""
        return kv_cache[:, 0, :, : self.kv_lora_rank + self.qk_rope_head_dim]

    def do_kv_cache_update(self, kv_c, k_pe, kv_cache, slot_mapping, *args):
        """Store the context latents (``[kv_c | k_pe]``) at their slots;
        ``PAD_SLOT_ID`` rows store nothing."""
        slots = self.latent_slots(kv_cache)
        rows = torch.nonzero(slot_mapping >= 0).flatten()
        where = slot_mapping[rows]
        latents = torch.cat([kv_c, k_pe.flatten(1)], dim=-1)
        slots[where // slots.shape[1], where % slots.shape[1]] = latents[rows]

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor):
        metadata = get_forward_context().attn_metadata
        if not isinstance(metadata, dict) or self.layer_name not in metadata:
            # Runs without attention metadata: the block alone.
            return super().forward(positions, hidden_states)
        common = metadata[self.layer_name]
        slots = self.latent_slots(self.kv_cache)
        rows, blocks, offsets = new_token_slots(common, slots.shape[1])
        slots[blocks, offsets] = (hidden_states @ self.key)[rows]
        mixed = hidden_states.new_zeros(hidden_states.shape[0], self.value.shape[1])
        for start, end, blocks, offsets in request_histories(common, slots.shape[1]):
            mixed[start:end] = self.attend(
                hidden_states[start:end], slots[blocks, offsets]
            )
        return self.project(mixed)


def rms_norm(out, x, weight, epsilon) -> None:
    """``vllm._C``'s ``rms_norm``; a 2-D weight holds one row per leading
    index of ``x`` (DSpark's norm of every draft layer's latents at once)."""
    weight = weight if weight.dim() == 1 else weight[:, None, :]
    out.copy_(x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + epsilon) * weight)


def rotary_embedding(positions, query, key, head_size, cos_sin_cache, is_neox):
    """``vllm._C``'s ``rotary_embedding``, in place: each ``head_size`` slice
    of ``query`` (and ``key``) rotated by its row's position."""
    cos, sin = cos_sin_cache[positions].to(query.dtype).chunk(2, dim=-1)
    cos, sin = cos[:, None], sin[:, None]
    for tensor in (query, key):
        if tensor is None:
            continue
        heads = tensor.view(positions.shape[0], -1, head_size)
        half = head_size // 2
        if is_neox:
            x1, x2 = heads[..., :half].clone(), heads[..., half:].clone()
            heads[..., :half] = x1 * cos - x2 * sin
            heads[..., half:] = x2 * cos + x1 * sin
        else:
            x1, x2 = heads[..., 0::2].clone(), heads[..., 1::2].clone()
            heads[..., 0::2] = x1 * cos - x2 * sin
            heads[..., 1::2] = x2 * cos + x1 * sin


# The vLLM._C ops DSpark's context precompute calls (``dspark_mla.ops``).
DSPARK_OPS = types.SimpleNamespace(rms_norm=rms_norm, rotary_embedding=rotary_embedding)


def greedy_argmax(logits: torch.Tensor) -> torch.Tensor:
    """``greedy_argmax`` (two Triton kernels): the first index of each
    row's maximum."""
    return logits.argmax(dim=-1)


def prepare_dflash_inputs(grid, out_input_ids, out_query_positions,
                          out_is_padding, out_query_start_loc, out_seq_lens,
                          out_query_slot_mapping, out_context_positions,
                          out_context_slot_mapping, out_sample_indices,
                          out_sample_pos, out_sample_idx_mapping,
                          out_temperature, out_seeds, target_positions,
                          target_query_start_loc, idx_mapping, last_sampled,
                          next_prefill_tokens, num_sampled, num_rejected,
                          temperature, seeds, block_table, block_table_stride,
                          parallel_drafting_token_id, block_size,
                          num_query_per_req, num_speculative_steps,
                          max_num_reqs, max_num_tokens, max_model_len, cp_rank,
                          num_reqs, SAMPLE_FROM_ANCHOR, PAD_SLOT_ID, CP_SIZE,
                          **meta) -> None:  # fmt: skip
    """``_prepare_dflash_inputs_kernel`` without context parallelism: per
    request, its accepted context rows' positions and slots (rejected rows
    PAD_SLOT_ID), then its query block (the bonus token, then the noise
    token) after its last accepted position, with slots, the rows to sample
    (each query position predicts the next with ``SAMPLE_FROM_ANCHOR``) and
    its sampling state; the rest of every buffer padded."""
    assert CP_SIZE == 1, "no context parallelism on the tests' ranks"
    table = block_table.reshape(-1)

    def slot(position: int, req: int) -> int:
        block = min(position // block_size, block_table_stride - 1)
        block_id = int(table[req * block_table_stride + block])
        return (
            PAD_SLOT_ID
            if block_id == 0
            else block_id * block_size + position % block_size
        )

    sample_off = 0 if SAMPLE_FROM_ANCHOR else 1
    for req in range(num_reqs):
        state = int(idx_mapping[req])
        ctx_start = int(target_query_start_loc[req])
        ctx_end = int(target_query_start_loc[req + 1])
        valid_end = ctx_end - int(num_rejected[req])
        for row in range(ctx_start, ctx_end):
            position = int(target_positions[row]) if row < valid_end else 0
            out_context_positions[row] = position
            out_context_slot_mapping[row] = (
                slot(position, req) if row < valid_end else PAD_SLOT_ID
            )
        if int(num_sampled[req]) > 0:
            bonus = int(last_sampled[state])
        else:
            bonus = int(next_prefill_tokens[state])
        last_position = int(target_positions[valid_end - 1])
        base = req * num_query_per_req
        for offset in range(num_query_per_req):
            position, index = last_position + 1 + offset, base + offset
            out_input_ids[index] = bonus if offset == 0 else parallel_drafting_token_id
            out_is_padding[index] = False
            out_query_positions[index] = min(position, max_model_len - 1)
            out_query_slot_mapping[index] = slot(position, req)
            if offset >= sample_off:
                sample = req * num_speculative_steps + offset - sample_off
                out_sample_indices[sample] = index
                out_sample_pos[sample] = (
                    position + 1 if SAMPLE_FROM_ANCHOR else position
                )
                out_sample_idx_mapping[sample] = state
        out_query_start_loc[req] = base
        out_seq_lens[req] = min(last_position + 1 + num_query_per_req, max_model_len)
        out_temperature[state] = temperature[state]
        out_seeds[state] = seeds[state]
    end = num_reqs * num_query_per_req
    out_query_start_loc[num_reqs : max_num_reqs + 1] = end
    out_seq_lens[num_reqs:max_num_reqs] = 0
    samples = slice(
        num_reqs * num_speculative_steps, max_num_reqs * num_speculative_steps
    )
    out_sample_indices[samples] = 0
    out_sample_pos[samples] = 0
    out_sample_idx_mapping[samples] = -1
    out_input_ids[end:max_num_tokens] = 0
    out_query_positions[end:max_num_tokens] = 0
    out_is_padding[end:max_num_tokens] = True
    out_query_slot_mapping[end:max_num_tokens] = PAD_SLOT_ID


# The Triton kernel of DSpark's speculator (DFlash's input preparation).
DSPARK_KERNELS = {
    (
        "vllm.v1.worker.gpu.spec_decode.dflash.speculator",
        "_prepare_dflash_inputs_kernel",
    ): prepare_dflash_inputs,
}


# --- Kimi K3's hybrid model state (gpu/model_states/mamba_hybrid.py) -------


def scatter_num_accepted(grid, idx_mapping, num_sampled, num_accepted):
    """``_scatter_num_accepted_kernel``: each request's sampled count (at
    least 1) into its slot; a -1 index is a filtered row."""
    for row in range(grid[0]):
        req = int(idx_mapping[row])
        if req >= 0:
            num_accepted[req] = max(int(num_sampled[row]), 1)


def fill_num_accepted(grid, idx_mapping, num_accepted, num_sampled):
    """``_fill_num_accepted_kernel``: one count into every request's slot."""
    for row in range(grid[0]):
        req = int(idx_mapping[row])
        if req >= 0:
            num_accepted[req] = num_sampled


HYBRID = "vllm.v1.worker.gpu.model_states.mamba_hybrid"
HYBRID_STATE_STAND_INS = {
    (HYBRID, "_scatter_num_accepted_kernel"): scatter_num_accepted,
    (HYBRID, "_fill_num_accepted_kernel"): fill_num_accepted,
}


def install_kernels() -> None:
    """The V2 runner's kernel stand-ins, the hybrid state's and DSpark's;
    idempotent."""
    v2_kernel_standins.install()
    for (module_name, kernel), body in (
        HYBRID_STATE_STAND_INS | DSPARK_KERNELS
    ).items():
        module = importlib.import_module(module_name)
        if not isinstance(getattr(module, kernel), v2_kernel_standins._Launch):
            setattr(module, kernel, v2_kernel_standins._Launch(kernel, body))


# The target's embedding and LM head, by the names vLLM's Kimi K3 class gives
# them (its text model is its ``language_model``).
TARGET_EMBEDDING = "language_model.model.embed_tokens.weight"
TARGET_LM_HEAD = "language_model.lm_head.weight"


def mtp_weight(name: str, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """The seeded tensor of Kimi K3's MTP drafter (``KimiK3MTP``) parameter
    ``name``: its embedding and its shared head hold the target's embedding
    and LM head, as a checkpoint's MTP weights do (vLLM shares the target's
    embedding with the drafter at PP = 1 only, where one rank holds both)."""
    if name == "model.embed_tokens.weight":
        name = TARGET_EMBEDDING
    elif re.fullmatch(r"model\.layers\.\d+\.shared_head\.head\.weight", name):
        name = TARGET_LM_HEAD
    return tiny_k3.full_weight(name, shape, seed)


# How much DSpark's Markov head favours repeating the draft before (its
# logit bias, against base logits spread over about 3): dspark_weight.
MARKOV_REPEAT = 3.0


def dspark_weight(name: str, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """The seeded tensor of Kimi K3's DSpark drafter parameter ``name``,
    but its Markov head (full rank in the tests' draft config): a bias of
    ``MARKOV_REPEAT`` on the token drafted before. The tiny K3's greedy
    completions repeat, so some drafts are accepted; where the base logits,
    which the context from the aux states sets, differ by more, they
    decide."""
    if name.startswith("model.markov_head."):
        return torch.eye(*shape, dtype=tiny_k3.DTYPE) * (
            MARKOV_REPEAT if name.endswith("markov_w1.weight") else 1.0
        )
    return tiny_k3.full_weight(name, shape, seed)


def seeded_dummy_weights(loader, model: nn.Module, model_config) -> None:
    """``DummyModelLoader.load_weights``: one seeded full model, each rank
    its shard (for the MTP drafter, :func:`mtp_weight`'s; for DSpark,
    :func:`dspark_weight`'s)."""
    from vllm.models.kimi_k3.nvidia import dspark_mla, mtp

    weight = tiny_k3.full_weight
    if isinstance(model, mtp.KimiK3MTP):
        weight = mtp_weight
    elif isinstance(model, dspark_mla.K3DSparkForCausalLM):
        weight = dspark_weight
    with torch.no_grad():
        tiny_k3.load_seeded_weights(model, SEED, weight=weight)


@contextlib.contextmanager
def serving_stand_ins() -> Iterator[None]:
    """While open, vLLM's loader builds Kimi K3 with the stand-ins above and
    seeds its weights; the forward must run inside it too."""
    from vllm.model_executor.model_loader import dummy_loader
    from vllm.models.kimi_k3.nvidia import dspark_mla
    from vllm.models.kimi_k3.nvidia import model as k3
    from vllm.v1.worker.gpu.spec_decode.dspark import speculator as dspark

    install_kernels()
    with tiny_k3.stand_ins():
        saved = {name: getattr(k3, name) for name in PAGED_ATTENTION}
        load_weights = dummy_loader.DummyModelLoader.load_weights
        saved_dspark = (
            dspark_mla.MultiHeadLatentAttention,
            dspark_mla.ops,
            dspark.greedy_argmax,
        )
        try:
            for name, cls in PAGED_ATTENTION.items():
                setattr(k3, name, cls)
            dspark_mla.MultiHeadLatentAttention = PagedContextAttention
            dspark_mla.ops = DSPARK_OPS
            dspark.greedy_argmax = greedy_argmax
            dummy_loader.DummyModelLoader.load_weights = seeded_dummy_weights
            yield
        finally:
            dummy_loader.DummyModelLoader.load_weights = load_weights
            for name, cls in saved.items():
                setattr(k3, name, cls)
            (
                dspark_mla.MultiHeadLatentAttention,
                dspark_mla.ops,
                dspark.greedy_argmax,
            ) = saved_dspark
