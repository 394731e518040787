"""worker_shim.decode_context: the mean length of the legs decoding, as load reports carry it."""

from __future__ import annotations

from worker_shim.decode_context import DecodeContext


def test_a_leg_counts_from_its_first_token_at_its_prompt_plus_what_it_streamed() -> None:
    c = DecodeContext()
    assert c.mean() == 0.0 and len(c) == 0
    c.grow("a", 1, 1000)
    assert c.mean() == 1001.0
    c.grow("b", 3, 200)
    c.grow("a", 2, 1000)  # the prompt counts once
    assert len(c) == 2 and c.mean() == (1003 + 203) / 2
    c.end("a")
    assert c.mean() == 203.0
    c.end("a")  # twice, or a leg that never decoded: nothing changes
    c.end("never")
    assert c.mean() == 203.0
    c.end("b")
    assert c.mean() == 0.0 and len(c) == 0


def test_a_leg_of_n_sequences_counts_n_times_at_its_share_of_the_tokens() -> None:
    # n = 4: the engine decodes four sequences; the tokens streamed are theirs together. Counted as
    # one, it read as one sequence at the prompt plus all four's tokens.
    c = DecodeContext()
    c.grow("n4", 8, 200, sequences=4)  # two steps of four sequences
    c.grow("one", 2, 600)
    assert len(c) == 2
    assert c.mean() == (4 * 200 + 8 + 602) / 5
    c.grow("n4", 4, 200, sequences=4)
    assert c.mean() == (4 * 203 + 602) / 5
    c.end("one")
    assert c.mean() == 203.0
    c.end("n4")
    assert c.mean() == 0.0
