"""The architecture cannot rot silently: no module imports from a layer above its own
(docs/architecture.md, The folders) and no modules of a subpackage import each other round about,
every subpackage ships in the wheel, modules and classes stay small, and every module says what it
is in a docstring of at least two lines."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = {"tahnode": ROOT / "node", "tahnode.kernels": ROOT / "kernels", "tahnode.proto": ROOT / "proto",
           "tahnode.configs": ROOT / "configs"}
GENERATED = {"tahnode.proto.tahnode_pb2", "tahnode.proto.tahnode_pb2_grpc"}

# Lowest first. A module may import from its own part or a lower layer; parts on the same layer
# (the daemon and the coordinator) never import each other.
LAYERS = [
    {"proto", "kernels", "configs", "tahnode"},  # "tahnode": the package's own __init__
    {"codecs"},
    {"config"},
    {"train"},
    {"net"},
    {"pipeline"},
    {"daemon", "coordinator"},
    {"tools"},
    {"cli"},
]
RANK = {part: rank for rank, parts in enumerate(LAYERS) for part in parts}
MAX_MODULE_LINES = 400
MAX_LINE = 120
MAX_CLASS_ATTRIBUTES = 15


def modules() -> dict[str, Path]:
    """Module name -> file, for every module of the package."""
    found = {}
    for package, folder in FOLDERS.items():
        for path in sorted(folder.rglob("*.py")):
            rel = path.relative_to(folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            name = ".".join([package, *parts])
            if package == "tahnode" and parts and f"tahnode.{parts[0]}" in FOLDERS:
                continue
            found[name] = path
    return found


def part_of(module: str) -> str | None:
    """The part of the system a tahnode module belongs to (its first name under tahnode)."""
    names = module.split(".")
    if names[0] != "tahnode":
        return None
    return names[1] if len(names) > 1 else "tahnode"


def imports_of(name: str, source: str, is_package: bool) -> list[str]:
    """Every tahnode module `name` imports, at the top or inside functions, relative or absolute."""
    package = name if is_package else name.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            found.append(target)
            found += [f"{target}.{alias.name}" for alias in node.names]  # `from . import codecs`
    return [t for t in found if t.startswith("tahnode.")]


def violations(name: str, source: str, is_package: bool = False) -> list[str]:
    own = part_of(name)
    if own not in RANK:
        return [f"{name} belongs to no layer"]
    bad = []
    for target in imports_of(name, source, is_package):
        other = part_of(target)
        if other not in RANK:
            bad.append(f"{name} imports {target}, which belongs to no layer")
        elif other != own and RANK[other] >= RANK[own]:
            bad.append(f"{name} ({own}) imports {target} ({other}): a layer above or beside it")
    return bad


def test_no_module_imports_from_a_layer_above_its_own():
    found = modules()
    assert "tahnode.pipeline.worker" in found and "tahnode.cli" in found and "tahnode.kernels.tahquant_ref" in found
    bad = [v for name, path in found.items() for v in violations(name, path.read_text(), path.name == "__init__.py")]
    assert bad == []


def test_the_layering_check_catches_upward_and_sideways_imports():
    assert violations("tahnode.pipeline.worker", "from ..coordinator.registry import SwarmRegistry\n")
    assert violations("tahnode.codecs.base", "def f():\n    from tahnode.train.model import StageModel\n")
    assert violations("tahnode.daemon.node", "from ..coordinator import state\n")
    assert violations("tahnode.net", "from ..pipeline import worker\n", is_package=True)
    assert violations("tahnode.kernels.naive_ref", "from .. import codecs\n")
    assert not violations("tahnode.pipeline.worker", "from ..net.transport import FORWARD\nfrom .state import Stats\n")
    assert not violations("tahnode.cli", "from .tools import demo\nfrom .coordinator.server import serve\n")


def import_graph(found: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the modules of its own subpackage it imports (anywhere in it: at the top, in a
    function, under TYPE_CHECKING), the subpackage's __init__ left out."""
    graph = {}
    for name, path in found.items():
        if path.name == "__init__.py":
            continue
        package = name.rpartition(".")[0]
        graph[name] = {t for t in imports_of(name, path.read_text(), False)
                       if t in found and t != name and t.rpartition(".")[0] == package
                       and found[t].name != "__init__.py"}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The circles of `graph` (each once, its modules sorted): modules that import each other, round
    about, are one object spread over several files."""
    found, done = set(), set()

    def walk(node: str, path: list[str]) -> None:
        if node in path:
            found.add(tuple(sorted(path[path.index(node):])))
            return
        if node in done:
            return
        for nxt in sorted(graph.get(node, ())):
            walk(nxt, path + [node])
        done.add(node)

    for node in sorted(graph):
        walk(node, [])
    return [list(c) for c in sorted(found)]


def test_no_circle_of_imports_inside_a_subpackage():
    graph = import_graph(modules())
    assert "tahnode.pipeline.core" in graph["tahnode.pipeline.worker"]
    assert circles(graph) == []


def test_the_circle_check_finds_circles_and_nothing_else():
    assert circles({"a.x": {"a.y"}, "a.y": {"a.z"}, "a.z": {"a.x"}, "a.w": {"a.x"}}) == [["a.x", "a.y", "a.z"]]
    assert circles({"a.x": {"a.y", "a.z"}, "a.y": {"a.z"}, "a.z": set()}) == []
    # the helper that names the worker only for its type annotations still closes a circle
    hidden = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .worker import StageWorker\n"
    graph = {"tahnode.pipeline.inbox": set(imports_of("tahnode.pipeline.inbox", hidden, False)),
             "tahnode.pipeline.worker": {"tahnode.pipeline.inbox"}}
    assert circles(graph) == [["tahnode.pipeline.inbox", "tahnode.pipeline.worker"]]


def test_every_subpackage_ships_in_the_wheel():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(project["packages"])
    folders = {name for name, path in modules().items() if path.name == "__init__.py"}
    assert listed == folders
    for package, folder in FOLDERS.items():
        assert (ROOT / project["package-dir"][package]).resolve() == folder


@pytest.mark.parametrize("name", sorted(n for n in modules() if n not in GENERATED))
def test_module_has_a_docstring_and_stays_small(name):
    path = modules()[name]
    source = path.read_text()
    doc = ast.get_docstring(ast.parse(source))
    assert doc and len(doc.strip().splitlines()) >= 2, f"{path}: say what the module is in two lines or more"
    assert len(source.splitlines()) <= MAX_MODULE_LINES, \
        f"{path} has more than {MAX_MODULE_LINES} lines: split it by job"


def test_no_line_is_longer_than_120_characters():
    """Every Python file of the repository, tests too; the generated protobuf modules aside."""
    files = [path for folder in ("node", "kernels", "proto", "configs", "tests")
             for path in sorted((ROOT / folder).rglob("*.py")) if not path.name.startswith("tahnode_pb2")]
    long = [f"{path.relative_to(ROOT)}:{k}" for path in files
            for k, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1) if len(line) > MAX_LINE]
    assert long == [], f"lines longer than {MAX_LINE} characters: break them inside their brackets"


def test_no_class_holds_more_than_fifteen_attributes():
    big = []
    for name, path in modules().items():
        if name in GENERATED or part_of(name) == "kernels":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                attrs = {t.attr for n in ast.walk(node) for t in getattr(n, "targets", [getattr(n, "target", None)])
                         if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self"}
                if len(attrs) > MAX_CLASS_ATTRIBUTES:
                    big.append(f"{name}.{node.name}: {len(attrs)} attributes ({', '.join(sorted(attrs))})")
    assert big == []


def dynamic_imports(source: str) -> list[str]:
    """The calls in `source` that import a module by a name computed at run time (importlib.import_module,
    __import__): imports the layering check above cannot see."""
    calls = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call):
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
            if name in ("import_module", "__import__"):
                calls.append(f"line {node.lineno}")
    return calls


def test_codecs_reach_their_kernels_through_imports_the_layering_check_sees():
    """Issue 40: a codec's implementations were found by strings and importlib (dispatch's module
    names), out of sight of the import graph; now each codec names its modules (kernels.dispatch.Paths)."""
    assert dynamic_imports("import importlib\nimportlib.import_module(f'tahnode.kernels.{c}_ref')") == ["line 2"]
    found = {name: dynamic_imports(path.read_text()) for name, path in modules().items()}
    assert {name: calls for name, calls in found.items() if calls} == {}  # the benches too (issue 63): cli's table


def test_every_bench_the_cli_lists_is_in_its_table_of_modules():
    from tahnode import cli

    modules = cli.bench_modules()
    assert set(modules) == set(cli.BENCHES)
    assert all(module.__name__ == f"tahnode.tools.bench_{name}" and callable(module.main)
               for name, module in modules.items())
