"""bf16 weights and compute with fp32 master weights (DeepSpeed's bf16 mode), as real models train.

An update far below bf16's resolution must still move the fp32 master copy that the optimizer keeps; the
bf16 weights the forward uses are that master rounded, so they move only once the steps add up."""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp

from tests.component.test_learner import _batch_samples, _free_port, _leave_group


def _master(optimizer) -> torch.Tensor:
    groups = getattr(optimizer, "single_partition_of_fp32_groups", None)  # ZeRO-1/2
    if groups is None:
        groups = optimizer.fp32_partitioned_groups_flat  # ZeRO-3
    return torch.cat([group.detach().reshape(-1) for group in groups])


def _bf16_main(rank: int, stage: int, model_path: str, port: int, out: str) -> None:
    from algorithms import registry
    from learner.batch import collate
    from learner.rank import LearnerRank, LearnerSpec

    spec = LearnerSpec(
        model_path=model_path,
        zero_stage=stage,
        learning_rate=1e-7,
        stabilizer_name="tis_seq",
        stabilizer_config=registry.build("tis_seq").config,
        dtype="bfloat16",
        max_tokens_per_micro_batch=100,
    )
    learner = LearnerRank(spec, rank, 1, "127.0.0.1", port)
    module_dtypes = sorted({str(p.dtype) for p in learner.engine.module.parameters()})
    master_before = _master(learner.optimizer).clone()
    weights_before = {name: tensor.clone() for name, tensor in learner.state_dict_for_publish().items()}
    metrics = learner.train_step(collate(_batch_samples(), 0))
    master_after = _master(learner.optimizer)
    weights_after = learner.state_dict_for_publish()
    changed = sum(int((weights_after[name] != tensor).sum()) for name, tensor in weights_before.items())
    torch.save(
        {
            "module_dtypes": module_dtypes,
            "master_dtype": str(master_after.dtype),
            "metrics": metrics,
            "master_moved": float((master_after != master_before).float().mean()),
            "weights_changed": changed / sum(t.numel() for t in weights_before.values()),
        },
        out,
    )
    _leave_group()


@pytest.mark.parametrize("stage", [2, 3])
def test_bf16_weights_train_through_an_fp32_master_copy(tiny_qwen2, tmp_path, stage):
    out = tmp_path / "bf16.pt"
    mp.start_processes(
        _bf16_main, args=(stage, tiny_qwen2, _free_port(), str(out)), nprocs=1, start_method="spawn", join=True
    )
    result = torch.load(out, weights_only=False)
    assert result["module_dtypes"] == ["torch.bfloat16"] and result["master_dtype"] == "torch.float32"
    assert result["metrics"]["perf/micro_batches"] > 1 and result["metrics"]["optim/grad_norm"] > 0
    # Adam's first step moves every trained entry by about the learning rate (1e-7): the master keeps it ...
    assert result["master_moved"] > 0.9, result
    # ... and bf16 (8 bits of mantissa) rounds nearly all of it away from the weights the forward uses
    assert result["weights_changed"] < 0.05, result
