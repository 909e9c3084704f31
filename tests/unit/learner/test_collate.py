"""The learner's padded batch, element by element against the samples it came from."""

import math
import random

import pytest
import torch

from learner.batch import collate, token_entropy


def _samples(seed: int, n: int = 12) -> list[dict]:
    rng = random.Random(seed)
    samples = []
    for i in range(n):
        prompt = [rng.randrange(1, 500) for _ in range(rng.randint(1, 9))]
        completion = [rng.randrange(1, 500) for _ in range(rng.randint(0, 7))]
        logprobs = [-rng.random() * 5 for _ in completion]
        samples.append(
            dict(
                prompt_ids=prompt,
                completion_ids=completion,
                behaviour_logprobs=logprobs,
                reward=rng.random(),
                group_id=i // 4,
                version=rng.randrange(5),
            )
        )
    return samples


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_every_token_lands_where_the_learner_reads_it(seed):
    samples = _samples(seed)
    batch = collate(samples, pad_token_id=-7)
    width = max(len(s["prompt_ids"]) + len(s["completion_ids"]) for s in samples)
    assert batch.input_ids.shape == (len(samples), width) and batch.input_ids.dtype == torch.long
    assert batch.loss_mask.dtype == torch.bool and batch.behaviour_logprobs.dtype == torch.float32
    for row, s in enumerate(samples):
        tokens = s["prompt_ids"] + s["completion_ids"]
        assert batch.input_ids[row].tolist() == tokens + [-7] * (width - len(tokens))
        assert batch.attention_mask[row].tolist() == [1] * len(tokens) + [0] * (width - len(tokens))
        # column t scores token t + 1: the completion's tokens are targets from the last prompt token on
        targets = {len(s["prompt_ids"]) - 1 + k: lp for k, lp in enumerate(s["behaviour_logprobs"])}
        for column in range(width - 1):
            assert bool(batch.loss_mask[row, column]) == (column in targets)
            expected = torch.tensor(targets.get(column, 0.0), dtype=torch.float32)
            assert torch.equal(batch.behaviour_logprobs[row, column], expected)
            if column in targets:
                assert batch.input_ids[row, column + 1] == tokens[column + 1]
    assert batch.rewards.tolist() == pytest.approx([s["reward"] for s in samples])
    assert batch.group_ids.tolist() == [s["group_id"] for s in samples]
    assert batch.versions.tolist() == [s["version"] for s in samples]


def test_a_sample_whose_log_probs_do_not_match_its_tokens_is_named():
    samples = _samples(3)
    samples[5]["behaviour_logprobs"] = samples[5]["behaviour_logprobs"] + [-0.1]
    with pytest.raises(ValueError, match=r"sample 5 \(group 1\)"):
        collate(samples, 0)
    with pytest.raises(ValueError, match="empty"):
        collate([], 0)


def test_token_entropy_is_the_entropy_of_each_next_token_distribution():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 6, 11, generator=gen) * 3
    logits[0, 0] = 0.0  # uniform: log V
    logits[1, 2] = torch.tensor([80.0] + [0.0] * 10)  # all mass on one token: 0
    for temperature in (1.0, 0.7):
        expected = torch.distributions.Categorical(logits=logits[:, :-1] / temperature).entropy()
        got = token_entropy(logits, temperature)
        assert got.shape == (3, 5) and not got.requires_grad
        torch.testing.assert_close(got, expected)
    assert token_entropy(logits)[0, 0].item() == pytest.approx(math.log(11))
    assert token_entropy(logits)[1, 2].item() == pytest.approx(0.0, abs=1e-6)
    assert token_entropy(logits, 0.5).mean() < token_entropy(logits, 1.0).mean() < token_entropy(logits, 2.0).mean()


def test_a_policy_mask_keeps_tool_tokens_off_the_loss_mask():
    samples = _samples(4, n=3)
    completion = samples[1]["completion_ids"]
    mask = [i % 3 != 1 for i in range(len(completion))]
    samples[1]["policy_mask"] = [int(m) for m in mask]
    batch = collate(samples, 0)
    start = len(samples[1]["prompt_ids"]) - 1
    assert batch.loss_mask[1, start : start + len(completion)].tolist() == mask
    assert batch.loss_mask[1].sum() == sum(mask) < len(completion)  # nothing else of the row is on it
    unmasked = collate([{k: v for k, v in s.items() if k != "policy_mask"} for s in samples], 0)
    assert torch.equal(batch.loss_mask[[0, 2]], unmasked.loss_mask[[0, 2]])  # the other rows as before
    samples[1]["policy_mask"] = samples[1]["policy_mask"][:-1]
    with pytest.raises(ValueError, match=r"sample 1 .* policy mask of"):
        collate(samples, 0)


def test_rank_shards_split_whole_groups_evenly_and_idle_a_rank_without_one():
    from learner.batch import rank_shards

    def group(group_id: int, size: int) -> list[dict]:
        return [
            dict(
                prompt_ids=[5, 6],
                completion_ids=[7] * (k + 1),
                behaviour_logprobs=[-1.0] * (k + 1),
                reward=1.0,
                group_id=group_id,
                version=0,
            )
            for k in range(size)
        ]

    three = rank_shards([group(0, 2), group(1, 2), group(2, 2)], 2, 0)
    assert [shard.group_ids.tolist() for shard in three] == [[0, 0, 1, 1], [2, 2]]  # no group left out
    one = rank_shards([group(7, 3)], 2, 0)
    assert one[0].group_ids.tolist() == [7, 7, 7] and one[0].loss_mask.sum() == 1 + 2 + 3
    idle = one[1]
    assert idle.size == 1 and idle.loss_mask.sum() == 0 and idle.behaviour_logprobs.abs().sum() == 0
    even = rank_shards([group(g, 1) for g in range(4)], 2, 0)
    assert [shard.group_ids.tolist() for shard in even] == [[0, 1], [2, 3]]
    with pytest.raises(ValueError, match="at least one prompt group"):
        rank_shards([], 2, 0)
