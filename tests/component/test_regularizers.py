"""The KL term to a frozen reference and the entropy bonus, on real DeepSpeed ranks (gloo) and the tiny model.

KL: 0 at the first step (the reference is the starting policy), grows as the policy trains, trains less
far from the reference with a larger coefficient, is the same on 2 ZeRO-3 ranks as on 1, and in the reward
subtracts coef x the sampled responses' KL. Entropy: the learner's gradient is the formula's, checked
against autograd of the plain model and by finite differences.
"""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp

from tests.component.test_learner import ADAM_EPS, LEARNING_RATE, _batch_samples, _free_port, _leave_group

TEMPERATURE = 1.0


def _uniform_rewards(samples: list[dict]) -> list[dict]:
    """Every response scored alike: GRPO's advantages are all 0, so the policy gradient is 0."""
    return [dict(s, reward=1.0) for s in samples]


def _rank_main(
    rank: int, world: int, model_path: str, port: int, out: str, options: dict, steps: int, uniform: bool
) -> None:
    from algorithms import registry
    from learner.batch import collate
    from learner.rank import LearnerRank, LearnerSpec

    options = dict(options)
    stage = options.pop("zero_stage", 2)
    stabilizer = registry.build("tis_token", cap=2.0)
    spec = LearnerSpec(
        model_path=model_path,
        zero_stage=stage,
        learning_rate=LEARNING_RATE,
        adam_eps=ADAM_EPS,
        stabilizer_name="tis_token",
        stabilizer_config=stabilizer.config,
        loss_aggregation="token-mean",
        temperature=TEMPERATURE,
        **options,
    )
    learner = LearnerRank(spec, rank, world, "127.0.0.1", port)
    samples = _uniform_rewards(_batch_samples()) if uniform else _batch_samples()
    share = [s for s in samples if s["group_id"] % world == rank]  # whole groups per rank
    metrics = [learner.train_step(collate(share, 0)) for _ in range(steps)]
    weights = learner.state_dict_for_publish()
    if rank == 0:
        torch.save({"metrics": metrics, "weights": weights}, out)
    _leave_group()


def _run(world: int, model_path: str, out, options: dict, steps: int = 1, uniform: bool = False) -> dict:
    mp.start_processes(
        _rank_main,
        args=(world, model_path, _free_port(), str(out), options, steps, uniform),
        nprocs=world,
        start_method="spawn",
        join=True,
    )
    return torch.load(out, weights_only=True)


def test_kl_starts_at_zero_grows_and_holds_the_policy_nearer_the_reference(tiny_qwen2, tmp_path):
    loose = _run(1, tiny_qwen2, tmp_path / "loose.pt", {"kl_coef": 1e-6, "kl_estimator": "k3"}, steps=3)
    tight = _run(1, tiny_qwen2, tmp_path / "tight.pt", {"kl_coef": 5.0, "kl_estimator": "k3"}, steps=3)
    loose_kl, tight_kl = ([m["stability/kl_ref_mean"] for m in run["metrics"]] for run in (loose, tight))
    assert loose_kl[0] == tight_kl[0] == 0.0  # the first step's policy is the reference
    # k3's gradient is 0 at the reference, so the first update is the same with any coefficient
    assert tight_kl[1] == pytest.approx(loose_kl[1], rel=1e-5)
    assert 0 < loose_kl[1] < loose_kl[2]  # the policy trains away from the reference
    assert tight_kl[2] < min(tight_kl[1], 0.5 * loose_kl[2])  # a large coefficient pulls it back
    # the KL term is part of the reported loss
    assert tight["metrics"][2]["optim/loss"] != pytest.approx(loose["metrics"][2]["optim/loss"], rel=1e-3)


@pytest.mark.slow  # 40 s: a 2-rank ZeRO-3 run beside a 1-rank one
def test_the_kl_term_is_the_same_on_two_zero3_ranks(tiny_qwen2, tmp_path):
    """ZeRO-3 on 2 ranks: the reference is a partitioned engine, and every rank runs its forwards."""
    tight = _run(1, tiny_qwen2, tmp_path / "tight.pt", {"kl_coef": 5.0, "kl_estimator": "k3"}, steps=3)
    sharded = _run(
        2, tiny_qwen2, tmp_path / "sharded.pt", {"kl_coef": 5.0, "kl_estimator": "k3", "zero_stage": 3}, steps=3
    )
    for one, two in zip(tight["metrics"], sharded["metrics"]):
        assert two["stability/kl_ref_mean"] == pytest.approx(one["stability/kl_ref_mean"], rel=1e-3, abs=1e-9)
    for name, tensor in tight["weights"].items():
        assert torch.allclose(sharded["weights"][name], tensor, rtol=0, atol=1e-3 * LEARNING_RATE), name


def test_the_adaptive_coefficient_moves_towards_the_target(tiny_qwen2, tmp_path):
    from algorithms.regularizers import adapted_kl_coef

    run = _run(
        1,
        tiny_qwen2,
        tmp_path / "adaptive.pt",
        {"kl_coef": 0.1, "kl_estimator": "k3", "kl_target": 1.0, "kl_horizon": 16},
        steps=2,
    )
    first, second = run["metrics"]
    assert first["stability/kl_ref_coef"] == pytest.approx(0.1)
    # the first step's KL (0) is far below the target: the coefficient falls by the controller's 20% bound
    assert second["stability/kl_ref_coef"] == pytest.approx(0.1 * (1 - 0.2))
    assert adapted_kl_coef(0.1, observed_kl=3.0, target_kl=1.0, horizon=16, sequences=8) == pytest.approx(0.11)
    assert adapted_kl_coef(0.1, observed_kl=1.05, target_kl=1.0, horizon=16, sequences=16) == pytest.approx(0.105)


def _plain_model(model_path: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)


def test_kl_in_the_reward_subtracts_the_sampled_responses_kl(tiny_qwen2, tmp_path):
    from learner.batch import collate, token_logprobs

    coef = 0.5
    run = _run(1, tiny_qwen2, tmp_path / "reward.pt", {"kl_coef": coef, "kl_estimator": "k1", "kl_in": "reward"})
    batch = collate(_batch_samples(), 0)
    with torch.no_grad():
        logits = _plain_model(tiny_qwen2)(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
        reference = token_logprobs(logits, batch.input_ids, TEMPERATURE)
    sampled_kl = ((batch.behaviour_logprobs - reference) * batch.loss_mask).sum(1)  # k1 of each response
    metrics = run["metrics"][0]
    assert metrics["rollout/kl_ref_penalty_mean"] == pytest.approx(coef * float(sampled_kl.mean()), rel=1e-4)
    assert metrics["rollout/reward_mean"] == pytest.approx(float(batch.rewards.mean()))  # the task's reward


def _entropy_loss(model, batch, coef: float) -> torch.Tensor:
    """-coef x the token-mean entropy over the loss mask: the whole loss when every advantage is 0."""
    from learner.batch import token_logprobs_and_entropy

    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    entropy = token_logprobs_and_entropy(logits, batch.input_ids, TEMPERATURE)[1]
    return -coef * (entropy * batch.loss_mask).sum() / batch.loss_mask.sum()


def test_the_entropy_bonus_gradient_is_the_formulas(tiny_qwen2, tmp_path):
    from learner.batch import collate

    coef = 0.3
    bonus = _run(1, tiny_qwen2, tmp_path / "bonus.pt", {"entropy_coef": coef}, steps=2, uniform=True)
    assert bonus["metrics"][1]["stability/entropy"] > bonus["metrics"][0]["stability/entropy"]  # a bonus, not a cost
    without = _run(1, tiny_qwen2, tmp_path / "without.pt", {}, uniform=True)
    assert without["metrics"][0]["optim/grad_norm"] == 0.0  # zero advantages: nothing to train on

    model = _plain_model(tiny_qwen2)
    batch = collate(_uniform_rewards(_batch_samples()), 0)
    params = [p for p in model.parameters() if p.requires_grad]
    grads = torch.autograd.grad(_entropy_loss(model, batch, coef), params)
    norm = torch.sqrt(sum((g.double() ** 2).sum() for g in grads))
    # the learner's gradient (before clipping) is -coef x the gradient of the aggregated entropy
    assert bonus["metrics"][0]["optim/grad_norm"] == pytest.approx(float(norm), rel=1e-4)

    # finite differences of the loss along the gradient agree with its autograd slope, ||g||^2
    step = 1e-2 / float(norm)
    with torch.no_grad():
        values = []
        for sign in (1, -1):
            for p, g in zip(params, grads):
                p.add_(sign * step * g)
            values.append(float(_entropy_loss(model, batch, coef)))
            for p, g in zip(params, grads):
                p.sub_(sign * step * g)
    slope = (values[0] - values[1]) / (2 * step)
    assert slope == pytest.approx(float(norm) ** 2, rel=2e-2)


def _reference_main(rank: int, model_path: str, port: int, folder: str, out: str) -> None:
    """A KL job's warm-up, then the reference taken from the warmed-up policy (as the driver does with
    algorithm.kl.reference rl_start): the first RL step's KL, against the start-up reference and the new one."""
    from algorithms import registry
    from learner.batch import collate
    from learner.rank import LearnerRank, LearnerSpec

    spec = LearnerSpec(
        model_path=model_path,
        zero_stage=2,
        learning_rate=LEARNING_RATE,
        adam_eps=ADAM_EPS,
        stabilizer_name="tis_token",
        stabilizer_config=registry.build("tis_token").config,
        kl_coef=1e-6,
        kl_estimator="low_var+",
    )
    learner = LearnerRank(spec, rank, 1, "127.0.0.1", port)
    batch = collate(_batch_samples(), 0)
    for _ in range(3):
        learner.sft_step(batch, 1e-2)
    before = learner.train_step(batch)["stability/kl_ref_mean"]  # against model_path: the warm-up moved away
    learner.save_model(folder)
    learner.load_reference(folder)
    after = learner.train_step(batch)["stability/kl_ref_mean"]  # against the policy as it is now
    torch.save({"before": before, "after": after}, out)
    _leave_group()


def test_the_reference_can_be_the_policy_after_the_warm_up(tiny_qwen2, tmp_path):
    out = tmp_path / "reference.pt"
    mp.start_processes(
        _reference_main,
        args=(tiny_qwen2, _free_port(), str(tmp_path / "reference"), str(out)),
        nprocs=1,
        start_method="spawn",
        join=True,
    )
    result = torch.load(out, weights_only=True)
    assert result["before"] > 1e-4  # the warm-up's own distance from the loaded model
    assert result["after"] == 0.0, result  # the step starts from the reference itself
