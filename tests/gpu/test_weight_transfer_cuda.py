"""The sender side of the nccl weight sync on one GPU: learner rank 0 packs its weights on the GPU, cast to
bf16, into vLLM's double-buffered buckets and broadcasts them. A group of one member (NCCL will not put
two ranks on one GPU) makes the broadcast itself a no-op, so this checks the packing, the cast, the
device and the memory bound, not the transport. Needs vLLM and Ray besides torch and DeepSpeed."""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp

from tests.component.test_learner import _free_port

pytestmark = pytest.mark.gpu


def _sender_main(rank: int, stage: int, model_path: str, ports: tuple[int, int], out: str) -> None:
    from cluster.run.learner_group import LearnerActor
    from learner.rank import LearnerSpec

    spec = LearnerSpec(model_path=model_path, zero_stage=stage, dtype="bfloat16", backend="nccl")
    learner = LearnerActor(spec, 0, 1, "127.0.0.1", ports[0])
    learner.join_weight_transfer("127.0.0.1", ports[1], 1, "nccl")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    sent = learner.send_weights("bfloat16")
    torch.cuda.synchronize()
    largest = max(p.numel() for p in learner.engine.module.parameters()) * 4
    torch.save(
        {
            "sent": sent,
            "extra_peak": torch.cuda.max_memory_allocated() - base,
            "largest": largest,
            "expected": sum(torch.Size(s.shape).numel() for s in learner.publish_specs("bfloat16")) * 2,
        },
        out,
    )


@pytest.mark.parametrize("stage", [2, 3])
def test_rank_0_packs_bf16_buckets_on_the_gpu_within_two_buffers(tiny_qwen2, tmp_path, stage):
    pytest.importorskip("vllm")
    pytest.importorskip("ray")
    out = str(tmp_path / f"sent-z{stage}.pt")
    mp.start_processes(
        _sender_main,
        args=(stage, tiny_qwen2, (_free_port(), _free_port()), out),
        nprocs=1,
        start_method="spawn",
        join=True,
    )
    result = torch.load(out, weights_only=True)
    assert result["sent"] == result["expected"] > 0
    # vLLM's producer keeps at most two packed buckets (of up to 1 GiB plus one tensor) in flight
    assert result["extra_peak"] <= 2 * ((1 << 30) + result["largest"])
