import pytest
import torch

from algorithms.advantages import ADVANTAGES, group_mean_advantages, grpo_advantages, rloo_advantages

REWARDS = torch.tensor([1.0, 0.0, 1.0, 0.0, 0.5, 0.5])
GROUPS = torch.tensor([4, 4, 9, 4, 2, 2])  # non-contiguous and unsorted on purpose


def test_group_mean():
    expected = torch.tensor([1 - 1 / 3, -1 / 3, 0.0, -1 / 3, 0.0, 0.0])
    assert torch.allclose(group_mean_advantages(REWARDS, GROUPS), expected)


def test_grpo_uses_unbiased_group_std_and_zero_for_flat_groups():
    adv = grpo_advantages(REWARDS, GROUPS)
    group4 = torch.tensor([1.0, 0.0, 0.0])
    expected = (group4 - group4.mean()) / (group4.std() + 1e-6)
    assert torch.allclose(adv[[0, 1, 3]], expected)
    assert adv[2].item() == 0.0 and adv[4:].eq(0).all()


def test_rloo_leaves_one_out():
    adv = rloo_advantages(REWARDS, GROUPS)
    assert adv[0].item() == pytest.approx(1 - 0.0)
    assert adv[1].item() == pytest.approx(0 - 0.5)
    assert adv[2].item() == 0.0  # singleton group


def test_registered_names():
    assert set(ADVANTAGES) == {"grpo", "dr_grpo", "reinforce", "rloo"}
