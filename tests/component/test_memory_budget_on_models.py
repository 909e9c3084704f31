"""`learner.max_tokens_per_micro_batch: auto` on a real rank: it resolves to a budget that it logs and trains
with, and the memory model it comes from covers the measured peak of a step without overstating it much."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.multiprocessing as mp

from tests.component.test_learner import _batch_samples, _free_port

SEQUENCE_TOKENS = 128


def _auto_main(rank: int, model_path: str, port: int, out: str) -> None:
    from algorithms import registry
    from learner.batch import collate
    from learner.rank import LearnerRank, LearnerSpec

    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())
    logger = logging.getLogger("stableasync.learner")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    spec = LearnerSpec(
        model_path=model_path,
        zero_stage=2,
        stabilizer_name="vcpo",
        stabilizer_config=registry.build("vcpo").config,
        max_tokens_per_micro_batch="auto",
        max_sequence_tokens=SEQUENCE_TOKENS,
    )
    learner = LearnerRank(spec, rank, 1, "127.0.0.1", port)
    metrics = learner.train_step(collate(_batch_samples(), 0))
    torch.save(
        {
            "tokens": learner.micro_batch_tokens,
            "why": learner.micro_batch_budget.why,
            "log": records,
            "metrics": metrics,
            "version": learner.version,
        },
        out,
    )


@pytest.mark.timeout(300)
def test_an_auto_budget_resolves_to_tokens_that_the_rank_logs_and_trains_with(tiny_qwen2, tmp_path):
    out = str(tmp_path / "auto.pt")
    mp.start_processes(_auto_main, args=(tiny_qwen2, _free_port(), out), nprocs=1, start_method="spawn", join=True)
    result = torch.load(out, weights_only=False)
    assert isinstance(result["tokens"], int) and result["tokens"] >= SEQUENCE_TOKENS
    assert result["why"].startswith(
        f"{result['tokens']} tokens per micro-batch (learner.max_tokens_per_micro_batch auto): 50% of "
    )
    assert "MiB per token" in result["why"]
    assert f"learner rank 0: {result['why']}" in result["log"]
    assert result["version"] == 1 and result["metrics"]["stability/skipped_step"] == 0
    assert result["metrics"]["perf/micro_batches"] == 1  # the tiny model's 16 rows fit a budget of this machine


def _calibration_main(
    rank: int, model_path: str, port: int, out: str, name: str, tokens: int, sequences: int, checkpointing: bool
) -> None:
    """Two steps from a fresh rank, the peak resident-set growth over both from right after the rank is
    built (the first step creates the optimizer's moments), beside the estimate for its micro-batch."""
    from algorithms import registry
    from benchmarks.learner_step import synthetic_batch
    from benchmarks.step_measures import follow_live_memory, peak_growth
    from learner import memory_budget
    from learner.rank import LearnerRank, LearnerSpec

    follow_live_memory()  # before the rank is built, so none of its blocks sit on glibc's heap

    spec = LearnerSpec(
        model_path=model_path,
        zero_stage=2,
        stabilizer_name=name,
        stabilizer_config=registry.build(name).config,
        max_tokens_per_micro_batch=sequences * tokens,
        max_sequence_tokens=tokens,
        gradient_checkpointing=checkpointing,
    )
    learner = LearnerRank(spec, rank, 1, "127.0.0.1", port)
    module = learner.engine.module
    batch = synthetic_batch(sequences, tokens, module.config.vocab_size)
    trained = sum(p.numel() for p in module.parameters() if p.requires_grad)
    memory = memory_budget.step_memory(
        memory_budget.ModelShape.from_config(module.config),
        4,
        trained,
        tokens,
        gradient_checkpointing=checkpointing,
        per_sample_norms=learner.stabilizer.needs_grad_norms,
        kept_gradient_cap_bytes=learner.norms.bookkeeping_budget.bytes_for(sequences * tokens)
        if learner.norms and learner.norms.bookkeeping
        else 0.0,
        later_bytes=memory_budget.unallocated_adam_bytes(learner.engine, trained, 2, 1),
        fused_head=learner.forwards.head is not None,
    )
    metrics: list[dict[str, float]] = []
    peak = peak_growth(lambda: metrics.extend(learner.train_step(batch) for _ in range(2)))
    torch.save(
        {
            "peak": peak,
            "estimate": memory.bytes_for(sequences * tokens),
            "micro_batches": [m["perf/micro_batches"] for m in metrics],
        },
        out,
    )


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name, checkpointing", [("tis_seq", False), ("vcpo", False), ("tis_seq", True)])
def test_the_estimate_covers_the_measured_peak_of_a_step_and_not_by_much(tiny_qwen2, tmp_path, name, checkpointing):
    """One micro-batch of 64 rows x 128 tokens: the estimate is at least the step's peak growth and not far
    above it (measured 2026-11-28: 1.66x for tis_seq, 2.37x for vcpo, whose estimate counts the whole cap on
    kept gradients, 2.06x with checkpointing; the peak is exact and repeats within 1%, docs/performance.md,
    "Choosing the budget")."""
    out = str(tmp_path / "calibration.pt")
    mp.start_processes(
        _calibration_main,
        args=(tiny_qwen2, _free_port(), out, name, SEQUENCE_TOKENS, 64, checkpointing),
        nprocs=1,
        start_method="spawn",
        join=True,
    )
    result = torch.load(out, weights_only=True)
    assert result["micro_batches"] == [1, 1]
    assert result["peak"] <= result["estimate"] <= 2.5 * result["peak"], result
