"""A model with no registered worker because etcd's records of it were refused: the 404 (or 400)
names the refused keys and why instead of blaming the router's --namespace (review 2026-12-04:
with every record refused after a schema skew, operators were sent to check the namespace)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import pytest

from router.request_path import Unknown
from tests.router.test_request_path import Dispatcher, path

ZERO = ("1234abcd", "block_size 0 is below 1")


def refused_of(records: dict[str, list[tuple[str, str]]]) -> Callable[[str | None], Sequence[tuple[str, str]]]:
    """RequestPath.refused over `records` by model (None: all of them)."""

    def refused(model: str | None) -> Sequence[tuple[str, str]]:
        return [r for rs in records.values() for r in rs] if model is None else records.get(model, [])

    return refused


def test_every_record_refused_names_them_not_the_namespace() -> None:
    p = path([], Dispatcher(), models=list, ns="prod", refused=refused_of({"m": [ZERO]}))
    for model in ("m", "other", None):
        with pytest.raises(Unknown) as err:
            p.resolve_model(model)
        said = str(err.value)
        assert err.value.code == (400 if model is None else 404)
        assert "1234abcd: block_size 0 is below 1" in said and "/prod/workers/ refused" in said, said
        assert "--namespace" not in said, said


def test_a_missing_models_refused_records_are_named_beside_the_served_ones() -> None:
    p = path([], Dispatcher(), models=lambda: ["a"], refused=refused_of({"m": [ZERO]}))
    with pytest.raises(Unknown) as err:
        p.resolve_model("m")
    assert "Registered: a; 1 worker record(s)" in str(err.value) and "1234abcd" in str(err.value)
    with pytest.raises(Unknown) as err:
        p.resolve_model("nope")
    assert str(err.value) == "The model `nope` does not exist. Registered: a"


def test_with_no_record_at_all_the_namespace_is_still_the_hint() -> None:
    p = path([], Dispatcher(), models=list, ns="prod")
    with pytest.raises(Unknown) as err:
        p.resolve_model("m")
    assert "--namespace is prod" in str(err.value)
