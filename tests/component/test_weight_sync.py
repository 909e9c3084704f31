"""The collective weight broadcast: the same code over gloo on CPU here, over NCCL on GPUs."""

from __future__ import annotations

import socket

import pytest
import torch
import torch.multiprocessing as mp

from learner.weight_sync import CollectiveWeightSync, PackedWeights, TensorSpec, buckets


def _weights() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {
        "model.embed_tokens.weight": torch.randn(300, 64, generator=gen),
        "model.norm.weight": torch.randn(64, generator=gen),
        "lm_head.weight": torch.randn(300, 64, generator=gen),
        "model.layers.0.mlp.up_proj.weight": torch.randn(128, 64, generator=gen).to(torch.bfloat16),
    }


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _member(rank: int, world: int, port: int, backend: str, bucket_mb: int, out: str) -> None:
    device = f"cuda:{rank}" if backend == "nccl" else "cpu"
    if backend == "nccl":
        torch.cuda.set_device(rank)
    sync = CollectiveWeightSync("127.0.0.1", port, rank, world, backend=backend, device=device, bucket_mb=bucket_mb)
    weights = _weights()
    if rank == 0:
        sync.send(weights)
    else:
        got = sync.receive(TensorSpec.of(weights))
        torch.save({k: v.cpu() for k, v in got.items()}, f"{out}.{rank}")


def _broadcast(world: int, backend: str, bucket_mb: int, tmp_path) -> list[dict[str, torch.Tensor]]:
    out = str(tmp_path / "received")
    mp.start_processes(_member, args=(world, _free_port(), backend, bucket_mb, out), nprocs=world,
                       start_method="spawn", join=True)
    return [torch.load(f"{out}.{rank}", weights_only=True) for rank in range(1, world)]


def test_buckets_split_by_size_and_dtype():
    specs = TensorSpec.of(_weights())
    groups = buckets(specs, bucket_mb=0)  # every tensor alone
    assert [len(g) for g in groups] == [1, 1, 1, 1]
    groups = buckets(specs, bucket_mb=64)
    assert all(len({s.dtype for s in g}) == 1 for g in groups)
    assert sum(len(g) for g in groups) == len(specs)


@pytest.mark.parametrize("bucket_mb", [0, 64])
def test_gloo_broadcast_delivers_exact_weights_to_every_generator(tmp_path, bucket_mb):
    expected = _weights()
    for received in _broadcast(3, "gloo", bucket_mb, tmp_path):
        assert received.keys() == expected.keys()
        for name, tensor in expected.items():
            assert received[name].dtype == tensor.dtype and torch.equal(received[name], tensor), name


def test_packed_weights_cross_the_object_store_exactly_and_are_mapped_not_copied():
    import ray

    expected = _weights()
    ray.init(address="local", num_cpus=1, include_dashboard=False, namespace="test-packed-weights")
    try:
        received = ray.get(ray.put(PackedWeights.pack(expected)))
        assert not received.data.flags.writeable  # a view of object-store memory, not a private copy
        tensors = received.tensors()
        assert list(tensors) == list(expected)  # the learner's order, which vLLM's loader sees
        for name, tensor in expected.items():
            assert tensors[name].dtype == tensor.dtype and torch.equal(tensors[name], tensor), name
    finally:
        ray.shutdown()


def test_unknown_backend_is_refused():
    with pytest.raises(ValueError, match="unknown weight-sync backend"):
        CollectiveWeightSync("127.0.0.1", _free_port(), 0, 1, backend="mpi")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_nccl_broadcast_delivers_exact_weights(tmp_path):
    expected = _weights()
    (received,) = _broadcast(2, "nccl", 64, tmp_path)
    for name, tensor in expected.items():
        assert torch.equal(received[name], tensor), name
