"""The canonical block hash is a wire format: pinned vectors guard it against any drift."""

from __future__ import annotations

import re
import struct
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import xxhash
from hypothesis import given
from hypothesis import strategies as st

from protocol.hashing import NATIVE, SEED, BlockHasher, block_hashes, block_hashes_py, root_hash

IMPLEMENTATIONS = [pytest.param(block_hashes_py, id="python")] + (
    [pytest.param(block_hashes, id="native")] if NATIVE else []
)

# Pinned once from the definition in DESIGN.md; a change here breaks every deployed router/shim pair.
VECTORS = [
    (list(range(32)), 16, "", [78276156063472216, 2009592880489177518]),
    ([7] * 64, 64, "", [15948335117098599849]),
    (list(range(16)), 16, "lora-a", [1920244791673950196]),
    ([0xFFFFFFFF] * 16, 16, "", [9021102377750242502]),
]


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
@pytest.mark.parametrize(("tokens", "block_size", "salt", "expected"), VECTORS)
def test_block_hashes_match_pinned_vectors(
    impl: Callable[..., list[int]], tokens: list[int], block_size: int, salt: str, expected: list[int]
) -> None:
    assert impl(tokens, block_size, salt=salt) == expected


def test_native_extension_is_built_where_its_header_exists() -> None:
    """`make install` adds libxxhash-dev; a silent fallback to Python would cost 6x in throughput."""
    if not Path("/usr/include/xxhash.h").exists():
        pytest.skip("xxhash.h not installed: the pure-Python hash is in use")
    assert NATIVE


@given(
    st.lists(st.integers(0, 2**32 - 1), max_size=300),
    st.sampled_from([1, 3, 16, 64]),
    st.one_of(st.none(), st.integers(0, 2**64 - 1)),
    st.sampled_from(["", "tenant"]),
)
def test_native_and_python_agree(tokens: list[int], block_size: int, parent: int | None, salt: str) -> None:
    assert block_hashes(tokens, block_size, parent=parent, salt=salt) == block_hashes_py(
        tokens, block_size, parent=parent, salt=salt
    )


def test_seed_and_root_are_pinned() -> None:
    assert SEED == 0x6B76737769746368
    assert root_hash() == 6753943950481272353
    assert root_hash("lora-a") == 14678177813281646100


def test_matches_the_design_formula_computed_independently() -> None:
    tokens = [5, 1, 99, 128000] * 8  # two blocks of 16
    h = xxhash.xxh3_64_intdigest(b"", seed=SEED)
    expected = []
    for i in range(2):
        block = tokens[i * 16 : (i + 1) * 16]
        h = xxhash.xxh3_64_intdigest(struct.pack("<Q", h) + struct.pack("<16I", *block), seed=SEED)
        expected.append(h)
    assert block_hashes(tokens, 16) == expected


def test_empty_prompt_has_no_blocks() -> None:
    assert block_hashes([], 16) == []


def test_partial_trailing_block_is_not_hashed() -> None:
    assert block_hashes(list(range(31)), 16) == block_hashes(list(range(16)), 16)
    assert block_hashes(list(range(15)), 16) == []


def test_salt_changes_every_hash() -> None:
    plain = block_hashes(list(range(48)), 16)
    salted = block_hashes(list(range(48)), 16, salt="tenant-a")
    assert len(plain) == len(salted) == 3
    assert not set(plain) & set(salted)


def test_bytes_and_str_salt_agree() -> None:
    assert block_hashes(list(range(16)), 16, salt=b"x") == block_hashes(list(range(16)), 16, salt="x")


def test_chain_continues_from_parent() -> None:
    tokens = list(range(64))
    whole = block_hashes(tokens, 16)
    tail = block_hashes(tokens[32:], 16, parent=whole[1])
    assert tail == whole[2:]


def test_hasher_extend_matches_whole_prompt() -> None:
    hasher = BlockHasher(16)
    tokens = list(range(100, 164))
    whole = hasher(tokens)
    assert hasher.extend(None, tokens[:16]) == whole[:1]
    assert hasher.extend(whole[0], tokens[16:]) == whole[1:]


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
@pytest.mark.parametrize("bad", [[-1], [2**32], [1.5], ["7"], [None]])
def test_out_of_range_token_is_a_clear_error(impl: Callable[..., list[int]], bad: list[object]) -> None:
    with pytest.raises(ValueError, match=r"token ids must be integers in \[0, 2\*\*32\)"):
        impl([1] * 5 + bad * 11, 16)


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
@pytest.mark.parametrize("block_size", [0, -16])
def test_non_positive_block_size_is_refused(impl: Callable[..., list[int]], block_size: int) -> None:
    with pytest.raises(ValueError, match="block_size must be positive"):
        impl([1] * 16, block_size)
    with pytest.raises(ValueError, match="block_size must be positive"):
        BlockHasher(block_size)


@given(st.lists(st.integers(0, 2**32 - 1), max_size=200), st.sampled_from([1, 4, 16, 32]))
def test_prefix_property(tokens: list[int], block_size: int) -> None:
    """Equal prefixes give equal leading hashes: what the router's prefix match relies on."""
    full = block_hashes(tokens, block_size)
    assert len(full) == len(tokens) // block_size
    cut = len(tokens) // 2
    assert block_hashes(tokens[:cut], block_size) == full[: cut // block_size]
    assert all(0 <= h < 2**64 for h in full)


# --- the two paths agree outside the happy path too (audit 2026-12-04) ---------------------------


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
@pytest.mark.parametrize("parent", [-1, 2**64, 2**64 + 7, 1.5, "7"])
def test_a_parent_out_of_range_is_a_clear_error_not_wrapped(impl: Callable[..., list[int]], parent: object) -> None:
    """The C path parsed `parent` with "K", which wraps mod 2**64 (2**64 + 7 hashed as 7); Python
    raised struct.error. Both check it, with or without a full block to hash."""
    for tokens in ([1] * 16, [1]):
        with pytest.raises(
            ValueError, match=r"parent must be an integer in \[0, 2\*\*64\): got " + re.escape(repr(parent))
        ):
            impl(tokens, 16, parent=parent)


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_a_parent_at_the_ends_of_its_range_is_taken(impl: Callable[..., list[int]]) -> None:
    for parent in (0, 2**64 - 1, np.uint64(2**64 - 1)):
        assert impl(list(range(32)), 16, parent=parent) == block_hashes_py(list(range(32)), 16, parent=int(parent))


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
@pytest.mark.parametrize("block_size", [2**40, 2**63 - 1, 2**63, 2**70])
def test_a_block_size_past_the_tokens_is_no_block_whatever_its_size(
    impl: Callable[..., list[int]], block_size: int
) -> None:
    """The C path allocated 8 + 4 * block_size bytes up front: MemoryError at 2**40, OverflowError
    past 2**63."""
    assert impl([1, 2, 3], block_size) == []


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
@pytest.mark.parametrize("kind", [np.int64, np.uint32, np.int32, np.uint64])
def test_numpy_integer_tokens_hash_as_the_ints_they_are(impl: Callable[..., list[int]], kind: type) -> None:
    """struct.pack takes objects with __index__; the C path refused them (ValueError)."""
    ints = list(range(40))
    assert impl([kind(t) for t in ints], 16) == impl(ints[:16] + [kind(t) for t in ints[16:]], 16)
    assert impl([kind(t) for t in ints], 16) == block_hashes_py(ints, 16)
    for bad in (np.int64(-1), np.uint64(2**32)):
        with pytest.raises(
            ValueError, match=r"token ids must be integers in \[0, 2\*\*32\): got " + re.escape(repr(bad))
        ):
            impl([kind(7)] * 15 + [bad], 16)


class _Shrinks:
    """A token whose __index__ empties the list being hashed."""

    def __init__(self, tokens: list[object], value: int) -> None:
        self.tokens, self.value = tokens, value

    def __index__(self) -> int:
        self.tokens.clear()
        return self.value


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_a_token_that_changes_the_list_hashes_the_list_as_it_was(impl: Callable[..., list[int]]) -> None:
    """The C path reads the list in place: the rest is read from a copy once a token may run code."""
    tokens: list[object] = list(range(40))
    tokens[3] = _Shrinks(tokens, 3)
    assert impl(tokens, 16) == block_hashes_py(list(range(40)), 16)
