"""NewerKinds: the kinds a newer kvswitch sends are the sender's strings, so their labels are capped."""

from __future__ import annotations

from router.newer_kinds import MAX_KIND_CHARS, MAX_KINDS, OTHER, NewerKinds, shown


def test_the_first_kinds_count_under_their_names_and_any_other_under_other() -> None:
    counts: dict[str, int] = {}
    kinds = NewerKinds(counts)
    for i in range(MAX_KINDS + 3):
        kinds.add({f"kind{i}": 2})
    kinds.add({"kind0": 1, "x" * (MAX_KIND_CHARS + 1): 1})
    assert counts == {**{f"kind{i}": 2 for i in range(MAX_KINDS)}, "kind0": 3, OTHER: 7}
    assert len(counts) == MAX_KINDS + 1


def test_a_line_shows_a_few_kinds_each_cut_short() -> None:
    assert shown({"moved": 2}) == "'moved'"
    many = {f"k{i}": 1 for i in range(MAX_KINDS + 2)}
    assert shown(many).endswith("'k7' and 2 more")
    assert shown({"y" * 500: 1}) == repr("y" * MAX_KIND_CHARS)
