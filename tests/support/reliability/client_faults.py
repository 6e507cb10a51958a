"""Client faults: the client goes away mid-stream, right after sending, or half-way through its
body, and each engine request must be aborted (checked on the server's own metrics)."""

from __future__ import annotations

import json
import random
import socket
import time
from urllib.parse import urlparse

import httpx

from vllm_allowed_tools.devtools.models.tool_pool import POOL

from ..calls import chat_selection, responses_selection
from ..metrics import scrape_metric, wait_until_idle
from .report import Figures
from .wire import PATHS, REQUEST_TIMEOUT, base_body, send_sync

DISCONNECT_BUDGET = 30000        # tokens a disconnected request would generate if not aborted
_COUNTERS = ("vllm:generation_tokens_total", "vllm:request_success_total",
             "vllm:prompt_tokens_total")


def _disconnect_body(api: str, policy: bool, index: int) -> dict:
    rng = random.Random(500 + index)
    body = base_body(api, DISCONNECT_BUDGET)
    if policy:
        catalog = rng.sample(list(POOL), 8)
        subset = [tool.name for tool in rng.sample(catalog, 2)]
        if api == "chat":
            body.update(tools=[t.chat_tool() for t in catalog],
                        tool_choice=chat_selection("auto", subset))
        else:
            body.update(tools=[t.responses_tool() for t in catalog],
                        tool_choice=responses_selection("auto", subset))
        body["parallel_tool_calls"] = True
    body["ignore_eos"] = True
    return body


def _raw_post(base_url: str, api: str, body: dict, fraction: float) -> None:
    """Send the headers and `fraction` of the body of a POST on a raw socket, then close it
    (no timer in between: a starved client cannot turn this into a late close)."""
    url = urlparse(base_url)
    data = json.dumps(body).encode()
    with socket.create_connection((url.hostname, url.port), timeout=10) as sock:
        sock.sendall((f"POST {url.path}{PATHS[api]} HTTP/1.1\r\nHost: {url.hostname}\r\n"
                      f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
                      ).encode() + data[: int(len(data) * fraction)])


def _disconnect(base_url: str, how: str, api: str, body: dict, events: int) -> tuple[int, str | None]:
    """Send `body` and go away the way `how` says; (stream events read, what went wrong)."""
    read = 0
    try:
        if how == "stream":
            body["stream"] = True
            with httpx.Client(timeout=REQUEST_TIMEOUT) as client, \
                    client.stream("POST", base_url + PATHS[api], json=body) as response:
                if response.status_code != 200:
                    return read, f"status {response.status_code}: {response.read()[:300]!r}"
                for line in response.iter_lines():
                    read += line.startswith("data: ")
                    if read >= events:
                        break
            # leaving the block closes the connection half-way through the stream
        elif how == "unary":
            _raw_post(base_url, api, body, 1.0)    # the whole request, then gone
        else:
            _raw_post(base_url, api, body, 0.5)    # half of the body, then gone
    except httpx.HTTPError as exc:
        return read, f"{type(exc).__name__}: {exc}"
    return read, None


def _plan(streams: int) -> list[tuple[str, str, bool, int]]:
    """(how, api, with a policy, events before the close) of each fault, in order."""
    plan = [("stream", "chat" if i % 2 == 0 else "responses", (i // 2) % 2 == 0, 1 + i % 6)
            for i in range(streams)]
    for api in ("chat", "responses"):
        plan.append(("unary", api, True, 0))
        plan.append(("half_body", api, True, 0))
    return plan


def _one_fault(base_url: str, index: int, fault: tuple[str, str, bool, int],
               figures: Figures) -> tuple[float, float]:
    """Run one fault and judge it; (tokens generated, seconds from the close to idle)."""
    how, api, policy, events = fault
    root = base_url.removesuffix("/v1")
    wait_until_idle(root)
    before = [scrape_metric(root, name) for name in _COUNTERS]
    read, problem = _disconnect(base_url, how, api, _disconnect_body(api, policy, index), events)
    closed = time.monotonic()
    idle_after = wait_until_idle(root)
    to_idle = time.monotonic() - closed
    time.sleep(1.0)   # an engine request not aborted would keep generating meanwhile
    running = scrape_metric(root, "vllm:num_requests_running")
    generated, finished, prompted = (scrape_metric(root, name) - value
                                     for name, value in zip(_COUNTERS, before))
    figures.counts[f"{how}_tried"] += 1
    # With EOS ignored, a request that is not aborted runs to its budget and finishes (it is
    # counted in request_success_total); an aborted one never finishes: `finished == 0` (and
    # nothing running) is the proof. How many tokens it made before the abort depends on how
    # soon this client got to close the socket and the server to notice: on a busy 2-core
    # machine both can be starved for seconds by the engine's own busy processes, so the
    # count is reported (figure `tokens_generated`), not bounded tighter than the budget.
    aborted = running == 0 and finished == 0 and generated < DISCONNECT_BUDGET
    figures.extra.setdefault("tokens_generated", {}).setdefault(how, []).append(int(generated))
    if how == "half_body":
        aborted = aborted and prompted == 0 and generated == 0
    if problem is None and aborted:
        figures.counts[f"{how}_aborted"] += 1
    else:
        figures.counts[f"{how}_not_aborted"] += 1
        figures.problems.append(
            f"{how} {api} policy={policy} after {read} events: {problem or 'not aborted'} "
            f"(running {running}, generated {generated:.0f} of {DISCONNECT_BUDGET}, "
            f"finished {finished:.0f}, idle after {idle_after:.1f}s)")
    return generated, to_idle


def run_disconnects(base_url: str, streams: int) -> Figures:
    """Client faults, one at a time: `streams` mid-stream disconnects (both endpoints, with and
    without a policy, after 1-6 events), per endpoint one unary request whose client is gone right
    after sending it and one whose body is cut off half-way. Each must leave no engine request
    behind."""
    figures = Figures()
    root = base_url.removesuffix("/v1")
    started = time.monotonic()
    generated_max = 0.0
    idle_seconds = 0.0
    for index, fault in enumerate(_plan(streams)):
        generated, to_idle = _one_fault(base_url, index, fault, figures)
        generated_max = max(generated_max, generated)
        idle_seconds = max(idle_seconds, to_idle)
    figures.extra["max_tokens_generated"] = generated_max
    figures.extra["max_seconds_close_to_idle"] = round(idle_seconds, 1)
    figures.extra["budget_tokens"] = DISCONNECT_BUDGET
    figures.extra["healthy_after"] = httpx.get(root + "/health", timeout=30).status_code == 200
    with httpx.Client(timeout=REQUEST_TIMEOUT) as client:
        check = send_sync(client, base_url, "chat", base_body("chat", 8), stream=False)
    figures.extra["answers_after"] = check.status == 200
    figures.extra["seconds"] = round(time.monotonic() - started, 1)
    return figures
