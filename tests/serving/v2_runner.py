# SPDX-License-Identifier: Apache-2.0
"""vLLM's own Model Runner V2 serving the tiny Kimi K3 on the CPU.

:class:`V2Runner` is vLLM's ``CPUModelRunner`` (a subclass of the V2
``GPUModelRunner``, patched by the series) with one method of its own:
``load_model`` builds the tiny K3 and hands it to vLLM's ``load_model`` as
its ``model=``, so everything after the build is vLLM's: the PP hand-off
declaration, the model state, the sampler, the persistent receive buffers,
the dummy and profile runs, the KV cache spec, its allocation and binding,
the input batch, block tables and slot mappings, ``execute_model`` with the
series' hand-over, ``sample_tokens``, the PP handler's token broadcast; with
``--speculative-config`` (the drafter layouts), vLLM's EAGLE-3 speculator,
its aux-layer set-up and relay across PP stages, the rejection sampler and
the drafts' broadcast.

What is stood in, below the runner:

- the Triton kernels a step launches: ``tests/sppp_testbed/v2_kernel_standins``
  (each named there, with the kernel it replaces);
- attention: :class:`PagedPrefixMixer`, a causal weighted prefix mean whose
  per-token values live in vLLM's paged KV cache. It declares a
  ``FullAttentionSpec``, so the engine's KV cache manager allocates blocks
  for it, the runner binds its cache view and builds its metadata through
  :class:`PrefixMixerBackend` (whose builder hands on vLLM's
  ``CommonAttentionMetadata``: block table, slot mapping, query starts,
  sequence lengths). A step writes its tokens' values at their slots and
  reads every earlier position of each request back through the request's
  block-table row: a wrong row, block or slot anywhere changes every later
  token, and a prefix-cache hit reads the blocks another request wrote;
- MoE and the rest of the test bed's stand-ins (``tiny_k3.stand_ins``);
- the LM head: :class:`TinyK3ForCausalLM`, a seeded full-vocabulary matrix
  (the tiny K3 is the text model ``KimiLinearModel``; vLLM's causal-LM
  wrapper brings Kimi K3's hybrid model state, whose KDA state the
  stand-in attention does not keep);
- with a drafter: its weights and its attention (``tests/serving/eagle3.py``,
  which also logs each step's drafts for the tests to compare).
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import torch
from torch import nn

from tests.serving.worker import (
    EXTRA_ROW_MARK,
    SEED,
    STAGE0_EXTRA_ROW,
    served_tiny_k3_config,
)
from tests.sppp_testbed import tiny_k3, v2_kernel_standins
from vllm.distributed import get_tensor_model_parallel_rank
from vllm.distributed.parallel_state import get_pp_group
from vllm.forward_context import get_forward_context
from vllm.logger import init_logger
from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
from vllm.model_executor.layers.linear import RowParallelLinear
from vllm.model_executor.models.interfaces import SupportsEagle3
from vllm.sequence import IntermediateTensors
from vllm.v1.attention.backend import AttentionBackend, AttentionMetadataBuilder
from vllm.v1.kv_cache_interface import FullAttentionSpec
from vllm.v1.worker.cpu.model_runner import CPUModelRunner

# Under the "vllm" logger, whose handlers print in the servers.
logger = init_logger(f"vllm.{__name__}")

ATTENTION_CLASSES = (
    "KimiK3DeltaAttention",
    "KimiLinearGatedDeltaNetAttention",
    "MultiHeadLatentAttention",
)


class PrefixMixerMetadataBuilder(AttentionMetadataBuilder):
    """Hands the layer vLLM's ``CommonAttentionMetadata`` as it is."""

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)

    def build(self, common_prefix_len, common_attn_metadata, fast_build=False):
        return common_attn_metadata


class PrefixMixerBackend(AttentionBackend):
    """The attention backend of :class:`PagedPrefixMixer` (no kernels)."""

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


class PagedPrefixMixer(nn.Module, AttentionLayerBase):
    """Attention stand-in over vLLM's paged KV cache: the token at position
    ``p`` of a request gets the mean over positions ``0..p`` of that
    request of ``(1 + 0.01 q) h_q``, read from the KV cache through the
    request's block table, then a real ``RowParallelLinear``."""

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

    def mix(self, values: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        count = positions.to(values.dtype) + 1
        metadata = get_forward_context().attn_metadata
        if not isinstance(metadata, dict) or self.layer_name not in metadata:
            # Runs without attention metadata: the batch as one sequence.
            return torch.cumsum(values, 0) / count[:, None]
        common = metadata[self.layer_name]
        slots = self.slots()
        rows, blocks, offsets = new_token_slots(common, slots.shape[1])
        slots[blocks, offsets] = values[rows]
        out = torch.zeros_like(values)
        for start, end, blocks, offsets in request_histories(common, slots.shape[1]):
            sums = torch.cumsum(slots[blocks, offsets], 0)
            query = positions[start:end].long()
            out[start:end] = sums[query] / count[start:end, None]
        return out

    def forward(self, hidden_states: torch.Tensor, positions: torch.Tensor):
        assert positions.shape[0] == hidden_states.shape[0]
        weight = 1.0 + 0.01 * positions.to(hidden_states.dtype)
        mixed = self.mix(hidden_states * weight[:, None], positions) @ self.value
        width = mixed.shape[1] // self.o_proj.tp_size
        start = get_tensor_model_parallel_rank() * width
        output, _ = self.o_proj(mixed[:, start : start + width].contiguous())
        return output


class TinyK3ForCausalLM(nn.Module, SupportsEagle3):
    """The tiny K3 text model with a seeded LM head; its PP declaration is
    the text model's, as vLLM's Kimi K3 wrappers delegate it, and so are
    EAGLE-3's aux layers (vLLM's ``SupportsEagle3`` sets them on the text
    model, whose stages capture, send and gather them)."""

    def __init__(self, *, vllm_config, prefix: str = "") -> None:
        # Built under tiny_k3.stand_ins(), with PagedPrefixMixer as attention.
        super().__init__()
        self.model = tiny_k3.build_model(vllm_config, SEED)
        # A plain matrix, not vLLM's ParallelLMHead: named so that vLLM's
        # load_eagle_model finds no target head to install on a drafter.
        lm_head = tiny_k3.full_weight(
            "lm_head.weight", (tiny_k3.VOCAB, tiny_k3.HIDDEN), SEED
        )
        self.register_buffer("lm_head_weight", lm_head)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_input_ids(input_ids)

    def make_empty_intermediate_tensors(self, batch_size, dtype, device):
        return self.model.make_empty_intermediate_tensors(batch_size, dtype, device)

    def get_pp_intermediate_tensor_all_gather_overrides(self) -> dict[str, bool]:
        return self.model.get_pp_intermediate_tensor_all_gather_overrides()

    def get_pp_intermediate_tensor_num_rows(self, num_tokens: int) -> int | None:
        return self.model.get_pp_intermediate_tensor_num_rows(num_tokens)

    def forward(self, input_ids, positions, intermediate_tensors=None,
                inputs_embeds=None, **kwargs):  # fmt: skip
        return self.model(input_ids, positions, intermediate_tensors, inputs_embeds)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return (hidden_states @ self.lm_head_weight.T).float()


class V2Runner(CPUModelRunner):
    """vLLM's CPU model runner (Model Runner V2) with the tiny K3."""

    def __init__(self, vllm_config, device: torch.device) -> None:
        v2_kernel_standins.install()
        # The tiny K3 computes in float64; the runner's buffers (the PP
        # receive buffers among them) take the served model's dtype.
        vllm_config.model_config.dtype = tiny_k3.DTYPE
        # So does the drafter (tests/serving/eagle3.py).
        if vllm_config.speculative_config is not None:
            draft = vllm_config.speculative_config.draft_model_config
            if draft is not None:
                draft.dtype = tiny_k3.DTYPE
        super().__init__(vllm_config, device)

    def execute_model(self, scheduler_output, *args, **kwargs):
        # Each request's prompt, by which the drafts are logged.
        prompts = self.__dict__.setdefault("prompts", {})
        for new in scheduler_output.scheduled_new_reqs:
            prompts[new.req_id] = "".join(map(chr, new.prompt_token_ids or ()))
        output = super().execute_model(scheduler_output, *args, **kwargs)
        if os.environ.get(STAGE0_EXTRA_ROW) and isinstance(output, IntermediateTensors):
            output = self.planted_extra_row(scheduler_output, output)
        return output

    def planted_extra_row(self, scheduler_output, output):
        """The first stage's output with its last row once more, in steps
        that run a request whose prompt begins with ``EXTRA_ROW_MARK``."""
        marked = self.__dict__.setdefault("marked_requests", set())
        mark = ord(EXTRA_ROW_MARK)
        for new in scheduler_output.scheduled_new_reqs:
            if new.prompt_token_ids and new.prompt_token_ids[0] == mark:
                marked.add(new.req_id)
        if not get_pp_group().is_first_rank or not marked.intersection(
            scheduler_output.num_scheduled_tokens
        ):
            return output
        return IntermediateTensors(
            {k: torch.cat([v, v[-1:]]) for k, v in output.tensors.items()}
        )

    def load_model(self, load_dummy_weights: bool = False, *args, **kwargs):
        pp = get_pp_group()
        config = served_tiny_k3_config(self.vllm_config)
        self._stand_ins = tiny_k3.stand_ins()
        self._stand_ins.__enter__()
        for name in ATTENTION_CLASSES:
            setattr(tiny_k3.k3, name, PagedPrefixMixer)
        with torch.no_grad():
            model = TinyK3ForCausalLM(vllm_config=config)
        text_model = model.model
        layers = self.vllm_config.compilation_config.static_forward_context
        for module in text_model.modules():
            if isinstance(module, PagedPrefixMixer):
                layers[module.layer_name] = module
        logger.info(
            "V2 runner: PP stage %d, layers [%d, %d), sequence parallel: %s",
            pp.rank_in_group,
            text_model.start_layer,
            text_model.end_layer,
            text_model.use_sequence_parallel,
        )
        from tests.serving import eagle3

        with eagle3.drafter_loader(SEED):
            loaded = super().load_model(load_dummy_weights, model=model)
        if self.speculator is not None or self.use_aux_hidden_state_outputs:
            eagle3.log_drafts_and_relay(self)
        return loaded
