"""A throwaway reverse proxy (the system's HAProxy) in front of several API server replicas, for
tests and benchmarks of a multi-replica deployment: a real load balancer, not a stand-in.

    with ThrowawayProxy.start([a.base_url, b.base_url]) as proxy:        # round-robin
        client = OpenAI(base_url=proxy.base_url, ...)
    with ThrowawayProxy.start(urls, mode="sticky") as proxy:              # hash of x-session-id
        ...

``roundrobin`` sends each request to the next replica, whatever session it belongs to; ``sticky``
hashes a request header (default ``x-session-id``, which the client sends) so that one session
always reaches one replica: what a prefix-aware router does for a session's prompt cache. A request
without the header is balanced round-robin. Every answer names the replica that served it in the
``x-served-by`` header (``r0``, ``r1``, ... in the order of the URLs given). Streams (SSE) pass
through as they are written: HAProxy forwards HTTP bodies without buffering them.

A replica that refuses connections (stopped, killed) is taken out by the health check (``GET
/health`` every second, out after two failures) and, until then, a request it refuses is sent to
another replica. A request a replica accepted is never resent (it may have changed something): one
it dies with, or one a dying replica accepts and resets, gets a 502, which clients retry.

Raises :class:`ProxyUnavailable` with the reason when there is no ``haproxy`` binary (Debian:
``apt-get install haproxy``) or it does not start.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Sequence
from urllib.parse import urlsplit

__all__ = ["SERVED_BY_HEADER", "SESSION_HEADER", "ProxyUnavailable", "ThrowawayProxy", "find_haproxy"]

SESSION_HEADER = "x-session-id"
SERVED_BY_HEADER = "x-served-by"
MODES = ("roundrobin", "sticky")


class ProxyUnavailable(RuntimeError):
    """No reverse proxy can be started here (the message says why)."""


def find_haproxy() -> str:
    """The ``haproxy`` binary (checked before anything expensive is started), or ProxyUnavailable."""
    binary = shutil.which("haproxy") or next(
        (p for p in ("/usr/sbin/haproxy", "/usr/local/sbin/haproxy") if os.access(p, os.X_OK)), None)
    if binary is None:
        raise ProxyUnavailable("no `haproxy` binary on PATH or in /usr/sbin "
                               "(Debian: apt-get install haproxy)")
    return binary


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _host_port(url: str) -> str:
    """``host:port`` of a backend URL (``http://127.0.0.1:8000/v1`` or its root)."""
    parts = urlsplit(url if "://" in url else f"http://{url}")
    if not parts.hostname or not parts.port:
        raise ValueError(f"backend URL {url!r} needs a host and a port (http://HOST:PORT[/v1])")
    return f"{parts.hostname}:{parts.port}"


def haproxy_config(port: int, backends: Sequence[str], mode: str = "roundrobin",
                   header: str = SESSION_HEADER, timeout_s: int = 600) -> str:
    """The configuration: one frontend on 127.0.0.1:`port`, one backend of `backends`.

    Long server/client timeouts (a generation may stream for minutes); ``retries`` with
    ``redispatch`` only ever resend a request whose connection was refused, never one a replica
    accepted. No server connection is kept idle for reuse: one to a replica that died would take
    the next request with it (a 502), where a new connection is refused and goes elsewhere."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    balance = ("balance roundrobin" if mode == "roundrobin" else
               f"balance hdr({header})\n    hash-type consistent")
    servers = "\n".join(f"    server r{i} {_host_port(url)} check inter 1s fall 2 rise 1"
                        for i, url in enumerate(backends))
    return f"""global
    nbthread 1
    maxconn 2048

defaults
    mode http
    timeout connect 5s
    timeout client {timeout_s}s
    timeout server {timeout_s}s
    timeout http-request 60s
    retries 3
    option redispatch 1
    option http-server-close
    http-reuse never

frontend replicas_in
    bind 127.0.0.1:{port}
    default_backend replicas

backend replicas
    {balance}
    option httpchk GET /health
    http-response set-header {SERVED_BY_HEADER} %[srv_name]
{servers}
"""


class ThrowawayProxy:
    """A running HAProxy; :meth:`stop` (or the context manager) ends it and removes its files."""

    def __init__(self, process: subprocess.Popen, port: int, folder: str, mode: str,
                 backends: Sequence[str]) -> None:
        self.process, self.port, self.folder, self.mode = process, port, folder, mode
        self.backends = list(backends)

    @property
    def root_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def base_url(self) -> str:
        return self.root_url + "/v1"

    @classmethod
    def start(cls, backends: Sequence[str], mode: str = "roundrobin", header: str = SESSION_HEADER,
              timeout: float = 30.0) -> ThrowawayProxy:
        """HAProxy on a free port in front of `backends`, once it accepts connections."""
        binary = find_haproxy()
        folder = tempfile.mkdtemp(prefix="vat-proxy-")
        config = os.path.join(folder, "haproxy.cfg")
        port = _free_port()
        with open(config, "w") as f:
            f.write(haproxy_config(port, backends, mode, header))
        check = subprocess.run([binary, "-c", "-q", "-f", config], capture_output=True, text=True,
                               timeout=30, check=False)
        if check.returncode != 0:
            shutil.rmtree(folder, ignore_errors=True)
            raise ProxyUnavailable(f"haproxy refused its configuration: "
                                   f"{(check.stderr or check.stdout).strip()[:400]}")
        with open(os.path.join(folder, "log"), "w") as log:
            process = subprocess.Popen([binary, "-db", "-f", config], stdout=log,
                                       stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                       start_new_session=True)
        proxy = cls(process, port, folder, mode, backends)
        proxy._wait_listening(timeout)
        return proxy

    def _wait_listening(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                said = self.log_text()[-400:]
                self.stop()
                raise ProxyUnavailable(f"haproxy exited with code {self.process.returncode}: {said}")
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", self.port), 1):
                return
            time.sleep(0.1)
        self.stop()
        raise ProxyUnavailable(f"haproxy did not listen on port {self.port} within {timeout:.0f}s")

    def log_text(self) -> str:
        try:
            with open(os.path.join(self.folder, "log"), errors="replace") as f:
                return f.read()
        except OSError:
            return ""

    def stop(self) -> None:
        if self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(5)
        shutil.rmtree(self.folder, ignore_errors=True)

    def __enter__(self) -> ThrowawayProxy:  # noqa: PYI034 - Python 3.10 has no typing.Self
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
