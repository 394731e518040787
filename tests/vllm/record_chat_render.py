"""Records vLLM 0.32's own prompt ids for tests/fixtures/vllm-0.32/chat_render/cases.jsonl: its
renderer (`HfRenderer`, with the request models' `build_chat_params`/`build_tok_params`, call for
call as `online_renderer` uses them) over the tiny tokenizer of make_model.py and each case's
template. Rewrites each case's `vllm_ids`; tests/router/test_vllm_render.py holds the router to them.
Also rewrites content_formats.json's `vllm`: the content format vLLM detects for each template
(tests/router/test_content_format.py).

    .venv-vllm/bin/python tests/vllm/record_chat_render.py
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

from vllm.config import ModelConfig, VllmConfig
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from vllm.entrypoints.openai.completion.protocol import CompletionRequest
from vllm.renderers.hf import HfRenderer, _detect_content_format
from vllm.renderers.inputs.preprocess import parse_model_prompt, prompt_to_seq
from vllm.renderers.params import merge_kwargs
from vllm.tokenizers import get_tokenizer

HERE = Path(__file__).resolve().parent
CASES = HERE.parent / "fixtures" / "vllm-0.32" / "chat_render" / "cases.jsonl"
FORMATS = CASES.parent / "content_formats.json"
MODEL = HERE.parent.parent / ".venv-vllm" / "tiny-llama"  # make_model.py's, for the model config

sys.path.insert(0, str(HERE.parent.parent))
from tests.vllm.make_model import build_tokenizer  # noqa: E402


def tokenizer_dir(root: Path, template: str | None) -> Path:
    """make_model.py's tokenizer, with `template` (a file beside the cases) as its chat template."""
    out = root / (Path(template).stem if template else "own")
    if not out.exists():
        out.mkdir()
        build_tokenizer(out)
        if template is not None:
            config = json.loads((out / "tokenizer_config.json").read_text())
            config["chat_template"] = (CASES.parent / template).read_text()
            (out / "tokenizer_config.json").write_text(json.dumps(config, indent=1))
    return out


def ids(tok_dir: Path, kind: str, body: dict[str, Any], server_defaults: dict[str, Any] | None = None) -> list[Any]:
    """`server_defaults`: the server's --default-chat-template-kwargs."""
    mc = ModelConfig(model=str(MODEL), tokenizer=str(tok_dir))
    renderer = HfRenderer(VllmConfig(model_config=mc), get_tokenizer(str(tok_dir)))
    if kind == "chat":
        req = ChatCompletionRequest(**body)
        tools = None if req.tools is None else [t.model_dump() for t in req.tools]
        defaults = merge_kwargs(server_defaults, {"tools": tools, "tokenize": False})
        params = req.build_chat_params(None, "auto").with_defaults(defaults)
        _, (engine,) = renderer.render_chat([req.messages], params, req.build_tok_params(mc))
        return list(engine["prompt_token_ids"])
    creq = CompletionRequest(**body)
    prompts = [parse_model_prompt(mc, p) for p in prompt_to_seq(creq.prompt)]
    return [list(e["prompt_token_ids"]) for e in renderer.render_cmpl(prompts, creq.build_tok_params(mc))]


def main() -> None:
    root = Path(tempfile.mkdtemp())
    try:
        cases = [json.loads(line) for line in CASES.read_text().splitlines()]
        for case in cases:
            case["vllm_ids"] = ids(tokenizer_dir(root, case["template"]), case["kind"], case["body"])
        CASES.write_text("".join(json.dumps(c) + "\n" for c in cases))
        print(f"recorded {len(cases)} cases into {CASES}")
        formats = json.loads(FORMATS.read_text())
        for f in formats:
            f["vllm"] = _detect_content_format(f["template"], default="string")
        FORMATS.write_text(json.dumps(formats, indent=1) + "\n")
        print(f"recorded {len(formats)} content formats into {FORMATS}")
    finally:
        shutil.rmtree(root)


if __name__ == "__main__":
    main()
