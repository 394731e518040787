"""LoRA adapters, as vLLM 0.32 serves them (`--enable-lora --lora-modules name=path ...`).

The sim loads no weights: a request naming an adapter runs as the base model, in the same modelled
time. What an adapter changes is whose KV it is. vLLM puts `("lora", name, path)` first in every
block's extra keys (`_gen_lora_extra_hash_keys`), so an adapter's chain shares no block with the base
model's or another adapter's, nor with its own from before it was re-pointed at another path, and
its `BlockStored` events carry `lora_id` (the adapter's lora_int_id) and `lora_name`.

lora_int_id: 1, 2, ... in the order the adapters were given, as vLLM's OpenAIServingModels counts
them while loading the static adapters at startup.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator, Sequence

import msgspec

from engine_sim.errors import SimConfigError, SimRequestError

__all__ = ["LoraAdapters", "LoraModule", "LoraRequest", "lora_requests"]

log = logging.getLogger(__name__)

_FLAG = "lora_modules"


class LoraModule(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One `--lora-modules` value: `name=path`, or vLLM's JSON form `{"name", "path",
    "base_model_name"}`. `path` is only echoed (the /v1/models card's `root`). `base_model_name`
    is accepted as vLLM accepts it; with one base model the card's parent is always that model."""

    name: str
    path: str
    base_model_name: str | None = None

    @classmethod
    def parse(cls, text: str) -> LoraModule:
        # vLLM's rule (LoRAParserAction): `=` and no `,` is name=path, anything else is JSON.
        if "=" in text and "," not in text:
            name, _, path = text.partition("=")
            return cls(name=name, path=path)
        try:
            raw = json.loads(text)
        except json.JSONDecodeError:
            raise SimConfigError(_FLAG, text, "expected name=path or a JSON object with name and path") from None
        try:
            return msgspec.convert(raw, cls)
        except msgspec.ValidationError as exc:
            raise SimConfigError(_FLAG, text, str(exc)) from None


class LoraRequest(msgspec.Struct, frozen=True, gc=False):
    """vLLM's LoRARequest as far as the sim needs it: `name` goes into block hashes and events,
    `int_id` is the events' `lora_id`, `path` the model card's `root`."""

    name: str
    int_id: int
    path: str


def lora_requests(modules: Sequence[LoraModule], names: Sequence[str]) -> dict[str, LoraRequest]:
    """The adapters served next to the model served under `names`, by name, in the order given.
    Raises SimConfigError for an empty name or path (vLLM refuses to load those), a name given twice
    (vLLM: "has already been loaded") or one of the model's own names (a request naming it could
    not say which it means)."""
    out: dict[str, LoraRequest] = {}
    for m in modules:
        if not m.name or not m.path:
            raise SimConfigError(_FLAG, f"{m.name}={m.path}", "an adapter needs a name and a path (name=path)")
        if m.name in names:
            raise SimConfigError(_FLAG, m.name, "an adapter may not take a served model name (--served-model-name)")
        if m.name in out:
            raise SimConfigError(_FLAG, m.name, "names the same adapter twice")
        out[m.name] = LoraRequest(m.name, len(out) + 1, m.path)
    return out


class LoraAdapters:
    """The adapters a server serves, by name, with vLLM's run-time loading
    (VLLM_ALLOW_RUNTIME_LORA_UPDATING: POST /v1/load_lora_adapter, /v1/unload_lora_adapter). An id
    is never given twice, as vLLM's counter only grows. Errors are vLLM's words (serving_models.py)."""

    def __init__(self, modules: Sequence[LoraModule], names: Sequence[str]) -> None:
        self.by_name = lora_requests(modules, names)
        self._names = tuple(names)
        self._next_id = len(self.by_name) + 1

    def get(self, name: str) -> LoraRequest | None:
        return self.by_name.get(name)

    def __iter__(self) -> Iterator[LoraRequest]:
        return iter(self.by_name.values())

    def load(self, name: str, path: str, inplace: bool = False) -> str:
        """The success text; SimRequestError (400) for a missing field, a served model's name, or
        a name already loaded unless `inplace` (vLLM's load_inplace: the adapter keeps its id and
        takes the new path, whose blocks hash apart from the old path's)."""
        if not name or not path:
            raise SimRequestError("Both 'lora_name' and 'lora_path' must be provided.", kind="InvalidUserInput")
        if name in self._names:
            raise SimRequestError(
                f"The lora adapter '{name}' conflicts with a served base model.", kind="InvalidUserInput"
            )
        previous = self.by_name.get(name)
        if previous is not None and not inplace:
            raise SimRequestError(
                f"The lora adapter '{name}' has already been loaded. If you want to load the adapter in place, "
                "set 'load_inplace' to True.",
                kind="InvalidUserInput",
            )
        if previous is None:
            self.by_name[name] = LoraRequest(name, self._next_id, path)
            self._next_id += 1
        else:
            if previous.path == path:  # vLLM's warning: the same path hashes the same blocks
                log.warning(
                    "Reloaded LoRA adapter '%s' in place from the same path '%s'. Prefix-cache blocks computed "
                    "with its previous weights are not invalidated; load changed weights from a new path to "
                    "avoid reusing them.",
                    name,
                    path,
                )
            self.by_name[name] = LoraRequest(name, previous.int_id, path)
        return f"Success: LoRA adapter '{name}' added successfully."

    def unload(self, name: str) -> str:
        """The success text; SimRequestError (400 without a name, 404 for one not loaded)."""
        if not name:
            raise SimRequestError("'lora_name' needs to be provided to unload a LoRA adapter.", kind="InvalidUserInput")
        if self.by_name.pop(name, None) is None:
            raise SimRequestError(f"The lora adapter '{name}' cannot be found.", status=404, kind="NotFoundError")
        return f"Success: LoRA adapter '{name}' removed successfully."
