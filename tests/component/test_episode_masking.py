"""Tool-result tokens of a multi-turn episode are context only: off the loss, every importance ratio and the ESS.

One real learner rank (DeepSpeed over gloo, the tiny model) at learning rate 0, so every step sees the same
weights: garbage behaviour log-probs on the tool tokens, and other tool tokens where nothing of the policy's
comes after them, leave the loss, the gradient norm and the ESS exactly as they were; training the same tokens
with no policy mask changes them (so the comparison can fail).
"""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp

from tests.component.test_learner import _free_port, _leave_group

TOOL_TOKENS = 4


def _episodes(garbage_tool_tokens: bool) -> list[dict]:
    """4 groups of 4 episodes: a policy turn, a tool result, a policy turn, a trailing tool result."""
    gen = torch.Generator().manual_seed(0)
    rubbish = torch.Generator().manual_seed(1)
    samples = []
    for group in range(4):
        prompt = torch.randint(3, 200, (5 + group,), generator=gen).tolist()
        for k in range(4):
            turns = [torch.randint(3, 200, (3 + k,), generator=gen).tolist() for _ in range(2)]
            tools = [torch.randint(3, 200, (TOOL_TOKENS,), generator=gen).tolist() for _ in range(2)]
            if garbage_tool_tokens:  # the trailing result's tokens differ; no policy token reads them
                tools[1] = torch.randint(3, 200, (TOOL_TOKENS,), generator=rubbish).tolist()
            logprobs = [(-2.0 + 0.3 * torch.randn(len(turn), generator=gen)).tolist() for turn in turns]
            tool_logprobs = (
                [(-40.0 * torch.rand(TOOL_TOKENS, generator=rubbish)).tolist() for _ in tools]
                if garbage_tool_tokens
                else [[0.0] * TOOL_TOKENS for _ in tools]
            )
            samples.append(
                dict(
                    prompt_ids=prompt,
                    completion_ids=turns[0] + tools[0] + turns[1] + tools[1],
                    behaviour_logprobs=logprobs[0] + tool_logprobs[0] + logprobs[1] + tool_logprobs[1],
                    policy_mask=[1] * len(turns[0]) + [0] * TOOL_TOKENS + [1] * len(turns[1]) + [0] * TOOL_TOKENS,
                    reward=float((k + group) % 3 == 0),
                    group_id=group,
                    version=0,
                )
            )
    return samples


def _rank_main(rank: int, model_path: str, port: int, out: str) -> None:
    from algorithms import registry
    from learner.batch import collate
    from learner.rank import LearnerRank, LearnerSpec

    stabilizer = registry.build("tis_token", cap=2.0)
    spec = LearnerSpec(
        model_path=model_path,
        zero_stage=2,
        learning_rate=0.0,
        stabilizer_name="tis_token",
        stabilizer_config=stabilizer.config,
        loss_aggregation="token-mean",
    )
    learner = LearnerRank(spec, rank, 1, "127.0.0.1", port)
    unmasked = [{k: v for k, v in s.items() if k != "policy_mask"} for s in _episodes(False)]
    metrics = {
        name: learner.train_step(collate(samples, 0))
        for name, samples in (("clean", _episodes(False)), ("garbage", _episodes(True)), ("unmasked", unmasked))
    }
    torch.save(metrics, out)
    _leave_group()


@pytest.fixture(scope="module")
def steps(tiny_qwen2, tmp_path_factory):
    out = tmp_path_factory.mktemp("masking") / "metrics.pt"
    mp.start_processes(_rank_main, args=(tiny_qwen2, _free_port(), str(out)), nprocs=1, start_method="spawn", join=True)
    return torch.load(out, weights_only=False)


KEYS = ("optim/loss", "optim/grad_norm", "stability/ess_ratio", "stability/entropy")


def test_tool_tokens_change_nothing_the_learner_computes(steps):
    for key in KEYS:
        assert key in steps["clean"], key
        assert steps["garbage"][key] == pytest.approx(steps["clean"][key], rel=1e-6, abs=1e-9), key
    assert steps["clean"]["optim/grad_norm"] > 0


def test_without_the_policy_mask_the_same_tokens_train_differently(steps):
    # trained on, the tool tokens move the gradient (so the test above can fail)
    assert steps["unmasked"]["optim/grad_norm"] != pytest.approx(steps["clean"]["optim/grad_norm"], rel=1e-3)
