# SPDX-License-Identifier: Apache-2.0
"""A tiny EAGLE-3 drafter for the serving tests: vLLM's own
``Eagle3LlamaForCausalLM``, built by vLLM's ``initialize_model`` from the
draft checkpoint's ``config.json``
(``tests.sppp_testbed.k3_checkpoint.write_eagle3_draft``), run by vLLM's
own V2 ``EagleSpeculator`` on the last PP stage.

What differs from a served EAGLE-3 checkpoint, and why:

- weights: seeded per parameter name at full size and loaded through each
  parameter's own ``weight_loader``, as the test bed seeds the target, so
  every TP rank holds its shard of the same drafter and TP1xPP1 and TP2xPPn
  drafts agree (vLLM's dummy loader draws each rank's shard on its own); a
  few are set so that its drafts are often accepted and read the taps
  (:func:`drafter_weight`). The input embedding and LM head have the
  target's values, and are the drafter's own as a checkpoint's would be
  (vLLM shares the target's equal embedding at PP = 1; the tiny K3's LM
  head is a plain matrix, which vLLM's ``load_eagle_model`` does not find
  to share);
- attention: :class:`PagedCausalAttention` in place of vLLM's ``Attention``
  in the drafter's ``LlamaAttention`` (the CUDA wheel has no CPU attention
  kernels): causal softmax attention whose keys and values are written to
  and read from vLLM's paged KV cache through the block tables and slot
  mappings the speculator hands it.

- custom ops: built with ``custom_ops=["none"]`` (vLLM's torch-native
  rotary embedding and norms), as the test bed builds the target: the CPU
  ones are ``vllm._C``'s, which the CUDA wheel lacks.

Everything else of the drafter is vLLM's: the ``fc`` that combines the aux
hidden states, the decoder layer, rotary embedding, MLP, norms, the
vocab-parallel LM head and its logits gather; and around it vLLM's
``load_eagle_model`` (embedding and head sharing), the speculator, its
attention metadata, the rejection sampler and the PP handler's broadcast of
the drafts to the other stages.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import torch
from torch import nn

from tests.serving.k3_standins import TARGET_EMBEDDING, TARGET_LM_HEAD
from tests.sppp_testbed import tiny_k3
from vllm.config import get_current_vllm_config
from vllm.distributed import get_tensor_model_parallel_rank
from vllm.distributed.parallel_state import get_pp_group
from vllm.forward_context import get_forward_context
from vllm.logger import init_logger
from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
from vllm.v1.kv_cache_interface import FullAttentionSpec

# Under the "vllm" logger, whose handlers print in the servers.
logger = init_logger(f"vllm.{__name__}")

NUM_SPECULATIVE_TOKENS = 2
# The drafter layer's output projections, scaled (drafter_weight says why).
DAMPING = 0.1


# The drafters the servers deploy with Kimi K3, by ``--speculative-config``
# method: EAGLE-3 and Kimi K3's DSpark (each its draft checkpoint, in
# ``drafts``) and Kimi K3's own MTP layer (``KimiK3MTPModel``, built from the
# target's checkpoint).
METHODS = ("eagle3", "mtp", "dspark")


def speculative_config(drafts: dict[str, Path], method: str = "eagle3") -> str:
    """``--speculative-config`` for the drafter of ``method``, as users pass
    it (DSpark's block size is its number of speculative tokens)."""
    config: dict[str, object] = {"method": method}
    if method != "dspark":
        config["num_speculative_tokens"] = NUM_SPECULATIVE_TOKENS
    if method in drafts:
        config["model"] = str(drafts[method])
    elif method != "mtp":
        raise ValueError(f"no test drafter for method {method!r}")
    return json.dumps(config)


class PagedCausalAttention(tiny_k3.CausalAttention, AttentionLayerBase):
    """Attention stand-in for the drafter's layers: per request, causal
    softmax attention of each query over the keys and values of every
    earlier position of that request, read from vLLM's paged KV cache.

    Takes vLLM ``Attention``'s arguments. A step writes its tokens' keys and
    values at their ``slot_mapping`` slots (K in the first half of a slot, V
    in the second: vLLM binds a full-attention layer's cache as ``[blocks,
    KV heads, block size, K|V]``) and reads each request's ``seq_lens``
    positions back through its ``block_table_tensor`` row; its queries are
    the request's last positions, as in vLLM's backends. A wrong slot, block
    or draft position changes the drafts that follow.
    """

    def __init__(self, *args, prefix: str = "", **kwargs):
        super().__init__(*args, prefix=prefix, **kwargs)
        self.kv_cache: torch.Tensor | None = None
        context = get_current_vllm_config().compilation_config.static_forward_context
        if prefix in context:
            raise ValueError(f"Duplicate layer name: {prefix}")
        context[prefix] = self

    def get_attn_backend(self):
        from tests.serving.k3_standins import PrefixMixerBackend

        return PrefixMixerBackend

    def get_kv_cache_spec(self, vllm_config) -> FullAttentionSpec:
        return FullAttentionSpec(
            block_size=vllm_config.cache_config.block_size,
            num_kv_heads=self.num_kv_heads,
            head_size=self.head_size,
            dtype=tiny_k3.DTYPE,
        )

    def forward(self, query, key, value, output_shape=None) -> torch.Tensor:
        size = self.head_size
        q = query.view(-1, self.num_heads, size)
        k = key.view(-1, self.num_kv_heads, size)
        v = value.view(-1, self.num_kv_heads, size)
        out = torch.zeros_like(q)
        metadata = get_forward_context().attn_metadata
        if not isinstance(metadata, dict) or self.layer_name not in metadata:
            # Runs without attention metadata: the batch as one sequence.
            return super().forward(query, key, value)
        from tests.serving.k3_standins import new_token_slots, request_histories

        common = metadata[self.layer_name]
        cache = self.kv_cache
        rows, blocks, offsets = new_token_slots(common, cache.shape[2])
        cache[blocks, :, offsets, :size] = k[rows]
        cache[blocks, :, offsets, size:] = v[rows]
        for start, end, blocks, offsets in request_histories(common, cache.shape[2]):
            slots = cache[blocks, :, offsets]
            out[start:end] = self.attend(
                q[start:end],
                slots[..., :size],
                slots[..., size:],
                len(offsets) - (end - start),
            )
        return out.reshape(q.shape[0], -1)


def drafter_weight(name: str, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """The full-size tensor for the drafter's parameter ``name``: seeded as
    the test bed seeds every weight, with three changes that make its drafts
    worth verifying and tied to the aux states. The input embedding and the
    LM head take the target's values; ``fc``, which combines the taps
    ``[1 | 2 | 4]``, adds the identity on tap 4 (the target's final residual
    stream, which its LM head reads) and on tap 1 (the one the middle stage
    of a PP3 layout relays) to its random weights; and the drafter layer's
    output projections are damped, so its result stays close to that
    combination. The drafter then often proposes what the tiny K3's
    repetitive greedy completions accept, and a wrong row of tap 1 changes
    its drafts and how many are accepted."""
    targets = {
        "model.embed_tokens.weight": TARGET_EMBEDDING,
        "lm_head.weight": TARGET_LM_HEAD,
    }
    weight = tiny_k3.full_weight(targets.get(name, name), shape, seed)
    if name == "model.fc.weight":
        eye = torch.eye(tiny_k3.HIDDEN, dtype=weight.dtype)
        weight[:, -tiny_k3.HIDDEN :] += eye
        weight[:, : tiny_k3.HIDDEN] += eye
    elif name.endswith(("o_proj.weight", "down_proj.weight")):
        weight = weight * DAMPING
    return weight


def seed_drafter(drafter: nn.Module, seed: int) -> None:
    """Give every parameter its slice of :func:`drafter_weight`'s tensor
    through its own ``weight_loader`` (``tiny_k3.load_seeded_weights``),
    then process the weights after loading. As vLLM's loader does for
    each weight a checkpoint holds, ``process_eagle_weight`` notes that the
    drafter has its own embedding and LM head (vLLM then shares the target's
    embedding where the target holds one and it is equal: PP = 1)."""
    from vllm.model_executor.models.utils import process_eagle_weight

    tiny_k3.load_seeded_weights(
        drafter,
        seed,
        weight=drafter_weight,
        loaded=lambda name: process_eagle_weight(drafter, name),
    )


@contextlib.contextmanager
def drafter_loader(seed: int):
    """While it is open, vLLM's ``load_eagle_model`` builds the drafter with
    vLLM's ``initialize_model`` (the class the draft config names), the
    attention stand-in in place of ``Attention``, and seeded weights."""
    from vllm.model_executor.model_loader.utils import initialize_model
    from vllm.model_executor.models import llama
    from vllm.v1.worker.gpu.spec_decode.eagle import utils as eagle_utils

    saved = eagle_utils.get_model

    def get_model(*, vllm_config, model_config=None, prefix: str = "", **kwargs):
        if vllm_config.speculative_config.method != "eagle3":
            # Kimi K3's MTP: vLLM's loader with the target's stand-ins and
            # seeded dummy weights (tests/serving/k3_standins.py).
            return saved(
                vllm_config=vllm_config,
                model_config=model_config,
                prefix=prefix,
                **kwargs,
            )
        dtype = torch.get_default_dtype()
        attention = llama.Attention
        compilation = vllm_config.compilation_config
        custom_ops = compilation.custom_ops
        llama.Attention = PagedCausalAttention
        # vLLM's native torch ops (the CPU ones are vllm._C's, which the CUDA
        # wheel lacks), as the test bed builds the target.
        compilation.custom_ops = ["none"]
        torch.set_default_dtype(tiny_k3.DTYPE)
        try:
            with torch.no_grad():
                drafter = initialize_model(
                    vllm_config, prefix=prefix, model_config=model_config
                )
                seed_drafter(drafter, seed)
        finally:
            llama.Attention = attention
            compilation.custom_ops = custom_ops
            torch.set_default_dtype(dtype)
        return drafter.eval()

    eagle_utils.get_model = get_model
    try:
        yield
    finally:
        eagle_utils.get_model = saved


# What a drafter server's log says, per rank: the aux slots its PP handler
# relays (a middle stage's are the earlier stages' taps), and on the last
# stage's first TP rank, each step's drafts of every request, by prompt.
RELAY_LOG = "EAGLE-3 relay: PP stage"
DRAFTS_LOG = "EAGLE-3 drafts"


def log_drafts_and_relay(runner) -> None:
    """Log what the V2 runner ``runner`` relays, and wrap its speculator's
    ``propose`` to log the drafts of every real step (``json``: the
    request's prompt and its drafts)."""
    pp = get_pp_group()
    handler = runner.pp_handler
    logger.info(
        "%s %d relays %s",
        RELAY_LOG,
        pp.rank_in_group,
        list(handler.aux_hidden_state_relay_keys) if handler is not None else [],
    )
    speculator = runner.speculator
    if speculator is None or get_tensor_model_parallel_rank() != 0:
        return
    propose = speculator.propose

    def logged_propose(input_batch, *args, **kwargs):
        drafts = propose(input_batch, *args, **kwargs)
        if kwargs.get("dummy_run"):
            return drafts
        prompts = getattr(runner, "prompts", {})
        for req_id, row in zip(input_batch.req_ids, drafts.tolist(), strict=False):
            if req_id in prompts:
                record = {"prompt": prompts[req_id], "drafts": row}
                logger.info("%s %s", DRAFTS_LOG, json.dumps(record))
        return drafts

    speculator.propose = logged_propose
