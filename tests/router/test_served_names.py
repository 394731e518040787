"""How request names resolve to workers (protocol.serving, router.served_names, and the whole-fleet
oracle the registry is checked against, tests/router/oracles.py): a model's own name wins over
another model's adapter; an alias and an adapter of one name clash, within a model too."""

from __future__ import annotations

from protocol import WorkerInfo, serving
from router.served_names import clash_message, served_as, shadow_message
from tests.router.oracles import resolve_names, shadowed


def w(worker: str, model: str, aliases: tuple[str, ...] = (), adapters: tuple[str, ...] = ()) -> WorkerInfo:
    return WorkerInfo(
        worker=worker, model=model, role="agg", engine="vllm", block_size=16, aliases=[*aliases], adapters=[*adapters]
    )


def test_an_alias_does_not_win_over_an_adapter_of_its_name() -> None:
    a, b = w("a", "llama", adapters=("chat",)), w("b", "qwen", aliases=("chat",))
    assert [i.worker for i in serving([a, b], "chat")] == ["a", "b"]  # before: b alone, silently
    assert resolve_names([a, b])["chat"] == {"llama": ["a"], "qwen": ["b"]}


def test_one_model_serving_a_name_as_itself_and_as_an_adapter_counts_twice() -> None:
    a, b, c = w("a", "llama", adapters=("chat",)), w("b", "llama", aliases=("chat",)), w("c", "llama", ("chat",))
    ways = served_as("chat", [a, b, c])
    assert ways == {"llama with its LoRA adapter chat": ["a"], "llama": ["b", "c"]}
    assert resolve_names([a, b, c])["chat"] == ways
    assert "(model llama on b, c; model llama with its LoRA adapter chat on a)" in clash_message("chat", ways)
    assert served_as("chat", [a]) == {"llama": ["a"]}  # an adapter alone is its model's, as before


def test_a_models_own_name_still_wins_over_another_models_adapter() -> None:
    q, m = w("q", "qwen"), w("m", "llama", adapters=("qwen", "sql"))
    assert [i.worker for i in serving([q, m], "qwen")] == ["q"]
    resolved = resolve_names([q, m])
    assert resolved["qwen"] == {"qwen": ["q"]} and resolved["sql"] == {"llama": ["m"]}
    assert not [name for name, models in resolved.items() if len(models) > 1]


def test_a_models_own_name_wins_over_another_models_alias() -> None:
    a, q = w("a", "llama"), w("q", "qwen", aliases=("llama", "chat"))
    resolved = resolve_names([a, q])
    assert resolved["llama"] == {"llama": ["a"]} and resolved["chat"] == {"qwen": ["q"]}  # before: llama clashed
    assert shadowed([a, q]) == {"llama": {"qwen": ["q"]}} and shadowed([q]) == {}
    assert "model qwen on q" in shadow_message("llama", shadowed([a, q])["llama"])
