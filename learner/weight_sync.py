"""Weights on their way from the learner to the generators, as vLLM's weight-transfer engines take them.

`PackedWeights`: one flat byte buffer for the object store (the default path), which a generator's
`stableasync_packed` engine loads. `CollectiveWeightSync`: the gloo broadcast of the `stableasync_gloo`
engine, streamed from learner rank 0 in same-dtype buckets of at most `bucket_mb` (the CPU stand-in for
vLLM's own NCCL engine, which the GPU path uses). `TensorSpec`: what a receiver allocates.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor

SOURCE_RANK = 0


@dataclass(frozen=True)
class TensorSpec:
    """Name, shape and dtype of one weight: what a receiver allocates before a broadcast."""

    name: str
    shape: tuple[int, ...]
    dtype: str

    @staticmethod
    def of(weights: dict[str, Tensor]) -> list[TensorSpec]:
        """The specs of `weights`, in their order (the order they are sent and received in)."""
        return [TensorSpec(n, tuple(t.shape), str(t.dtype).removeprefix("torch.")) for n, t in weights.items()]

    @staticmethod
    def wire(specs: list[TensorSpec]) -> dict[str, list]:
        """`specs` as vLLM's weight-transfer update info spells them: names, dtype_names and shapes."""
        return {
            "names": [s.name for s in specs],
            "dtype_names": [s.dtype for s in specs],
            "shapes": [list(s.shape) for s in specs],
        }

    @staticmethod
    def from_wire(names: list[str], dtype_names: list[str], shapes: list[list[int]]) -> list[TensorSpec]:
        """The specs of an update info (`wire`'s inverse)."""
        return [TensorSpec(name, tuple(shape), dtype) for name, dtype, shape in zip(names, dtype_names, shapes)]


# Each tensor starts on a multiple of this many bytes, so a view of any dtype is aligned.
_ALIGN_BYTES = 64


@dataclass(frozen=True)
class PackedWeights:
    """Weights as one flat byte buffer with each tensor's spec and byte offset: what goes in the object store.

    Ray pickles a dict of torch tensors tensor by tensor and copies each one out again on every read;
    a numpy buffer is one out-of-band object that readers on the node map without copying, and whose
    tensors are views.
    """

    specs: tuple[TensorSpec, ...]
    offsets: tuple[int, ...]
    data: np.ndarray  # uint8

    @staticmethod
    def pack(weights: dict[str, Tensor], dtype: str | None = None) -> PackedWeights:
        """Copy `weights` (any device) into one CPU buffer, in their order, cast to `dtype` (default: each
        tensor's own), one tensor at a time."""
        packed = PackedWeights.allocate(
            [
                TensorSpec(name, tuple(t.shape), dtype or str(t.dtype).removeprefix("torch."))
                for name, t in weights.items()
            ]
        )
        for index, tensor in enumerate(weights.values()):
            packed.put(index, tensor)
        return packed

    @staticmethod
    def allocate(specs: list[TensorSpec]) -> PackedWeights:
        """An empty buffer for `specs`, filled tensor by tensor with `put`: a publisher that gathers one
        parameter at a time never holds more than that parameter beside the buffer."""
        offsets, end = [], 0
        for spec in specs:
            offsets.append(end)
            nbytes = torch.Size(spec.shape).numel() * getattr(torch, spec.dtype).itemsize
            end += -(-nbytes // _ALIGN_BYTES) * _ALIGN_BYTES
        return PackedWeights(tuple(specs), tuple(offsets), np.empty(end, dtype=np.uint8))

    def put(self, index: int, tensor: Tensor) -> None:
        """Copy `tensor` (any device; cast to its spec's dtype) into its place in the buffer."""
        spec = self.specs[index]
        if tuple(tensor.shape) != spec.shape:
            raise ValueError(f"{spec.name}: shape {tuple(tensor.shape)} does not match its spec {spec.shape}")
        _view(torch.from_numpy(self.data), self.offsets[index], getattr(torch, spec.dtype), spec.shape).copy_(
            tensor.detach()
        )

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes)

    def update_info(self) -> dict[str, Any]:
        """The `stableasync_packed` engine's update info: plain lists and one uint8 tensor, which vLLM
        passes to its workers in this process as they are, and across a process boundary without pickle."""
        with warnings.catch_warnings():  # torch warns that the (read-only) array is not writable
            warnings.simplefilter("ignore", UserWarning)
            data = torch.from_numpy(self.data)
        return {**TensorSpec.wire(list(self.specs)), "offsets": list(self.offsets), "data": data}

    def tensors(self) -> dict[str, Tensor]:
        """Name -> tensor views of the buffer. Read-only when it is object-store memory: load, never modify."""
        return dict(unpack(**self.update_info()))


def _view(data: Tensor, offset: int, dtype: torch.dtype, shape: tuple[int, ...] | torch.Size) -> Tensor:
    """The tensor of `dtype` and `shape` stored at byte `offset` of the uint8 buffer `data`."""
    nbytes = torch.Size(shape).numel() * dtype.itemsize
    return data[offset : offset + nbytes].view(dtype).view(shape)


def unpack(
    names: list[str], dtype_names: list[str], shapes: list[list[int]], offsets: list[int], data: Tensor
) -> list[tuple[str, Tensor]]:
    """(name, tensor) views of a packed uint8 buffer, as `PackedWeights.update_info` describes it."""
    return [
        (spec.name, _view(data, offset, getattr(torch, spec.dtype), spec.shape))
        for spec, offset in zip(TensorSpec.from_wire(names, dtype_names, shapes), offsets)
    ]


def buckets(specs: list[TensorSpec], bucket_mb: int) -> list[list[TensorSpec]]:
    """Consecutive same-dtype groups of at most `bucket_mb` (a larger tensor gets a bucket alone)."""
    limit = bucket_mb << 20
    out: list[list[TensorSpec]] = []
    size = 0
    for spec in specs:
        nbytes = torch.Size(spec.shape).numel() * torch.empty((), dtype=getattr(torch, spec.dtype)).element_size()
        if not out or out[-1][0].dtype != spec.dtype or size + nbytes > limit:
            out.append([])
            size = 0
        out[-1].append(spec)
        size += nbytes
    return out


class CollectiveWeightSync:
    """One member of a gloo weight group: rank 0 is learner rank 0, the others generator engine workers."""

    def __init__(
        self, host: str, port: int, rank: int, world_size: int, bucket_mb: int = 512, timeout_s: float = 600.0
    ) -> None:
        timeout = timedelta(seconds=timeout_s)
        store = dist.TCPStore(host, port, world_size, is_master=rank == SOURCE_RANK, timeout=timeout)
        self.group = dist.ProcessGroupGloo(dist.PrefixStore("stableasync-weights", store), rank, world_size, timeout)
        self.device = torch.device("cpu")
        self.rank, self.bucket_mb = rank, bucket_mb
        self._store = store  # the group keeps using it

    def send(self, specs: list[TensorSpec], tensors: Iterable[Tensor]) -> int:
        """Broadcast the tensors of `specs`, taken from `tensors` in the same order and cast to each spec's
        dtype (rank 0 only): one bucket at a time, so the sender holds one bucket beside the tensor it
        reads. Returns the bytes sent."""
        if self.rank != SOURCE_RANK:
            raise RuntimeError("only the learner (rank 0) sends weights")
        stream, sent = iter(tensors), 0
        for bucket in buckets(specs, self.bucket_mb):
            flat = torch.cat(
                [next(stream).detach().to(self.device, getattr(torch, s.dtype)).reshape(-1) for s in bucket]
            )
            # torch's stubs leave out Backend.broadcast, which the C++ class binds (tensor, root)
            self.group.broadcast(flat, SOURCE_RANK).wait()  # type: ignore[attr-defined]
            sent += flat.numel() * flat.element_size()
        return sent

    def receive(self, specs: list[TensorSpec]) -> Iterator[list[tuple[str, Tensor]]]:
        """The weights of `specs` (generators), one received bucket at a time, as (name, tensor) views of it."""
        for bucket in buckets(specs, self.bucket_mb):
            sizes = [torch.Size(s.shape).numel() for s in bucket]
            flat = torch.empty(sum(sizes), dtype=getattr(torch, bucket[0].dtype), device=self.device)
            self.group.broadcast(flat, SOURCE_RANK).wait()  # type: ignore[attr-defined]  # as in send
            yield [(spec.name, part.view(spec.shape)) for spec, part in zip(bucket, torch.split(flat, sizes))]
