"""The package's import graph has no cycle, and no decision is looked up by a name built at run time.

Every import counts, also one deferred into a function or kept for type checkers: a deferred import
hides a cycle from the interpreter, not from a reader, and the next refactor that moves it to the top
turns it into an import error."""
from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "vllm_allowed_tools"
ROOT = PACKAGE.name


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imported(module: str, path: Path, tree: ast.AST, modules: set[str]) -> set[str]:
    """The package's modules ``module`` imports (``from .x import y`` counts ``x`` and, when ``y``
    is a module, ``x.y``); a package imports its parents' ``__init__`` too."""
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[:len(package) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            found.add(target)
            found.update(f"{target}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    edges = set()
    for target in found & modules:
        edges.add(target)
        parts = target.split(".")
        edges.update(".".join(parts[:i]) for i in range(1, len(parts))
                     if not module.startswith(".".join(parts[:i])))
    edges.discard(module)
    return edges & modules


def import_graph() -> dict[str, set[str]]:
    paths = {_module_name(path): path for path in PACKAGE.rglob("*.py")}
    modules = set(paths)
    return {name: _imported(name, path, ast.parse(path.read_text()), modules)
            for name, path in paths.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_the_package_has_no_import_cycle() -> None:
    found = cycles(import_graph())
    assert not found, "import cycles (break each by moving what both sides need below them): " + \
        "; ".join(" <-> ".join(m.removeprefix(ROOT + ".") for m in cycle) for cycle in found)


def test_the_cycle_finder_finds_a_cycle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert cycles(graph) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_the_graph_sees_deferred_and_type_checking_imports() -> None:
    tree = ast.parse("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .b import X\n"
                     "def f():\n    from ..c import y\n")
    modules = {f"{ROOT}.p.a", f"{ROOT}.p.b", f"{ROOT}.c", f"{ROOT}.p", ROOT}
    edges = _imported(f"{ROOT}.p.a", PACKAGE / "p" / "a.py", tree, modules)
    assert {f"{ROOT}.p.b", f"{ROOT}.c"} <= edges


def _names_built_for_lookup(tree: ast.AST) -> list[int]:
    """Lines where ``getattr`` / ``hasattr`` is given a name assembled at run time (an f-string, a
    concatenation, ``%`` or ``.format``): a decision made by whatever method happens to be named
    so."""
    lines = []
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                and node.func.id in ("getattr", "hasattr") and len(node.args) >= 2):
            name = node.args[1]
            if isinstance(name, (ast.JoinedStr, ast.BinOp)) or (
                    isinstance(name, ast.Call) and isinstance(name.func, ast.Attribute)
                    and name.func.attr == "format"):
                lines.append(node.lineno)
    return lines


def test_no_decision_is_looked_up_by_a_built_name() -> None:
    found = [f"{path.relative_to(PACKAGE)}:{line}" for path in sorted(PACKAGE.rglob("*.py"))
             for line in _names_built_for_lookup(ast.parse(path.read_text()))]
    assert not found, f"getattr with a name built at run time (use a typed method): {found}"


def test_a_built_name_lookup_is_found() -> None:
    tree = ast.parse('getattr(f, f"is_{kind}_allowed")\ngetattr(f, "is_" + kind)\n'
                     'getattr(f, "x_{}".format(k))\ngetattr(f, "catalog", None)\n')
    assert _names_built_for_lookup(tree) == [1, 2, 3]
