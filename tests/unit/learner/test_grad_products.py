"""The per-sample gradient algebra of VCPO's norms (learner/vcpo/products.py) against dense per-sample gradients."""

from __future__ import annotations

import torch

from learner.vcpo.products import CHUNK_ELEMENTS, Factors, InputGramSum, squared_norm


def _dense_squared_norm(part: Factors) -> torch.Tensor:
    return torch.bmm(part.left.transpose(1, 2), part.right).square().sum((1, 2))


def test_calls_sharing_an_input_sum_to_their_own_norms_with_the_input_gram_formed_once():
    """q, k and v of one input: <X X^T, sum_j G_j G_j^T> is the sum of their per-sample squared norms."""
    gen = torch.Generator().manual_seed(0)
    right = torch.randn(3, 5, 64, generator=gen)  # [B, T, in]: the shared input
    parts = [Factors(torch.randn(3, 5, out, generator=gen), right) for out in (64, 32, 32)]
    assert not any(part.dense_is_cheaper for part in parts)  # T = 5: the Gram route
    grams = InputGramSum()
    assert all(grams.add(part) for part in parts)
    want = sum(_dense_squared_norm(part) for part in parts)
    assert torch.allclose(grams.squared_norms(), want, rtol=1e-5)
    assert torch.allclose(sum(squared_norm([part]) for part in parts), want, rtol=1e-5)


def test_calls_the_sum_cannot_take_are_left_to_squared_norm():
    gen = torch.Generator().manual_seed(1)
    grams = InputGramSum()
    assert grams.squared_norms() is None  # nothing taken
    assert not grams.add(torch.randn(2, 3))  # a dense per-sample gradient
    assert not grams.add(Factors(torch.randint(0, 9, (2, 4), generator=gen), torch.randn(2, 4, 3), rows=9))  # ids
    long_rows = Factors(torch.randn(1, 512, 2, generator=gen), torch.randn(1, 512, 2, generator=gen))
    assert long_rows.dense_is_cheaper and not grams.add(long_rows)  # its own route is dense
    # the sums held at once (one per row bucket) stay within half a Gram chunk between them: shapes alone decide
    steps = int((CHUNK_ELEMENTS // 4) ** 0.5) + 1
    wide = torch.zeros(()).expand(1, steps, 4 * steps)  # no memory behind it
    assert not Factors(wide, wide).dense_is_cheaper
    assert not InputGramSum(alive=2).add(Factors(wide, wide))
    assert InputGramSum(alive=1).max_elements >= steps * steps > InputGramSum(alive=2).max_elements
