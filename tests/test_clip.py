"""diloco.clip (zb.diloco.clip): which contributions are scaled, by how much, and how the norms ride in the
check-in; the node's outer step against a single-process reference is in tests/test_node_inprocess.py."""

from __future__ import annotations

import math

import pytest
import torch

from zb.config import load_config
from zb.diloco.checkin import make_plan
from zb.diloco.clip import clip_scales, from_bits, to_bits
from zb.errors import InvalidInput


def test_an_outsized_contribution_is_scaled_to_k_times_the_median():
    assert clip_scales([1.0, 1000.0, 2.0], [0, 1, 2], 3.0) == [1.0, pytest.approx(6.0 / 1000.0), 1.0]


def test_with_two_contributors_the_larger_is_bounded_by_the_smaller():
    assert clip_scales([1.0, 1000.0], [0, 1], 2.0) == [1.0, pytest.approx(0.002)]
    assert clip_scales([1.0, 1.5], [0, 1], 2.0) == [1.0, 1.0]          # within k: as they are


def test_only_contributors_count_and_are_scaled():
    # Rank 0 receives the state (not a contributor): its norm neither sets the median nor gets a factor.
    assert clip_scales([900.0, 1.0, 1.0, 50.0], [1, 2, 3], 2.0) == [1.0, 1.0, 1.0, pytest.approx(0.04)]


def test_off_alone_or_non_finite_leaves_everything_as_it_is():
    assert clip_scales([1.0, 1000.0, 2.0], [0, 1, 2], None) == [1.0, 1.0, 1.0]
    assert clip_scales([1000.0], [0], 2.0) == [1.0]
    # A NaN norm is the non-finite skip's case (every node skips the step); the rest are judged without it.
    assert clip_scales([math.nan, 1.0, 100.0], [0, 1, 2], 2.0) == [1.0, 1.0, pytest.approx(0.02)]


def test_the_plan_carries_the_same_factors_on_every_rank():
    norms = [1.0, 1000.0, 2.0]
    plans = [make_plan([0, 0, 0], [5, 5, 5], norms=norms, clip=3.0) for _ in range(3)]
    assert all(p.scales == plans[0].scales for p in plans) and plans[0].clipped() == [1]


@pytest.mark.parametrize("value", [0.0, 1.5, 1e-30, 3.0e38, 123456.789])
def test_a_norm_travels_as_its_bits(value):
    assert from_bits(to_bits(value)) == value
    assert from_bits(to_bits(value) + 0) == value     # summed with the zeros of the other ranks' columns


def test_clip_is_refused_where_it_cannot_act():
    with pytest.raises(InvalidInput, match="diloco.clip.*cannot combine with diloco.overlap = eager"):
        load_config([], {"diloco.clip": "3", "diloco.overlap": "eager"}, environ={})
    with pytest.raises(InvalidInput, match="diloco.clip.*at least 1"):
        load_config([], {"diloco.clip": "0.5"}, environ={})
    assert load_config([], {"diloco.clip": "3"}, environ={}).diloco.clip == 3.0


def test_a_non_finite_norm_leaves_its_node_out_of_the_average_but_applying_it():
    """Issue 40: NaN every round skipped every outer step. With diloco.clip the node is left out at the check-in
    (it applies the others' average and restarts from it) and is discredited; without clip the norm is not sent."""
    plan = make_plan([0, 0, 0], [5, 5, 5], norms=[1.0, math.nan, 1.2], clip=2.0)
    assert plan.contributors == [0, 2] and plan.appliers == [0, 1, 2] and plan.receivers == []
    assert plan.non_finite == [1] and plan.discredited() == [1]
    assert make_plan([0, 0, 0], [5, 5, 5], norms=[1.0, math.nan, 1.2]).contributors == [0, 1, 2]


def test_a_rounds_token_count_is_bounded_like_a_norm():
    """Issue 40: tokens x1000 gave the honest nodes a weight of 0.000998. With diloco.clip = 2 a claim counts at
    most 2 x the median: bounded, not discredited (an honest fast node trains many times the median too)."""
    plan = make_plan([0, 0, 0], [5, 5, 5], round_tokens=[100, 100_000, 120], clip=2.0)
    assert plan.round_tokens == [100, 240, 120] and plan.overweight == [1] and plan.discredited() == []
    honest = make_plan([0, 0, 0], [5, 5, 5], round_tokens=[100, 190, 120], clip=2.0)
    assert honest.round_tokens == [100, 190, 120] and honest.discredited() == []
    assert make_plan([0, 0, 0], [5, 5, 5], round_tokens=[100, 100_000, 120]).round_tokens == [100, 100_000, 120]


def test_a_stated_residual_widens_the_check_by_at_most_k_times_the_median():
    from zb.diloco.verify import credible_residuals, passes, slack

    assert credible_residuals([0.1, 1e30, 0.2], 2.0) == [0.1, 0.4, 0.2]
    assert credible_residuals([0.1, 1e30], None) == [0.1, 1e30]
    assert not passes(math.nan, 1.0, 1.0) and passes(1.0, 1.0, 1.0) and not passes(4.0, 1.0, 1.5)
    assert slack("none", 3) < 1.001 < slack("int8", 3) < slack("int4", 3) < slack("int2", 3)


def test_the_squared_norm_is_the_fp64_sum_within_3e_7():
    from zb.diloco.clip import squared_norm

    g = torch.Generator().manual_seed(0)
    for t in (torch.randn(2_000_003, generator=g), torch.randn(100_000, generator=g) ** 5, torch.randn(7, generator=g)):
        exact = float(torch.linalg.vector_norm(t, dtype=torch.float64)) ** 2
        assert abs(squared_norm(t) - exact) <= 3e-7 * exact
    assert squared_norm(torch.zeros(0)) == 0.0


def test_counts_and_norms_a_rank_states_are_taken_in_range():
    """A negative token count flipped the sign of the liar's weight; a negative norm shrank the check's bound."""
    plan = make_plan([0, 0, 0], [5, 5, 5], round_tokens=[100, -5000, 120], round_steps=[10, -3, 12],
                     norms=[1.0, -4.0, 1.2], clip=2.0)
    assert plan.round_tokens[1] == 0 and plan.round_steps[1] == 0
    assert plan.non_finite == [1] and 1 not in plan.contributors
