"""The kvswitch command lines README.md and docs/*.md give, as a reader would copy them: from code
blocks (a `$ ` prompt, `\\` continuations and `# ` comments taken off) and from inline code."""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["DocCommand", "commands_in"]

# What runs a kvswitch program: `kvswitch SUB`, `python -m MODULE` of this tree, `make TARGET`.
_KVSWITCH = re.compile(r"^(?:\S*/)?kvswitch$")
_PYTHON = re.compile(r"^(?:\S*/)?python3?$")
_OWN_MODULES = ("bench", "router", "engine_sim", "worker_shim", "kvswitch", "protocol", "discovery", "runtime")
# Words before the program that only wrap it: `time`, `/usr/bin/time -v`.
_WRAPPERS = {"time": 0, "/usr/bin/time": 1}
_ENV = re.compile(r"^[A-Z_][A-Z0-9_]*=")
_CONTROL = {"|", "||", "&&", ";", "&", ">", ">>", "<", "2>", "2>&1", "&>"}
_INLINE = re.compile(r"`([^`]+)`")
_FENCE = re.compile(r"^\s*```")


@dataclass(frozen=True)
class DocCommand:
    """One command: where it is, the variables set before it, its words (program first), the text
    it was read from, and whether that was inline code (which may name a command or a flag without
    the rest of a command line) or a line of a code block (a whole command)."""

    file: str
    line: int
    env: dict[str, str] = field(compare=False)
    argv: tuple[str, ...]
    source: str
    inline: bool

    @property
    def text(self) -> str:
        return " ".join([*(f"{k}={v}" for k, v in self.env.items()), *self.argv])

    @property
    def where(self) -> str:
        return f"{self.file}:{self.line}"


def _words(text: str) -> list[str] | None:
    lexer = shlex.shlex(text, posix=True, punctuation_chars="|&;<>")
    lexer.whitespace_split = True
    lexer.commenters = "#"
    try:
        return list(lexer)
    except ValueError:  # an unclosed quote: prose, not a command
        return None


def _command(words: list[str]) -> tuple[dict[str, str], tuple[str, ...]] | None:
    """The variables and words of the first command in `words` when it runs a kvswitch program."""
    env: dict[str, str] = {}
    i = 0
    while i < len(words) and _ENV.match(words[i]):
        name, value = words[i].split("=", 1)
        env[name] = value
        i += 1
    while i < len(words) and words[i] in _WRAPPERS:
        i += 1 + _WRAPPERS[words[i]]
    end = next((j for j in range(i, len(words)) if words[j] in _CONTROL), len(words))
    argv = words[i:end]
    if len(argv) < 2:
        return None
    program = argv[0]
    if _KVSWITCH.match(program):
        # `kvswitch up: stopped`, `kvswitch bench compare: SIGINT ...`: what a subcommand prints
        return None if any(w.endswith(":") for w in argv[1:3]) else (env, ("kvswitch", *argv[1:]))
    if _PYTHON.match(program) and argv[1] == "-m" and len(argv) > 2 and argv[2].split(".")[0] in _OWN_MODULES:
        return env, ("python", *argv[1:])
    if program == "make" and re.match(r"^[a-z][a-z-]*$", argv[1]):
        return env, ("make", *argv[1:])
    return None


Lines = list[tuple[int, str]]


def _blocks(lines: list[str]) -> tuple[list[Lines], Lines]:
    """(the code blocks, the prose lines), each line with its 1-based number."""
    blocks: list[Lines] = []
    prose: Lines = []
    inside = False
    for number, line in enumerate(lines, 1):
        if _FENCE.match(line):
            inside = not inside
            if inside:
                blocks.append([])
            continue
        (blocks[-1] if inside else prose).append((number, line))
    return blocks, prose


def _block_commands(path: str, block: Lines) -> list[DocCommand]:
    """A block's commands; where some lines have a `$ ` prompt, the others are their output."""
    prompted = any(line.lstrip().startswith("$ ") for _, line in block)
    found = []
    pending = ""
    start = 0
    for number, line in block:
        text = line.strip()
        if not pending:
            start = number
            if prompted and not text.startswith("$ "):
                continue
            text = text.removeprefix("$ ")
        if text.endswith("\\"):
            pending += text[:-1] + " "
            continue
        whole = pending + text
        words = _words(whole)
        if words is None and (closed := _words(whole + "'")) and _command(closed):
            # a command whose quoted argument goes on on the next line
            pending = whole + " "
            continue
        pending = ""
        if words and (got := _command(words)):
            found.append(DocCommand(path, start, *got, source=whole, inline=False))
    assert not pending, f"{path}:{start}: a command's quote or continuation runs out of its block"
    return found


def _inline_commands(path: str, prose: list[tuple[int, str]]) -> list[DocCommand]:
    """Inline code spans, which may wrap onto the next line of their paragraph."""
    found = []
    text = "\n".join(line for _, line in prose)
    numbers = [number for number, _ in prose]
    for match in _INLINE.finditer(text):
        span = match.group(1)
        if "\n\n" in span:
            continue
        words = _words(span.replace("\n", " "))
        if words and (got := _command(words)):
            line = numbers[text.count("\n", 0, match.start())]
            found.append(DocCommand(path, line, *got, source=span, inline=True))
    return found


def commands_in(path: Path, root: Path) -> list[DocCommand]:
    name = str(path.relative_to(root))
    blocks, prose = _blocks(path.read_text(encoding="utf-8").splitlines())
    return [c for block in blocks for c in _block_commands(name, block)] + _inline_commands(name, prose)
