"""Whether a chat template takes a message's content as text or as a list of parts, decided as
vLLM 0.32 decides it when `--chat-template-content-format` is `auto` (its default): a template with
a loop over a message's content (`{% for part in message['content'] %}`, directly, through a
variable assigned from the messages, or through a macro given the content) takes parts ("openai"),
any other takes text ("string"). The two render differently: parts are not joined by newlines, and
templates often trim them, so routing on the other form gives ids the engine never computes.
"""

from __future__ import annotations

import hashlib
from collections import deque
from collections.abc import Iterator
from typing import Literal

import jinja2
from jinja2 import nodes

__all__ = ["CONTENT_FORMATS", "ContentFormat", "detect_content_format"]

ContentFormat = Literal["string", "openai"]
CONTENT_FORMATS = ("auto", "string", "openai")  # the flag's values, vLLM's


_CACHE_SIZE = 32
# By environment and the template's digest (a client's template may be megabytes): an environment
# with other extensions may parse a template otherwise.
_detected: dict[tuple[int, bytes], ContentFormat] = {}


def detect_content_format(env: jinja2.Environment, template: str) -> ContentFormat:
    """`template`'s content format; "string" when it does not parse (rendering then says why)."""
    key = (id(env), hashlib.sha256(template.encode(errors="surrogatepass")).digest())
    found = _detected.get(key)
    if found is None:
        if len(_detected) >= _CACHE_SIZE:
            _detected.clear()
        found = _detected[key] = _detect(env, template)
    return found


def _detect(env: jinja2.Environment, template: str) -> ContentFormat:
    try:
        ast = env.parse(template)
        return "openai" if next(_content_loops(ast), None) is not None else "string"
    except (jinja2.TemplateError, _Unsure):
        return "string"


class _Unsure(Exception):
    """A loop or assignment target vLLM's detection asserts is a plain name is not one: vLLM then
    takes the default, "string"."""


def _name(target: nodes.Node) -> str:
    if not isinstance(target, nodes.Name):
        raise _Unsure
    return target.name


def _loads(node: nodes.Node, name: str) -> bool:
    return isinstance(node, nodes.Name) and node.ctx == "load" and node.name == name


def _item(node: nodes.Node, name: str, key: str) -> bool:
    """`name[key]` or `name.key`."""
    if isinstance(node, nodes.Getitem):
        return _loads(node.node, name) and isinstance(node.arg, nodes.Const) and node.arg.value == key
    return isinstance(node, nodes.Getattr) and _loads(node.node, name) and node.attr == key


def _reads(node: nodes.Node, name: str, key: str | None = None) -> bool:
    """`node` reads `name` (or its `key`), through filters, tests and slices."""
    if isinstance(node, nodes.Filter):
        return node.node is not None and _reads(node.node, name, key)
    if isinstance(node, nodes.Test):
        return _reads(node.node, name, key)
    if isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Slice):
        return _reads(node.node, name, key)
    return _item(node, name, key) if key else _loads(node, name)


def _aliases(ast: nodes.Template, name: str) -> list[str]:
    """`name` and every variable assigned from it, or from one of those, anywhere. Each name is
    followed once: vLLM's walk re-queues a cycle (`set x = messages`, `set messages = x`) forever,
    which would hold a tokenizer thread for good on one client's template."""
    assigns = list(ast.find_all(nodes.Assign))
    out, seen = [name], {name}
    queue = deque([name])
    while queue:
        current = queue.popleft()
        for assign in assigns:
            if _reads(assign.node, current):
                out.append(target := _name(assign.target))
                if target not in seen:
                    seen.add(target)
                    queue.append(target)
    return out


def _message_names(ast: nodes.Template) -> list[str]:
    """The loop variables of loops over the messages (`{% for message in messages %}`)."""
    sources = _aliases(ast, "messages")
    return [_name(loop.target) for loop in ast.find_all(nodes.For) if any(_reads(loop.iter, s) for s in sources)]


def _content_loops(ast: nodes.Template) -> Iterator[nodes.For]:
    messages = _message_names(ast)

    def is_content(node: nodes.Node) -> bool:
        return any(_reads(node, m, "content") for m in messages)

    # Macro parameters given a message's content, by position or by keyword, and macros' loops.
    params_of_loop: dict[int, set[str]] = {}
    in_macro: set[int] = set()
    for macro in ast.find_all(nodes.Macro):
        names = [a.name for a in macro.args]
        given: set[str] = set()
        for call in ast.find_all(nodes.Call):
            if not (isinstance(call.node, nodes.Name) and call.node.name == macro.name):
                continue
            given.update(names[i] for i, arg in enumerate(call.args[: len(names)]) if is_content(arg))
            given.update(k.key for k in call.kwargs if k.key in names and is_content(k.value))
        for loop in macro.find_all(nodes.For):
            in_macro.add(id(loop))
            if given:
                params_of_loop[id(loop)] = given

    for loop in ast.find_all(nodes.For):
        it = loop.iter
        name = it.name if isinstance(it, nodes.Name) else None
        if (
            is_content(it)
            or (name is not None and name in params_of_loop.get(id(loop), ()))
            or (name == "content" and id(loop) not in in_macro)
        ):
            _name(loop.target)
            yield loop
