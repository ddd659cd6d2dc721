"""The server's packages import only the layers below them (docs/design/server-layers.md)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "server" / "tokensampler_server"
# From the top; a layer may import itself and every layer after it.
LAYERS = ["app", "rpc", "validation", "batching", "workloads", "backends", "model", "resources", "core"]
# Packages that share a floor: neither imports the other.
SIBLINGS = {frozenset({"batching", "workloads"})}


def _layer(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if parts[0] == "tokensampler_server" and len(parts) > 1 and parts[1] in LAYERS else None


def _imports(path: Path) -> list[str]:
    """The tokensampler_server modules a file imports, relative imports resolved."""
    package = ["tokensampler_server", *path.relative_to(PACKAGE).parent.parts]
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            found += [module] + [f"{module}.{alias.name}" for alias in node.names]
    return found


def test_every_import_runs_down_the_layers() -> None:
    upward = []
    for path in sorted(PACKAGE.rglob("*.py")):
        own = _layer("tokensampler_server." + ".".join(path.relative_to(PACKAGE).with_suffix("").parts))
        if own is None:
            continue
        for module in _imports(path):
            target = _layer(module)
            if target is None or target == own:
                continue
            if LAYERS.index(target) < LAYERS.index(own) or frozenset({own, target}) in SIBLINGS:
                upward.append(f"{path.relative_to(PACKAGE)} imports {module}")
    assert not upward, "imports that run up the layers:\n" + "\n".join(upward)


def test_every_package_is_a_layer() -> None:
    packages = {p.parent.name for p in PACKAGE.glob("*/__init__.py")}
    assert packages == set(LAYERS), f"packages {sorted(packages ^ set(LAYERS))} are not in the layer list"
