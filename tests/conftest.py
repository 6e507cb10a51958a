"""Fixtures: one real ``vllm serve`` per flavour per test session, started through our CLI.

Each server is `vllm-allowed-tools serve-tiny` on a random free port
(:func:`vllm_allowed_tools.devtools.serve.start_serve_tiny`: it gives up at a deadline, with the
server's last output); teardown stops it by PID (the CLI kills its process group), and the server
log's tail is appended to the report of any failing test that used it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

# OpenMP threads that wait for work sleep instead of spinning: every process of the run (test
# workers, the background model build, the servers) shares two cores, and a spinning thread burns a
# core another process needs (the tiny-model training step: half the CPU, a third of the time, the
# same gradients). Set before anything loads torch, so every child inherits it.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from vllm_allowed_tools.devtools.serve import SEPARATE_WORKER, ServeTinyProcess
from vllm_allowed_tools.devtools.serve_ledger import SERVER_LEDGER_ENV
from vllm_allowed_tools.response.conformance_check import CHECK_LOG_ENV, read_check_log
from vllm_allowed_tools.settings import reset_for_tests
from vllm_allowed_tools.vllm_glue.plugin import register_tag_builder

# _RUNNING: the servers started and not yet stopped, the list itself (pytest_sessionfinish stops them)
from support.servers import _RUNNING, start_cli_server, stop_cli_server

# grammars are built in-process here as in the server: vLLM's own tag builders lent as the plugin
# lends them when vLLM loads it
register_tag_builder()

_CONFORMANCE = pytest.StashKey[tuple]()
_CREATED = pytest.StashKey[str]()


@pytest.fixture(autouse=True)
def _settings_read_per_test():
    """The plugin keeps its settings for the process (``settings.current()``); a test that sets
    variables or ``sys.argv`` before it builds a middleware gets them read, and leaves none behind."""
    reset_for_tests()
    yield
    reset_for_tests()


@pytest.fixture(scope="session")
def random_server():
    """The random-weight adversary, served with the plugin (allowed_hermes); its model runs in a
    worker process of its own, so the reliability load can tell the engine core's memory (our
    logits processors, compiled grammars) from the KV cache's (tests/test_reliability_e2e.py)."""
    server = start_cli_server("random", extra_args=list(SEPARATE_WORKER))
    yield server
    stop_cli_server(server)


@pytest.fixture(scope="session")
def happy_server():
    """The tool-happy model (emits well-formed calls, mostly outside a 2-of-8 allowlist)."""
    server = start_cli_server("tool-happy")
    yield server
    stop_cli_server(server)


@pytest.fixture(scope="session")
def real_server(tmp_path_factory):
    """A real instruct model (SmolLM2-135M, built from its registry package on first use, ~40 s)
    with the plugin and an approval policy gating ``delete_file``, a name only approval tests put
    in a catalog: what needs a model that reads its prompt (tests/test_real_model_e2e.py)."""
    policy = tmp_path_factory.mktemp("real-approvals") / "approvals.json"
    policy.write_text(json.dumps({"rules": [{"tools": ["delete_file"], "approval": "required"}]}))
    server = start_cli_server("real", env={"VLLM_ALLOWED_TOOLS_APPROVAL_POLICY": str(policy)})
    yield server
    stop_cli_server(server)


@pytest.fixture(scope="session")
def vanilla_server():
    """The same random model and template under plain vLLM (base `hermes` parser, no middleware)."""
    server = start_cli_server("random", options=["--vanilla", "--parser", "hermes"])
    yield server
    stop_cli_server(server)


#: where the test groups of this run are written (by the first worker) for the controller
_GROUPS_ENV = "VLLM_ALLOWED_TOOLS_TEST_GROUPS"
_GROUPS_CREATED = pytest.StashKey[str]()
_LEDGER_CREATED = pytest.StashKey[str]()
_BUILDER = pytest.StashKey[tuple]()


def _group_of(item) -> str:
    """A test's group: its module, and for a module parametrized over server configurations (a
    module- or session-scoped parametrized fixture: one server per format, per stage) also that
    configuration. A group runs whole on one worker, so no module server starts twice."""
    group = item.nodeid.split("::", 1)[0]
    callspec = getattr(item, "callspec", None)
    if callspec is not None:
        definitions = item._fixtureinfo.name2fixturedefs
        shared = sorted(name for name in callspec.params
                        if name in definitions and definitions[name][-1].scope in ("module", "session"))
        if shared:
            group += "[" + ",".join(f"{name}={callspec.params[name]!r}" for name in shared) + "]"
    return group


#: fixtures that serve a trained tiny model (their tests wait for its build): tool-happy builds
#: first, thinking after it
_TOOL_HAPPY_FIXTURES = frozenset({"happy_server", "stage_happy_server"})
_THINKING_FIXTURES = frozenset({"thinking_server"})


def _trained_rank(item) -> int:
    """0: no trained model; 1: tool-happy (a ``trained_model`` mark says so where a module starts
    its own server); 2: thinking, which the background build makes last."""
    fixtures = set(getattr(item, "fixturenames", ()))
    if _THINKING_FIXTURES & fixtures:
        return 2
    return 1 if item.get_closest_marker("trained_model") is not None or _TOOL_HAPPY_FIXTURES & fixtures else 0


def _needs_trained_model(item) -> bool:
    return _trained_rank(item) > 0


def _trained_groups_last(items) -> None:
    """The groups that serve a trained model run after the rest, in the order the background
    build makes the models (:func:`_build_trained_models_in_background`), so no worker sits
    waiting for a build while other groups could run. Within a rank, the larger groups first
    (what xdist's own reordering would do, which the scheduler turns off so this order holds)."""
    rank: dict[str, int] = {}
    size: dict[str, int] = {}
    first: dict[str, int] = {}
    groups = [_group_of(item) for item in items]
    for index, (item, group) in enumerate(zip(items, groups)):
        rank[group] = max(rank.get(group, 0), _trained_rank(item))
        size[group] = size.get(group, 0) + 1
        first.setdefault(group, index)
    order = {id(item): (rank[group], -size[group], first[group], index)
             for index, (item, group) in enumerate(zip(items, groups))}
    items.sort(key=lambda item: order[id(item)])


def pytest_collection_modifyitems(config, items):
    """Trained-model groups last; parallel runs (pytest-xdist): the first worker writes every
    test's group for the controller's scheduler (:func:`pytest_xdist_make_scheduler`), which only
    sees test ids."""
    _trained_groups_last(items)
    workerinput = getattr(config, "workerinput", None)
    if not config.option.collectonly and any(_needs_trained_model(item) for item in items):
        if workerinput is None or workerinput.get("workerid") == "gw0":
            _build_trained_models_in_background(config)
        _yield_to_the_model_build()
    path = os.environ.get(_GROUPS_ENV)
    if workerinput is None or workerinput.get("workerid") != "gw0" or not path:
        return
    staging = f"{path}.{os.getpid()}"
    with open(staging, "w", encoding="utf-8") as handle:
        json.dump({item.nodeid: _group_of(item) for item in items}, handle)
    os.replace(staging, path)


def pytest_xdist_make_scheduler(config, log):
    """Whole test groups to each worker (xdist's own ``loadgroup`` reads marks that pytest 9.2's
    node ids no longer carry), in the collection's order: xdist's default reorders groups by their
    number of tests, which sent trained-model groups out early to wait for their build."""
    from xdist.scheduler import LoadScopeScheduling

    config.option.loadscopereorder = False   # the order is _trained_groups_last's

    class ServerGroups(LoadScopeScheduling):
        _groups: dict = {}

        def _split_scope(self, nodeid: str) -> str:
            if not self._groups:
                try:
                    with open(os.environ[_GROUPS_ENV], encoding="utf-8") as handle:
                        type(self)._groups = json.load(handle)
                except (KeyError, OSError, ValueError):
                    pass
            return self._groups.get(nodeid) or nodeid.split("::", 1)[0]

    return ServerGroups(config, log)


#: how much nicer than the model build the test processes (and the servers they start) run
_BUILD_PRIORITY = 5


def _yield_to_the_model_build() -> None:
    """While the trained models are not built, this test process (and every server it starts
    from now on) runs nicer than the build started before it: the build is the run's critical path
    (the trained-model groups wait for it), so it gets the cores first, the rest what is left."""
    from vllm_allowed_tools.devtools.models.tiny_model import TRAINED_FLAVOURS, cached_model
    if any(cached_model(flavour) is None for flavour in TRAINED_FLAVOURS):
        os.nice(_BUILD_PRIORITY)


def _build_trained_models_in_background(config) -> None:
    """Start building the trained tiny models now, in a child (the same build a fixture would
    start, behind the same cache lock), when a selected test serves one and they are not cached."""
    from vllm_allowed_tools.devtools.models.tiny_model import TRAINED_FLAVOURS, cached_model
    if all(cached_model(flavour) is not None for flavour in TRAINED_FLAVOURS):
        return
    handle, log = tempfile.mkstemp(prefix="vat-model-builds-", suffix=".log")
    config.stash[_BUILDER] = (subprocess.Popen(
        [sys.executable, "-m", "vllm_allowed_tools.devtools.models.tiny_model", "--ensure",
         *TRAINED_FLAVOURS],
        stdout=handle, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL), log)
    os.close(handle)


def pytest_configure(config):
    config.addinivalue_line("markers", "trained_model: serves a trained tiny model (runs last)")
    if getattr(config, "workerinput", None) is None and not os.environ.get(SERVER_LEDGER_ENV):
        handle, path = tempfile.mkstemp(prefix="vat-server-starts-", suffix=".jsonl")
        os.close(handle)
        os.environ[SERVER_LEDGER_ENV] = path
        config.stash[_LEDGER_CREATED] = path
    if getattr(config, "workerinput", None) is None and not os.environ.get(_GROUPS_ENV):
        handle, path = tempfile.mkstemp(prefix="vat-test-groups-", suffix=".json")
        os.close(handle)
        os.environ[_GROUPS_ENV] = path
        config.stash[_GROUPS_CREATED] = path


def pytest_unconfigure(config):
    builder = config.stash.get(_BUILDER, None)
    if builder is not None and builder[0].poll() is None:
        builder[0].terminate()
        builder[0].wait(30)
    for key in (_GROUPS_CREATED, _LEDGER_CREATED):
        created = config.stash.get(key, None)
        if created:
            Path(created).unlink(missing_ok=True)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.failed and report.when in ("setup", "call"):
        for name in ("random_server", "happy_server", "real_server", "vanilla_server"):
            server = item.funcargs.get(name) if hasattr(item, "funcargs") else None
            if isinstance(server, ServeTinyProcess):
                report.sections.append((f"vllm server log ({server.flavour}), last lines",
                                        server.log_tail()))


def pytest_sessionstart(session):
    """Open Responses check mode for every server this session starts (``server_environment``
    passes it on): each one validates every Responses object and event it sends into one file.
    Parallel workers (pytest-xdist) inherit the file from the controller and name their process in
    ``<file>.test-pids``: what they write themselves (in-process fakes) is not a server's answer."""
    if not os.environ.get(CHECK_LOG_ENV):
        handle, path = tempfile.mkstemp(prefix="vat-conformance-", suffix=".jsonl")
        os.close(handle)
        os.environ[CHECK_LOG_ENV] = path
        session.config.stash[_CREATED] = path
    with open(os.environ[CHECK_LOG_ENV] + ".test-pids", "a", encoding="utf-8") as pids:
        pids.write(f"{os.getpid()}\n")


def _test_pids() -> set[int]:
    try:
        with open(os.environ[CHECK_LOG_ENV] + ".test-pids", encoding="utf-8") as pids:
            return {int(line) for line in pids if line.strip().isdigit()}
    except OSError:
        return {os.getpid()}


def pytest_sessionfinish(session, exitstatus):
    for server in list(_RUNNING):
        stop_cli_server(server)
    # the servers' records only: an in-process middleware test answers with a fake app's bodies
    counts, failures = read_check_log(os.environ[CHECK_LOG_ENV], exclude_pids=_test_pids() | {os.getpid()})
    session.config.stash[_CONFORMANCE] = (counts, failures)
    created = session.config.stash.get(_CREATED, None)
    if created and not counts:   # no server answered on /v1/responses: nothing to keep
        Path(created).unlink(missing_ok=True)
        Path(created + ".test-pids").unlink(missing_ok=True)
    if failures and session.exitstatus == 0:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def _server_starts_summary(terminalreporter) -> None:
    """What the run's vLLM starts cost, by the file that started them: the suite's main cost."""
    try:
        with open(os.environ[SERVER_LEDGER_ENV], encoding="utf-8") as handle:
            starts = [json.loads(line) for line in handle if line.strip()]
    except (KeyError, OSError, ValueError):
        return
    if not starts:
        return
    by_file: dict[str, list[float]] = {}
    for start in starts:
        by_file.setdefault(start["test"].split("::", 1)[0] or "(no test)", []).append(start["seconds"])
    total = sum(sum(seconds) for seconds in by_file.values())
    terminalreporter.write_line(f"vLLM server starts: {len(starts)}, {total:.0f} s until healthy in all")
    for name, seconds in sorted(by_file.items(), key=lambda item: -sum(item[1])):
        terminalreporter.write_line(f"  {len(seconds):3d} starts {sum(seconds):6.0f} s  {name}")


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """Every Responses answer the servers sent was validated: the count, and each failure."""
    if getattr(config, "workerinput", None) is None:
        _server_starts_summary(terminalreporter)
    counts, failures = config.stash.get(_CONFORMANCE, ({}, []))
    if not counts:
        return
    terminalreporter.write_line(
        f"Open Responses conformance: {counts.get('object', 0)} objects and "
        f"{counts.get('event', 0)} streamed events validated, {len(failures)} failing "
        f"({os.environ[CHECK_LOG_ENV]})", red=bool(failures), green=not failures)
    for record in failures[:50]:
        terminalreporter.write_line(f"  {record['kind']} {record['type']}: "
                                    + "; ".join(record["problems"]), red=True)


os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
