"""The package's shape, checked: a reader finds each role in one folder, and no part outgrows what a
reader can hold (the limits docs/architecture.md's layout section states). And the tests' own: no
test module imports another (what they share is in tests/support/), and every test checks something."""
from __future__ import annotations

import ast
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "vllm_allowed_tools"
MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 60
ROLES = ("request", "decode", "response", "approvals", "dispatch", "formats", "grammars", "templates",
         "asgi", "vllm_glue", "devtools")


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


def _package_imports(path: Path) -> set[str]:
    """The package modules ``path`` imports from (``from .x import y``, ``from ..x import y``,
    ``from vllm_allowed_tools.x import y``), as paths relative to the package: ``vllm_glue/x.py``,
    or a package's ``__init__.py``."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.ImportFrom):
            continue
        parts = node.module.split(".") if node.module else []
        if node.level:   # level 1: this module's folder, 2: the one above it, ...
            base = path.relative_to(PACKAGE).parents[node.level - 1]
        elif parts[:1] == [PACKAGE.name]:
            base, parts = Path(), parts[1:]
        else:
            continue
        target = base.joinpath(*parts)
        for alias in node.names:   # a module imported from a package, else the module itself
            candidates = [target / f"{alias.name}.py",
                          *([target.with_suffix(".py")] if parts else []), target / "__init__.py"]
            existing = [str(c) for c in candidates if (PACKAGE / c).is_file()]
            found.update(existing[:1])
    return found


def _reaches_vllm(module: str, seen: set[str]) -> bool:
    """Whether a package module imports vLLM, itself or through the package modules it imports."""
    if module in seen:
        return False
    seen.add(module)
    path = PACKAGE / module
    return "vllm" in _imports(path) or any(_reaches_vllm(other, seen) for other in _package_imports(path))


def test_only_the_glue_imports_vllm() -> None:
    outside = [str(p.relative_to(PACKAGE)) for p in _modules()
               if "vllm" in _imports(p) and p.relative_to(PACKAGE).parts[0] != "vllm_glue"]
    assert not outside, f"modules outside vllm_glue/ that import vLLM: {outside}"


def test_the_glue_is_exactly_the_vllm_facing_layer() -> None:
    """Every vllm_glue/ module faces vLLM (imports it, itself or through a module it builds on);
    one that does not belongs to the plain layers (asgi/, request/, ...)."""
    plain = [str(p.relative_to(PACKAGE)) for p in sorted((PACKAGE / "vllm_glue").glob("*.py"))
             if p.name != "__init__.py" and not _reaches_vllm(str(p.relative_to(PACKAGE)), set())]
    assert not plain, f"vllm_glue/ modules that import no vLLM (move them out of the glue): {plain}"


def test_the_asgi_layer_reaches_no_vllm() -> None:
    """asgi/ runs on plain ASGI: no vLLM import, and nothing from the glue (which the glue's own
    middleware builds it with)."""
    reaching = [str(p.relative_to(PACKAGE)) for p in sorted((PACKAGE / "asgi").glob("*.py"))
                if _reaches_vllm(str(p.relative_to(PACKAGE)), set())
                or any(m.startswith("vllm_glue/") for m in _package_imports(p))]
    assert not reaching, f"asgi/ modules that reach vLLM or vllm_glue/: {reaching}"


def test_the_import_scan_resolves_relative_and_absolute_imports() -> None:
    middleware = PACKAGE / "vllm_glue" / "middleware.py"
    assert {"asgi/guarding_middleware.py", "settings.py", "vllm_glue/capabilities.py"} <= _package_imports(middleware)
    assert _reaches_vllm("vllm_glue/middleware.py", set())   # through capabilities.py
    assert not _reaches_vllm("asgi/guarding_middleware.py", set())


def _layout_entries() -> set[str]:
    """The package's entries docs/architecture.md's layout block names (``name/`` or ``name.py``)."""
    text = (PACKAGE.parent / "docs" / "architecture.md").read_text()
    block = text.split("## Layout", 1)[1].split("```text", 1)[1].split("```", 1)[0]
    package_lines = block.split("vllm_allowed_tools/\n", 1)[1].split("\ndocs/", 1)[0]
    return {match.group(1) for line in package_lines.splitlines()
            for match in re.finditer(r"(?:^|;)\s{2,}([a-z_]+(?:/|\.py))(?=\s)", line)}


def test_the_documented_layout_is_the_tree() -> None:
    """A newcomer reads the layout to find a module's home: every top-level folder and module is in
    it, and nothing it names is gone."""
    tree = {f"{p.name}/" for p in PACKAGE.iterdir() if p.is_dir() and p.name != "__pycache__"}
    tree |= {p.name for p in PACKAGE.glob("*.py") if p.name != "__init__.py"}
    documented = _layout_entries()
    assert documented == tree, (f"docs/architecture.md's layout lacks {sorted(tree - documented)} "
                                f"and names {sorted(documented - tree)}, which the package does not hold")



def _test_module_imports(source: str) -> list[str]:
    """``line: module`` for each import in ``source`` of a test module (``test_*``) or of
    ``conftest``, at any depth (a function's own imports too)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            modules = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            modules = [node.module]
        else:
            continue
        found += [f"{node.lineno}: {module}" for module in modules
                  if module.split(".")[0] == "conftest" or module.split(".")[0].startswith("test_")]
    return sorted(found, key=lambda where: int(where.split(":")[0]))


def test_no_test_module_imports_another_or_conftest() -> None:
    """What test modules share lives in tests/support/ (one module per concern): a test module that
    imports another runs that module's imports and fixtures as its own, and ties the two together."""
    tests = Path(__file__).resolve().parent
    found = [f"tests/{path.name}:{where}" for path in sorted(tests.glob("test_*.py"))
             for where in _test_module_imports(path.read_text())]
    assert not found, ("test modules that import a test module or conftest (what they share belongs "
                       f"in tests/support/): {found}")


def test_the_test_import_scan_finds_every_kind_of_import() -> None:
    source = ("import test_a\nimport os, test_b as b\nfrom test_c import x\nfrom conftest import y\n"
              "def f():\n    from test_d import z\nfrom support.test_e import w\nimport conftest\n"
              "from support import servers\n")
    assert _test_module_imports(source) == ["1: test_a", "2: test_b", "3: test_c", "4: conftest",
                                            "6: test_d", "8: conftest"]


#: pytest's own checks, which a test may make instead of an ``assert`` (``pytest.raises(...)``, ...)
_PYTEST_CHECKS = frozenset({"raises", "warns", "deprecated_call", "fail", "skip", "xfail", "importorskip"})


def _checks_itself(function: ast.AST) -> bool:
    """Whether ``function`` (its nested functions too) asserts, calls one of pytest's checks, or
    calls something named ``assert*`` (a mock's ``assert_called_once``, a helper of the package)."""
    for node in ast.walk(function):
        if isinstance(node, ast.Assert):
            return True
        if isinstance(node, ast.Call):
            name = getattr(node.func, "attr", getattr(node.func, "id", ""))
            if name.startswith("assert") or (name in _PYTEST_CHECKS and isinstance(node.func, ast.Attribute)
                                             and getattr(node.func.value, "id", None) == "pytest"):
                return True
    return False


def _names_in_scope(module: str, tree: ast.Module, modules: set[str]) -> tuple[dict, dict]:
    """A module's functions and the ones it imports from the other ``modules`` (name: (module,
    function)), and the modules it imports whole (name: module)."""
    functions, whole = {}, {}
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            functions[node.name] = (module, node.name)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            for alias in node.names:
                if f"{node.module}.{alias.name}" in modules:
                    whole[alias.asname or alias.name] = f"{node.module}.{alias.name}"
                elif node.module in modules:
                    functions[alias.asname or alias.name] = (node.module, alias.name)
        elif isinstance(node, ast.Import):
            whole.update({alias.asname: alias.name for alias in node.names
                          if alias.asname and alias.name in modules})
    return functions, whole


def _tests_that_check_nothing(sources: dict[str, str]) -> list[str]:
    """``module:line name`` of each ``test*`` function of the ``test_*`` modules in ``sources``
    (module name: source; tests/support/'s helpers among them) that checks nothing: no check of its
    own (``_checks_itself``), and no use of a function of ``sources`` that checks, itself or through
    the functions it uses."""
    trees = {module: ast.parse(source) for module, source in sources.items()}
    uses, checking, tests = {}, set(), []
    for module, tree in trees.items():
        functions, whole = _names_in_scope(module, tree, set(trees))
        for node in ast.walk(tree):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            key = (module, node.name, node.lineno)
            uses[key] = {functions[n.id] for n in ast.walk(node)
                         if isinstance(n, ast.Name) and n.id in functions}
            uses[key] |= {(whole[n.value.id], n.attr) for n in ast.walk(node)
                          if isinstance(n, ast.Attribute) and getattr(n.value, "id", None) in whole}
            if _checks_itself(node):
                checking.add(key[:2])
            if module.startswith("test_") and node.name.startswith("test"):
                tests.append(key)
    grown = True
    while grown:
        before = len(checking)
        checking |= {key[:2] for key, used in uses.items() if used & checking}
        grown = len(checking) > before
    return [f"{module}:{line} {name}" for module, name, line in tests if (module, name) not in checking]


def test_every_test_checks_something() -> None:
    """A test whose body asserts nothing (no ``assert``, no ``pytest.raises``, no helper that
    asserts) passes whatever the code does: it only shows that what it ran did not raise."""
    tests = Path(__file__).resolve().parent
    sources = {".".join(path.relative_to(tests).with_suffix("").parts): path.read_text()
               for path in sorted([*tests.glob("test_*.py"), *(tests / "support").rglob("*.py")])}
    idle = _tests_that_check_nothing(sources)
    assert not idle, f"test functions that check nothing (assert what the feature must give): {idle}"


def test_the_check_scan_follows_helpers_through_support() -> None:
    sources = {
        "support.helpers": ("def check(x):\n    assert x\ndef wrap(x):\n    check(x)\n"
                            "def idle(x):\n    return x\n"),
        "test_a": ("import pytest\nfrom support.helpers import wrap, idle\nfrom support import helpers\n"
                   "def test_asserts():\n    assert 1\n"                                   # 4
                   "def test_through_a_helper():\n    wrap(1)\n"                            # 6
                   "def test_through_the_module():\n    helpers.check(1)\n"                 # 8
                   "def test_raises():\n    with pytest.raises(ValueError):\n        int('x')\n"
                   "def test_mock(m):\n    m.assert_called_once()\n"                       # 13
                   "def local():\n    assert 2\n"
                   "def test_local():\n    local()\n"                                      # 17
                   "def test_idle():\n    idle(1)\n"                                      # 19
                   "def test_hands_a_helper_on():\n    list(map(wrap, [1]))\n"             # 21
                   "class TestThing:\n    def test_method(self):\n        helpers.idle(1)\n"),
        "support.other": "def test_like_but_a_helper():\n    pass\n",
    }
    assert _tests_that_check_nothing(sources) == ["test_a:19 test_idle", "test_a:24 test_method"]


def test_the_wire_package_sits_at_the_bottom() -> None:
    """wire/ is what the API-server process and the engine agree on: it imports nothing from the role
    folders (only call_filter.py and errors.py, which import nothing of the package), so both sides
    load it without loading each other."""
    allowed = {"call_filter.py", "errors.py"}
    reaching = {str(p.relative_to(PACKAGE)): sorted(m for m in _package_imports(p)
                                                    if m not in allowed and not m.startswith("wire/"))
                for p in sorted((PACKAGE / "wire").glob("*.py"))}
    reaching = {module: found for module, found in reaching.items() if found}
    assert not reaching, f"wire/ modules that import the role folders: {reaching}"
    assert all(not _package_imports(PACKAGE / module) for module in allowed)


#: the reads of ``tool_choice`` outside wire/ (which parses it), each as (module, expression): none
#: parses it; each only passes the value on or reads back what the plugin wrote (the test clients that
#: read the bodies they built and the echoes they got back are in tests/support/, not the package).
TOOL_CHOICE_READS = {
    ("request/rewrite.py", 'body.get("tool_choice")'):
        "the client's own choice, kept as sent to be echoed back (echo_of, restore_echo)",
    ("response/openai_extensions.py", 'response.get("tool_choice")'):
        "a Responses object's echo of the choice, reshaped for the conformance check: an answer",
}


def _tool_choice_reads(source: str) -> list[str]:
    """The expressions in ``source`` that read a ``tool_choice`` field: ``x.get("tool_choice")``
    (or ``pop``), ``x["tool_choice"]``, ``getattr(x, "tool_choice", ...)``, ``x.tool_choice``;
    writes are not reads."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and node.args and isinstance(node.func, ast.Attribute) \
                and node.func.attr in ("get", "pop") and _is_key(node.args[0]):
            found.append(node)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
                and node.func.id == "getattr" and len(node.args) > 1 and _is_key(node.args[1]):
            found.append(node)
        elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load) and _is_key(node.slice):
            found.append(node)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load) \
                and node.attr == "tool_choice":
            found.append(node)
    return [ast.get_source_segment(source, node) or "" for node in found]


def _is_key(node: ast.AST) -> bool:
    return isinstance(node, ast.Constant) and node.value == "tool_choice"


def test_the_tool_choice_scan_finds_reads_not_writes() -> None:
    source = ('a = body.get("tool_choice")\nb = body["tool_choice"]\nc = getattr(r, "tool_choice", None)\n'
              'd = r.tool_choice == "required"\nbody["tool_choice"] = "auto"\nr.tool_choice = "auto"\n'
              'e = {"tool_choice": 1}\n"""a docstring naming request.tool_choice"""\n')
    assert sorted(_tool_choice_reads(source)) == sorted([
        'body.get("tool_choice")', 'body["tool_choice"]', 'getattr(r, "tool_choice", None)',
        "r.tool_choice"])


def test_only_the_wire_package_reads_tool_choice() -> None:
    """One parser of the client's ``tool_choice`` (wire/tool_choice.py): any other module that reads
    the field is a second parser, with its own idea of the shapes and its own error texts."""
    reads = sorted((str(p.relative_to(PACKAGE)), expression) for p in _modules()
                   if p.relative_to(PACKAGE).parts[0] != "wire"
                   for expression in _tool_choice_reads(p.read_text()))
    assert reads == sorted(TOOL_CHOICE_READS), (
        "tool_choice is read outside wire/ (read it with wire.read_tool_choice / tool_choice_of, or "
        f"list a pass-through in TOOL_CHOICE_READS with its reason): {reads}")


#: the parts of the package from the top floor down: a part imports only parts on its own floor or
#: below (docs/architecture.md draws the same order); a part not named here is a ground-floor file.
#: A part is a folder, a folder inside one (devtools/models: the models the commands build and
#: serve, below the commands), or a module; a module's part is the longest that holds it.
FLOORS = (("devtools",), ("devtools/models",), ("vllm_glue",), ("asgi",), ("server_tools",), ("approvals",),
          ("decode", "response", "dispatch"), ("settings.py",), ("arguments.py",), ("request",),
          ("wire", "formats"))
#: upward arrows still standing, each with why (the list only shrinks)
UPWARD_KNOWN: dict[tuple[str, str], str] = {}


def _floor(module: str) -> int:
    path = Path(module).parts
    holding = [(len(Path(part).parts), n) for n, parts in enumerate(FLOORS) for part in parts
               if path[:len(Path(part).parts)] == Path(part).parts]
    return max(holding)[1] if holding else len(FLOORS)


def test_a_module_is_on_the_floor_of_the_longest_part_holding_it() -> None:
    assert _floor("devtools/commands.py") == 0 and _floor("devtools/serve.py") == 0
    assert _floor("devtools/models/tiny_model.py") == 1
    assert _floor("settings.py") == FLOORS.index(("settings.py",))
    assert _floor("cpu_build.py") == len(FLOORS)


def test_no_import_runs_back_up_between_the_parts() -> None:
    """A part that imports one above it ties the lower layer to the upper one's changes (and to its
    imports): what the lower part needs moves down, or the upper part lends it as a parameter."""
    upward = {(str(p.relative_to(PACKAGE)), target) for p in _modules()
              for target in _package_imports(p)
              if _floor(target) < _floor(str(p.relative_to(PACKAGE)))}
    assert upward == set(UPWARD_KNOWN), (
        f"imports that run back up a floor: {sorted(upward - set(UPWARD_KNOWN))}; gone from the known "
        f"list (take them out of UPWARD_KNOWN): {sorted(set(UPWARD_KNOWN) - upward)}")


def test_every_module_has_a_file_name_of_its_own() -> None:
    """Two ``errors.py`` (or ``turn.py``, ``calls.py``) are two tabs of the same name in an editor and
    two hits for one word in a search: each module's file name says which part it belongs to."""
    by_name: dict[str, list[str]] = {}
    for path in _modules():
        if path.name != "__init__.py":
            by_name.setdefault(path.name, []).append(str(path.relative_to(PACKAGE)))
    shared = {name: paths for name, paths in by_name.items() if len(paths) > 1}
    assert not shared, f"file names used more than once in the package: {shared}"
