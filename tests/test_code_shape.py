"""The package's shape, checked: a reader finds each role in one folder, and no part outgrows what a
reader can hold (the limits docs/architecture.md's layout section states)."""
from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "vllm_allowed_tools"
MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 60
ROLES = ("request", "decode", "response", "approvals", "dispatch", "formats", "grammars", "templates",
         "vllm_glue", "devtools", "testing")


def _modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def test_every_role_is_a_folder() -> None:
    missing = [role for role in ROLES if not (PACKAGE / role).is_dir()]
    assert not missing, f"role folders missing from the layout: {missing}"


def test_no_module_over_the_line_limit() -> None:
    long = {str(p.relative_to(PACKAGE)): n for p in _modules()
            if (n := p.read_text().count("\n")) > MAX_MODULE_LINES}
    assert not long, f"modules over {MAX_MODULE_LINES} lines: {long}"


def test_no_function_over_the_line_limit() -> None:
    long = []
    for path in _modules():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(PACKAGE)}:{node.lineno} {node.name} ({lines})")
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines: {long}"


def _imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def test_only_the_glue_imports_vllm() -> None:
    outside = [str(p.relative_to(PACKAGE)) for p in _modules()
               if "vllm" in _imports(p) and p.relative_to(PACKAGE).parts[0] != "vllm_glue"]
    assert not outside, f"modules outside vllm_glue/ that import vLLM: {outside}"
