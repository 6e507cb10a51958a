"""Codex CLI (npm ``@openai/codex``, pinned in ``clients/codex``) against a real ``vllm serve``.

Codex talks to the server through a loopback gateway written here: it forwards every request
unchanged (or, where a test says so, with ``tool_choice`` narrowed: the stand-in for an operator's
gateway, since Codex never sends ``allowed_tools`` itself) and keeps each request body and the raw
SSE reply, so the tests can check what Codex really sent and what it was answered.

- Codex's default request (functions, a ``namespace`` tool, ``web_search``, an ``id`` on every input
  item, a ~23K-token prompt, ``client_metadata``, ``include``, ``reasoning``) is answered with 200
  and a stream Codex accepts: ``codex exec`` exits 0 and prints the text the server streamed. The
  same run against vanilla vLLM (same model, same template) behaves the same.
- Narrowed to a member of Codex's ``multi_agent_v1`` namespace, the call comes back with its
  ``namespace`` and bare name (streamed and unary); Codex runs it and sends the call back in its next
  request, which the server accepts too.

The Codex binary is installed by ``.ci/run`` (``npm ci --prefix clients/codex``); when it is missing
these tests install it the same way. Only a machine without ``npm`` skips them.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest

ROOT = Path(__file__).resolve().parent.parent
CODEX_DIR = ROOT / "clients" / "codex"
CODEX_BIN = CODEX_DIR / "node_modules" / ".bin" / "codex"
NAMESPACE, MEMBER = "multi_agent_v1", "close_agent"   # a member of Codex's default namespace tool
PINNED_TARGET = "agent-1"   # the one `target` the gateway lets close_agent take
CODEX_TIMEOUT_S = 240


@pytest.fixture(scope="session")
def codex_bin() -> Path:
    if not CODEX_BIN.exists():
        if shutil.which("npm") is None:
            pytest.skip("npm is not available on this machine, so the Codex CLI (npm @openai/codex, "
                        "pinned in clients/codex) cannot be installed: Codex tests skipped")
        result = subprocess.run(["npm", "ci", "--prefix", str(CODEX_DIR), "--no-audit", "--no-fund"],
                                check=False, capture_output=True, text=True, timeout=600)
        if result.returncode != 0 or not CODEX_BIN.exists():
            pytest.fail(f"npm ci --prefix {CODEX_DIR} failed (exit {result.returncode}):\n"
                        f"{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    return CODEX_BIN


# --------------------------------------------------------------------------- the recording gateway


@dataclass
class Exchange:
    sent: dict[str, Any]        # the body Codex sent
    forwarded: dict[str, Any]   # the body the server got (after the gateway's rewrite, if any)
    status: int = 0
    reply: bytes = b""

    def events(self) -> list[dict[str, Any]]:
        """The SSE events of the reply, in order (each ``data:`` payload, decoded)."""
        events = []
        for block in self.reply.decode("utf-8", errors="replace").split("\n\n"):
            data = [line[5:].lstrip() for line in block.splitlines() if line.startswith("data:")]
            if data and data != ["[DONE]"]:
                events.append(json.loads("\n".join(data)))
        return events


class Gateway:
    """Loopback HTTP server between Codex and vLLM (``upstream`` is the server's root URL)."""

    def __init__(self, upstream: str,
                 rewrite: Callable[[int, dict[str, Any]], dict[str, Any]] | None = None) -> None:
        self.upstream = upstream
        self.rewrite = rewrite
        self.exchanges: list[Exchange] = []
        self._lock = threading.Lock()
        gateway = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.0"   # the reply ends when the connection closes

            def do_POST(self) -> None:
                sent = json.loads(self.rfile.read(int(self.headers.get("content-length", "0"))))
                with gateway._lock:
                    index = len(gateway.exchanges)
                    forwarded = gateway.rewrite(index, json.loads(json.dumps(sent))) \
                        if gateway.rewrite else sent
                    exchange = Exchange(sent, forwarded)
                    gateway.exchanges.append(exchange)
                with httpx.stream("POST", gateway.upstream + self.path, json=forwarded,
                                  headers={"authorization": self.headers.get("authorization", "")},
                                  timeout=CODEX_TIMEOUT_S) as response:
                    exchange.status = response.status_code
                    self.send_response(response.status_code)
                    self.send_header("content-type", response.headers.get("content-type", ""))
                    self.end_headers()
                    for chunk in response.iter_raw():
                        exchange.reply += chunk
                        self.wfile.write(chunk)
                        self.wfile.flush()

            def do_GET(self) -> None:  # Codex may probe /models; nothing to list
                self.send_response(404)
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}/v1"

    def __enter__(self) -> Gateway:  # noqa: PYI034
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()


def run_codex(codex: Path, base_url: str, tmp_path: Path, prompt: str,
              model: str = "tiny", sandbox: str = "read-only") -> subprocess.CompletedProcess:
    """``codex exec`` against ``base_url`` with a fresh CODEX_HOME (nothing leaves the loopback).
    ``model``: the name Codex is configured with (it picks its tool set by it); ``sandbox``: Codex's
    ``sandbox_mode`` (its work dir is ``tmp_path / "work"``)."""
    home, work = tmp_path / "codex-home", tmp_path / "work"
    home.mkdir(parents=True)
    work.mkdir(parents=True)
    (home / "config.toml").write_text(f"""\
model = "{model}"
model_provider = "local"
approval_policy = "never"
sandbox_mode = "{sandbox}"
check_for_update_on_startup = false

[model_providers.local]
name = "local"
base_url = "{base_url}"
wire_api = "responses"
env_key = "LOCAL_API_KEY"
request_max_retries = 0
stream_max_retries = 0
""")
    env = {**os.environ, "CODEX_HOME": str(home), "LOCAL_API_KEY": "test"}
    env.pop("OPENAI_API_KEY", None)
    result = subprocess.run(
        [str(codex), "exec", "--skip-git-repo-check", "-c", "analytics.enabled=false",
         "--disable", "plugins", prompt],
        stdin=subprocess.DEVNULL, capture_output=True, cwd=work, env=env, timeout=CODEX_TIMEOUT_S,
        check=False)
    result.stdout = result.stdout.decode("utf-8", errors="replace")
    result.stderr = result.stderr.decode("utf-8", errors="replace")
    return result


def new_log_statuses(server, offset: int) -> list[int]:
    """HTTP statuses of the /v1/responses requests the server logged after ``offset``."""
    return [int(m) for m in re.findall(r'"POST /v1/responses HTTP/1\.1" (\d{3})',
                                       server.log_text()[offset:])]


def completed_text(events: list[dict[str, Any]]) -> str:
    response = events[-1]["response"]
    return "".join(part.get("text", "") for item in response["output"] if item["type"] == "message"
                   for part in item.get("content") or [] if part.get("type") == "output_text")


def check_codex_request_shape(body: dict[str, Any]) -> None:
    """What Codex 0.171 sends (notes/clients.md); if Codex changes, this says so."""
    types = {tool["type"] for tool in body["tools"]}
    assert {"function", "namespace", "web_search"} <= types, types
    namespace = next(t for t in body["tools"] if t["type"] == "namespace")
    assert namespace["name"] == NAMESPACE and MEMBER in [t["name"] for t in namespace["tools"]]
    assert body["tool_choice"] == "auto" and body["stream"] is True
    assert body["input"] and all(item.get("id") for item in body["input"]), \
        "Codex puts an id on every input item"
    assert "client_metadata" in body and body.get("prompt_cache_key")


def end_token_bias(flavour: str = "tool-happy") -> dict[str, float]:
    """``logit_bias`` that makes the tiny model end its answer with its first token."""
    from vllm_allowed_tools.devtools.models.tiny_model import ensure_model
    config = json.loads((ensure_model(flavour, log=lambda *_: None) / "config.json").read_text())
    return {str(config["eos_token_id"]): 100.0}


def ends_after(flavour: str, requests: int = 2) -> Callable[[int, dict[str, Any]], dict[str, Any]]:
    """The gateway's rewrite for a whole ``codex exec`` run: the first ``requests`` go as Codex
    sent them (the model's own calls, Codex's answers to them, its next turn); every later one is
    answered at once (the end token forced), so the run's length never depends on what a tiny
    model writes. Without it the run ends only when the 32K context is full: a trained tiny model
    keeps calling Codex's goal tools (non-strict: any object) with required fields missing, and
    Codex keeps answering with an error (every call an object: measured, ~60 requests, ~200 s)."""
    bias = end_token_bias(flavour)

    def rewrite(index: int, body: dict[str, Any]) -> dict[str, Any]:
        if index >= requests:
            body["logit_bias"] = bias
        return body
    return rewrite


# --------------------------------------------------------------------------------------- tests


@pytest.mark.server
@pytest.mark.parametrize("server_name", ["random_server", "vanilla_server", "happy_server"])
def test_codex_exec_runs_to_completion(request, server_name, codex_bin, tmp_path):
    """Codex's whole default request is accepted (200) and its stream too, with the plugin exactly
    as with vanilla vLLM, on both tiny flavours: Codex never sends allowed_tools, and a plain
    ``auto`` turn under the plugin can only call a tool Codex offered (tests/test_catalog_decoding_e2e.py),
    so its run ends as it does on vanilla vLLM."""
    server = request.getfixturevalue(server_name)
    offset = len(server.log_text())
    started = time.monotonic()
    with Gateway(server.root_url, rewrite=ends_after(server.flavour)) as gateway:
        result = run_codex(codex_bin, gateway.base_url, tmp_path, "list the files here")
    elapsed = time.monotonic() - started
    assert result.returncode == 0, f"codex exit {result.returncode}:\n{result.stderr[-4000:]}"

    assert gateway.exchanges, "Codex sent nothing"
    first = gateway.exchanges[0]
    check_codex_request_shape(first.sent)
    statuses = [exchange.status for exchange in gateway.exchanges]
    assert statuses == [200] * len(statuses)
    assert new_log_statuses(server, offset) == statuses, "the server logged other statuses"

    for exchange in gateway.exchanges:
        events = exchange.events()
        kinds = [event["type"] for event in events]
        assert kinds[0] == "response.created" and kinds[-1] == "response.completed", kinds
        assert "response.failed" not in kinds and "error" not in kinds
        if server_name != "vanilla_server":
            # every call Codex receives is one it can run: arguments a JSON object, whatever the
            # model wrote (Codex answers `"unit{"` with an error, and the loop went on until the
            # context was full)
            for item in events[-1]["response"]["output"]:
                if item["type"] == "function_call":
                    assert isinstance(json.loads(item["arguments"]), dict), item
    events = gateway.exchanges[-1].events()
    usage = events[-1]["response"]["usage"]
    print(f"\n{server_name}: {len(gateway.exchanges)} request(s), prompt "
          f"{gateway.exchanges[0].events()[-1]['response']['usage']['input_tokens']} tokens, "
          f"output {usage['output_tokens']} tokens, codex ran {elapsed:.1f} s")
    assert gateway.exchanges[0].events()[-1]["response"]["usage"]["input_tokens"] > 15_000, \
        "Codex's base prompt should be ~23K tokens with the tiny 2K-vocabulary tokenizer"
    # Codex parsed the stream: it prints the final message the server streamed
    text = completed_text(events).strip()
    if text:
        assert text in result.stdout, (text, result.stdout)


def narrow_to_namespace_member(index: int, body: dict[str, Any]) -> dict[str, Any]:
    """The test's operator gateway: Codex's first request may only call ``close_agent`` of the
    ``multi_agent_v1`` namespace; later requests get ``tool_choice: "none"`` so the run ends.

    The first request's call is made short and the same on every run: Codex's ``close_agent`` takes
    a free string (``strict: false``), which the random-weight model fills with tokens until
    ``max_output_tokens`` cuts the call off (sometimes, unseeded; always, greedy), and a cut-off call
    is no call. So the gateway pins ``target`` to one value (``strict: true``, an enum) and asks for
    greedy decoding: the grammar then fixes the whole call (about 45 tokens) and the model's only
    choices are whitespace."""
    if index == 0:
        body["tool_choice"] = {"type": "allowed_tools", "mode": "required",
                               "tools": [{"type": "function", "name": MEMBER}]}
        body["parallel_tool_calls"] = False
        body["max_output_tokens"] = 200
        body["temperature"] = 0.0
        body["seed"] = 0
        for tool in body["tools"]:
            if tool.get("type") == "namespace" and tool.get("name") == NAMESPACE:
                for member in tool["tools"]:
                    if member.get("name") == MEMBER:
                        member["strict"] = True
                        member["parameters"] = {
                            "type": "object", "additionalProperties": False, "required": ["target"],
                            "properties": {"target": {"type": "string", "enum": [PINNED_TARGET]}}}
    else:   # the run ends: the answer ends at its first token (16 tokens of the model's text were
        # sometimes cut by the limit: an incomplete answer, which Codex reports as an error)
        body["tool_choice"] = "none"
        body["max_output_tokens"] = 16
        body["logit_bias"] = end_token_bias()
    return body


@pytest.mark.server
def test_codex_namespaced_call_round_trip(happy_server, codex_bin, tmp_path):
    """A call to a namespace member comes back with ``namespace`` and its bare name, Codex accepts
    the streamed call, runs it, and resends it (with an id) in a history the server accepts."""
    offset = len(happy_server.log_text())
    with Gateway(happy_server.root_url, rewrite=narrow_to_namespace_member) as gateway:
        result = run_codex(codex_bin, gateway.base_url, tmp_path, "close the helper agent")
    assert result.returncode == 0, f"codex exit {result.returncode}:\n{result.stderr[-4000:]}"
    statuses = [exchange.status for exchange in gateway.exchanges]
    assert len(statuses) >= 2 and statuses == [200] * len(statuses), statuses
    assert new_log_statuses(happy_server, offset) == statuses

    first = gateway.exchanges[0]
    check_codex_request_shape(first.sent)
    events = first.events()
    assert events[-1]["type"] == "response.completed", [e["type"] for e in events]
    calls = [item for item in events[-1]["response"]["output"] if item["type"] == "function_call"]
    assert len(calls) == 1, events[-1]["response"]["output"]
    call = calls[0]
    assert (call.get("namespace"), call["name"]) == (NAMESPACE, MEMBER), call
    assert json.loads(call["arguments"]) == {"target": PINNED_TARGET}
    done = [e["item"] for e in events if e["type"] == "response.output_item.done"
            and e["item"]["type"] == "function_call"]
    assert [(item.get("namespace"), item["name"]) for item in done] == [(NAMESPACE, MEMBER)]
    # the client's own tool_choice is what the response object reports
    assert events[-1]["response"]["tool_choice"]["type"] == "allowed_tools"

    # Codex accepted the streamed call, ran it, and sent it back with its output
    follow_up = gateway.exchanges[1].sent
    assert all(item.get("id") for item in follow_up["input"])
    echoed = [item for item in follow_up["input"]
              if item.get("type") == "function_call" and item.get("call_id") == call["call_id"]]
    assert len(echoed) == 1 and echoed[0]["name"] == MEMBER, follow_up["input"][-3:]
    assert echoed[0].get("namespace") == NAMESPACE, echoed[0]
    outputs = [item for item in follow_up["input"]
               if item.get("type") == "function_call_output" and item["call_id"] == call["call_id"]]
    assert len(outputs) == 1, follow_up["input"][-3:]
    assert follow_up["prompt_cache_key"] == first.sent["prompt_cache_key"]

    # the same narrowed request, unary: the namespace is on the output item as well
    unary = {**narrow_to_namespace_member(0, json.loads(json.dumps(first.sent))), "stream": False}
    response = httpx.post(happy_server.base_url + "/responses", json=unary, timeout=120)
    assert response.status_code == 200, response.text
    assert response.json()["status"] == "completed", response.json()
    calls = [item for item in response.json()["output"] if item["type"] == "function_call"]
    assert [(c.get("namespace"), c["name"]) for c in calls] == [(NAMESPACE, MEMBER)], calls
    assert json.loads(calls[0]["arguments"]) == {"target": PINNED_TARGET}


#: a model name from Codex's own catalog: Codex then sends its full tool array, with the ``custom``
#: tool ``apply_patch`` whose ``format`` is a Lark grammar
CODEX_CATALOG_MODEL = "gpt-5.5"


def served_as_tiny(index: int, body: dict[str, Any]) -> dict[str, Any]:
    """The gateway serves Codex's ``gpt-5.5`` with the tiny model (what ``--served-model-name
    gpt-5.5`` would do, without a server of its own)."""
    body["model"] = "tiny"
    return body


def grammar_tools(body: dict[str, Any]) -> list[dict[str, Any]]:
    return [tool for tool in body.get("tools") or [] if tool.get("type") == "custom"
            and (tool.get("format") or {}).get("type") == "grammar"]


@pytest.mark.server
def test_codex_own_catalog_is_served_with_the_plugin_and_refused_by_vanilla_vllm(
        happy_server, vanilla_server, codex_bin, tmp_path):
    """Codex configured with a model of its own catalog sends ``apply_patch`` as a ``custom`` tool
    with a Lark grammar. Vanilla vLLM answers that request with a 400 and Codex cannot run a turn;
    with the plugin every request is a 200, ``codex exec`` runs to completion, and the response
    echoes the tool as Codex sent it."""
    with Gateway(vanilla_server.root_url, rewrite=served_as_tiny) as gateway:
        refused = run_codex(codex_bin, gateway.base_url, tmp_path / "vanilla", "list the files here",
                            model=CODEX_CATALOG_MODEL)
    assert refused.returncode != 0
    assert gateway.exchanges and grammar_tools(gateway.exchanges[0].sent), \
        "Codex should send apply_patch as a grammar custom tool for " + CODEX_CATALOG_MODEL
    assert gateway.exchanges[0].status == 400
    assert b"grammar" in gateway.exchanges[0].reply, gateway.exchanges[0].reply[:400]

    offset = len(happy_server.log_text())
    ends = ends_after("tool-happy")
    with Gateway(happy_server.root_url, rewrite=lambda i, body: ends(i, served_as_tiny(i, body))) as gateway:
        result = run_codex(codex_bin, gateway.base_url, tmp_path / "plugin", "list the files here",
                           model=CODEX_CATALOG_MODEL)
    assert result.returncode == 0, f"codex exit {result.returncode}:\n{result.stderr[-4000:]}"
    statuses = [exchange.status for exchange in gateway.exchanges]
    assert statuses and statuses == [200] * len(statuses), statuses
    assert new_log_statuses(happy_server, offset) == statuses
    sent = grammar_tools(gateway.exchanges[0].sent)
    assert [tool["name"] for tool in sent] == ["apply_patch"]
    for exchange in gateway.exchanges:
        events = exchange.events()
        assert events[-1]["type"] == "response.completed", [e["type"] for e in events]
        echoed = [tool for tool in events[-1]["response"]["tools"] if tool.get("name") == "apply_patch"]
        assert echoed == sent, echoed


#: the patch the test's gateway lets the model write: Codex's own grammar admits every input of it
#: (checked below), a fixed path in Codex's work dir, one or two lines of a two-word vocabulary
NARROW_PATCH_GRAMMAR = '''start: "*** Begin Patch" LF "*** Add File: hello.txt" LF line line? "*** End Patch" LF?
line: "+" WORD LF
WORD: "hello" | "world"
%import common.LF
'''


def narrow_to_apply_patch(index: int, body: dict[str, Any]) -> dict[str, Any]:
    """The test's operator gateway for Codex's ``apply_patch``: the first request may only call
    that custom tool (``allowed_tools`` ``required`` over a ``custom`` entry), its grammar narrowed
    to :data:`NARROW_PATCH_GRAMMAR` (as the namespace test pins ``close_agent``'s argument: a
    random path or an endless line would make the run depend on sampling); later requests end the
    run as the namespace test's do."""
    served_as_tiny(index, body)
    if index == 0:
        body["tool_choice"] = {"type": "allowed_tools", "mode": "required",
                               "tools": [{"type": "custom", "name": "apply_patch"}]}
        body["parallel_tool_calls"] = False
        body["max_output_tokens"] = 200
        body["temperature"] = 0.0
        body["seed"] = 0
        for tool in grammar_tools(body):
            if tool["name"] == "apply_patch":
                tool["format"] = {**tool["format"], "definition": NARROW_PATCH_GRAMMAR}
        return body
    return narrow_to_namespace_member(index, body)


@pytest.mark.server
def test_codex_applies_a_patch_the_model_wrote_under_its_own_grammar(happy_server, codex_bin, tmp_path):
    """Codex (configured as ``gpt-5.5``) sends ``apply_patch`` with its Lark grammar; narrowed to
    it, the model's ``custom_tool_call`` input is held to the grammar while decoding, Codex's own
    grammar accepts it, and Codex applies it: the file appears in its work dir, and the next request
    (the call and its ``custom_tool_call_output`` in the history) is served too."""
    from vllm_allowed_tools.request.custom_tools import compile_custom_grammar

    with Gateway(happy_server.root_url, rewrite=narrow_to_apply_patch) as gateway:
        result = run_codex(codex_bin, gateway.base_url, tmp_path, "add a file hello.txt",
                           model=CODEX_CATALOG_MODEL, sandbox="workspace-write")
    assert result.returncode == 0, f"codex exit {result.returncode}:\n{result.stderr[-4000:]}"
    statuses = [exchange.status for exchange in gateway.exchanges]
    assert len(statuses) >= 2 and statuses == [200] * len(statuses), statuses

    codex_grammar = next(tool for tool in grammar_tools(gateway.exchanges[0].sent)
                         if tool["name"] == "apply_patch")["format"]
    events = gateway.exchanges[0].events()
    assert events[-1]["type"] == "response.completed", [e["type"] for e in events]
    calls = [item for item in events[-1]["response"]["output"] if item["type"] == "custom_tool_call"]
    assert [call["name"] for call in calls] == ["apply_patch"], events[-1]["response"]["output"]
    patch = calls[0]["input"]
    assert compile_custom_grammar("apply_patch", codex_grammar["syntax"],
                                  codex_grammar["definition"]).admits(patch), patch
    streamed = "".join(e["delta"] for e in events if e["type"] == "response.custom_tool_call_input.delta")
    assert streamed == patch

    # Codex applied it: the file holds the added lines
    lines = [line[1:] for line in patch.splitlines() if line.startswith("+")]
    written = tmp_path / "work" / "hello.txt"
    assert written.exists(), (patch, result.stdout[-2000:], result.stderr[-2000:])
    assert written.read_text().splitlines() == lines

    # ... and sent the call back with its output, which the server accepted (200 above)
    follow_up = gateway.exchanges[1].sent["input"]
    assert [item["type"] for item in follow_up if item.get("call_id") == calls[0]["call_id"]] == \
        ["custom_tool_call", "custom_tool_call_output"], follow_up[-3:]
