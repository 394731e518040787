"""The sampler's tokens and the synthetic distribution logprobs report."""

from __future__ import annotations

import itertools
import math

from hypothesis import given
from hypothesis import strategies as st

from engine_sim.sampler import MAX_RANKS, Sampler, word_ids


@given(st.lists(st.integers(0, 31999), min_size=1, max_size=50), st.integers(0, 500), st.integers(0, 3))
def test_the_ranking_is_a_distribution_led_by_the_emitted_token(prompt: list[int], index: int, choice: int) -> None:
    s = Sampler(prompt, seed=None, choice=choice)
    ranked = s.logprobs(index, MAX_RANKS)
    tokens = [t for t, _ in ranked]
    assert tokens[0] == s.token(index) and len(set(tokens)) == MAX_RANKS
    assert set(tokens) <= set(word_ids())
    lps = [lp for _, lp in ranked]
    assert all(a > b for a, b in itertools.pairwise(lps))
    assert math.log(0.4) <= lps[0] < 0 and sum(math.exp(lp) for lp in lps) < 1


def test_choices_and_seeds_give_different_tokens_deterministically() -> None:
    prompt = list(range(100, 140))
    base = [Sampler(prompt).token(i) for i in range(8)]
    assert base == [Sampler(prompt, choice=0).token(i) for i in range(8)]
    assert base != [Sampler(prompt, choice=1).token(i) for i in range(8)]
    assert base != [Sampler(prompt, seed=3).token(i) for i in range(8)]


def test_token_avoiding_takes_the_next_best() -> None:
    s = Sampler([1, 2, 3])
    first, second = s.ranked(5, 2)
    assert s.token_avoiding(5, {first}) == second and s.token_avoiding(5, set()) == first
