"""Start a real ``vllm serve`` with the plugin on a tiny model, and never leave it running.

Used by the ``vllm-allowed-tools serve-tiny`` console script, the demo and the test fixtures. It
imports no vLLM: the server runs in a child process (its own process group, killed with us).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Sequence

from ..formats import wire_format, wire_formats
from ..templates import template_path

DEFAULT_PARSER = "allowed_hermes"
SERVED_MODEL_NAME = "tiny"
MAX_MODEL_LEN = 32768   # a real client's prompt (Codex: ~20K tokens at this vocabulary) must fit
#: the bundled chat template each of our parsers is served with (falls back to hermes)
TEMPLATE_FOR_PARSER = {entry.parser_name: entry.template for entry in wire_formats()}
MIDDLEWARE = "vllm_allowed_tools.vllm_glue.middleware.AllowedToolsMiddleware"


class ServeError(RuntimeError):
    """The server could not be started; the message says why and what to do."""


def check_port_free(host: str, port: int) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
        except OSError as exc:
            raise ServeError(f"port {port} on {host} is already in use ({exc.strerror}); "
                             "stop whatever listens there or pick another --port") from exc


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def server_environment(base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment vLLM's CPU build needs (see README, "CPU notes")."""
    env = dict(os.environ if base is None else base)
    env.setdefault("VLLM_TARGET_DEVICE", "cpu")
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TRANSFORMERS_OFFLINE", "1")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env.setdefault("VLLM_NO_USAGE_STATS", "1")
    env.setdefault("DO_NOT_TRACK", "1")
    env.setdefault("PYTHONHASHSEED", "0")   # stable prefix-cache hashes across restarts
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    # random weights pad JSON with whitespace until max_tokens; real models need at most a little
    env.setdefault("VLLM_ALLOWED_TOOLS_MAX_JSON_WHITESPACE", "1")
    return env


def server_command(model_dir: Path, port: int, host: str = "127.0.0.1", parser: str = DEFAULT_PARSER,
                   extra_args: Sequence[str] = (), vanilla: bool = False) -> list[str]:
    """``vllm serve`` with the plugin (vLLM's CLI entry, called with this interpreter).

    ``vanilla`` leaves our middleware out (pair it with a base parser such as ``hermes``): the same
    model and template under plain vLLM, for parity tests and baselines.
    """
    plugin = [] if vanilla else ["--middleware", MIDDLEWARE]
    return [
        sys.executable, "-c", "import sys; from vllm.entrypoints.cli.main import main; "
        "sys.argv[0] = 'vllm'; sys.exit(main())",
        "serve", str(model_dir), "--served-model-name", SERVED_MODEL_NAME,
        "--host", host, "--port", str(port),
        "--dtype", "float32", "--max-model-len", str(MAX_MODEL_LEN), "--enforce-eager",
        "--block-size", "32", "--max-num-seqs", "32",
        # vLLM 0.32 CPU: a seeded request whose prefill gets chunked kills the engine ("CPU
        # Generator does not use offset"); a whole-context batch budget never chunks
        "--no-enable-chunked-prefill", "--max-num-batched-tokens", str(MAX_MODEL_LEN),
        "--enable-auto-tool-choice", "--tool-call-parser", parser,
        "--chat-template", str(template_for_parser(parser)),
        "--structured-outputs-config.backend", "xgrammar",
        "--enable-prompt-tokens-details",
        *plugin,
        *extra_args,
    ]


def preflight() -> None:
    """Refuse to start an environment we know crashes, with the fix instead of a traceback."""
    from ..devtools.cpu_setup import CUDA_ONLY_COMPANIONS, _installed

    if _installed("vllm-cpu") is None:
        return
    broken = [name for name in CUDA_ONLY_COMPANIONS if _installed(name)]
    if broken or _installed("vllm") is None:
        raise ServeError("this vllm-cpu environment is not set up (" +
                         (f"{', '.join(broken)} would crash vLLM at import" if broken else
                          "the `vllm` metadata alias is missing") +
                         "); run `vllm-allowed-tools cpu-setup` once after installing")


def template_for_parser(parser: str) -> Path:
    """The bundled template ``parser`` (ours or its base's name) is served with; hermes otherwise."""
    try:
        return template_path(wire_format(parser).template)
    except (ValueError, FileNotFoundError):
        return template_path("hermes")


def _die_with_parent() -> None:  # pragma: no cover - runs in the child before exec
    os.setsid()
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


@dataclass
class TinyServer:
    """A running server; use as a context manager or call :meth:`stop`."""
    process: subprocess.Popen
    host: str
    port: int
    log_path: Path
    _log: IO | None = field(default=None, repr=False)

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}/v1"

    @property
    def root_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def log_tail(self, lines: int = 60) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def stop(self, timeout: float = 20.0) -> int | None:
        """Terminate the whole process group (API server, engine core, workers)."""
        if self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(5)
        with contextlib.suppress(ProcessLookupError):   # stragglers left in the group
            os.killpg(self.process.pid, signal.SIGKILL)
        if self._log:
            self._log.close()
            self._log = None
        return self.process.returncode

    def __enter__(self) -> "TinyServer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def wait_healthy(server: TinyServer, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            raise ServeError(f"vllm exited with code {server.process.returncode} before it was "
                             f"healthy; its log ({server.log_path}) ends with:\n{server.log_tail()}")
        try:
            with urllib.request.urlopen(server.root_url + "/health", timeout=2) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
            pass
        time.sleep(0.5)
    server.stop()
    raise ServeError(f"vllm was not healthy after {timeout:.0f}s; its log ({server.log_path}) "
                     f"ends with:\n{server.log_tail()}")


def start_server(model_dir: Path, port: int | None = None, host: str = "127.0.0.1",
                 parser: str = DEFAULT_PARSER, extra_args: Sequence[str] = (),
                 log_path: Path | None = None, timeout: float = 300.0,
                 env: dict[str, str] | None = None, vanilla: bool = False) -> TinyServer:
    """Start vLLM on `model_dir` and return once ``/health`` answers (or raise ServeError)."""
    from .tiny_model import validate_model_dir

    validate_model_dir(model_dir)
    preflight()
    if port is None:
        port = free_port(host)
    check_port_free(host, port)
    if log_path is None:
        log_path = Path(tempfile.mkstemp(prefix="vllm-allowed-tools-", suffix=".log")[1])
    log = open(log_path, "w", buffering=1)
    environment = server_environment(env)
    environment.setdefault("VLLM_CACHE_ROOT", tempfile.mkdtemp(prefix="vllm-cache-"))
    process = subprocess.Popen(server_command(model_dir, port, host, parser, extra_args, vanilla),
                               stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                               env=environment, preexec_fn=_die_with_parent)
    server = TinyServer(process=process, host=host, port=port, log_path=Path(log_path), _log=log)
    try:
        wait_healthy(server, timeout)
    except BaseException:
        server.stop()
        raise
    return server
