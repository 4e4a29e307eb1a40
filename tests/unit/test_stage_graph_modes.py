# SPDX-License-Identifier: Apache-2.0
"""Whether Kimi K3's PP stages resolve one CUDA graph mode.

Each stage's runner resolves its mode from the weakest CUDA graph support
among its own attention backends (``init_attn_backend``, then
``CompilationConfig.resolve_cudagraph_mode_and_sizes``), and the last
stage's include the drafter's. Stages that resolve differently pad a batch
differently, and under SP the start-up agreement refuses them (proven on
real ranks by ``test_modes_are_compared_as_the_runners_resolved_them``).

Here the stages are built as Kimi K3 selects its backends on an NVIDIA GPU,
each backend's support taken from vLLM's own metadata builder, and resolved
by vLLM's own code in the seed's mode (FULL_DECODE_ONLY) and vLLM's default
(FULL_AND_PIECEWISE). Resolution only lowers a mode for a backend below
UNIFORM_BATCH (speculative decodes), one that never graphs, or a mixed-FULL
mode. With the drafters' default backends every stage resolves alike: the
MTP layer runs the target's own MLA backend, and Kimi K3 puts EAGLE-3 and
DSpark drafts on FLASHINFER_MLA (MLA drafts) or FLASH_ATTN (GQA drafts),
both at least UNIFORM_BATCH (``configure_dense_draft``). A draft backend
chosen below that (``attention_backend`` in ``--speculative-config``)
lowers the last stage only; that case is built here too, with the padding
it gives 9 MTP decode requests on each stage (30 tokens on stage 0, 32 on
the last).
"""

from __future__ import annotations

import pytest

from tests.sppp_testbed.bases import only_from_0_34
from tests.sppp_testbed.cpu_platform import accept_x86_without_triton

accept_x86_without_triton()

from vllm.config import CompilationMode, CUDAGraphMode, VllmConfig  # noqa: E402
from vllm.v1.attention.backend import AttentionCGSupport  # noqa: E402
from vllm.v1.attention.backends.registry import AttentionBackendEnum  # noqa: E402

# Kimi K3's own layers on every stage of the production PP2 (60 layers, one
# MLA per four): KDA, and MLA on the backend the flags or the platform pick
# (FLASHINFER_MLA first on SM100, FLASHMLA and TRITON_MLA after it,
# KIMI_K3_KV_BALANCED_MLA by --attention-backend from vLLM 0.34.0); K3.1's
# DSA layers add a sparse MLA backend and the indexer.
DENSE_MLA = tuple(
    name
    for name in ("FLASHINFER_MLA", "KIMI_K3_KV_BALANCED_MLA", "FLASHMLA", "TRITON_MLA")
    if name in AttentionBackendEnum.__members__
)
SPARSE_MLA = (None, "FLASHINFER_MLA_SPARSE", "FLASHMLA_SPARSE")
# The drafters' defaults: the draft backend Kimi K3 sets for each on 0.34.0,
# and SM100's first MLA choice on 0.33.0 (None: the MTP layer, built of the
# target's own MLA).
DRAFTERS = {"mtp": None, "eagle3 or dspark, MLA draft": "FLASHINFER_MLA"}
MODES = ("FULL_DECODE_ONLY", "FULL_AND_PIECEWISE")


def builder_support(name: str) -> AttentionCGSupport:
    builder = AttentionBackendEnum[name].get_class().get_builder_cls()
    return builder.get_cudagraph_support(VllmConfig(), None)


def kda_support() -> AttentionCGSupport:
    from vllm.models.kimi_k3.nvidia import kda_metadata

    return kda_metadata.KimiK3KDAMetadataBuilder._cudagraph_support


def indexer_support() -> AttentionCGSupport:
    from vllm.v1.attention.backends.mla.indexer import (
        DeepseekV32IndexerMetadataBuilder,
    )

    return DeepseekV32IndexerMetadataBuilder.get_cudagraph_support(VllmConfig(), None)


def weakest(supports: list[AttentionCGSupport]) -> AttentionCGSupport:
    return min(supports, key=lambda support: support.value)


def resolve(mode: str, support: AttentionCGSupport, decode_query_len: int):
    """The mode a stage's runner resolves, by vLLM's own code, compiled as
    the seed serves (VLLM_COMPILE, attention split out of the graph)."""
    config = VllmConfig()
    compilation = config.compilation_config
    compilation.mode = CompilationMode.VLLM_COMPILE
    compilation.splitting_ops = list(compilation._attention_ops)
    compilation.cudagraph_mode = CUDAGraphMode[mode]
    return compilation.resolve_cudagraph_mode_and_sizes(
        support, "weakest", uniform_decode_query_len=decode_query_len
    )


def stage_supports(dense: str, sparse: str | None) -> list[AttentionCGSupport]:
    supports = [kda_support(), builder_support(dense)]
    if sparse is not None:
        supports += [builder_support(sparse), indexer_support()]
    return supports


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("drafter", DRAFTERS)
@pytest.mark.parametrize("sparse", SPARSE_MLA)
@pytest.mark.parametrize("dense", DENSE_MLA)
def test_every_stage_resolves_one_mode_with_the_drafters_defaults(
    dense, sparse, drafter, mode
):
    target = stage_supports(dense, sparse)
    draft = DRAFTERS[drafter] or dense
    last = [*target, builder_support(draft)]
    for num_speculative_tokens in (1, 3):
        query_len = 1 + num_speculative_tokens
        assert resolve(mode, weakest(target), query_len) == resolve(
            mode, weakest(last), query_len
        ), (dense, sparse, drafter, mode, num_speculative_tokens)


def test_every_default_backend_graphs_speculative_decodes():
    """What the test above rests on, named: no backend Kimi K3 or its
    drafters take by default lowers a speculative decode's graphs."""
    names = {*DENSE_MLA, *filter(None, SPARSE_MLA), *filter(None, DRAFTERS.values())}
    supports = {name: builder_support(name) for name in names}
    supports["KDA"] = kda_support()
    supports["indexer"] = indexer_support()
    low = {
        name: support.name
        for name, support in supports.items()
        if support.value < AttentionCGSupport.UNIFORM_BATCH.value
    }
    assert not low, low


@only_from_0_34("the V2 runner's request-keyed decode graphs")
@pytest.mark.parametrize("mode", MODES)
def test_a_draft_backend_below_uniform_batch_lowers_the_last_stage(mode):
    """A draft on a backend that graphs single-token decodes only (as
    CUTLASS_MLA on SM100, whose module needs a GPU to import) lowers the
    last stage, and 9 MTP decode requests of 3 tokens pad differently."""
    from tests.unit.agreement_cost import sm100_manager

    num_speculative_tokens = 2
    query_len = 1 + num_speculative_tokens
    target = stage_supports("FLASHINFER_MLA", "FLASHINFER_MLA_SPARSE")
    last = [*target, AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE]
    first_mode = resolve(mode, weakest(target), query_len)
    last_mode = resolve(mode, weakest(last), query_len)
    assert first_mode == CUDAGraphMode[mode]
    assert last_mode == CUDAGraphMode.PIECEWISE

    padded = []
    for resolved in (first_mode, last_mode):
        _, manager = sm100_manager(
            spec=(num_speculative_tokens,),
            max_num_seqs=128,
            max_num_batched_tokens=32768,
            mode=resolved.name,
        )
        manager._graphs_captured = True  # dispatch as after capture
        desc = manager.dispatch(9, 9 * query_len, query_len, 0)
        padded.append(desc.num_tokens)
    # SM100's default sizes: stage 0 runs the decode graph of 10 requests
    # (30 tokens), the last stage, piecewise, the token-keyed graph of 32:
    # at TP2 under SP, 15 shard rows sent where 16 are expected.
    assert padded == [30, 32], padded
