"""Start a real ``vllm serve`` with the plugin on a tiny model, and never leave it running.

:func:`start_server` runs vLLM itself (the ``serve-tiny`` console script, the demo, the prompt-cache
benchmark); :func:`start_serve_tiny` runs that console script as a child, as the test fixtures and
the reliability benchmark do. Both give up at a deadline and kill what they started. No vLLM import:
the server runs in a child process (its own process group, killed with us).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import queue
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Sequence

from ..formats import wire_format, wire_formats
from ..settings import Settings, process_environment
from ..templates import template_path
from .models.tiny_model import positions_of, validate_model_dir, vllm_cache_dir
from .serve_ledger import record_start

DEFAULT_PARSER = "allowed_hermes"
SERVED_MODEL_NAME = "tiny"
MAX_MODEL_LEN = 32768   # a real client's prompt (Codex: ~20K tokens at this vocabulary) must fit
#: the bundled chat template each of our parsers is served with (falls back to hermes)
TEMPLATE_FOR_PARSER = {entry.parser_name: entry.template for entry in wire_formats()
                       if entry.template is not None}
from ..vllm_glue.plugin import MIDDLEWARE  # noqa: E402  (no vLLM import: the plugin module is light)


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
    """The environment vLLM's CPU build needs (docs/install.md, "The CPU build's fixes"), over
    ``base`` (default: this process's)."""
    ours = process_environment()
    env = dict(ours if base is None else base)
    env.setdefault("VLLM_TARGET_DEVICE", "cpu")
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TRANSFORMERS_OFFLINE", "1")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env.update({key: env.get(key, "1") for key in ("VLLM_NO_USAGE_STATS", "DO_NOT_TRACK")})
    env.setdefault("PYTHONHASHSEED", "0")   # stable prefix-cache hashes across restarts
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    # idle OpenMP threads sleep, not spin (real model, loaded 2 cores: 0.2-0.6 tokens/s spinning, ~35 not)
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    # the model runs in the engine-core process (see IN_PROCESS_WORKER), which vLLM's CPU
    # platform allows only with multiprocessing declared off (the API server and the engine core
    # stay separate processes: vLLM's async engine client ignores this variable)
    env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    # random weights pad JSON with whitespace until max_tokens; real models need at most a little
    env.setdefault("VLLM_ALLOWED_TOOLS_MAX_JSON_WHITESPACE", "1")
    # the test session's Open Responses check mode (tests/conftest.py) reaches every server it
    # starts, also one started with an environment of its own
    check_log = Settings.from_environ(ours).conformance_log
    if check_log is not None:
        env.setdefault(Settings.variable("conformance_log"), str(check_log))
    return env


#: ``chat_template`` value that serves the model folder's own template (no ``--chat-template``)
MODEL_TEMPLATE = "model"
#: one model worker inside the engine-core process (vLLM's ``uni`` executor, its default on one
#: GPU) instead of a third process: a CPU start spawns, and so imports vLLM, once less (~12 s)
IN_PROCESS_WORKER = ("--distributed-executor-backend", "uni")
#: vLLM's CPU default back (passed after IN_PROCESS_WORKER, so it wins): the model and its KV
#: cache in a worker process of their own, apart from the engine core's scheduler and grammars
SEPARATE_WORKER = ("--distributed-executor-backend", "mp")


def server_command(model_dir: Path, port: int, host: str = "127.0.0.1", parser: str = DEFAULT_PARSER,
                   extra_args: Sequence[str] = (), vanilla: bool = False,
                   chat_template: str | Path | None = None, one_flag: bool = False,
                   python: str | None = None) -> list[str]:
    """``vllm serve`` with the plugin (vLLM's CLI entry, called with `python`: this interpreter
    when None, another environment's to serve what is installed there, e.g. a built wheel).

    ``chat_template``: None serves the bundled template of ``parser``; a path serves that file;
    :data:`MODEL_TEMPLATE` passes no ``--chat-template`` (the tokenizer's own template).
    ``one_flag``: the plugin's short launch, ``--tool-call-parser`` alone (no ``--middleware``, no
    backend flag: the plugin adds what it needs).

    ``vanilla`` leaves our middleware out (pair it with a base parser such as ``hermes``): the same
    model and template under plain vLLM, for parity tests and baselines.
    """
    plugin = [] if vanilla or one_flag else ["--middleware", MIDDLEWARE]
    max_len = min(MAX_MODEL_LEN, positions_of(model_dir) or MAX_MODEL_LEN)
    backend = [] if one_flag else ["--structured-outputs-config.backend", "xgrammar"]
    if chat_template is None:
        chat_template = template_for_parser(parser) or MODEL_TEMPLATE
    template = [] if str(chat_template) == MODEL_TEMPLATE else ["--chat-template", str(chat_template)]
    return [
        python or sys.executable, "-c", "import sys; from vllm.entrypoints.cli.main import main; "
        "sys.argv[0] = 'vllm'; sys.exit(main())",
        "serve", str(model_dir), "--served-model-name", SERVED_MODEL_NAME,
        "--host", host, "--port", str(port),
        "--dtype", "float32", "--max-model-len", str(max_len), "--enforce-eager",
        "--block-size", "32", "--max-num-seqs", "32",
        # vLLM 0.32 CPU: a seeded request whose prefill gets chunked kills the engine ("CPU
        # Generator does not use offset"); a whole-context batch budget never chunks
        "--no-enable-chunked-prefill", "--max-num-batched-tokens", str(max_len),
        "--enable-auto-tool-choice", "--tool-call-parser", parser,
        *template,
        *backend,
        "--enable-prompt-tokens-details",
        *IN_PROCESS_WORKER,
        *plugin,
        *extra_args,
    ]


def preflight() -> None:
    """Refuse to start an environment we know crashes, with the fix instead of a traceback."""
    from ..cpu_build import setup_problem

    problem = setup_problem()
    if problem is not None:
        raise ServeError(f"this vllm-cpu environment is not set up ({problem}); run "
                         "`vllm-allowed-tools cpu-setup` once after installing")


def template_for_parser(parser: str) -> Path | None:
    """The bundled template ``parser`` (ours or its base's name) is served with; hermes otherwise;
    None for a format vLLM renders without a chat template (gpt-oss's harmony)."""
    try:
        template = wire_format(parser).template
        return template_path(template) if template is not None else None
    except (ValueError, FileNotFoundError):
        return template_path("hermes")


def log_tail(path: Path, lines: int = 60) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def _terminated_with_parent() -> None:  # pragma: no cover - runs in the child before exec
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _die_with_parent() -> None:  # pragma: no cover - runs in the child before exec
    os.setsid()
    _terminated_with_parent()


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
        return log_tail(self.log_path, lines)

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
                 env: dict[str, str] | None = None, vanilla: bool = False,
                 chat_template: str | Path | None = None, one_flag: bool = False,
                 python: str | None = None, cwd: Path | None = None,
                 validate: bool = True) -> TinyServer:
    """Start vLLM on `model_dir` and return once ``/health`` answers (or raise ServeError).

    `python`: the interpreter vLLM runs under (None: this one); `cwd`: the server's working
    directory, which its ``python -c`` puts first on ``sys.path`` (None: ours; pass a folder
    outside a source checkout when `python` must import an installed copy of the package);
    ``validate=False`` serves a folder that is not one of our tiny models.
    """
    if validate:   # False: a model folder that is not a tiny model of ours (benchmarks/random_model.py)
        validate_model_dir(model_dir)
    preflight()
    if port is None:
        port = free_port(host)
    check_port_free(host, port)
    if log_path is None:
        log_path = Path(tempfile.mkstemp(prefix="vllm-allowed-tools-", suffix=".log")[1])
    log = open(log_path, "w", buffering=1)
    environment = server_environment(env)
    # one vLLM cache for every start: vLLM inspects a model class in a child process (a whole
    # vLLM import, ~15 s of a CPU start) unless the answer is in its cache; the cache's files are
    # keyed by the model module's hash and written atomically, so starts can share it
    environment.setdefault("VLLM_CACHE_ROOT", str(vllm_cache_dir()))
    process = subprocess.Popen(server_command(model_dir, port, host, parser, extra_args, vanilla,
                                              chat_template, one_flag, python),
                               stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                               env=environment, cwd=cwd, preexec_fn=_die_with_parent)
    server = TinyServer(process=process, host=host, port=port, log_path=Path(log_path), _log=log)
    started = time.monotonic()
    try:
        wait_healthy(server, timeout)
    except BaseException:
        server.stop()
        raise
    record_start(model_dir, parser, extra_args, vanilla, one_flag, time.monotonic() - started)
    return server


# ------------------------------------------------------------------ the serve-tiny console script

class _OutputLines:
    """Reads a child's output on a thread, so waiting for one line can give up at a deadline."""

    def __init__(self, stream: IO[str], keep: int = 80) -> None:
        self._lines: queue.Queue[str | None] = queue.Queue()
        self.last: deque[str] = deque(maxlen=keep)
        self.ended = False
        threading.Thread(target=self._pump, args=(stream,), daemon=True).start()

    def _pump(self, stream: IO[str]) -> None:
        with contextlib.suppress(ValueError, OSError):   # closed under us: stop reading
            for line in stream:
                self.last.append(line.rstrip("\n"))
                self._lines.put(line)
        self._lines.put(None)

    def wait_for(self, prefix: str, deadline: float) -> str | None:
        """The first line starting with `prefix`, or None at end of output or at the deadline."""
        while (left := deadline - time.monotonic()) > 0:
            try:
                line = self._lines.get(timeout=left)
            except queue.Empty:
                return None
            if line is None:
                self.ended = True
                return None
            if line.startswith(prefix):
                return line.strip()
        return None


@dataclass(eq=False)
class ServeTinyProcess:
    """A running ``serve-tiny`` child (it owns the vLLM process group and stops it on SIGTERM)."""
    process: subprocess.Popen
    base_url: str
    log_path: Path
    flavour: str
    output: _OutputLines = field(repr=False)

    @property
    def root_url(self) -> str:
        return self.base_url.removesuffix("/v1")

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def log_tail(self, lines: int = 80) -> str:
        return log_tail(self.log_path, lines)

    def client(self, **kwargs: Any) -> Any:
        from openai import OpenAI
        return OpenAI(base_url=self.base_url, api_key="test", max_retries=0, timeout=120, **kwargs)

    def stop(self, timeout: float = 30.0) -> int | None:
        return _stop_child(self.process, timeout)


def _stop_child(process: subprocess.Popen, timeout: float) -> int | None:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)   # serve-tiny stops its server's whole group
        try:
            process.wait(timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(10)
    return process.returncode


def serve_tiny_command(flavour: str, port: int, log_path: Path, options: Sequence[str] = (),
                       extra_args: Sequence[str] = ()) -> list[str]:
    command = [sys.executable, "-m", "vllm_allowed_tools.devtools.commands", "serve-tiny",
               "--port", str(port), "--flavour", flavour, "--log-file", str(log_path), *options]
    return command + (["--", *extra_args] if extra_args else [])


def start_serve_tiny(flavour: str = "random", *, options: Sequence[str] = (),
                     extra_args: Sequence[str] = (), env: dict[str, str] | None = None,
                     timeout: float = 900.0, log_path: Path | None = None) -> ServeTinyProcess:
    """Run ``vllm-allowed-tools serve-tiny`` (it builds the model on first use) on a free port and
    return once it prints its base URL; at the deadline it is stopped and ServeError says why.

    `options` are serve-tiny's own flags, `extra_args` vLLM's, `env` is added to ours.
    """
    if log_path is None:
        log_path = Path(tempfile.mkstemp(prefix=f"vllm-{flavour}-", suffix=".log")[1])
    process = subprocess.Popen(serve_tiny_command(flavour, free_port(), log_path, options, extra_args),
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                               text=True, env={**process_environment(), **(env or {})},
                               # a test process killed outright takes its servers with it
                               preexec_fn=_terminated_with_parent)
    output = _OutputLines(process.stdout)
    try:
        url = output.wait_for("http", time.monotonic() + timeout)
    except BaseException:   # interrupted while it starts (Ctrl-C, a signal): never leave it running
        _stop_child(process, 30.0)
        raise
    if url is None:
        if output.ended:   # it closed its output: it is exiting
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(10)
        hung = process.poll() is None
        _stop_child(process, 30.0)
        why = (f"printed no URL within {timeout:.0f}s and was stopped" if hung
               else f"exited with code {process.returncode}")
        said = "\n".join(output.last)   # when it exits on an error, that names the log and quotes it
        log = f"\nthe server log ({log_path}) ends with:\n{log_tail(log_path)}" if hung or not said else ""
        raise ServeError(f"serve-tiny ({flavour}) {why}; its output ends with:\n{said}{log}")
    return ServeTinyProcess(process=process, base_url=url, log_path=log_path, flavour=flavour,
                            output=output)
