"""What a learner rank publishes to the generators (and saves as a model): its weights, one at a time.

Apart from `learner/rank.py` so that a new weight transport or export reads one small class: `parameters`
names what the generators load, `weights` gathers each whole (a collective under ZeRO-3), and `packed`
copies them into `learner/weight_sync.py`'s buffer.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from torch import Tensor

from learner.lora import adapter_weights
from learner.weight_sync import PackedWeights, TensorSpec


class Publisher:
    """The published weights of a rank's `module` (the engine's model): every parameter, or with `lora` the
    adapter's alone; under ZeRO-3 (`zero_stage` 3) each rank holds a partition and gathers in step."""

    def __init__(self, module: Any, lora: bool, zero_stage: int, rank: int) -> None:
        self.module, self.lora, self.zero_stage, self.rank = module, lora, zero_stage, rank

    def specs(self, dtype: str) -> list[TensorSpec]:
        """Name (HF checkpoint), whole shape and wire `dtype` of every published weight, in the order
        `weights` yields them; read locally (ZeRO-3's `ds_shape`), no collective."""
        return [
            TensorSpec(name, tuple(getattr(param, "ds_shape", param.shape)), dtype) for name, param in self.parameters()
        ]

    def parameters(self) -> Iterator[tuple[str, Tensor]]:
        """What the generators load: every parameter, or with LoRA the adapter's alone (peft's names)."""
        if self.lora:
            yield from adapter_weights(self.module).items()
        else:
            yield from self.module.named_parameters()

    def weights(self) -> Iterator[tuple[str, Tensor]]:
        """(name, weight) of `specs`, whole, one at a time: valid until the next is asked for (copy it).
        Under ZeRO-3 every rank must iterate in step, since each parameter's gather is a collective; no
        rank holds more than one gathered parameter."""
        for name, param in self.parameters():
            if self.zero_stage != 3:
                yield name, param.detach()
                continue
            import deepspeed

            with deepspeed.zero.GatheredParameters([param], modifier_rank=None):
                yield name, param.detach()

    def follow(self) -> None:
        """A rank that keeps no weights while rank 0 publishes them: under ZeRO-3, its part in each gather."""
        if self.zero_stage == 3:
            for _ in self.weights():
                pass

    def packed(self, dtype: str = "float32") -> PackedWeights | None:
        """The weights cast to `dtype`, copied one tensor at a time into one buffer for the generators (rank 0;
        None on the other ranks, which under ZeRO-3 take part in each parameter's gather)."""
        if self.rank != 0:
            self.follow()
            return None
        packed = PackedWeights.allocate(self.specs(dtype))
        for index, (_, tensor) in enumerate(self.weights()):
            packed.put(index, tensor)
        return packed

    def state_dict(self) -> dict[str, Tensor]:
        """`packed` as a name -> tensor dict (a copy; empty off rank 0)."""
        packed = self.packed()
        return packed.tensors() if packed is not None else {}
