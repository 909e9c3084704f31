"""Weights on the wire: the gloo broadcast (the CPU stand-in for vLLM's NCCL engine) and the packed buffer."""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp

from learner.ports import listenable_port
from learner.weight_sync import CollectiveWeightSync, PackedWeights, TensorSpec, buckets


def _weights() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {
        "model.embed_tokens.weight": torch.randn(300, 64, generator=gen),
        "model.norm.weight": torch.randn(64, generator=gen),
        "lm_head.weight": torch.randn(300, 64, generator=gen),
        "model.layers.0.mlp.up_proj.weight": torch.randn(128, 64, generator=gen).to(torch.bfloat16),
    }


def _member(rank: int, world: int, port: int, bucket_mb: int, out: str) -> None:
    sync = CollectiveWeightSync("127.0.0.1", port, rank, world, bucket_mb=bucket_mb)
    weights = _weights()
    specs = TensorSpec.of(weights)
    if rank == 0:
        sync.send(specs, iter(weights.values()))
    else:
        buckets_received = [[(name, tensor.clone()) for name, tensor in bucket] for bucket in sync.receive(specs)]
        torch.save(
            {
                "weights": {name: tensor for bucket in buckets_received for name, tensor in bucket},
                "bucket_sizes": [len(bucket) for bucket in buckets_received],
            },
            f"{out}.{rank}",
        )


def _broadcast(world: int, bucket_mb: int, tmp_path) -> list[dict[str, torch.Tensor]]:
    out = str(tmp_path / "received")
    mp.start_processes(
        _member, args=(world, listenable_port(), bucket_mb, out), nprocs=world, start_method="spawn", join=True
    )
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
    for result in _broadcast(3, bucket_mb, tmp_path):
        received = result["weights"]
        assert received.keys() == expected.keys()
        # the receiver holds one bucket at a time: with no room for two tensors, every tensor comes alone
        assert result["bucket_sizes"] == ([1] * len(expected) if bucket_mb == 0 else [3, 1])
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
