# SPDX-License-Identifier: Apache-2.0
"""Torch stand-ins for the Triton kernels Model Runner V2 launches in a plain
greedy or sampled step, and in a greedy step with an EAGLE-3 drafter (its
input preparation and the strict rejection sampler), so that vLLM's own V2
runner (``GPUModelRunner``, as ``CPUModelRunner`` subclasses it) and its
speculator run on the tests' CPU ranks.

The wheel these tests install is vLLM's CUDA wheel: its Triton has no CPU
backend, so no ``@triton.jit`` kernel can launch here. Each stand-in replaces
one kernel object in its module (``module._name_kernel``), at the launch:
``kernel[grid](*args, **meta)`` calls the stand-in with the grid and the same
arguments, so vLLM's Python wrapper around every launch (what it allocates,
the arguments it computes, the buffers it hands on) still runs. Each stand-in
does what its kernel's programs do together, written for clarity, not speed,
with the batch sizes of the tests (a few requests). Two kernels take their
tensors by address (the block tables of several KV cache groups); the
addresses are looked up among the tensors ``BlockTables._make_ptr_tensor``
was given, which :func:`install` records.

Without Triton, vLLM's placeholder module leaves each ``@triton.jit`` kernel
an undecorated Python function, so a launch of a kernel without a stand-in
fails at once (``'function' object is not subscriptable``, at the launch
line, which names the kernel); it never runs on wrong data.
Also replaced: ``UvaBuffer`` (pinned memory and a device view of it need
CUDA) by vLLM's own CPU ``UvaBuffer``, which vLLM installs itself only where
triton-cpu is present (``vllm/v1/worker/cpu/shm.py``).

Only the processes that call :func:`install` (the serving tests' V2 workers)
are changed; nothing here is installed into vLLM.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

__all__ = ["install", "STAND_INS"]

# Tensors handed to BlockTables._make_ptr_tensor, by address.
_BY_ADDRESS: dict[int, torch.Tensor] = {}


def _tensor_at(address: int) -> torch.Tensor:
    try:
        return _BY_ADDRESS[address]
    except KeyError:
        raise RuntimeError(
            f"no tensor recorded at address {address:#x} (stand-in kernels "
            "resolve only BlockTables' pointer tensors)"
        ) from None


class _Launch:
    """What ``kernel[grid]`` returns in place of a Triton launcher."""

    def __init__(self, name: str, body: Callable) -> None:
        self.name, self.body = name, body

    def __getitem__(self, grid):
        grid = grid if isinstance(grid, tuple) else (grid,)
        return functools.partial(self.body, grid)

    def __repr__(self) -> str:
        return f"<torch stand-in for Triton kernel {self.name}>"


# --- vllm/v1/worker/gpu/buffer_utils.py -----------------------------------


def apply_write(grid, output, output_stride, indices, starts, contents, cu_lens,
                group_ids, BLOCK_SIZE, MULTI_GROUP):  # fmt: skip
    """``_apply_write_kernel``: write ``contents[cu_lens[i-1]:cu_lens[i]]`` to
    row ``indices[i]`` from column ``starts[i]`` of the output (with
    ``MULTI_GROUP``, of the tensor at ``output[group_ids[i]]``)."""
    ends = cu_lens.tolist()
    for i in range(grid[0]):
        begin = ends[i - 1] if i else 0
        if MULTI_GROUP:
            group = int(group_ids[i])
            target = _tensor_at(int(output[group])).view(-1)
            stride = int(output_stride[group])
        else:
            target, stride = output.view(-1), output_stride
        at = int(indices[i]) * stride + int(starts[i])
        target[at : at + ends[i] - begin] = contents[begin : ends[i]]


# --- vllm/v1/worker/gpu/input_batch.py ------------------------------------


def prepare_prefill_inputs(grid, input_ids, next_prefill_tokens, next_stride,
                           num_lookahead, idx_mapping, query_start_loc,
                           all_token_ids, all_token_ids_stride, prefill_len,
                           num_computed_tokens, **meta):  # fmt: skip
    """``_prepare_prefill_inputs_kernel``: for each request still in its
    prompt, copy the scheduled prompt tokens into ``input_ids`` and the next
    ``num_lookahead`` prompt tokens (0 past the prompt) into
    ``next_prefill_tokens[:, req]``."""
    for b in range(grid[0]):
        req = int(idx_mapping[b])
        prompt, done = int(prefill_len[req]), int(num_computed_tokens[req])
        if done >= prompt:
            continue
        start, end = int(query_start_loc[b]), int(query_start_loc[b + 1])
        tokens = all_token_ids[req]
        input_ids[start:end] = tokens[done : done + end - start]
        for k in range(num_lookahead):
            p = done + end - start + k
            next_prefill_tokens[k, req] = tokens[p] if p < prompt else 0


def prepare_pos_seq_lens(grid, pos, seq_lens, idx_mapping, query_start_loc,
                         num_computed_tokens, max_num_reqs, **meta):  # fmt: skip
    """``_prepare_pos_seq_lens_kernel``: each request's positions continue
    from its computed tokens; its ``seq_len`` is computed + scheduled; the
    rows past the batch are zero."""
    num_reqs = grid[0] - 1
    seq_lens[num_reqs:max_num_reqs] = 0
    for b in range(num_reqs):
        done = int(num_computed_tokens[int(idx_mapping[b])])
        start, end = int(query_start_loc[b]), int(query_start_loc[b + 1])
        seq_lens[b] = done + end - start
        pos[start:end] = torch.arange(done, done + end - start)


def combine_sampled_and_draft_tokens(grid, input_ids, idx_mapping,
                                     last_sampled_tokens, query_start_loc,
                                     seq_lens, prefill_len, draft_tokens,
                                     draft_tokens_stride, cu_num_logits,
                                     logits_indices, BLOCK_SIZE,
                                     NUM_NEW_SAMPLED_TOKENS=1):  # fmt: skip
    """``_combine_sampled_and_draft_tokens_kernel``: the logits rows are each
    request's last ``num_logits`` query rows; a request past its prompt gets
    its last sampled token (and its draft tokens) as input ids."""
    for b in range(grid[0]):
        req = int(idx_mapping[b])
        first, last = int(cu_num_logits[b]), int(cu_num_logits[b + 1])
        num_logits = last - first
        end = int(query_start_loc[b + 1])
        logits_indices[first:last] = torch.arange(end - num_logits, end)
        seq_len, prompt = int(seq_lens[b]), int(prefill_len[req])
        if seq_len <= prompt:
            continue
        if NUM_NEW_SAMPLED_TOKENS > 0 and seq_len - num_logits >= prompt:
            input_ids[end - num_logits] = last_sampled_tokens[req]
        num_draft = num_logits - NUM_NEW_SAMPLED_TOKENS
        if num_draft > 0:
            input_ids[end - num_draft : end] = draft_tokens[req, :num_draft]


def get_num_sampled_and_rejected(grid, num_sampled, num_rejected, seq_lens,
                                 cu_num_logits, idx_mapping,
                                 prefill_len):  # fmt: skip
    """``_get_num_sampled_and_rejected_kernel``: a request still in a chunked
    prefill samples and rejects nothing; otherwise rejected = logits -
    sampled."""
    for b in range(grid[0]):
        chunked = int(seq_lens[b]) < int(prefill_len[int(idx_mapping[b])])
        if chunked:
            num_sampled[b] = 0
        num_logits = int(cu_num_logits[b + 1]) - int(cu_num_logits[b])
        num_rejected[b] = 0 if chunked else num_logits - int(num_sampled[b])


def post_update(grid, idx_mapping, num_computed_tokens, last_sampled_tokens,
                output_bin_counts, output_bin_counts_stride, sampled_tokens,
                sampled_tokens_stride, num_sampled, num_rejected,
                query_start_loc, all_token_ids, all_token_ids_stride,
                total_len, draft_tokens, draft_tokens_out, num_draft_tokens,
                **meta):  # fmt: skip
    """``_post_update_kernel``: append each request's sampled tokens to its
    token history (and output counts), remember the last one, and advance its
    computed tokens by query length - rejected."""
    for b in range(grid[0]):
        req = int(idx_mapping[b])
        if req < 0:
            continue
        if draft_tokens is not None:
            draft_tokens_out[req, :num_draft_tokens] = draft_tokens[b]
        length, sampled = int(total_len[req]), int(num_sampled[b])
        if sampled > 0:
            last_sampled_tokens[req] = sampled_tokens[b, sampled - 1]
            total_len[req] = length + sampled
        for i in range(sampled):
            token = int(sampled_tokens[b, i])
            all_token_ids[req, length + i] = token
            if output_bin_counts is not None:
                output_bin_counts[req, token] += 1
        query_len = 0
        if query_start_loc is not None:
            query_len = int(query_start_loc[b + 1]) - int(query_start_loc[b])
        num_computed_tokens[req] += query_len - int(num_rejected[b])


def post_update_num_computed_tokens(grid, idx_mapping, num_computed_tokens,
                                    query_start_loc):  # fmt: skip
    """``_post_update_num_computed_tokens_kernel``: computed += query length."""
    for b in range(grid[0]):
        query_len = int(query_start_loc[b + 1]) - int(query_start_loc[b])
        num_computed_tokens[int(idx_mapping[b])] += query_len


def expand_idx_mapping(grid, idx_mapping, expanded_idx_mapping,
                       expanded_local_pos, cu_num_logits, **meta):  # fmt: skip
    """``_expand_idx_mapping_kernel``: one entry per logits row, naming its
    request and its index among that request's rows."""
    for b in range(grid[0]):
        first, last = int(cu_num_logits[b]), int(cu_num_logits[b + 1])
        expanded_idx_mapping[first:last] = idx_mapping[b]
        expanded_local_pos[first:last] = torch.arange(last - first)


# --- vllm/v1/worker/gpu/block_table.py ------------------------------------


def gather_block_tables(grid, batch_idx_to_req_idx, src_ptrs, dst_ptrs,
                        strides, num_blocks, num_blocks_stride, num_reqs,
                        num_computed_tokens, sliding_window_reach,
                        block_sizes, MASK_SLIDING_WINDOW,
                        BLOCK_SIZE):  # fmt: skip
    """``_gather_block_tables_kernel``: row ``b`` of each group's input block
    table is the block-table row of the batch's request ``b``, its first
    ``num_blocks`` entries (the rest as they were); rows past the batch are
    zero. Sliding windows: the blocks no query can reach are the null block."""
    for group in range(grid[0]):
        src = _tensor_at(int(src_ptrs[group]))
        dst = _tensor_at(int(dst_ptrs[group]))
        for b in range(grid[1]):
            if b >= num_reqs:
                dst[b].zero_()
                continue
            req = int(batch_idx_to_req_idx[b])
            count = int(num_blocks[group, req])
            row = src[req, :count].clone()
            reach = int(sliding_window_reach[group])
            if MASK_SLIDING_WINDOW and reach > 0:
                first = int(num_computed_tokens[req])
                row[: max(first - reach, 0) // int(block_sizes[group])] = 0
            dst[b, :count] = row


def compute_slot_mappings(grid, max_num_tokens, idx_mapping, query_start_loc,
                          pos, block_table_ptrs, block_table_strides,
                          block_sizes, slot_mapping_enabled, dcp_sharded,
                          slot_mappings, slot_mappings_stride, cp_rank,
                          CP_SIZE, CP_INTERLEAVE, PAD_ID,
                          TRITON_BLOCK_SIZE):  # fmt: skip
    """``_compute_slot_mappings_kernel`` without context parallelism: each
    token's slot is ``block_table[req, pos // block_size] * block_size + pos
    % block_size``; a dummy request's tokens (index -1), a group without slot
    mapping and every slot past the batch's tokens are ``PAD_ID``."""
    if CP_SIZE != 1:
        raise NotImplementedError("stand-in slot mapping: no context parallelism")
    num_reqs = grid[1] - 1
    for group in range(grid[0]):
        table = _tensor_at(int(block_table_ptrs[group]))
        size = int(block_sizes[group])
        out = slot_mappings[group]
        out[int(query_start_loc[num_reqs]) : max_num_tokens] = PAD_ID
        for b in range(num_reqs):
            start, end = int(query_start_loc[b]), int(query_start_loc[b + 1])
            req = int(idx_mapping[b])
            if req < 0 or not bool(slot_mapping_enabled[group]):
                out[start:end] = PAD_ID
                continue
            positions = pos[start:end].long()
            blocks = table[req, positions // size].long()
            out[start:end] = blocks * size + positions % size


# --- vllm/v1/worker/gpu/sample/gumbel.py ----------------------------------


def gumbel_sample(logits, expanded_idx_mapping, temperature, seed, pos,
                  apply_temperature, is_drafting, logits_cache=None,
                  logits_cache_col=None, use_fp64=False,
                  logits_cache_source=None, logits_cache_row_mapping=None,
                  bias=None):  # fmt: skip
    """``gumbel_sample`` (``_gumbel_sample_kernel`` and
    ``_gumbel_combine_kernel``): per row, the first argmax of the logits
    where the request's temperature is 0; otherwise of logits / temperature
    plus Gumbel noise drawn from a generator seeded by (request seed,
    position). Not Triton's Philox stream: a valid sample, not the same one."""
    if logits_cache is not None or bias is not None:
        raise NotImplementedError("stand-in gumbel_sample: no draft logits cache")
    sampled = logits.new_empty(logits.shape[0], dtype=torch.int64)
    dtype = torch.float64 if use_fp64 else torch.float32
    for row in range(logits.shape[0]):
        req = int(expanded_idx_mapping[row])
        values = logits[row].to(dtype)
        t = float(temperature[req])
        if t != 0.0:
            if apply_temperature:
                values = values / t
            generator = torch.Generator().manual_seed(
                (int(seed[req]) * 1_000_003 + int(pos[row])) % (1 << 63)
            )
            uniform = torch.rand(values.shape, generator=generator, dtype=dtype)
            values = values - torch.log(-torch.log(uniform.clamp_min(1e-20)))
        sampled[row] = torch.argmax(values)
    return sampled


# --- vllm/v1/worker/gpu/spec_decode/target_dependent_ar/speculator.py ------
# The EAGLE-3 speculator's input preparation (the serving tests' drafter).


def draft_prefill_inputs(grid, last_token_indices, draft_current_step,
                         draft_input_ids, draft_positions,
                         draft_query_start_loc, draft_seq_lens,
                         target_input_ids, target_positions, idx_mapping,
                         last_sampled, next_prefill_tokens, num_sampled,
                         num_rejected, query_start_loc, seq_lens, max_num_reqs,
                         **meta):  # fmt: skip
    """``_prepare_prefill_inputs_kernel`` (the speculator's): the draft
    prefill runs on the target's rows, each request's input ids shifted left
    by one with the next token (its last sampled one, or the next prompt token
    in a chunked prefill) at its last row before the rejected ones; positions,
    query starts and sequence lengths are the target's; the padding past the
    batch repeats the last query end, and the draft step restarts at 0."""
    num_reqs = grid[0]
    next_prompt_tokens = next_prefill_tokens.reshape(-1)
    for b in range(num_reqs):
        req = int(idx_mapping[b])
        start, end = int(query_start_loc[b]), int(query_start_loc[b + 1])
        length = end - start - int(num_rejected[b])
        if int(num_sampled[b]) > 0:
            next_token = int(last_sampled[req])
        else:
            next_token = int(next_prompt_tokens[req])
        last = start + length - 1
        draft_input_ids[start:last] = target_input_ids[start + 1 : start + length]
        last_token_indices[b] = last
        draft_input_ids[last] = next_token
        draft_positions[start : start + length] = target_positions[
            start : start + length
        ]
        draft_query_start_loc[b] = start
        draft_seq_lens[b] = seq_lens[b]
    draft_current_step.fill_(0)
    query_end = int(query_start_loc[num_reqs])
    draft_query_start_loc[num_reqs : max_num_reqs + 1] = query_end
    draft_seq_lens[num_reqs:max_num_reqs] = 0
    last_token_indices[num_reqs:max_num_reqs] = 0


def draft_decode_inputs(grid, draft_tokens, draft_tokens_stride,
                        target_seq_lens, num_rejected, input_ids, positions,
                        sample_src_positions, query_start_loc, seq_lens,
                        max_model_len, max_num_reqs, BLOCK_SIZE,
                        ADVANCE_DRAFT_POSITIONS):  # fmt: skip
    """``_prepare_decode_inputs_kernel``: the first draft decode step takes
    each request's first draft token as its one input id, one query token a
    request (query starts 0, 1, ..., padded with the request count), the
    sampling key one further, and the sequence length of the accepted tokens
    (plus the new position where the drafter writes one, both clamped to the
    model length)."""
    num_reqs = grid[0] - 1
    query_start_loc[: max_num_reqs + 1] = torch.clamp(
        torch.arange(max_num_reqs + 1), max=num_reqs
    )
    seq_lens[num_reqs:max_num_reqs] = 0
    for b in range(num_reqs):
        input_ids[b] = draft_tokens[b]
        sample_src_positions[b] += 1
        seq_len = int(target_seq_lens[b]) - int(num_rejected[b])
        if ADVANCE_DRAFT_POSITIONS:
            positions[b] = min(int(positions[b]) + 1, max_model_len - 1)
            seq_len = min(seq_len + 1, max_model_len)
        seq_lens[b] = seq_len


def update_draft_inputs(grid, output_draft_tokens, output_draft_tokens_stride,
                        next_input_hidden_states,
                        next_input_hidden_states_stride, input_ids, positions,
                        sample_src_positions, seq_lens, draft_tokens,
                        current_draft_step, hidden_states,
                        hidden_states_stride, hidden_size, max_model_len,
                        num_speculative_steps, BLOCK_SIZE,
                        ADVANCE_DRAFT_POSITIONS):  # fmt: skip
    """``_update_draft_inputs_kernel``: record each request's draft token of
    this step; unless it was the last step, make it the next input id, the
    drafter's output hidden state the next input state, and advance the
    sampling key, position and sequence length (clamped to the model
    length)."""
    step = int(current_draft_step)
    limit = int(max_model_len)
    for b in range(grid[0]):
        output_draft_tokens[b, step] = draft_tokens[b]
        if step >= num_speculative_steps - 1:
            continue
        sample_src_positions[b] += 1
        input_ids[b] = draft_tokens[b]
        next_input_hidden_states[b, :hidden_size] = hidden_states[b, :hidden_size]
        if ADVANCE_DRAFT_POSITIONS:
            positions[b] = min(int(positions[b]) + 1, limit - 1)
            seq_lens[b] = min(int(seq_lens[b]) + 1, limit)


# --- vllm/v1/worker/gpu/spec_decode/rejection_sampler.py -------------------


def gather_draft_sampled(grid, draft_sampled, pos, input_ids, positions,
                         logits_indices, expanded_idx_mapping,
                         expanded_local_pos, prefill_len, num_logits,
                         BLOCK_SIZE):  # fmt: skip
    """``_gather_draft_sampled_kernel``: each logits row's input token and
    position; a draft row (local position > 0) of a step that starts inside
    the prompt holds no draft, -1."""
    for row in range(num_logits):
        token = int(logits_indices[row])
        position = int(positions[token])
        local = int(expanded_local_pos[row])
        prompt = int(prefill_len[int(expanded_idx_mapping[row])])
        placeholder = local > 0 and position - local < prompt
        draft_sampled[row] = -1 if placeholder else input_ids[token]
        pos[row] = position


# --- vllm/v1/worker/gpu/spec_decode/rejection_sampler_utils.py -------------
# Strict rejection sampling for greedy requests: no other request reaches
# these stand-ins (a sampled request fails at the first, naming it).


def _greedy_only(temperature, req: int, kernel: str) -> None:
    if float(temperature[req]) != 0.0:
        raise NotImplementedError(
            f"stand-in {kernel}: greedy requests only (temperature 0)"
        )


def _is_bonus_row(expanded_local_pos, row: int, num_logits: int) -> bool:
    """The last logits row of its request (the next row starts another)."""
    return row + 1 >= num_logits or int(expanded_local_pos[row + 1]) == 0


def _block_argmax(values: torch.Tensor) -> tuple[float, int]:
    """Max and first index of the max, NaN read as -inf."""
    values = values.float().masked_fill(values.isnan(), float("-inf"))
    index = int(torch.argmax(values))
    return float(values[index]), index


def local_logits_stats(grid, target_local_argmax, target_local_argmax_stride,
                       target_local_max, target_local_max_stride,
                       target_local_sumexp, target_local_sumexp_stride,
                       draft_local_max, draft_local_max_stride,
                       draft_local_sumexp, draft_local_sumexp_stride,
                       target_logits, target_logits_stride, draft_logits,
                       draft_logits_stride_0, draft_logits_stride_1,
                       draft_logits_row_mapping, expanded_idx_mapping,
                       expanded_local_pos, temperature, vocab_size,
                       num_logits, BLOCK_SIZE, HAS_DRAFT_LOGITS):  # fmt: skip
    """``_compute_local_logits_stats_kernel``, greedy: per logits row but a
    request's last (the bonus row) and per vocabulary block, the target's max
    logit and its first index."""
    num_rows, num_blocks = grid
    for row in range(num_rows):
        if _is_bonus_row(expanded_local_pos, row, num_logits):
            continue
        _greedy_only(
            temperature, int(expanded_idx_mapping[row]),
            "_compute_local_logits_stats_kernel",
        )  # fmt: skip
        for block in range(num_blocks):
            first = block * BLOCK_SIZE
            values = target_logits[row, first : min(first + BLOCK_SIZE, vocab_size)]
            value, index = _block_argmax(values)
            target_local_argmax[row, block] = first + index
            target_local_max[row, block] = value


def rejection(grid, sampled, sampled_stride, rejected_steps,
              target_rejected_logsumexp, draft_rejected_logsumexp,
              target_logits, target_logits_stride, target_local_argmax,
              target_local_argmax_stride, target_local_max,
              target_local_max_stride, target_local_sumexp,
              target_local_sumexp_stride, draft_sampled, draft_logits,
              draft_logits_stride_0, draft_logits_stride_1,
              draft_logits_row_mapping, draft_local_max,
              draft_local_max_stride, draft_local_sumexp,
              draft_local_sumexp_stride, cu_num_logits, idx_mapping,
              temperature, seed, pos, synthetic_conditional_rates,
              cumulative_log_p, local_residual_mass,
              local_residual_mass_stride, fly_entropy, fly_entropy_threshold,
              vocab_num_blocks, PADDED_VOCAB_NUM_BLOCKS, HAS_DRAFT_LOGITS,
              SYNTHETIC_MODE, USE_BLOCK_VERIFICATION, FLY_WINDOW_SIZE,
              **meta):  # fmt: skip
    """``_rejection_kernel``, greedy and strict: walk each request's drafts
    while each equals the target's argmax at its row (the argmax of the
    block maxima, first block on a tie); the first that does not is replaced
    by the target's argmax and ends the walk; a -1 placeholder never
    matches. Stores the accepted count."""
    if SYNTHETIC_MODE or USE_BLOCK_VERIFICATION or FLY_WINDOW_SIZE:
        raise NotImplementedError("stand-in _rejection_kernel: strict mode only")
    for b in range(grid[0]):
        _greedy_only(temperature, int(idx_mapping[b]), "_rejection_kernel")
        start, end = int(cu_num_logits[b]), int(cu_num_logits[b + 1])
        accepted = 0
        for i in range(end - start - 1):
            row = start + i
            draft = int(draft_sampled[row + 1])
            _, block = _block_argmax(target_local_max[row, :vocab_num_blocks])
            target = int(target_local_argmax[row, block])
            if draft >= 0 and draft == target:
                accepted += 1
                sampled[b, i] = draft
                continue
            sampled[b, i] = target
            break
        rejected_steps[b] = accepted
        target_rejected_logsumexp[b] = 0.0
        draft_rejected_logsumexp[b] = 0.0


def resample(grid, resampled_local_argmax, resampled_local_argmax_stride,
             resampled_local_max, resampled_local_max_stride, target_logits,
             target_logits_stride, target_rejected_logsumexp, draft_logits,
             draft_logits_stride_0, draft_logits_stride_1,
             draft_logits_row_mapping, draft_rejected_logsumexp,
             rejected_step, cu_num_logits, expanded_idx_mapping,
             draft_sampled, temperature, seed, pos, cumulative_log_p,
             contexts, contexts_stride, watermarking, watermarking_skip_mask,
             watermark_key_0, watermark_key_1, vocab_size, BLOCK_SIZE,
             HAS_DRAFT_LOGITS, USE_FP64, USE_BLOCK_VERIFICATION,
             CONTEXT_WIDTH, WATERMARK, DEDUPLICATE_CONTEXTS,
             SKIP_MASKED_BLOCKS):  # fmt: skip
    """``_resample_kernel``, greedy: a request that accepted every draft
    takes its bonus row's argmax (per vocabulary block here, combined by
    ``_insert_resampled_kernel``); one that rejected a draft already holds
    the target's argmax there, and nothing is resampled."""
    num_reqs, num_blocks = grid
    for b in range(num_reqs):
        row = int(cu_num_logits[b]) + int(rejected_step[b])
        _greedy_only(
            temperature, int(expanded_idx_mapping[row]), "_resample_kernel"
        )  # fmt: skip
        if row != int(cu_num_logits[b + 1]) - 1:
            continue
        for block in range(num_blocks):
            first = block * BLOCK_SIZE
            values = target_logits[row, first : min(first + BLOCK_SIZE, vocab_size)]
            value, index = _block_argmax(values)
            resampled_local_argmax[b, block] = first + index
            resampled_local_max[b, block] = value


def insert_resampled(grid, sampled, sampled_stride, num_sampled,
                     resampled_local_argmax, resampled_local_argmax_stride,
                     resampled_local_max, resampled_local_max_stride,
                     resample_num_blocks, cu_num_logits, expanded_idx_mapping,
                     temperature, PADDED_RESAMPLE_NUM_BLOCKS,
                     **meta):  # fmt: skip
    """``_insert_resampled_kernel``: one token more for every request; a
    request at its bonus row gets the argmax of the block maxima there."""
    for b in range(grid[0]):
        count = int(num_sampled[b])
        num_sampled[b] = count + 1
        row = int(cu_num_logits[b]) + count
        _greedy_only(
            temperature, int(expanded_idx_mapping[row]), "_insert_resampled_kernel"
        )  # fmt: skip
        if row != int(cu_num_logits[b + 1]) - 1:
            continue
        _, block = _block_argmax(resampled_local_max[b, :resample_num_blocks])
        sampled[b, count] = resampled_local_argmax[b, block]


SPEC = "vllm.v1.worker.gpu.spec_decode."
# (module, kernel attribute) -> stand-in; gumbel_sample is replaced whole.
STAND_INS: dict[tuple[str, str], Callable] = {
    ("vllm.v1.worker.gpu.buffer_utils", "_apply_write_kernel"): apply_write,
    ("vllm.v1.worker.gpu.input_batch", "_prepare_prefill_inputs_kernel"):
        prepare_prefill_inputs,
    ("vllm.v1.worker.gpu.input_batch", "_prepare_pos_seq_lens_kernel"):
        prepare_pos_seq_lens,
    ("vllm.v1.worker.gpu.input_batch", "_combine_sampled_and_draft_tokens_kernel"):
        combine_sampled_and_draft_tokens,
    ("vllm.v1.worker.gpu.input_batch", "_get_num_sampled_and_rejected_kernel"):
        get_num_sampled_and_rejected,
    ("vllm.v1.worker.gpu.input_batch", "_post_update_kernel"): post_update,
    ("vllm.v1.worker.gpu.input_batch", "_post_update_num_computed_tokens_kernel"):
        post_update_num_computed_tokens,
    ("vllm.v1.worker.gpu.input_batch", "_expand_idx_mapping_kernel"):
        expand_idx_mapping,
    ("vllm.v1.worker.gpu.block_table", "_gather_block_tables_kernel"):
        gather_block_tables,
    ("vllm.v1.worker.gpu.block_table", "_compute_slot_mappings_kernel"):
        compute_slot_mappings,
    (SPEC + "target_dependent_ar.speculator", "_prepare_prefill_inputs_kernel"):
        draft_prefill_inputs,
    (SPEC + "target_dependent_ar.speculator", "_prepare_decode_inputs_kernel"):
        draft_decode_inputs,
    (SPEC + "target_dependent_ar.speculator", "_update_draft_inputs_kernel"):
        update_draft_inputs,
    (SPEC + "rejection_sampler", "_gather_draft_sampled_kernel"):
        gather_draft_sampled,
    (SPEC + "rejection_sampler_utils", "_compute_local_logits_stats_kernel"):
        local_logits_stats,
    (SPEC + "rejection_sampler_utils", "_rejection_kernel"): rejection,
    (SPEC + "rejection_sampler_utils", "_resample_kernel"): resample,
    (SPEC + "rejection_sampler_utils", "_insert_resampled_kernel"):
        insert_resampled,
}  # fmt: skip


def install() -> None:
    """Put the stand-ins in place in this process; idempotent."""
    import importlib

    import vllm.v1.worker.cpu.buffer_utils as cpu_buffer_utils
    import vllm.v1.worker.gpu.buffer_utils as buffer_utils
    from vllm.triton_utils import HAS_TRITON, triton
    from vllm.v1.worker.gpu.block_table import BlockTables

    if getattr(install, "done", False):
        return
    if HAS_TRITON:
        raise RuntimeError(
            "Triton is usable in this process: the stand-ins are for hosts "
            "whose Triton cannot launch (vLLM's placeholder module)"
        )
    # vLLM's Triton placeholder keeps each kernel as its undecorated Python
    # function and has no next_power_of_2, which launch wrappers call.
    if not hasattr(triton, "next_power_of_2"):
        triton.next_power_of_2 = lambda n: 1 if n <= 1 else 1 << (n - 1).bit_length()
    buffer_utils.UvaBuffer = cpu_buffer_utils.UvaBuffer
    for (module_name, kernel), body in STAND_INS.items():
        module = importlib.import_module(module_name)
        assert callable(getattr(module, kernel)), (module_name, kernel)
        setattr(module, kernel, _Launch(kernel, body))
    import vllm.v1.worker.gpu.sample.gumbel as gumbel
    import vllm.v1.worker.gpu.sample.sampler as sampler

    gumbel.gumbel_sample = sampler.gumbel_sample = gumbel_sample

    make_ptr_tensor = BlockTables._make_ptr_tensor

    def record_addresses(self, tensors):
        tensors = list(tensors)
        for tensor in tensors:
            _BY_ADDRESS[tensor.data_ptr()] = tensor
        return make_ptr_tensor(self, tensors)

    BlockTables._make_ptr_tensor = record_addresses
    install.done = True
