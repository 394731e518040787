"""The package graph runs one way (DESIGN.md): each package imports only packages below it, so the
runtime image can leave bench/ out and nothing pulls a package in through a cycle."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# A package may import its own modules and those of lower layers, never a peer or a higher layer.
LAYERS: dict[str, int] = {
    "protocol": 0,
    "runtime": 0,
    "discovery": 1,
    "engine_sim": 2,
    "worker_shim": 2,
    "router": 2,
    "kvswitch": 3,
    "bench": 4,
}


def _imports(path: Path) -> set[str]:
    """Top-level names of every package `path` imports, at module level or inside functions."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module.split(".")[0])
    return found


def _edges() -> dict[str, set[tuple[str, str]]]:
    edges: dict[str, set[tuple[str, str]]] = {p: set() for p in LAYERS}
    for package in LAYERS:
        for path in sorted((ROOT / package).rglob("*.py")):
            for imported in _imports(path) & LAYERS.keys():
                if imported != package:
                    edges[package].add((imported, str(path.relative_to(ROOT))))
    return edges


def test_every_package_imports_only_lower_layers() -> None:
    wrong = [
        f"{where} imports {imported} (layer {LAYERS[imported]} >= {package}'s {LAYERS[package]})"
        for package, edges in _edges().items()
        for imported, where in sorted(edges)
        if LAYERS[imported] >= LAYERS[package]
    ]
    assert not wrong, "\n".join(wrong)


def test_the_package_graph_has_no_cycle() -> None:
    graph = {p: {i for i, _ in e} for p, e in _edges().items()}
    done: set[str] = set()

    def visit(node: str, path: tuple[str, ...]) -> None:
        assert node not in path, f"import cycle: {' -> '.join((*path, node))}"
        if node in done:
            return
        for nxt in sorted(graph[node]):
            visit(nxt, (*path, node))
        done.add(node)

    for package in graph:
        visit(package, ())


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))  # __version__ is public


def _private_imports(path: Path, package: str) -> list[str]:
    """Names `path` (in `package`) takes from another package that are not public: a `_name`, or
    anything from a `_module` (the brief: a package uses another only through its public names)."""
    found: list[str] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            parts = node.module.split(".")
            if parts[0] == package or parts[0] not in LAYERS:
                continue
            found += [f"{node.module}.{a.name}" for a in node.names if _private(a.name)]
            if any(_private(part) for part in parts[1:]):
                found.append(node.module)
        elif isinstance(node, ast.Import):
            found += [
                a.name
                for a in node.names
                if a.name.split(".")[0] in LAYERS.keys() - {package}
                and any(_private(part) for part in a.name.split(".")[1:])
            ]
    return found


def test_no_package_takes_another_packages_private_names() -> None:
    wrong = [
        f"{path.relative_to(ROOT)}: {name}"
        for package in LAYERS
        for path in sorted((ROOT / package).rglob("*.py"))
        for name in _private_imports(path, package)
    ]
    assert not wrong, "\n".join(wrong)


def test_the_checker_sees_a_private_import(tmp_path: Path) -> None:
    module = tmp_path / "m.py"
    module.write_text(
        "from protocol.tokenizer import _SPLIT, BOS_ID\nfrom protocol._fasthash import f\nimport router._x\n"
    )
    assert _private_imports(module, "bench") == ["protocol.tokenizer._SPLIT", "protocol._fasthash", "router._x"]
    assert _private_imports(module, "protocol") == ["router._x"]


def test_the_checker_sees_an_upward_import(tmp_path: Path) -> None:
    module = tmp_path / "m.py"
    module.write_text("def f():\n    from kvswitch.cluster import LocalCluster\n    import bench.cli\n")
    assert _imports(module) == {"kvswitch", "bench"}


def test_every_top_level_package_is_layered() -> None:
    packages = {p.parent.name for p in ROOT.glob("*/__init__.py")} - {"tests"}
    assert packages == LAYERS.keys()


@pytest.mark.parametrize("service", ["router.cli", "worker_shim.cli", "engine_sim.cli", "kvswitch.up"])
def test_services_start_without_bench_or_matplotlib(service: str) -> None:
    """What the runtime image holds: each service's modules import with bench and matplotlib absent."""
    code = (
        "import sys\n"
        "sys.modules['bench'] = sys.modules['matplotlib'] = None\n"
        f"import {service}\n"
        "import router.service, worker_shim.shim, kvswitch.cluster, kvswitch.demo\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr


def test_kvswitch_bench_without_bench_says_it_is_not_in_this_build() -> None:
    code = "import sys\nsys.modules['bench'] = None\nfrom kvswitch.cli import main\nsys.exit(main(['bench']))\n"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert "kvswitch bench: not available in this build" in out.stderr


def test_pyproject_version_is_the_protocol_version() -> None:
    import tomllib

    from protocol.version import __version__

    assert tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"] == __version__
