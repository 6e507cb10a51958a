"""Fixtures: one real ``vllm serve`` per flavour per test session, started through our CLI.

Each server is `vllm-allowed-tools serve-tiny` on a random free port; the fixture waits for the base
URL line (printed once /health answers), tears the server down by PID (the CLI kills its process
group), and appends the server log's tail to the report of any failing test that used it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from vllm_allowed_tools.testing.server import free_port


@dataclass
class RunningServer:
    base_url: str
    root_url: str
    process: subprocess.Popen
    log_path: Path
    flavour: str

    def log_tail(self, lines: int = 80) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def client(self, **kwargs):
        from openai import OpenAI
        return OpenAI(base_url=self.base_url, api_key="test", max_retries=0, timeout=120, **kwargs)


_RUNNING: list[RunningServer] = []


def start_cli_server(flavour: str, extra_args: list[str] | None = None,
                     timeout: float = 900.0, options: list[str] | None = None,
                     env: dict[str, str] | None = None) -> RunningServer:
    """Start `vllm-allowed-tools serve-tiny` (builds the model on first use) and wait for its URL."""
    port = free_port()
    log_path = Path(tempfile.mkstemp(prefix=f"vllm-{flavour}-", suffix=".log")[1])
    command = [sys.executable, "-m", "vllm_allowed_tools.devtools.cli", "serve-tiny", "--port", str(port),
               "--flavour", flavour, "--log-file", str(log_path), *(options or [])]
    if extra_args:
        command += ["--", *extra_args]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=None, text=True,
                               env={**os.environ, **(env or {})})
    deadline = time.monotonic() + timeout
    line = ""
    while time.monotonic() < deadline:
        line = process.stdout.readline()
        if line.startswith("http") or process.poll() is not None or line == "":
            break
    if not line.startswith("http"):
        process.kill()
        tail = log_path.read_text(errors="replace")[-6000:] if log_path.exists() else ""
        pytest.fail(f"serve-tiny ({flavour}) did not come up (exit {process.poll()}):\n{tail}")
    base_url = line.strip()
    server = RunningServer(base_url=base_url, root_url=base_url.removesuffix("/v1"), process=process,
                           log_path=log_path, flavour=flavour)
    _RUNNING.append(server)
    return server


def stop_cli_server(server: RunningServer) -> None:
    if server.process.poll() is None:
        server.process.send_signal(signal.SIGTERM)
        try:
            server.process.wait(30)
        except subprocess.TimeoutExpired:
            server.process.kill()
            server.process.wait(10)
    if server in _RUNNING:
        _RUNNING.remove(server)


@pytest.fixture(scope="session")
def random_server():
    """The random-weight adversary, served with the plugin (allowed_hermes)."""
    server = start_cli_server("random")
    yield server
    stop_cli_server(server)


@pytest.fixture(scope="session")
def happy_server():
    """The tool-happy model (emits well-formed calls, mostly outside a 2-of-8 allowlist)."""
    server = start_cli_server("tool-happy")
    yield server
    stop_cli_server(server)


@pytest.fixture(scope="session")
def vanilla_server():
    """The same random model and template under plain vLLM (base `hermes` parser, no middleware)."""
    server = start_cli_server("random", options=["--vanilla", "--parser", "hermes"])
    yield server
    stop_cli_server(server)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.failed and report.when in ("setup", "call"):
        for name in ("random_server", "happy_server", "vanilla_server"):
            server = item.funcargs.get(name) if hasattr(item, "funcargs") else None
            if isinstance(server, RunningServer):
                report.sections.append((f"vllm server log ({server.flavour}), last lines",
                                        server.log_tail()))


def pytest_sessionfinish(session, exitstatus):
    for server in list(_RUNNING):
        stop_cli_server(server)


os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
