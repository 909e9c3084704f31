"""The micro-batched learner step gives the single-pass update, for every stabilizer and loss aggregation.

One process per (ranks, ZeRO stage) runs every case: a fresh LearnerRank from the same weights, one
train_step on the same prompt groups, with the whole batch in one micro-batch and with token budgets that
split it 2 and 7 ways. Splitting changes only the order of fp32 sums, so metrics agree to 1e-5 relative
and the weights to the Adam step tolerance of test_learner.py. On one rank the whole-batch step is also
checked against the loss's definition, computed here with plain autograd and no learner."""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp

from algorithms.aggregation import AGGREGATIONS
from algorithms.batch import PolicyBatch
from algorithms.registry import STABILIZERS
from tests.component.test_learner import ADAM_EPS, LEARNING_RATE, _batch_samples, _free_port, _leave_group

SPLITS = (1, 2, 7)
CONSTANT_TOKENS = 8
# the default band (0.999, 1.001) drops every sequence of this batch, and a step that trains nothing proves nothing
CONFIGS = {"mis_geo": {"low": 0.8, "high": 1.25}}
# The loss sums signed terms that cancel (a group's advantages sum to 0), so its fp32 rounding is absolute:
# about 1e-7 here, against terms of ~5 nats each. The gradient and the weights carry the relative check.
LOSS_ABS_TOLERANCE = 1e-6
COMPARED = (
    "optim/loss",
    "optim/grad_norm",
    "stability/ess_ratio",
    "stability/kl_k3",
    "stability/entropy",
    "stability/lr_scale",
)


def _budget_for(split: int, share: list[dict], keep_groups: bool) -> int | None:
    """The smallest token budget whose plan has `split` micro-batches on this share (None for 1)."""
    from learner import micro_batches
    from learner.batch import collate

    if split == 1:
        return None
    batch = collate(share, 0)
    for budget in range(int(batch.sequence_lengths.max()), batch.size * batch.input_ids.shape[1] + 1):
        # the learner packs the rows of a stabilizer without per-sample norms (keep_groups): real tokens count
        if (
            len(
                micro_batches.plan(batch.sequence_lengths, batch.group_ids, budget, keep_groups, packed=not keep_groups)
            )
            == split
        ):
            return budget
    raise AssertionError(f"no budget splits the share {split} ways")


def _near_policy_samples(model_path: str) -> list[dict]:
    """test_learner's prompt groups with behaviour log-probs near the model's own (noise of 0.2 nats per
    token), so that masking rules keep some sequences and every stabilizer's step trains."""
    from transformers import AutoModelForCausalLM

    from learner.batch import collate, token_logprobs

    samples = _batch_samples()
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    noise = torch.Generator().manual_seed(1)
    for sample in samples:
        batch = collate([sample], 0)
        with torch.no_grad():
            logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
        own = token_logprobs(logits, batch.input_ids)[batch.loss_mask]
        sample["behaviour_logprobs"] = (own + 0.2 * torch.randn(own.shape, generator=noise)).tolist()
    return samples


def _cases_main(
    rank: int, world: int, stage: int, model_path: str, port: int, out: str, names: list[str], samples: list[dict]
) -> None:
    from algorithms import registry
    from learner.batch import collate
    from learner.rank import LearnerRank, LearnerSpec

    share = [s for s in samples if s["group_id"] % world == rank]
    whole_share = [s for s in samples if s["group_id"] % world == 0]
    shared_budgets = {}  # rank 0's budgets serve every rank (one job setting); other shares split their own way
    results = {}
    for name in names:
        stabilizer = registry.build(name, **CONFIGS.get(name, {}))
        for aggregation in AGGREGATIONS:
            for split in SPLITS:
                key = (name, split, stabilizer.needs_grad_norms)
                if key not in shared_budgets:
                    shared_budgets[key] = _budget_for(split, whole_share, stabilizer.needs_grad_norms)
                spec = LearnerSpec(
                    model_path=model_path,
                    zero_stage=stage,
                    learning_rate=LEARNING_RATE,
                    adam_eps=ADAM_EPS,
                    stabilizer_name=name,
                    stabilizer_config=stabilizer.config,
                    loss_aggregation=aggregation,
                    constant_tokens=CONSTANT_TOKENS,
                    max_tokens_per_micro_batch=shared_budgets[key],
                )
                learner = LearnerRank(spec, rank, world, "127.0.0.1", port)
                metrics = learner.train_step(collate(share, 0))
                weights = learner.state_dict_for_publish()
                results[(name, aggregation, split)] = {"metrics": metrics, "weights": weights}
    if rank == 0:
        torch.save(results, out)
    _leave_group()


def _run_cases(
    world: int, stage: int, model_path: str, tmp_path, names: list[str], samples: list[dict] | None = None
) -> dict:
    out = str(tmp_path / f"cases-w{world}-z{stage}.pt")
    samples = samples or _near_policy_samples(model_path)
    mp.start_processes(
        _cases_main,
        args=(world, stage, model_path, _free_port(), out, names, samples),
        nprocs=world,
        start_method="spawn",
        join=True,
    )
    return torch.load(out, weights_only=False)


def _check_parity(results: dict) -> None:
    failures = []
    for (name, aggregation, split), result in sorted(results.items()):
        if split == 1:
            continue
        failures += _differences(
            f"{name}/{aggregation}/{split} ways",
            result["metrics"],
            result["weights"],
            results[(name, aggregation, 1)]["metrics"],
            results[(name, aggregation, 1)]["weights"],
            COMPARED,
        )
    assert not failures, "\n".join(failures)


def _differences(
    label: str, metrics: dict, weights: dict, want_metrics: dict, want_weights: dict, keys: tuple[str, ...]
) -> list[str]:
    """What differs beyond fp32 reordering: metrics to rel 1e-5 (the loss to LOSS_ABS_TOLERANCE; NaN equals
    NaN), weights to a hundredth of an Adam step."""
    failures = []
    for key in keys:
        got, want = metrics.get(key), want_metrics.get(key)
        absolute = LOSS_ABS_TOLERANCE if key == "optim/loss" else 1e-7
        if (
            want is None
            or got is None
            or not (got == pytest.approx(want, rel=1e-5, abs=absolute) or (got != got and want != want))
        ):
            failures.append(f"{label}: {key} {got} != {want}")
    for param, tensor in want_weights.items():
        if not torch.allclose(tensor, weights[param], rtol=0, atol=1e-4 * LEARNING_RATE):
            failures.append(f"{label}: weights of {param} differ")
            break
    return failures


def _reference_step(model_path: str, samples: list[dict], name: str, aggregation: str) -> dict:
    """The single-pass update computed here from its definition, without the learner: plain autograd of
    the stabilized loss over the whole batch (the denominator from the decision's mask), DeepSpeed's
    gradient clipping and AdamW's first step, lr x lr_scale x g / (|g| + eps)."""
    from transformers import AutoModelForCausalLM

    from algorithms import registry
    from algorithms.advantages import ADVANTAGES
    from algorithms.aggregation import loss_denominator, policy_loss
    from learner.batch import collate, token_logprobs
    from learner.vcpo.ghost_norms import per_sample_loop_norms

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    batch = collate(samples, 0)
    stabilizer = registry.build(name, **CONFIGS.get(name, {}))
    params = [p for p in model.parameters() if p.requires_grad]

    def logprobs_of(rows) -> torch.Tensor:
        logits = model(input_ids=rows.input_ids, attention_mask=rows.attention_mask).logits
        return token_logprobs(logits, rows.input_ids)

    logprobs = logprobs_of(batch)
    log_w = ((logprobs.detach() - batch.behaviour_logprobs) * batch.loss_mask).sum(1)
    lengths = batch.loss_mask.sum(1).float()
    norms = None
    if stabilizer.needs_grad_norms:

        def sample_logp(i: int) -> torch.Tensor:
            row = batch.rows(torch.tensor([i]))
            return (logprobs_of(row) * row.loss_mask).sum()

        norms = per_sample_loop_norms(sample_logp, batch.size, params)
    advantages = stabilizer.advantages(batch.rewards, log_w, norms, batch.group_ids, lengths)
    if advantages is None:
        advantages = ADVANTAGES["grpo"](batch.rewards, batch.group_ids)
    policy = PolicyBatch(logprobs, batch.behaviour_logprobs, advantages, batch.loss_mask)
    decision = stabilizer.token_weights(policy)
    denominator = loss_denominator(decision.mask, aggregation, CONSTANT_TOKENS)
    loss = policy_loss(policy, decision, aggregation, denominator, CONSTANT_TOKENS)
    grads = torch.autograd.grad(loss, params)
    norm = torch.sqrt(sum(g.double().square().sum() for g in grads)).item()
    clip = max(1.0, (norm + 1e-6) / 1.0)  # LearnerSpec.grad_clip 1.0, as ZeRO clips
    lr = LEARNING_RATE * stabilizer.lr_scale(policy.seq_log_ratio[policy.token_lengths > 0])
    with torch.no_grad():
        for param, grad in zip(params, grads):
            clipped = grad / clip
            param -= lr * clipped / (clipped.abs() + ADAM_EPS)
    return {"optim/grad_norm": norm, "optim/loss": float(loss.detach()), "weights": model.state_dict()}


def _check_against_the_definition(results: dict, model_path: str, samples: list[dict]) -> None:
    failures = []
    for (name, aggregation, split), result in sorted(results.items()):
        if split != 1:
            continue
        reference = _reference_step(model_path, samples, name, aggregation)
        failures += _differences(
            f"{name}/{aggregation} against the definition",
            result["metrics"],
            result["weights"],
            reference,
            reference["weights"],
            ("optim/grad_norm", "optim/loss"),
        )
    assert not failures, "\n".join(failures)


def _all_moved(results: dict, model_path: str) -> None:
    """The reference steps trained (a parity of steps that did nothing would prove nothing)."""
    from transformers import AutoModelForCausalLM

    initial = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).state_dict()
    for (name, aggregation, split), result in results.items():
        if split == 1 and result["metrics"]["stability/skipped_step"] == 0:
            moved = sum(not torch.equal(initial[p], t) for p, t in result["weights"].items())
            assert moved > 0, f"{name}/{aggregation}: the step left every weight as it was"


# ZeRO-3 gathers every parameter in each forward and is slow on CPU: the slow suite covers it, with one rule of
# each kind (one pass, the no-grad pass, per-sample norms) and with every rule; the default run's ZeRO-3 checks
# are tests/component/test_learner.py's rank and stage parity.
ZERO3_KINDS = ["tis_seq", "m2po", "vcpo"]
# On 2 ranks the default run takes every rule that decides on the whole batch (a no-grad pass whose statistics
# the ranks share: BAPO, M2PO, MIS), VCPO (per-sample norms, an ESS over both ranks) and one rule per row; the
# other per-row rules run the same code on 2 ranks, checked with every rule in the slow suite.
TWO_RANK_KINDS = ["bapo", "m2po", "mis_seq", "tis_seq", "vcpo"]


@pytest.mark.timeout(300)  # a rank waiting in a collective the other never calls fails here
@pytest.mark.parametrize(
    "world, stage, names",
    [
        (1, 2, sorted(STABILIZERS)),
        (2, 2, TWO_RANK_KINDS),
        pytest.param(2, 2, sorted(STABILIZERS), marks=pytest.mark.slow),
        pytest.param(2, 3, ZERO3_KINDS, marks=pytest.mark.slow),
    ],
)  # 30 s on 1 rank
def test_every_stabilizer_and_aggregation_gives_the_single_pass_update(tiny_qwen2, tmp_path, world, stage, names):
    samples = _near_policy_samples(tiny_qwen2)
    results = _run_cases(world, stage, tiny_qwen2, tmp_path, names, samples)
    assert len(results) == len(names) * len(AGGREGATIONS) * len(SPLITS)
    _all_moved(results, tiny_qwen2)
    _check_parity(results)
    if world == 1:  # the whole-batch step is the loss's definition (2 ranks: test_learner's rank parity)
        _check_against_the_definition(results, tiny_qwen2, samples)


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("world, stage", [(1, 3), (2, 3)])
def test_every_stabilizer_gives_the_single_pass_update_under_zero3(tiny_qwen2, tmp_path, world, stage):
    results = _run_cases(world, stage, tiny_qwen2, tmp_path, sorted(STABILIZERS))
    _all_moved(results, tiny_qwen2)
    _check_parity(results)


def _late_nonfinite_main(rank: int, world: int, stage: int, name: str, model_path: str, port: int, out: str) -> None:
    """A NaN behaviour log-prob in the shortest sequence, which runs in the last micro-batch: earlier
    micro-batches have accumulated their gradients by then. The step must drop them all, and the next
    clean step must equal a fresh learner's first (the optimizer state never saw the poisoned gradient)."""
    from algorithms import registry
    from learner.batch import collate
    from learner.rank import LearnerRank, LearnerSpec

    clean = [s for s in _batch_samples() if s["group_id"] % world == rank]
    corrupt = [dict(s, behaviour_logprobs=list(s["behaviour_logprobs"])) for s in clean]
    if rank == 0:
        corrupt[0]["behaviour_logprobs"][0] = float("nan")  # group 0's shortest response
    budget = _budget_for(7, clean, keep_groups=False)

    def learner() -> LearnerRank:
        spec = LearnerSpec(
            model_path=model_path,
            zero_stage=stage,
            learning_rate=LEARNING_RATE,
            adam_eps=ADAM_EPS,
            stabilizer_name=name,
            stabilizer_config=registry.build(name).config,
            max_tokens_per_micro_batch=budget,
        )
        return LearnerRank(spec, rank, world, "127.0.0.1", port)

    poisoned = learner()
    before = poisoned.state_dict_for_publish()
    skipped = poisoned.train_step(collate(corrupt, 0))
    unchanged = poisoned.state_dict_for_publish()
    after_skip = poisoned.train_step(collate(clean, 0))
    continued = poisoned.state_dict_for_publish()
    fresh = learner()
    first = fresh.train_step(collate(clean, 0))
    reference = fresh.state_dict_for_publish()
    if rank == 0:
        torch.save(
            {
                "skipped": skipped,
                "after_skip": after_skip,
                "first": first,
                "version": poisoned.version,
                "changed_by_skip": [n for n in before if not torch.equal(before[n], unchanged[n])],
                "differs_from_fresh": [
                    n
                    for n in reference
                    if not torch.allclose(reference[n], continued[n], rtol=0, atol=1e-4 * LEARNING_RATE)
                ],
            },
            out,
        )
    _leave_group()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world, stage, name", [(1, 2, "tis_seq"), (2, 3, "tis_seq"), (2, 2, "m2po"), (1, 2, "vcpo")])
def test_a_non_finite_micro_batch_drops_the_whole_step_and_nothing_it_accumulated(
    tiny_qwen2, tmp_path, world, stage, name
):
    out = str(tmp_path / "late.pt")
    mp.start_processes(
        _late_nonfinite_main,
        args=(world, stage, name, tiny_qwen2, _free_port(), out),
        nprocs=world,
        start_method="spawn",
        join=True,
    )
    result = torch.load(out, weights_only=True)
    assert result["skipped"]["stability/skipped_step"] == 1 and result["skipped"]["perf/micro_batches"] > 1
    assert result["changed_by_skip"] == []
    assert result["after_skip"]["stability/skipped_step"] == 0 and result["version"] == 1
    assert result["after_skip"]["optim/grad_norm"] == pytest.approx(result["first"]["optim/grad_norm"], rel=1e-5)
    assert result["differs_from_fresh"] == []


def _checkpointing_main(rank: int, model_path: str, port: int, out: str, samples: list[dict]) -> None:
    """The same step with and without gradient checkpointing, in 2 micro-batches, for a one-pass rule, a
    two-pass one and VCPO's recorded forward (whose hooks must not see the backward's recomputation)."""
    from algorithms import registry
    from learner.batch import collate
    from learner.rank import LearnerRank, LearnerSpec

    budget = _budget_for(2, samples, keep_groups=True)
    results = {}
    for name in ("tis_seq", "m2po", "vcpo"):
        for checkpointing in (False, True):
            spec = LearnerSpec(
                model_path=model_path,
                zero_stage=2,
                learning_rate=LEARNING_RATE,
                adam_eps=ADAM_EPS,
                stabilizer_name=name,
                stabilizer_config=registry.build(name).config,
                max_tokens_per_micro_batch=budget,
                gradient_checkpointing=checkpointing,
            )
            learner = LearnerRank(spec, rank, 1, "127.0.0.1", port)
            metrics = learner.train_step(collate(samples, 0))
            results[(name, checkpointing)] = {"metrics": metrics, "weights": learner.state_dict_for_publish()}
    torch.save(results, out)


def test_gradient_checkpointing_gives_the_same_update(tiny_qwen2, tmp_path):
    out = str(tmp_path / "checkpointing.pt")
    samples = _near_policy_samples(tiny_qwen2)
    mp.start_processes(
        _checkpointing_main, args=(tiny_qwen2, _free_port(), out, samples), nprocs=1, start_method="spawn", join=True
    )
    results = torch.load(out, weights_only=False)
    # the parity check compares split 2 against split 1: here "split" 1 is checkpointing off
    _check_parity({(name, "token-mean", 2 if on else 1): result for (name, on), result in results.items()})
    assert results[("vcpo", True)]["metrics"]["opob/sample_grad_norm_mean"] == pytest.approx(
        results[("vcpo", False)]["metrics"]["opob/sample_grad_norm_mean"], rel=1e-5
    )


@pytest.mark.timeout(300)
def test_vcpo_auto_keeps_per_sample_gradients_only_for_micro_batches_within_its_budget(tiny_qwen2, tmp_path):
    """opob_impl auto with a budget between what the step's two micro-batches would keep: one takes
    book-keeping, the other the ghost backward, in the same step, and the update is the one that either
    path alone gives. (2 ranks with book-keeping: test_learner.py.)"""
    from transformers import AutoModelForCausalLM

    from learner import micro_batches
    from learner.batch import collate
    from learner.vcpo.ghost_norms import GhostGradNorms

    samples = _near_policy_samples(tiny_qwen2)
    whole = collate(samples, 0)
    tokens = _budget_for(2, samples, keep_groups=True)
    norms = GhostGradNorms(AutoModelForCausalLM.from_pretrained(tiny_qwen2, dtype=torch.float32))
    # what each micro-batch keeps as the learner runs it: packed, each row bucket at its own width
    cost = norms.bucket_cost(torch.device("cpu"))
    plan = micro_batches.plan(whole.sequence_lengths, whole.group_ids, tokens, True, packed=True, bucket_cost=cost)
    kept_mb = sorted(
        sum(len(bucket.rows) * norms.kept_bytes_per_sample(bucket.width) for bucket in run.packing.buckets) / 2**20
        for run in plan.micro_batches
    )
    assert len(kept_mb) == 2 and kept_mb[0] < kept_mb[1], kept_mb
    out = str(tmp_path / "auto.pt")
    cases = {impl: (impl, tokens, sum(kept_mb) / 2) for impl in ("ghost", "bookkeeping", "auto")}
    mp.start_processes(
        _vcpo_cases_main,
        args=(1, tiny_qwen2, _free_port(), out, samples, cases),
        nprocs=1,
        start_method="spawn",
        join=True,
    )
    results = torch.load(out, weights_only=False)
    assert results["ghost"]["metrics"]["opob/bookkeeping_share"] == 0.0
    assert results["bookkeeping"]["metrics"]["opob/bookkeeping_share"] == 1.0
    assert 0.0 < results["auto"]["metrics"]["opob/bookkeeping_share"] < 1.0
    failures = []
    for impl in ("bookkeeping", "auto"):
        failures += _differences(
            impl,
            results[impl]["metrics"],
            results[impl]["weights"],
            results["ghost"]["metrics"],
            results["ghost"]["weights"],
            (*COMPARED, "opob/baseline_mean", "opob/sample_grad_norm_mean"),
        )
    assert not failures, "\n".join(failures)


def _vcpo_cases_main(
    rank: int,
    world: int,
    model_path: str,
    port: int,
    out: str,
    samples: list[dict],
    cases: dict[str, tuple[str, int | None, float]],
) -> None:
    """One VCPO step per case, label: (opob_impl, token budget, bookkeeping_budget_mb), ZeRO-2."""
    from algorithms import registry
    from learner.batch import collate
    from learner.rank import LearnerRank, LearnerSpec

    share = collate([s for s in samples if s["group_id"] % world == rank], 0)
    results = {}
    for label, (impl, tokens, budget_mb) in cases.items():
        config = registry.build("vcpo", opob_impl=impl, bookkeeping_budget_mb=budget_mb).config
        spec = LearnerSpec(
            model_path=model_path,
            zero_stage=2,
            learning_rate=LEARNING_RATE,
            adam_eps=ADAM_EPS,
            stabilizer_name="vcpo",
            stabilizer_config=config,
            loss_aggregation="seq-mean-token-mean",
            max_tokens_per_micro_batch=tokens,
        )
        learner = LearnerRank(spec, rank, world, "127.0.0.1", port)
        results[label] = {"metrics": learner.train_step(share), "weights": learner.state_dict_for_publish()}
    if rank == 0:
        torch.save(results, out)
    _leave_group()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [1, 2])
def test_vcpo_carries_a_group_split_across_micro_batches_in_one_pass(tiny_qwen2, tmp_path, world):
    """Budgets of two rows and of one row split every prompt group into pieces: book-keeping trains each
    piece in one forward, the group's baseline part waiting in the score buffer until its last piece, and
    the update is the whole-batch step's. A budget too small for the score buffer takes the two-pass
    ghost step instead, with the same update."""
    from transformers import AutoModelForCausalLM

    from learner.batch import collate

    samples = _near_policy_samples(tiny_qwen2)
    longest = int(collate(samples, 0).sequence_lengths.max())
    model = AutoModelForCausalLM.from_pretrained(tiny_qwen2, dtype=torch.float32)
    score_buffer_mb = 4 * sum(p.numel() for p in model.parameters()) / 2**20
    cases = {
        "whole": ("auto", None, 1024),
        "two rows": ("bookkeeping", 2 * longest, 1024),
        "one row": ("bookkeeping", longest, 1024),
        "auto": ("auto", 2 * longest, 1024),
        "ghost": ("ghost", 2 * longest, 1024),
        "buffer over budget": ("auto", 2 * longest, score_buffer_mb / 2),
    }
    out = str(tmp_path / "carried.pt")
    mp.start_processes(
        _vcpo_cases_main,
        args=(world, tiny_qwen2, _free_port(), out, samples, cases),
        nprocs=world,
        start_method="spawn",
        join=True,
    )
    results = torch.load(out, weights_only=False)
    groups_per_rank = len({s["group_id"] for s in samples}) / world
    for label in ("two rows", "one row", "auto"):
        metrics = results[label]["metrics"]
        assert metrics["perf/learner_passes"] == 1 and metrics["opob/carried_groups"] == groups_per_rank, label
    for label in ("ghost", "buffer over budget"):
        metrics = results[label]["metrics"]
        assert metrics["perf/learner_passes"] == 2 and metrics["opob/carried_groups"] == 0, label
    failures = []
    for label in ("two rows", "one row", "auto", "ghost", "buffer over budget"):
        failures += _differences(
            label,
            results[label]["metrics"],
            results[label]["weights"],
            results["whole"]["metrics"],
            results["whole"]["weights"],
            (*COMPARED, "opob/baseline_mean", "opob/baseline_shift_abs", "opob/sample_grad_norm_mean"),
        )
    assert not failures, "\n".join(failures)
