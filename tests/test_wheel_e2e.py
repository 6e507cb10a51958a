"""The built wheel, installed and served: what a user gets from ``pip install`` of our wheel.

Every other test imports the source tree (an editable install), where a template or grammar missing
from the package data, or a mistyped entry point, goes unnoticed. This one builds the sdist and the
wheel with ``python -m build`` from a copy of the tree (nothing is written in the checkout), checks
the wheel carries every file of the package byte for byte, declares the project's entry points, and
that the sdist builds the same wheel; installs it into a fresh virtualenv layered over this
interpreter's environment (its own site-packages first, then ours through a ``.pth`` path line, so
vLLM and torch are reused, while the editable install's import hook, itself a ``.pth`` file in ours,
never runs there); proves the package, its data and its entry points resolve to the wheel's copy;
and serves the tiny model from that environment with the one-flag launch (``--tool-call-parser
allowed_hermes``, no ``--middleware``), one ``allowed_tools`` request per API through the SDK.
"""

from __future__ import annotations

import ast
import configparser
import json
import os
import random
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from dataclasses import dataclass
from pathlib import Path

import pytest

from vllm_allowed_tools.devtools.models.tiny_model import ensure_model
from vllm_allowed_tools.devtools.models.tool_pool import POOL_BY_NAME, sample_catalog
from vllm_allowed_tools.devtools.serve import MODEL_TEMPLATE, start_server
from vllm_allowed_tools.formats import wire_formats
from vllm_allowed_tools.settings import STAGE_ENV

from support.calls import chat_calls, responses_calls

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "vllm_allowed_tools"
DISTRIBUTION = "vllm-allowed-tools"
#: the entry points the wheel must carry: each group's entry of ours
ENTRY_POINTS = {"console_scripts": "vllm-allowed-tools", "vllm.general_plugins": "allowed_tools",
                "vllm.logits_processors": "allowed_tools"}
#: outside a git checkout (an unpacked sdist), the folders no build reads
NOT_SOURCE = {".git", ".venv", ".cache", "__pycache__", "build", "dist", "node_modules",
              ".pytest_cache", ".hypothesis"}


# ------------------------------------------------------------------ the source tree and the builds

def source_files(root: Path = ROOT) -> list[str]:
    """The checkout's files as a clean clone holds them (git's view: tracked, and untracked but not
    ignored, so a new template counts before it is committed), relative to `root`."""
    if (root / ".git").exists():
        listed = subprocess.run(["git", "-C", str(root), "ls-files", "-z", "--cached", "--others",
                                 "--exclude-standard"], capture_output=True, check=True, timeout=60)
        return sorted(name for name in listed.stdout.decode().split("\0")
                      if name and os.path.lexists(root / name))
    found = []
    for folder, dirs, files in os.walk(root):
        for name in list(dirs):
            linked = os.path.islink(Path(folder, name))   # a linked folder is one entry, copied as a link
            if linked or name in NOT_SOURCE or name.endswith(".egg-info"):
                dirs.remove(name)
                files += [name] if linked else []
        found += [str(Path(folder, name).relative_to(root)) for name in files if not name.endswith(".pyc")]
    return sorted(found)


def package_files() -> dict[str, bytes]:
    """Every file of the package in the source tree (code and data), by its path in a wheel."""
    return {name: (ROOT / name).read_bytes() for name in source_files()
            if name.startswith(PACKAGE + "/")}


def copy_tree(names: list[str], into: Path) -> Path:
    """The source files copied under `into` (symbolic links kept as links), to build from."""
    for name in names:
        source, target = ROOT / name, into / name
        target.parent.mkdir(parents=True, exist_ok=True)
        if source.is_symlink():
            target.symlink_to(os.readlink(source))
        else:
            shutil.copy2(source, target)
    return into


def build(source: Path, outdir: Path, *targets: str) -> list[Path]:
    """``python -m build`` with this environment's setuptools (no download); no target builds the
    sdist, then the wheel from that sdist, as a release does."""
    result = subprocess.run([sys.executable, "-m", "build", "--no-isolation", *targets,
                             "--outdir", str(outdir), str(source)],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, (
        "python -m build failed (install the test extra: pip install -e '.[test]'):\n"
        f"{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    return sorted(outdir.iterdir())


def wheel_files(wheel: Path) -> dict[str, bytes]:
    with zipfile.ZipFile(wheel) as archive:
        return {name: archive.read(name) for name in archive.namelist() if not name.endswith("/")}


@dataclass(frozen=True)
class Builds:
    sdist: Path
    #: the wheel ``python -m build`` ships: built from the sdist
    wheel: Path
    #: the wheel built straight from the tree (``--wheel``)
    wheel_from_tree: Path


@pytest.fixture(scope="module")
def builds(tmp_path_factory) -> Builds:
    work = tmp_path_factory.mktemp("wheel-build")
    names = source_files()
    released = build(copy_tree(names, work / "tree"), work / "dist")
    direct = build(copy_tree(names, work / "tree-for-wheel"), work / "direct", "--wheel")
    sdists = [path for path in released if path.name.endswith(".tar.gz")]
    wheels = [path for path in released if path.suffix == ".whl"]
    assert len(sdists) == 1 and len(wheels) == 1 and len(direct) == 1, (released, direct)
    return Builds(sdist=sdists[0], wheel=wheels[0], wheel_from_tree=direct[0])


def test_the_wheel_carries_every_file_of_the_package(builds):
    in_tree = package_files()
    assert any(name.endswith(".jinja") for name in in_tree), "the source listing found no templates"
    in_wheel = {name: data for name, data in wheel_files(builds.wheel).items()
                if name.startswith(PACKAGE + "/")}
    missing = sorted(set(in_tree) - set(in_wheel))
    assert not missing, (f"the wheel lacks {missing}: declare them in [tool.setuptools.package-data] "
                         "of pyproject.toml")
    extra = sorted(set(in_wheel) - set(in_tree))
    assert not extra, f"the wheel carries files the source tree does not have: {extra}"
    changed = sorted(name for name, data in in_tree.items() if in_wheel[name] != data)
    assert not changed, f"the wheel's copies differ from the source tree's: {changed}"


#: what the command line needs ships with it: the server starter (``serve-tiny``, the demo) and the
#: models it builds and serves (the tiny ones, per-format copies, the tiny gpt-oss, the real SmolLM2)
COMMAND_HELPERS = ("devtools/serve.py", "devtools/serve_ledger.py", "devtools/models/tiny_model.py",
                   "devtools/models/format_model.py", "devtools/models/gpt_oss_model.py",
                   "devtools/models/real_model.py", "devtools/models/tool_pool.py",
                   "devtools/models/transcripts.py", "devtools/models/helper_settings.py")
#: what only the tests have: a wheel module importing one of these would not run where it is installed
TEST_ONLY_IMPORTS = {"support", "tests", "conftest", "pytest", "_pytest", "hypothesis", "selenium"}


def _imported_modules(path: str, source: bytes) -> set[str]:
    """The modules a wheel module imports, relative imports resolved to wheel paths' dotted form."""
    package = path.removesuffix(".py").split("/")[:-1]
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level + 1] if node.level else []
            module = [*base, *(node.module.split(".") if node.module else [])]
            found |= {".".join(module)} | {".".join([*module, alias.name]) for alias in node.names}
    return found


def test_the_wheel_ships_what_the_commands_need_and_no_test_helper(builds):
    """``testing/`` is gone from the package: the server starter and the models the commands serve
    ship in ``devtools/`` (each devtools module is a command, ``python -m`` or the console script,
    or one a command imports), and what only the tests use is in tests/support/, not the wheel."""
    files = wheel_files(builds.wheel)
    modules = {name: data for name, data in files.items() if name.endswith(".py")}
    missing = [helper for helper in COMMAND_HELPERS if f"{PACKAGE}/{helper}" not in modules]
    assert not missing, f"the commands' helpers missing from the wheel: {missing}"
    assert not [name for name in files if "/testing/" in name or name.startswith(("tests/", "support/"))]
    needing_tests = sorted(name for name, data in modules.items()
                           if {module.split(".")[0] for module in _imported_modules(name, data)}
                           & TEST_ONLY_IMPORTS)
    assert not needing_tests, f"wheel modules that import what only the tests have: {needing_tests}"
    [entry_points] = [data for name, data in files.items() if name.endswith(".dist-info/entry_points.txt")]
    script = configparser.ConfigParser(delimiters=("=",))
    script.read_string(entry_points.decode("utf-8"))
    console = script["console_scripts"]["vllm-allowed-tools"].split(":")[0]
    devtools = {name.removesuffix(".py").replace("/", "."): data for name, data in modules.items()
                if name.startswith(f"{PACKAGE}/devtools/") and not name.endswith("__init__.py")}
    reached, todo = set(), [console, *(name for name, data in devtools.items()
                                       if b'if __name__ == "__main__":' in data)]
    while todo:
        module = todo.pop()
        if module in devtools and module not in reached:
            reached.add(module)
            todo += _imported_modules(module.replace(".", "/") + ".py", devtools[module])
    assert set(devtools) == reached, (
        f"devtools modules no command needs (test helpers belong in tests/support/): "
        f"{sorted(set(devtools) - reached)}")


def test_the_sdist_builds_the_same_wheel(builds):
    from_sdist, from_tree = wheel_files(builds.wheel), wheel_files(builds.wheel_from_tree)
    differ = sorted(name for name in set(from_sdist) | set(from_tree)
                    if from_sdist.get(name) != from_tree.get(name))
    assert not differ, f"the wheel built from the sdist differs from the tree's in {differ}"


def test_the_wheel_declares_the_projects_entry_points(builds):
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    declared = {"console_scripts": project["scripts"], **project["entry-points"]}
    assert all(name in declared.get(group, {}) for group, name in ENTRY_POINTS.items()), declared
    [text] = [data for name, data in wheel_files(builds.wheel).items()
              if name.endswith(".dist-info/entry_points.txt")]
    parsed = configparser.ConfigParser(delimiters=("=",))
    parsed.optionxform = str   # entry point names are case-sensitive
    parsed.read_string(text.decode("utf-8"))
    assert {group: dict(parsed[group]) for group in parsed.sections()} == declared


# ------------------------------------------------------------------ the wheel's own environment

@dataclass(frozen=True)
class WheelVenv:
    python: Path
    bin: Path
    #: the venv's own site-packages, where the wheel is installed
    site: Path
    #: this interpreter's site-packages, reached through the venv's ``.pth`` path line
    layered: tuple[Path, ...]
    #: the environment to run it in: no PYTHONPATH, no user site
    env: dict[str, str]
    #: a working directory outside the checkout (``python -c`` puts it first on sys.path)
    workdir: Path


def isolated_environment(venv: Path) -> dict[str, str]:
    env = {key: value for key, value in os.environ.items()
           if key not in ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP", "PYTHONSAFEPATH")}
    env.update(VIRTUAL_ENV=str(venv), PYTHONNOUSERSITE="1",
               PATH=f"{venv / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}")
    return env


def layered_venv(venv: Path, wheel: Path, workdir: Path) -> WheelVenv:
    """A virtualenv holding only the wheel, then this environment's packages after its own.

    The wheel goes in first, with the venv's path its own, so pip sees no other copy of the
    package; the ``.pth`` path line comes after: a path line adds the folder without running that
    folder's ``.pth`` files, so the editable install's finder is never installed in the venv."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python, env = venv / "bin" / "python", isolated_environment(venv)
    install = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install",
                              "--no-deps", "--no-index", "--quiet", str(wheel)],
                             capture_output=True, text=True, env=env, cwd=workdir, timeout=300)
    assert install.returncode == 0, f"pip install {wheel.name} failed:\n{install.stdout}\n{install.stderr}"
    purelib = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    site = Path(subprocess.run([str(python), "-c", purelib], capture_output=True, text=True, env=env,
                               cwd=workdir, check=True, timeout=60).stdout.strip())
    paths = sysconfig.get_paths()
    layered = tuple(dict.fromkeys(Path(paths[key]) for key in ("purelib", "platlib")))
    (site / "layered-over-the-test-environment.pth").write_text("".join(f"{p}\n" for p in layered))
    return WheelVenv(python=python, bin=venv / "bin", site=site, layered=layered, env=env, workdir=workdir)


@pytest.fixture(scope="module")
def wheel_venv(builds, tmp_path_factory) -> WheelVenv:
    work = tmp_path_factory.mktemp("wheel-venv")
    (work / "cwd").mkdir()
    return layered_venv(work / "venv", builds.wheel, work / "cwd")


#: run by the venv's interpreter: where the package, its data and its entry points come from
PROBE = r"""
import importlib.metadata as metadata, importlib.util, json, sys
import vllm_allowed_tools
from vllm_allowed_tools.formats import wire_formats
from vllm_allowed_tools.grammars import GRAMMAR_DIR
from vllm_allowed_tools.response import conformance
from vllm_allowed_tools.templates import template_path
points = {}
for group, name in json.loads(sys.argv[1]).items():
    points[group] = [{"dist": str(ep.dist.locate_file("")),
                      "origin": importlib.util.find_spec(ep.module).origin}
                     for ep in metadata.entry_points(group=group) if ep.name == name]
dist = metadata.distribution(sys.argv[2])
print(json.dumps({
    "package": vllm_allowed_tools.__file__, "template": str(template_path("hermes")),
    "grammars": str(GRAMMAR_DIR), "formats": len(wire_formats()), "schema": str(conformance.SCHEMA_FILE),
    "schemas": len(conformance.document()["components"]["schemas"]), "entry_points": points,
    "dist": str(dist.locate_file("")), "direct_url": dist.read_text("direct_url.json") or "",
    "vllm": importlib.util.find_spec("vllm").origin, "sys_path": sys.path,
    "editable_hooks": sorted(m for m in sys.modules if m.startswith("__editable__"))}))
"""


def _inside(path: str | Path, folder: Path) -> bool:
    return Path(path).resolve().is_relative_to(folder.resolve())


def test_the_venv_resolves_the_package_and_its_entry_points_to_the_wheels_copy(wheel_venv, builds):
    probe = subprocess.run([str(wheel_venv.python), "-c", PROBE, json.dumps(ENTRY_POINTS), DISTRIBUTION],
                           capture_output=True, text=True, env=wheel_venv.env, cwd=wheel_venv.workdir,
                           timeout=120)
    assert probe.returncode == 0, probe.stderr
    seen = json.loads(probe.stdout)
    site = wheel_venv.site
    for what in ("package", "template", "grammars", "schema", "dist"):
        assert _inside(seen[what], site) and not _inside(seen[what], ROOT), (what, seen[what], site)
    assert builds.wheel.name in seen["direct_url"], seen["direct_url"]   # pip installed our wheel
    assert seen["formats"] == len(wire_formats())   # every grammar file loaded from the wheel
    assert seen["schemas"] > 0
    for group, points in seen["entry_points"].items():
        # one each although the editable install's metadata is on the path too: the venv's wins
        assert len(points) == 1, (group, points)
        assert _inside(points[0]["dist"], site) and _inside(points[0]["origin"], site), (group, points)
    assert seen["editable_hooks"] == [], "the editable install's import hook ran in the wheel's venv"
    # vLLM is this environment's, reached through the path line after the venv's own packages
    assert any(_inside(seen["vllm"], folder) for folder in wheel_venv.layered), seen["vllm"]
    path = [str(Path(entry).resolve()) for entry in seen["sys_path"]]
    assert path.index(str(site.resolve())) < path.index(str(wheel_venv.layered[0].resolve())), path


def test_the_console_script_runs_from_the_wheel(wheel_venv):
    script = wheel_venv.bin / "vllm-allowed-tools"
    assert script.read_text().splitlines()[0] == f"#!{wheel_venv.python}"
    result = subprocess.run([str(script), "--help"], capture_output=True, text=True,
                            env=wheel_venv.env, cwd=wheel_venv.workdir, timeout=120)
    assert result.returncode == 0 and "serve-tiny" in result.stdout, result.stdout + result.stderr


# ------------------------------------------------------------------ served from the wheel

@pytest.mark.server
def test_one_flag_vllm_serve_from_the_wheel_enforces_allowed_tools(wheel_venv):
    """`vllm serve MODEL --tool-call-parser allowed_hermes` under the wheel's venv (the model's own
    template, no --chat-template, no --middleware): the plugin is found through the wheel's entry
    points and answers ``allowed_tools`` on both APIs (plain vLLM refuses the Chat shape); under
    ``required`` the random-weight model calls one of the two allowed tools of eight, with arguments
    that fit its schema, only because the plugin's grammar makes it. The server validates its
    Responses answer against the wheel's vendored Open Responses schema (the session's check mode)."""
    from openai import OpenAI

    rng = random.Random(3)
    catalog = sample_catalog(rng, 8)
    allowed = [tool.name for tool in rng.sample(catalog, 2)]
    server = start_server(ensure_model("random", log=lambda *_: None), chat_template=MODEL_TEMPLATE,
                          one_flag=True, python=str(wheel_venv.python), cwd=wheel_venv.workdir,
                          env={key: value for key, value in wheel_venv.env.items() if key != STAGE_ENV},
                          timeout=600)
    try:
        args = " ".join(map(str, server.process.args))
        assert "--middleware" not in args and "--chat-template" not in args, args
        # the wheel's plugin entry point installed the middleware; on CPU the one-flag launch
        # applies the grammar by the logits processor vLLM loads from the wheel's
        # `vllm.logits_processors` entry point (docs/decode-path.md)
        assert ("middleware active for --tool-call-parser allowed_hermes; allowed-tools grammars "
                "are applied by the logits-processor stage") in server.log_tail(4000), server.log_tail()
        client = OpenAI(base_url=server.base_url, api_key="test", max_retries=0, timeout=120)
        calls, text, _ = chat_calls(client, catalog, "required", allowed, seed=0)
        assert len(calls) == 1 and calls[0][0] in allowed, (calls, text, allowed)
        assert POOL_BY_NAME[calls[0][0]].arguments_valid(calls[0][1]), calls
        r_calls, r_text, response = responses_calls(client, catalog, "required", allowed, seed=0)
        assert len(r_calls) == 1 and r_calls[0][0] in allowed, (r_calls, r_text, allowed)
        assert POOL_BY_NAME[r_calls[0][0]].arguments_valid(r_calls[0][1]), r_calls
        assert response.tool_choice.type == "allowed_tools"   # the client's own choice, restored
    finally:
        server.stop()
