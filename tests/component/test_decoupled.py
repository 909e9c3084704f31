"""The decoupled objective (`algorithm.proximal: recompute`) on real DeepSpeed ranks (gloo).

Parity: one mini-batch and one epoch give today's update, stale behaviour log-probs or not. Several
updates per step: 2 ranks take the same updates as 1 rank (each global mini-batch is the same prompt
groups either way), and the trust region clips once the policy has moved.
"""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp

from tests.component.test_learner import ADAM_EPS, LEARNING_RATE, _batch_samples, _free_port, _leave_group


def _on_policy(samples: list[dict]) -> list[dict]:
    """The samples with behaviour log-probs a fixed distance from any policy's: the parity tests care only that
    both runs see the same ones."""
    return [dict(s, behaviour_logprobs=[-5.3] * len(s["completion_ids"])) for s in samples]


def _rank_main(rank: int, world: int, model_path: str, port: int, out: str, options: dict, stale: bool) -> None:
    from algorithms import registry
    from learner.batch import collate
    from learner.rank import LearnerRank, LearnerSpec

    stabilizer = registry.build("tis_token", cap=2.0)
    spec = LearnerSpec(
        model_path=model_path,
        zero_stage=2,
        learning_rate=LEARNING_RATE,
        adam_eps=ADAM_EPS,
        stabilizer_name="tis_token",
        stabilizer_config=stabilizer.config,
        loss_aggregation="token-mean",
        **options,
    )
    learner = LearnerRank(spec, rank, world, "127.0.0.1", port)
    samples = _batch_samples() if stale else _on_policy(_batch_samples())
    share = [s for s in samples if s["group_id"] % world == rank]  # whole groups per rank
    metrics = learner.train_step(collate(share, 0))
    weights = learner.state_dict_for_publish()
    if rank == 0:
        torch.save({"metrics": metrics, "weights": weights, "version": learner.version}, out)
    _leave_group()


def _run(world: int, model_path: str, out, options: dict, stale: bool = True) -> dict:
    mp.start_processes(
        _rank_main,
        args=(world, model_path, _free_port(), str(out), options, stale),
        nprocs=world,
        start_method="spawn",
        join=True,
    )
    return torch.load(out, weights_only=True)


# fresh behaviour log-probs take the same code path as stale ones: that case runs with -m slow only
@pytest.mark.parametrize("stale", [True, pytest.param(False, marks=pytest.mark.slow)])
def test_one_mini_batch_and_one_epoch_give_todays_update(tiny_qwen2, tmp_path, stale):
    plain = _run(1, tiny_qwen2, tmp_path / "plain.pt", {}, stale)
    decoupled = _run(1, tiny_qwen2, tmp_path / "decoupled.pt", {"proximal": "recompute"}, stale)
    assert decoupled["version"] == plain["version"] == 1
    assert decoupled["metrics"]["optim/updates"] == 1 and decoupled["metrics"]["stability/proximal_clip_frac"] == 0
    for key in ("optim/loss", "optim/grad_norm", "stability/ess_ratio"):
        assert decoupled["metrics"][key] == pytest.approx(plain["metrics"][key], rel=1e-6), key
    for name, tensor in plain["weights"].items():
        assert torch.allclose(decoupled["weights"][name], tensor, rtol=0, atol=1e-6 * LEARNING_RATE), name


def test_several_updates_per_step_are_the_same_on_two_ranks_and_clip_around_the_proximal_policy(tiny_qwen2, tmp_path):
    options = {
        "proximal": "recompute",
        "mini_batches": 2,
        "epochs": 2,
        "proximal_eps_low": 0.02,
        "proximal_eps_high": 0.02,
    }
    one_rank = _run(1, tiny_qwen2, tmp_path / "one.pt", options)
    two_ranks = _run(2, tiny_qwen2, tmp_path / "two.pt", options)
    for result in (one_rank, two_ranks):
        assert result["version"] == 1  # four optimizer updates, one new policy version
        assert result["metrics"]["optim/updates"] == 4 and result["metrics"]["stability/skipped_updates"] == 0
        # after the first update the policy has moved (the later updates trained) past the narrow trust region
        assert result["metrics"]["stability/proximal_clip_frac"] > 0
    assert two_ranks["metrics"]["stability/proximal_clip_frac"] == pytest.approx(
        one_rank["metrics"]["stability/proximal_clip_frac"], rel=1e-6
    )
    # each global mini-batch holds the same prompt groups on 1 and 2 ranks: reduction order is the only difference
    for name, tensor in one_rank["weights"].items():
        assert torch.allclose(two_ranks["weights"][name], tensor, rtol=0, atol=4e-4 * LEARNING_RATE), name

    def moved(a: dict, b: dict) -> int:
        return sum(int((a["weights"][n] - b["weights"][n]).abs().max() > LEARNING_RATE / 2) for n in a["weights"])

    unclipped = _run(
        1, tiny_qwen2, tmp_path / "unclipped.pt", {**options, "proximal_eps_low": 0.99, "proximal_eps_high": 100.0}
    )
    assert unclipped["metrics"]["stability/proximal_clip_frac"] == 0
    assert moved(one_rank, unclipped) > 0  # and the trust region changed what they trained
