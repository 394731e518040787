"""ChoiceText: one choice's text as vLLM's incremental detokenizer builds it."""

from __future__ import annotations

from engine_sim.detokenizer import ChoiceText


def test_text_that_could_begin_a_stop_string_is_held_back() -> None:
    t = ChoiceText(["abc"])
    assert [t.add("xa"), t.add("b")] == ["", "x"]
    assert t.add("cz") == "" and (t.text, t.stop_reason) == ("x", "abc")


def test_include_stop_str_keeps_it_and_holds_nothing_back() -> None:
    t = ChoiceText(["abc"], include_stop=True)
    assert [t.add("xa"), t.add("b"), t.add("cz")] == ["xa", "b", "c"]
    assert (t.text, t.stop_reason) == ("xabc", "abc")


def test_stop_strings_are_not_looked_for_within_min_tokens() -> None:
    t = ChoiceText(["b"], min_tokens=2)
    assert [t.add("b"), t.add("b")] == ["b", "b"]
    before = t.stop_reason
    assert t.add("xb") == "x" and (before, t.text, t.stop_reason) == (None, "bbx", "b")


def test_a_stop_string_ending_in_new_text_is_found_across_tokens() -> None:
    t = ChoiceText(["lo wo"])
    for piece in ("hel", "lo", " w", "orld"):
        t.add(piece)
    assert (t.text, t.stop_reason) == ("hel", "lo wo")


def test_the_stop_string_completed_earliest_wins_not_the_first_listed() -> None:
    t = ChoiceText(["zz", "a"])
    t.add("a zz")
    assert (t.text, t.stop_reason) == ("", "a")  # vLLM's check_stop_strings


def test_a_stop_token_adds_no_text_unless_included() -> None:
    t = ChoiceText([])
    assert t.add(" one") == " one" and t.add(" two", stop_token=42) == ""
    assert (t.text, t.stop_reason) == (" one", 42)
    kept = ChoiceText([], include_stop=True)
    kept.add(" two", stop_token=42)
    assert (kept.text, kept.stop_reason) == (" two", 42)


def test_finish_releases_what_was_held() -> None:
    t = ChoiceText(["xyz"])
    assert t.add("ab") == "" and t.finish() == "ab"
