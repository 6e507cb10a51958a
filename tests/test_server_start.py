"""start_serve_tiny's deadline fires even when the child prints nothing, and its errors quote the
child's last output (stand-in children: no vLLM)."""

from __future__ import annotations

import sys
import time

import pytest

from vllm_allowed_tools.devtools import serve as server_module
from vllm_allowed_tools.devtools.serve import ServeError, start_serve_tiny


def _child(monkeypatch, code: str) -> None:
    monkeypatch.setattr(server_module, "serve_tiny_command",
                        lambda *args, **kwargs: [sys.executable, "-c", code])


def test_a_silent_hang_is_stopped_at_the_deadline(monkeypatch, tmp_path):
    _child(monkeypatch, "import time; print('building the model', flush=True); time.sleep(120)")
    started = time.monotonic()
    with pytest.raises(ServeError, match="printed no URL within 1s and was stopped") as error:
        start_serve_tiny(timeout=1, log_path=tmp_path / "server.log")
    assert time.monotonic() - started < 30
    assert "building the model" in str(error.value)
    assert str(tmp_path / "server.log") in str(error.value)


def test_an_exit_before_the_url_says_why(monkeypatch, tmp_path):
    _child(monkeypatch, "import sys; print('error: port in use', file=sys.stderr); sys.exit(2)")
    with pytest.raises(ServeError, match="exited with code 2") as error:
        start_serve_tiny(timeout=60, log_path=tmp_path / "server.log")
    assert "error: port in use" in str(error.value)


def test_the_url_line_returns_a_handle_that_stops_the_child(monkeypatch, tmp_path):
    _child(monkeypatch, "import time; print('starting', flush=True); "
                        "print('http://127.0.0.1:9/v1', flush=True); time.sleep(120)")
    server = start_serve_tiny(timeout=60, log_path=tmp_path / "server.log")
    assert server.base_url == "http://127.0.0.1:9/v1" and server.root_url == "http://127.0.0.1:9"
    assert server.process.poll() is None
    assert server.stop(timeout=10) is not None and server.process.poll() is not None
