"""What only CUDA can show: a learner rank in bf16 on one GPU, and the stabilizers on CUDA tensors.

Skipped without a CUDA device (`-m gpu` selects them; conftest skips them on CPU machines). Run them
whenever a GPU is lent: `python -m pytest -q tests/gpu`.
"""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp

from algorithms import registry
from algorithms.batch import PolicyBatch
from tests.component.test_learner import _batch_samples, _free_port

pytestmark = pytest.mark.gpu


def _cuda_rank_main(rank: int, stage: int, model_path: str, port: int, out: str) -> None:
    from learner.batch import collate
    from learner.rank import LearnerRank, LearnerSpec

    spec = LearnerSpec(model_path=model_path, zero_stage=stage, learning_rate=1e-3, stabilizer_name="tis_seq",
                       stabilizer_config=registry.build("tis_seq").config, dtype="bfloat16", backend="nccl",
                       max_tokens_per_micro_batch=48)  # several micro-batches, padded to equal counts
    learner = LearnerRank(spec, 0, 1, "127.0.0.1", port)
    batch = collate(_batch_samples(), 0)
    sft = learner.sft_step(batch, learning_rate=1e-3)
    before = learner.state_dict_for_publish()
    metrics = learner.train_step(batch)  # a CPU batch: the rank moves it to its device
    after = learner.state_dict_for_publish()
    learner.save_model(out + ".model")
    torch.save({"device": str(learner.device), "sft": sft, "metrics": metrics,
                "changed": sum(not torch.equal(before[n], after[n]) for n in before),
                "published_devices": sorted({str(t.device) for t in after.values()})}, out)


@pytest.mark.parametrize("stage", [2, 3])
def test_a_bf16_learner_rank_steps_publishes_and_saves_on_one_gpu(tiny_qwen2, tmp_path, stage):
    out = str(tmp_path / f"cuda-z{stage}.pt")
    mp.start_processes(_cuda_rank_main, args=(stage, tiny_qwen2, _free_port(), out), nprocs=1, start_method="spawn",
                       join=True)
    result = torch.load(out, weights_only=True)
    assert result["device"].startswith("cuda")
    assert result["metrics"]["perf/micro_batches"] > 1 and result["metrics"]["stability/skipped_step"] == 0
    assert all(value == value for value in result["metrics"].values() if isinstance(value, float))  # no NaN
    assert result["changed"] > 0 and result["published_devices"] == ["cpu"]


@pytest.mark.parametrize("name", sorted(registry.STABILIZERS))
def test_each_stabilizer_decides_on_cuda_as_on_cpu(name):
    gen = torch.Generator().manual_seed(0)
    behaviour = -2.0 + torch.randn(16, 32, generator=gen)
    learner = behaviour + 0.3 * torch.randn(16, 32, generator=gen)
    mask = torch.arange(32)[None, :] < torch.randint(1, 33, (16,), generator=gen)[:, None]
    advantages = torch.randn(16, generator=gen)
    stabilizer = registry.build(name)
    on_cpu = stabilizer.token_weights(PolicyBatch(learner * mask, behaviour * mask, advantages, mask))
    on_cuda = stabilizer.token_weights(PolicyBatch(*(t.cuda() for t in (learner * mask, behaviour * mask,
                                                                        advantages, mask))))
    assert on_cuda.weights.device.type == "cuda"
    assert torch.allclose(on_cuda.weights.cpu(), on_cpu.weights, rtol=1e-5, atol=1e-6)
    assert torch.equal(on_cuda.mask.cpu().bool(), on_cpu.mask.bool())
