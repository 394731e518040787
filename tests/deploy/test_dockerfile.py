"""deploy/Dockerfile's build stage gets every file the package build reads from the source tree, at
the path it has in the repository: pyproject.toml, setup.py, the `readme` and every `license-files`
match. Until 2026-12-06 it left LICENSE out: setuptools warned `Pattern 'LICENSE' did not match any
files` (deprecated, an error after 2027-02-18) and the image shipped without the license text."""

from __future__ import annotations

import posixpath
import re
import shlex
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "deploy" / "Dockerfile"


def _build_stage() -> str:
    """The stage that builds the wheel (`pip wheel`)."""
    stages = re.split(r"(?m)^FROM\s", DOCKERFILE.read_text())[1:]
    (build,) = [s for s in stages if "pip wheel" in s]
    return build


def _copied(stage: str) -> set[str]:
    """The build-context paths each COPY of `stage` takes, checked to land at the same path under
    the WORKDIR (`COPY a b ./` puts a at ./a; `COPY d d` puts d at ./d)."""
    copied: set[str] = set()
    for line in stage.splitlines():
        if not line.startswith("COPY "):
            continue
        words = shlex.split(line, comments=True)
        assert not any(w.startswith("--from") for w in words), line  # another stage's files, not the context's
        *sources, dest = [w for w in words[1:] if not w.startswith("--")]
        for source in sources:
            lands = posixpath.join(dest, posixpath.basename(source)) if dest.endswith("/") else dest
            assert posixpath.normpath(lands) == posixpath.normpath(source), f"{line}: {source} lands at {lands}"
            copied.add(posixpath.normpath(source))
    return copied


def _needed() -> list[str]:
    """What the build reads beside the packages: its two configs, the readme, the license files."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    readme = project["readme"]
    needed = ["pyproject.toml", "setup.py", readme if isinstance(readme, str) else readme["file"]]
    for pattern in project.get("license-files", []):
        matches = sorted(p.relative_to(ROOT).as_posix() for p in ROOT.glob(pattern) if p.is_file())
        assert matches, f"pyproject.toml's license-files pattern {pattern!r} matches no file"
        needed += matches
    return needed


def _covered(path: str, copied: set[str]) -> bool:
    return any(path == c or path.startswith(f"{c}/") for c in copied)


def test_the_build_stage_copies_every_file_pyproject_names() -> None:
    copied = _copied(_build_stage())
    missing = [path for path in _needed() if not _covered(path, copied)]
    assert missing == [], f"deploy/Dockerfile's build stage does not COPY {missing}"


def test_the_check_sees_a_file_left_out() -> None:
    stage = "python:3.11-slim AS build\nCOPY pyproject.toml setup.py README.md ./\nCOPY protocol protocol\n"
    copied = _copied(stage)
    assert _covered("protocol/hashing.py", copied) and not _covered("LICENSE", copied)
    assert "LICENSE" in _needed()
