# SPDX-License-Identifier: Apache-2.0
"""Count the collectives and PP transfers of one step, per rank, by phase.

The TP group's ``all_gather``/``reduce_scatter``/``all_reduce`` and the PP
group's ``isend_tensor_dict``/``irecv_tensor_dict`` are wrapped on the group
instances for the duration of a step. Each call becomes a :class:`CommRecord`
labelled with the phase the step is in:

- ``embedding``: the first stage's vocab-parallel embedding;
- ``layers``: from the first decoder layer of the stage to its last;
- ``stage output``: after the stage's last layer (the last stage's gather);
- ``PP recv`` / ``PP send``: the hand-off between stages, including the TP
  all-gather vLLM's receiver runs for replicated keys;
- ``drafter``: the drafter the last stage feeds after the target.

A PP record holds one tensor key and the shape that actually travels: the
1/TP slice when the transport treats the key as TP-replicated, else the
whole local tensor, as ``GroupCoordinator._should_use_all_gather`` decides.
"""

from __future__ import annotations

import contextlib
import types
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch import nn

from vllm.distributed.parallel_state import GroupCoordinator

TP_OPS = ("all_gather", "reduce_scatter", "all_reduce")


@dataclass(frozen=True)
class CommRecord:
    phase: str
    op: str
    shape: tuple[int, ...]
    nbytes: int
    key: str = ""


@dataclass
class CommLedger:
    phase: str = "idle"
    records: list[CommRecord] = field(default_factory=list)

    def add(self, op: str, tensor: torch.Tensor, key: str = "") -> None:
        self.records.append(
            CommRecord(
                self.phase,
                op,
                tuple(tensor.shape),
                tensor.numel() * tensor.element_size(),
                key,
            )
        )

    @contextlib.contextmanager
    def in_phase(self, phase: str) -> Iterator[None]:
        previous, self.phase = self.phase, phase
        try:
            yield
        finally:
            self.phase = previous

    @contextlib.contextmanager
    def watching(
        self, tp_group: GroupCoordinator, pp_group: GroupCoordinator
    ) -> Iterator[None]:
        """Wrap the groups' communication methods while the block runs."""
        for name in TP_OPS:
            setattr(tp_group, name, self._tp_op(name, getattr(tp_group, name)))
        pp_group.isend_tensor_dict = self._pp_send(pp_group)
        pp_group.irecv_tensor_dict = self._pp_recv(pp_group)
        try:
            yield
        finally:
            for name in TP_OPS:
                delattr(tp_group, name)
            del pp_group.isend_tensor_dict, pp_group.irecv_tensor_dict

    @contextlib.contextmanager
    def counting(self, module: types.ModuleType, name: str) -> Iterator[None]:
        """Record each call of ``module.name``, a local op such as
        ``sp_shard``, under that name while the block runs: its input's
        shape, and no bytes, since nothing is communicated."""
        original = getattr(module, name)

        def counted(tensor: torch.Tensor, *args, **kwargs):
            self.records.append(CommRecord(self.phase, name, tuple(tensor.shape), 0))
            return original(tensor, *args, **kwargs)

        setattr(module, name, counted)
        try:
            yield
        finally:
            setattr(module, name, original)

    def watch_stage(self, model: nn.Module) -> None:
        """Switch phases at the model's embedding and first and last layer."""
        layers = [model.layers[i] for i in range(model.start_layer, model.end_layer)]
        model.embed_tokens.register_forward_pre_hook(
            lambda *_: setattr(self, "phase", "embedding")
        )
        layers[0].register_forward_pre_hook(lambda *_: setattr(self, "phase", "layers"))
        layers[-1].register_forward_hook(
            lambda *_: setattr(self, "phase", "stage output")
        )

    def _tp_op(self, name: str, original):
        def counted(tensor: torch.Tensor, *args, **kwargs):
            self.add(name, tensor)
            return original(tensor, *args, **kwargs)

        return counted

    def _travelling(self, group, key, tensor, all_gather_group, overrides):
        if group._should_use_all_gather(
            key, tensor.numel(), all_gather_group, overrides
        ):
            return tensor.reshape(all_gather_group.world_size, -1)[0]
        return tensor

    def _pp_send(self, group: GroupCoordinator):
        original = type(group).isend_tensor_dict.__get__(group)

        def send(tensor_dict, dst=None, all_gather_group=None, all_gather_tensors=None):
            for key, value in tensor_dict.items():
                if isinstance(value, torch.Tensor) and value.numel():
                    self.add(
                        "pp_send",
                        self._travelling(
                            group, key, value, all_gather_group, all_gather_tensors
                        ),
                        key,
                    )
            return original(tensor_dict, dst, all_gather_group, all_gather_tensors)

        return send

    def _pp_recv(self, group: GroupCoordinator):
        original = type(group).irecv_tensor_dict.__get__(group)

        def recv(src=None, all_gather_group=None, all_gather_tensors=None):
            tensors, handles, postprocess = original(
                src, all_gather_group, all_gather_tensors
            )
            for key, value in (tensors or {}).items():
                if isinstance(value, torch.Tensor) and value.numel():
                    self.add("pp_recv", value, key)
            return tensors, handles, postprocess

        return recv

    def summary(self) -> dict[tuple[str, str], tuple[int, int]]:
        """``(phase, op) -> (calls, bytes)``."""
        totals: dict[tuple[str, str], list[int]] = defaultdict(lambda: [0, 0])
        for record in self.records:
            total = totals[(record.phase, record.op)]
            total[0] += 1
            total[1] += record.nbytes
        return {k: (calls, nbytes) for k, (calls, nbytes) in totals.items()}
