"""The package layering is a checked contract: import-linter's contracts in pyproject.toml
hold and name every package, no module imports itself back through others, imports sit at module
level (except optional dependencies), and no private name crosses a module boundary."""

from __future__ import annotations

import ast
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Set

import grimp

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "recshard"
# imported where used, so recshard works without them (fbgemm may fail to load its .so)
OPTIONAL = {"fbgemm_gpu", "yaml", "matplotlib"}


def test_import_linter_contracts_hold() -> None:
    lint = shutil.which("lint-imports", path=str(Path(sys.executable).parent)) or "lint-imports"
    done = subprocess.run([lint, "--no-cache"], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


def test_every_package_sits_in_a_layer() -> None:
    """A new package must be placed in the layers (and in docs/layout.md), not left unchecked."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    (layers,) = [c["layers"] for c in config["contracts"] if c["name"] == "recshard layers"]
    placed = {name.strip() for layer in layers for name in layer.split("|")}
    packages = {f"recshard.{p.name}" for p in PACKAGE.iterdir() if (p / "__init__.py").exists()}
    modules = {f"recshard.{p.stem}" for p in PACKAGE.glob("*.py") if p.stem != "__init__"}
    assert sorted((packages | modules) - placed) == []


def _layout_rows() -> List[List[str]]:
    """The rows of docs/layout.md's package table: layer, package, what, imports."""
    rows = []
    for line in (ROOT / "docs" / "layout.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 4 and cells[0].isdigit():
            rows.append(cells)
    return rows


def _layer_of() -> Dict[str, int]:
    """Package name (without `recshard.`) -> its layer in pyproject.toml, 1 at the bottom."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    (layers,) = [c["layers"] for c in config["contracts"] if c["name"] == "recshard layers"]
    return {
        name.strip().removeprefix("recshard."): len(layers) - i
        for i, layer in enumerate(layers)
        for name in layer.split("|")
    }


def test_layout_doc_matches_the_import_graph() -> None:
    """docs/layout.md's "What is where" gives each package's layer as in pyproject.toml and
    the packages it imports as the import graph has them."""
    layer_of = _layer_of()
    graph = grimp.build_graph("recshard", cache_dir=None)
    imported: Dict[str, Set[str]] = {name: set() for name in layer_of}
    for module in graph.modules:
        parts = module.split(".")
        if len(parts) < 2:
            continue
        for target in graph.find_modules_directly_imported_by(module):
            other = target.split(".")
            if len(other) > 1 and other[1] != parts[1]:
                imported[parts[1]].add(other[1])
    documented = {}
    for layer, package, _, imports in _layout_rows():
        name = package.strip("`")
        said = set() if imports.startswith("nothing") else {i.strip() for i in imports.split(",")}
        documented[name] = (int(layer), said)
    actual = {name: (layer_of[name], imported[name]) for name in layer_of}
    wrong = [
        f"{name}: docs/layout.md says {documented.get(name)}, the contract and graph give "
        f"layer {layer}, imports {', '.join(sorted(imports)) or 'nothing'}"
        for name, (layer, imports) in sorted(actual.items())
        if documented.get(name) != (layer, imports)
    ] + [f"{name}: in docs/layout.md, not a package" for name in documented if name not in actual]
    assert wrong == []


def test_readme_layers_match_the_contract() -> None:
    """The README's short "What is where" puts each package in its pyproject.toml layer."""
    layer_of = _layer_of()
    readme: Dict[str, int] = {}
    for line in (ROOT / "README.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 2 and cells[0].isdigit():
            for name in re.findall(r"`(\w+)` \(", cells[1]):
                readme[name] = int(cells[0])
    assert readme == layer_of


def _cycles(edges: Dict[str, Set[str]]) -> List[List[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    found: List[List[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in edges[node]:
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = [stack.pop()]
            while component[-1] != node:
                component.append(stack.pop())
            if len(component) > 1:
                found.append(sorted(component))

    for node in edges:
        if node not in index:
            visit(node)
    return found


def test_no_module_imports_itself_back() -> None:
    graph = grimp.build_graph("recshard", cache_dir=None)
    edges = {m: graph.find_modules_directly_imported_by(m) for m in graph.modules}
    # a package's __init__ re-exporting its own modules is not a cycle between modules
    edges = {m: {d for d in ds if not m.startswith(d + ".")} for m, ds in edges.items()}
    assert _cycles(edges) == []


def _imports(tree: ast.AST) -> List[ast.AST]:
    return [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))]


def test_imports_sit_at_module_level_except_optional_dependencies() -> None:
    late = []
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text())
        top = (
            {id(n) for n in tree.body}
            | {
                id(n)
                for node in tree.body
                if isinstance(node, ast.If)
                for n in node.body  # TYPE_CHECKING
            }
            | {id(n) for node in tree.body if isinstance(node, ast.Try) for n in node.body}
        )
        for node in _imports(tree):
            if id(node) in top:
                continue
            names = (
                [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else [a.name for a in node.names]
            )
            if any(name.split(".")[0] not in OPTIONAL for name in names):
                late.append(f"{path.relative_to(ROOT)}:{node.lineno}: {names}")
    assert late == []


def test_no_private_name_is_imported_across_modules() -> None:
    private = []
    for path in sorted(list(PACKAGE.rglob("*.py")) + list((ROOT / "tests").rglob("*.py"))):
        for node in _imports(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("recshard"):
                private += [
                    f"{path.relative_to(ROOT)}:{node.lineno}: {a.name}"
                    for a in node.names
                    if a.name.startswith("_")
                ]
    assert private == []
