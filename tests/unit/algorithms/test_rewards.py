"""Reward shaping: DAPO's soft overlong punishment, by hand."""

import pytest

from algorithms.rewards import overlong_penalty


@pytest.mark.parametrize(
    ("tokens", "expected"), [(0, 0.0), (12, 0.0), (13, -0.25), (14, -0.5), (15, -0.75), (16, -1.0), (17, -1.0)]
)
def test_overlong_penalty_falls_linearly_over_the_buffer_to_the_cap(tokens, expected):
    # DAPO eq. 13 with L_max 16 and L_cache 4: ((16 - 4) - |y|) / 4 inside the buffer, -1 past it
    assert overlong_penalty(tokens, max_new_tokens=16, buffer_tokens=4, penalty=1.0) == expected


def test_overlong_penalty_scales_and_turns_off():
    assert overlong_penalty(14, 16, 4, penalty=0.5) == -0.25
    assert overlong_penalty(16, 16, 0, penalty=1.0) == 0.0  # no buffer: off
    assert overlong_penalty(8, 8, 8, penalty=1.0) == -1.0 and overlong_penalty(1, 8, 8, penalty=1.0) == -0.125
