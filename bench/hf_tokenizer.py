"""The built-in tokenizer (protocol.tokenizer) as a Hugging Face tokenizer, laid out as a hub cache.

aiperf needs a Hugging Face tokenizer to synthesise prompts of a given length and count tokens.
Offline (`HF_HUB_OFFLINE=1`, as on a machine with no hub access) aiperf 0.13 fails to load a local
tokenizer *path*, but it loads a hub *name* from the cache. So `write_hub_cache(hf_home)` writes

    $HF_HOME/hub/models--kvswitch--builtin/refs/main                        (the revision)
    $HF_HOME/hub/models--kvswitch--builtin/snapshots/<rev>/tokenizer.json
    $HF_HOME/hub/models--kvswitch--builtin/snapshots/<rev>/tokenizer_config.json
    $HF_HOME/hub/models--kvswitch--builtin/snapshots/<rev>/config.json

and aiperf runs with `HF_HOME=<hf_home> HF_HUB_OFFLINE=1 --tokenizer kvswitch/builtin`.

The export is exact, not an approximation: the pre-tokenizer is the built-in one's split regex; the
model is a BPE with no merges, `ignore_merges` (a piece in the vocabulary is one token) and
`byte_fallback` (any other piece becomes its UTF-8 bytes, `<0xNN>`, whose ids are the byte values
0..255, as in the built-in vocabulary); the specials are added tokens. So aiperf's token counts are
the engines' and the router's. Decoding is exact wherever the ids spell valid UTF-8 (everything
aiperf decodes); a run of bytes that is not UTF-8 becomes one U+FFFD per byte here, where Python's
`errors="replace"` may merge some.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from protocol.tokenizer import BOS_ID, EOS_ID, SPECIAL_TOKENS, VOCAB_SIZE, vocabulary_pieces

__all__ = ["HUB_NAME", "tokenizer_json", "write_hub_cache"]

HUB_NAME = "kvswitch/builtin"
# The built-in tokenizer's split (protocol.tokenizer._SPLIT); `.` there runs with DOTALL, which
# the `\s` alternative before it covers for the only character DOTALL adds (newline).
_SPLIT = r"<\|(?:bos|eos|im_start|im_end)\|>| ?\w+| +|\s|."


def tokenizer_json() -> dict[str, Any]:
    """The `tokenizer.json` (Hugging Face tokenizers' serialisation) of the built-in tokenizer."""
    vocab = {f"<0x{b:02X}>": b for b in range(256)}
    for tid, piece in enumerate(vocabulary_pieces()):
        if tid >= 256:
            vocab[piece.decode()] = tid
    assert len(vocab) == VOCAB_SIZE
    added = [
        {"id": tid, "content": s, "single_word": False, "lstrip": False, "rstrip": False,
         "normalized": False, "special": True}
        for s, tid in SPECIAL_TOKENS.items()
    ]  # fmt: skip
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": {
            "type": "Split",
            "pattern": {"Regex": _SPLIT},
            "behavior": "Isolated",
            "invert": False,
        },
        "post_processor": None,
        "decoder": {"type": "Sequence", "decoders": [{"type": "ByteFallback"}, {"type": "Fuse"}]},
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": True,
            "ignore_merges": True,
            "vocab": vocab,
            "merges": [],
        },
    }


def _tokenizer_config() -> dict[str, Any]:
    pieces = vocabulary_pieces()
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": pieces[BOS_ID].decode(),
        "eos_token": pieces[EOS_ID].decode(),
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 1_000_000,
    }


def write_hub_cache(hf_home: Path, name: str = HUB_NAME) -> Path:
    """Write the tokenizer as the hub cache entry `name` under `hf_home`; returns the snapshot
    directory. The revision is the content's hash, so rewriting the same content is a no-op."""
    files = {
        "tokenizer.json": json.dumps(tokenizer_json(), ensure_ascii=False).encode(),
        "tokenizer_config.json": json.dumps(_tokenizer_config(), indent=1).encode(),
        # transformers reads the model's config to pick a tokenizer class; this one names none.
        "config.json": json.dumps({"vocab_size": VOCAB_SIZE}).encode(),
    }
    digest = hashlib.sha1()
    for filename, body in sorted(files.items()):
        digest.update(filename.encode() + b"\0" + body)
    revision = digest.hexdigest()
    repo = hf_home / "hub" / f"models--{name.replace('/', '--')}"
    snapshot = repo / "snapshots" / revision
    snapshot.mkdir(parents=True, exist_ok=True)
    for filename, body in files.items():
        (snapshot / filename).write_bytes(body)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(revision)
    return snapshot
