# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""What pipeline stages hand each other, as their agreement compares it: the
batches the scheduler can send every stage alike, what bounds the ones a
stage's runner pads, and the aux hidden states that cross a boundary.
"""

from dataclasses import dataclass

from torch import nn

from vllm.model_executor.models.interfaces import EagleModelMixin
from vllm.utils.math_utils import cdiv


@dataclass(frozen=True)
class BatchShape:
    """A batch the scheduler hands every stage alike."""

    num_tokens: int
    num_reqs: int
    # Tokens per request of a uniform decode batch.
    uniform_token_count: int | None = None
    # The longest request's tokens; None for a batch that holds a prefill.
    max_query_len: int | None = None
    num_active_loras: int = 0

    def __str__(self) -> str:
        if self.uniform_token_count is not None:
            kind = f"a uniform decode of {self.uniform_token_count} per request"
        elif self.max_query_len is not None:
            kind = f"decodes of up to {self.max_query_len} tokens"
        else:
            kind = "with a prefill"
        if self.uniform_token_count is None and self.num_reqs > cdiv(
            self.num_tokens, self.max_query_len or self.num_tokens
        ):
            kind += f", {self.num_reqs} requests"
        loras = f", {self.num_active_loras} LoRA(s)" if self.num_active_loras else ""
        return f"a batch of {self.num_tokens} tokens ({kind}{loras})"


@dataclass(frozen=True)
class ShapeBounds:
    """What bounds the batches one stage's runner pads."""

    # CUDA graphs pad no batch above this many tokens (0: no graphs).
    max_num_tokens: int
    # The runner's decode query length.
    max_query_len: int
    lora_counts: tuple[int, ...]
    # The most requests its graphs hold (--max-num-seqs). Stage 0 runs on
    # the engine's node (rank 0): there also the most requests its scheduler
    # puts in a batch, and the token budget the most tokens any step holds
    # (the scheduler's batches and the warm-up and KV-sizing steps).
    max_num_reqs: int
    max_num_batched_tokens: int


def batch_shapes(bounds: list[ShapeBounds]) -> list[BatchShape]:
    """Every batch whose padding can differ between the stages of
    ``bounds``: as many tokens as any stage's graphs pad and the scheduler
    sends, and requests as the scheduler sends. A graph that bounds its
    requests holds min(its tokens, its stage's max_num_seqs), and its tokens
    are at least the batch's: only a stage's max_num_seqs decides whether a
    batch's requests fit, so the fewest requests a batch can have and one
    past each stage's limit stand for every request count."""
    scheduler = bounds[0]
    max_num_tokens = min(
        max(b.max_num_tokens for b in bounds), scheduler.max_num_batched_tokens
    )
    max_query_len = max(b.max_query_len for b in bounds)
    lora_counts = sorted({count for b in bounds for count in b.lora_counts})
    past_limits = sorted({b.max_num_reqs + 1 for b in bounds})

    def request_counts(num_tokens: int, least: int) -> list[int]:
        most = min(num_tokens, scheduler.max_num_reqs)
        return [n for n in (least, *past_limits) if least <= n <= most]

    return [
        shape
        for num_tokens in range(1, max_num_tokens + 1)
        for loras in lora_counts
        for shape in (
            *(
                BatchShape(num_tokens, n, None, None, loras)
                for n in request_counts(num_tokens, 1)
            ),
            *(
                BatchShape(num_tokens, n, None, q, loras)
                for q in range(1, max_query_len + 1)
                for n in request_counts(num_tokens, cdiv(num_tokens, q))
            ),
            *(
                BatchShape(num_tokens, num_tokens // q, q, q, loras)
                for q in range(1, max_query_len + 1)
                if num_tokens % q == 0 and num_tokens // q <= scheduler.max_num_reqs
            ),
        )
    ]


def aux_hidden_state_layers(model: nn.Module) -> tuple[tuple[int, ...], int, int]:
    """The aux hidden-state layers that cross this stage's boundaries, and
    its layer range. A model that does not relay taps across stages
    (``supports_aux_hidden_states_over_pp``) captures its first one from what
    it received and sends none, so none cross."""
    for module in model.modules():
        if isinstance(module, EagleModelMixin):
            relays = module.supports_aux_hidden_states_over_pp
            return (
                tuple(module.aux_hidden_state_layers) if relays else (),
                module.start_layer,
                getattr(module, "end_layer", module.start_layer),
            )
    return (), 0, 0
