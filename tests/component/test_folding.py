"""VCPO's folded book-keeping on a whole step: one backward through the model per micro-batch (carried pieces of
split groups included) and about a plain step's FLOPs, counted with `FlopCounterMode` as the benchmark does, where
the ghost path takes two backwards and about 1.8x."""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp

from tests.component.test_learner import _free_port, _leave_group

CASES = {"tis_seq": ("tis_seq", {}), "folded": ("vcpo", {"opob_impl": "bookkeeping"}), "ghost": ("vcpo", {})}


def _main(rank: int, model_path: str, port: int, out: str) -> None:
    from algorithms import registry
    from benchmarks.learner_step import synthetic_batch
    from learner.rank import LearnerRank, LearnerSpec

    results = {}
    for label, (name, config) in CASES.items():
        config = {**config, "opob_impl": "ghost"} if label == "ghost" else config
        spec = LearnerSpec(
            model_path=model_path,
            zero_stage=2,
            stabilizer_name=name,
            stabilizer_config=registry.build(name, **config).config,
            loss_aggregation="seq-mean-token-mean",
            max_tokens_per_micro_batch=256,  # four micro-batches, two of them pieces of split groups
        )
        learner = LearnerRank(spec, rank, 1, "127.0.0.1", port)
        batch = synthetic_batch(16, 40, learner.engine.module.config.vocab_size)
        learner.train_step(batch)  # the first step's one-time work out of the count
        results[label] = _counted(learner, batch)
    torch.save(results, out)
    _leave_group()


def _counted(learner, batch) -> dict:
    """One step's FLOPs, backwards through the model and metrics."""
    from benchmarks.step_measures import counted_step

    metrics: dict = {}
    flops, backwards = counted_step(learner.engine.module, lambda: metrics.update(learner.train_step(batch)))
    return {"flops": flops, "backwards": backwards, "metrics": metrics}


@pytest.mark.timeout(300)
def test_a_folded_vcpo_step_is_one_backward_per_micro_batch_at_about_a_plain_steps_flops(tiny_qwen2, tmp_path):
    out = tmp_path / "folding.pt"
    mp.start_processes(_main, args=(tiny_qwen2, _free_port(), str(out)), nprocs=1, start_method="spawn", join=True)
    results = torch.load(out, weights_only=False)
    plain, folded, ghost = results["tis_seq"], results["folded"], results["ghost"]
    micro_batches = folded["metrics"]["perf/micro_batches"]
    assert folded["metrics"]["opob/folded_share"] == 1.0 and folded["metrics"]["opob/carried_groups"] > 0
    assert folded["backwards"] == micro_batches
    assert ghost["backwards"] == 2 * ghost["metrics"]["perf/micro_batches"]
    assert folded["flops"] <= 1.15 * plain["flops"] < ghost["flops"], folded["flops"] / plain["flops"]
