# SPDX-License-Identifier: Apache-2.0
"""A tiny Kimi K3 checkpoint directory, loaded as a user's checkpoint loads.

:func:`write_checkpoint` writes what ``vllm serve /models/Kimi-K3`` reads
from a real checkpoint, in miniature: ``config.json`` with the
architecture name a K3 (``KimiK3ForConditionalGeneration``) or K3.1
(``KimiK31ForConditionalGeneration``) checkpoint carries and the composite
``kimi_k3`` config vLLM registers (``KimiK3Config``): a ``text_config`` of
the test bed's tiny shape (KDA and MLA layers alternating, DSA on the
full-attention layers where this vLLM builds them, MoE with a shared
expert, AttnRes on or off, one MTP layer) and a ``vision_config`` of a
one-block MoonViT; its image processor's settings; and a character-level
tokenizer. Nothing is downloaded.

:mod:`tests.sppp_testbed.loaded_stages` starts vLLM's worker and V2 runner
on it, whose loader builds the class the architecture names.
"""

from __future__ import annotations

import json
from pathlib import Path

from tests.sppp_testbed import tiny_k3
from vllm import ModelRegistry

# The architecture names of K3 and K3.1 checkpoints that this vLLM's model
# registry maps (0.33.0 knows K3's only); each loads
# KimiK3ForConditionalGeneration.
ARCHITECTURES = tuple(
    name
    for name in ("KimiK3ForConditionalGeneration", "KimiK31ForConditionalGeneration")
    if name in ModelRegistry.get_supported_archs()
)
EOS = 0
# The target's layers whose outputs an EAGLE-3 drafter reads (its aux
# hidden states; tap i is the residual stream after layer i - 1, tap 4 the
# target's final one). At PP2 (layers [0, 2), [2, 4)) stage 0 sends taps 1
# and 2 across the boundary; at PP3 ([0, 1), [1, 3), [3, 4)) stage 0 sends
# tap 1, which the middle stage's runner relays beside its own tap 2.
EAGLE3_AUX_LAYERS = (1, 2, 4)
# One KV head of the hidden size, as the serving target's attention stand-in
# declares (a TP rank replicates a single KV head): the drafter's KV cache
# pages have the size of the target's on every rank, whatever the TP size.
EAGLE3_NUM_HEADS = 2
EAGLE3_HEAD_DIM = tiny_k3.HIDDEN
# The target layers whose outputs Kimi K3's DSpark drafter reads
# (``target_layer_ids``, zero-based; vLLM taps the residual stream after
# each, aux layers 1, 2 and 4, as EAGLE3_AUX_LAYERS): the same hand-off
# across stages as EAGLE-3's, read by another drafter class.
DSPARK_TARGET_LAYERS = tuple(layer - 1 for layer in EAGLE3_AUX_LAYERS)
# Tokens DSpark drafts in one parallel block (its ``block_size``, which
# vLLM takes for num_speculative_tokens).
DSPARK_BLOCK_SIZE = 2
# The noise token that fills the block's positions after the anchor.
DSPARK_NOISE_TOKEN = tiny_k3.VOCAB - 2
# The media placeholder's id: inside the tiny vocabulary.
MEDIA_PLACEHOLDER = tiny_k3.VOCAB - 1


def text_config(attn_res: bool, dsa: bool, width: int = 4) -> dict:
    """The test bed's tiny text model as a checkpoint's ``text_config``,
    with the KDA state sizes a real one declares (the runner sizes the KDA
    cache from them; the stand-in attention keeps no state)."""
    config = tiny_k3.tiny_config(attn_res=attn_res, dsa=dsa, width=width).to_dict()
    config["linear_attn_config"].update(
        num_heads=width, head_dim=16, short_conv_kernel_size=4
    )
    config.update(eos_token_id=EOS, bos_token_id=1, torch_dtype="float32")
    return config


# MoonViT as Kimi K3's vision_config spells it, one block of width 16.
VISION_CONFIG = {
    "model_type": "kimi_k3_vision",
    "patch_size": 4,
    "init_pos_emb_height": 8,
    "init_pos_emb_width": 8,
    "init_pos_emb_time": 2,
    "vt_num_attention_heads": 2,
    "vt_num_hidden_layers": 1,
    "vt_hidden_size": 16,
    "vt_intermediate_size": 32,
    "qkv_hidden_size": 16,
    "mm_hidden_size": 16,
    "merge_kernel_size": [2, 2],
}


# The image processor's settings (vLLM's KimiK25FusedVisionProcessor reads
# them from preprocessor_config.json), for the vision config above.
MEDIA_PROC_CFG = {
    "patch_size": VISION_CONFIG["patch_size"],
    "merge_kernel_size": VISION_CONFIG["merge_kernel_size"],
    "temporal_merge_kernel_size": 1,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
    "in_patch_limit": 64,
    "patch_limit_on_one_side": 8,
    "in_patch_limit_each_frame": None,
    "in_patch_limit_video": None,
    "fixed_output_tokens": None,
}


def write_checkpoint(
    path: Path,
    architecture: str = ARCHITECTURES[0],
    *,
    attn_res: bool = False,
    dsa: bool = tiny_k3.HAS_DSA,
    width: int = 4,
) -> Path:
    """Write the checkpoint directory (no weights: loaded with dummy ones)."""
    write_tokenizer(path, tiny_k3.MAX_MODEL_LEN)
    (path / "preprocessor_config.json").write_text(
        json.dumps({"media_proc_cfg": MEDIA_PROC_CFG})
    )
    config = {
        "architectures": [architecture],
        "model_type": "kimi_k3",
        "text_config": text_config(attn_res, dsa, width),
        "vision_config": VISION_CONFIG,
        "media_placeholder_token_id": MEDIA_PLACEHOLDER,
        "pad_token_id": 0,
        "eos_token_id": EOS,
        "bos_token_id": 1,
        "torch_dtype": "float32",
    }
    (path / "config.json").write_text(json.dumps(config, indent=1))
    return path


def write_tokenizer(path: Path, model_max_length: int, **config) -> None:
    """A character-level tokenizer over the tiny vocabulary (id ``i`` is
    ``chr(i)``, ``"\x00"`` the end of a sequence); ``config`` adds to its
    ``tokenizer_config.json`` (a chat template)."""
    from tokenizers import Tokenizer, decoders, models

    path.mkdir(parents=True, exist_ok=True)
    vocab = {chr(i): i for i in range(tiny_k3.VOCAB)}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="\x01"))
    tokenizer.decoder = decoders.Fuse()
    tokenizer.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "eos_token": "\x00",
                "unk_token": "\x01",
                "model_max_length": model_max_length,
                **config,
            }
        )
    )


def write_eagle3_draft(path: Path) -> Path:
    """An EAGLE-3 draft checkpoint's ``config.json``: a one-layer Llama that
    vLLM's ``eagle3`` method wraps as ``Eagle3LlamaForCausalLM``, reading
    the target's taps ``EAGLE3_AUX_LAYERS``."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["LlamaForCausalLM"],
                "model_type": "llama",
                "vocab_size": tiny_k3.VOCAB,
                "draft_vocab_size": tiny_k3.VOCAB,
                "hidden_size": tiny_k3.HIDDEN,
                "intermediate_size": 96,
                "num_hidden_layers": 1,
                "num_attention_heads": EAGLE3_NUM_HEADS,
                "num_key_value_heads": 1,
                "head_dim": EAGLE3_HEAD_DIM,
                "max_position_embeddings": 4096,
                "rms_norm_eps": 1e-6,
                "eagle_aux_hidden_state_layer_ids": list(EAGLE3_AUX_LAYERS),
                "tie_word_embeddings": False,
                "torch_dtype": "float32",
            }
        )
    )
    return path


def write_dspark_draft(path: Path) -> Path:
    """A DSpark draft checkpoint's ``config.json`` for Kimi K3: the dense MLA
    drafter vLLM's registry maps ``K3DSparkModel`` to
    (``K3DSparkForCausalLM``, config ``k3_dspark``), reading the target's
    layers ``DSPARK_TARGET_LAYERS``. vLLM picks its DSpark speculator by
    ``dspark`` in the draft's path, so ``path``'s name must carry it."""
    if "dspark" not in path.name.lower():
        raise ValueError(f"vLLM finds a DSpark draft by its path: {path}")
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["K3DSparkModel"],
                "model_type": "k3_dspark",
                "vocab_size": tiny_k3.VOCAB,
                "draft_vocab_size": tiny_k3.VOCAB,
                "hidden_size": tiny_k3.HIDDEN,
                "target_hidden_size": tiny_k3.HIDDEN,
                "target_layer_ids": list(DSPARK_TARGET_LAYERS),
                "num_target_layers": len(DSPARK_TARGET_LAYERS),
                "intermediate_size": 96,
                "hidden_act": "silu",
                "num_hidden_layers": 1,
                "num_attention_heads": 2,
                "q_lora_rank": 32,
                "kv_lora_rank": 16,
                "qk_nope_head_dim": 16,
                "qk_rope_head_dim": 8,
                "v_head_dim": 16,
                # Full rank: the serving tests' Markov head repeats tokens.
                "markov_rank": tiny_k3.VOCAB,
                "block_size": DSPARK_BLOCK_SIZE,
                "dspark_noise_token_id": DSPARK_NOISE_TOKEN,
                "max_position_embeddings": 4096,
                "rms_norm_eps": 1e-6,
                "tie_word_embeddings": False,
                "torch_dtype": "float32",
            }
        )
    )
    return path
