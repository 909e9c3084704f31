"""The vLLM worker side of the weight transfer: our engines in vLLM's weight-transfer factory.

Every generator loads new weights through vLLM's own weight-transfer lifecycle (`start_weight_update`,
`update_weights`, `finish_weight_update`), whatever carries them:

- `nccl` (vLLM's engine): GPU to GPU from learner rank 0, the GPU cluster path;
- `stableasync_packed`: one `PackedWeights` buffer from Ray's object store, the default path, which
  needs no group and so lets generators join and leave;
- `stableasync_gloo`: a gloo broadcast from learner rank 0, the same protocol and rank layout as the
  nccl path on CPU, so that CPU tests exercise the collective path end to end.

vLLM imports this module into each worker by dotted path (`worker_extension_cls`) before it loads the
model and creates the engine, so importing it registers the engines in every worker process, and keeps
vLLM's per-reload log lines quiet there: a streaming generator's engine core is a process of its own.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import WeightTransferEngine, WeightTransferInitInfo, WeightTransferUpdateInfo
from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

from actors.vllm_logs import quiet_per_reload_logs, quieted_loggers

PACKED_BACKEND = "stableasync_packed"
GLOO_BACKEND = "stableasync_gloo"


@dataclass
class NoInitInfo(WeightTransferInitInfo):
    """The object-store engine joins no group."""


@dataclass
class PackedUpdateInfo(WeightTransferUpdateInfo):
    """`PackedWeights.update_info`: each tensor's name, dtype, shape and byte offset in `data`."""

    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]
    offsets: list[int]
    data: Any  # [bytes] uint8 tensor, or the bytes themselves when it crossed into another process


@dataclass(kw_only=True)
class GlooInitInfo(WeightTransferInitInfo):
    """Where learner rank 0 hosts the group, and this engine's first rank in it (as vLLM's nccl engine)."""

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    bucket_mb: int = 512


@dataclass
class SpecsUpdateInfo(WeightTransferUpdateInfo):
    """What the next broadcast carries, in its order (the fields of vLLM's nccl update info)."""

    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]


def _model(engine: WeightTransferEngine) -> Any:
    """The engine's vLLM model, whose `load_weights` takes (checkpoint name, tensor) pairs (torch's Module
    type does not declare it)."""
    return engine.model


class _CheckpointFormatEngine(WeightTransferEngine):
    """Checkpoint-named tensors into the model through vLLM's layerwise reload, as its nccl engine does:
    each layer is processed as soon as all its tensors have arrived."""

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)

    def update_weights(self, update_info: dict[str, Any]) -> None:
        """The base class's, without its device synchronisation on a CPU worker (where it raises)."""
        self.receive_weights(self.parse_update_info(update_info))
        if self.device.type != "cpu":
            torch.accelerator.synchronize()

    def shutdown(self) -> None:
        return None


class PackedEngine(_CheckpointFormatEngine):
    init_info_cls = NoInitInfo
    update_info_cls = PackedUpdateInfo

    def init_transfer_engine(self, init_info: NoInitInfo) -> None:
        return None

    def receive_weights(self, update_info: PackedUpdateInfo) -> None:
        from learner.weight_sync import unpack

        data = update_info.data
        if not isinstance(data, torch.Tensor):  # bytes: the update crossed into an engine-core process
            with warnings.catch_warnings():  # torch warns that the received bytes are read-only; they are read
                warnings.simplefilter("ignore", UserWarning)
                data = torch.frombuffer(data, dtype=torch.uint8)
        _model(self).load_weights(
            unpack(update_info.names, update_info.dtype_names, update_info.shapes, update_info.offsets, data)
        )


class GlooEngine(_CheckpointFormatEngine):
    init_info_cls = GlooInitInfo
    update_info_cls = SpecsUpdateInfo
    sync: Any = None

    def init_transfer_engine(self, init_info: GlooInitInfo) -> None:
        from learner.weight_sync import CollectiveWeightSync

        parallel = self.parallel_config
        rank = parallel.data_parallel_index * parallel.world_size + parallel.rank + init_info.rank_offset
        self.sync = CollectiveWeightSync(
            init_info.master_address, init_info.master_port, rank, init_info.world_size, bucket_mb=init_info.bucket_mb
        )

    def receive_weights(self, update_info: SpecsUpdateInfo) -> None:
        from learner.weight_sync import TensorSpec

        if self.sync is None:
            raise RuntimeError("the gloo weight transfer was not initialised (init_weight_transfer_engine first)")
        specs = TensorSpec.from_wire(update_info.names, update_info.dtype_names, update_info.shapes)
        for bucket in self.sync.receive(specs):  # one bucket's tensors at a time, loaded as they arrive
            _model(self).load_weights(bucket)

    def shutdown(self) -> None:
        self.sync = None


def register_engines() -> None:
    """Ours in vLLM's factory, once per process (the factory refuses a name twice)."""
    for name, engine in ((PACKED_BACKEND, PackedEngine), (GLOO_BACKEND, GlooEngine)):
        if name not in WeightTransferEngineFactory._registry:
            WeightTransferEngineFactory.register_engine(name, engine)


register_engines()
quiet_per_reload_logs()


class WeightUpdateExtension:
    """Mixed into the vLLM worker; importing it is what registers the engines above in the worker."""

    def quieted_loggers(self) -> tuple[int, list[str]]:
        """This worker's process and its quieted per-reload loggers (a test asks through collective_rpc)."""
        return os.getpid(), quieted_loggers()
