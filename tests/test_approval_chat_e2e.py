"""The approval chat (``examples/approval_chat``), driven as a person drives it: in a real headless
Chromium, through its one command (the app starts ``serve-tiny --flavour real`` itself: the real
SmolLM2-135M-Instruct, with the example's policy), one start for the module.

A person types a request and sees the turn's tools (which it allows, which ask first), then the
approval prompt scrolled into view (the tool, the arguments the model wrote, the server's message,
one control per offered scope plus decline and cancel, each with its meaning), chooses "this
session" with the keyboard, sees the call run and the answer, sees the next call run labelled as
run under the session grant, sees the grant on My approvals, revokes it and is asked again; a
decline, its reason typed before the Decline button, gets the model's answer in words. Two
parallel approvals (a scripted stand-in server) are sent only once both are answered. Each step
leaves a screenshot in the folder the test prints.

Determinism: the app's documented tool rule (a message naming a tool makes the first request
``allowed_tools`` ``required`` over it) and temperature 0 make the model call exactly the tool the
message names, with the same arguments every run; the test checks what a person would expect of
them (the email goes to Bob, the file deleted is the one named).
"""

from __future__ import annotations

import contextlib
import http.server
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

ROOT = Path(__file__).resolve().parent.parent
APP = ROOT / "examples" / "approval_chat" / "app.py"
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMEDRIVER = shutil.which("chromedriver") or "/usr/bin/chromedriver"
KEY_A, KEY_B = "person-a-key", "person-b-key"
STEP_TIMEOUT_S = 600     # one agent action: two or three model requests on a loaded 2-core machine

webdriver = pytest.importorskip("selenium.webdriver",
                                reason="selenium is not installed: pip install -e '.[test]'")
from selenium.common.exceptions import WebDriverException  # noqa: E402
from selenium.webdriver.chrome.service import Service  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.common.keys import Keys  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402

pytestmark = [
    pytest.mark.skipif(not (os.access(CHROMIUM, os.X_OK) and os.access(CHROMEDRIVER, os.X_OK)),
                       reason=f"needs Debian's chromium and chromium-driver ({CHROMIUM}, "
                              f"{CHROMEDRIVER}): apt-get install -y chromium chromium-driver"),
]


# ---------------------------------------------------------------------------------- fixtures


class ScriptedResponses(http.server.ThreadingHTTPServer):
    """A stand-in ``/v1/responses`` that asks two approvals in one response, which the tiny model
    never does (it makes one call a turn): the page's rule for parallel elicitations needs them.
    It records every request body; an ``accept`` gets its call back, anything else a message."""

    bodies: list[dict[str, Any]]

    @classmethod
    def start(cls) -> ScriptedResponses:
        server = cls(("127.0.0.1", 0), _ScriptedHandler)
        server.bodies = []
        threading.Thread(target=server.serve_forever, daemon=True).start()
        return server

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/v1"

    def stop(self) -> None:
        self.shutdown()
        self.server_close()

    def answer(self, body: dict[str, Any]) -> list[dict[str, Any]]:
        self.bodies.append(body)
        history = body["input"]
        asked = {item["id"]: item for item in history if item.get("type") == "elicitation"}
        answers = [item for item in history if item.get("type") == "elicitation_response"]
        ran = {item["call_id"] for item in history if item.get("type") == "function_call"}
        accepted = [asked[a["elicitation_id"]] for a in answers if a["action"] == "accept"
                    and asked[a["elicitation_id"]]["call_id"] not in ran]
        if accepted:
            return [{"type": "function_call", "id": "fc_" + e["call_id"], "call_id": e["call_id"],
                     "name": e["name"], "arguments": e["arguments"]} for e in accepted]
        choice = body.get("tool_choice")
        if isinstance(choice, dict) and len(choice.get("tools", [])) >= 2:
            return [_scripted_elicitation(tool["name"]) for tool in choice["tools"]]
        return [{"type": "message", "role": "assistant",
                 "content": [{"type": "output_text", "text": f"Seen {len(answers)} answers."}]}]


def _scripted_elicitation(name: str) -> dict[str, Any]:
    arguments = {"send_email": {"recipient": "Bob", "subject": "Notes", "body": "The notes."},
                 "delete_file": {"path": "old_report.txt"}}[name]
    return {"id": "elicit_" + secrets.token_hex(8), "type": "elicitation",
            "elicitation_type": "tool_call_approval", "message": f"The assistant wants to call {name}.",
            "call_id": "call_" + secrets.token_hex(4), "name": name, "namespace": None,
            "arguments": json.dumps(arguments), "arguments_digest": "sha256:" + "0" * 64,
            "tool_definition_digest": "sha256:" + "1" * 64,
            "requested_scopes": ["once", "session", "always"], "expires_at": int(time.time()) + 600}


class _ScriptedHandler(http.server.BaseHTTPRequestHandler):
    server: ScriptedResponses

    def log_message(self, *args: Any) -> None:
        pass

    def do_GET(self) -> None:   # /v1/models: every key is accepted
        self._send(200, "application/json", b'{"data": [{"id": "tiny"}]}')

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        events = [{"type": "response.output_item.done", "item": item}
                  for item in self.server.answer(body)]
        events.append({"type": "response.completed", "response": {"status": "completed"}})
        self._send(200, "text/event-stream", "".join(
            f"event: {e['type']}\ndata: {json.dumps(e)}\n\n" for e in events).encode())

    def _send(self, status: int, content_type: str, data: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


class ChatApp:
    def __init__(self, process: subprocess.Popen, url: str, log: Path) -> None:
        self.process, self.url, self.log = process, url, log

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)   # the app stops its model server itself
            try:
                self.process.wait(90)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(10)


def _start_app(folder: Path, *options: str, timeout: float = 900.0) -> ChatApp:
    """The example's one command, on a free port; returns once it prints its URL. Without
    ``options`` it starts its own model server."""
    log = folder / "app.log"
    command = [sys.executable, str(APP), "--port", "0", *(options or (
        "--api-key", KEY_A, "--api-key", KEY_B, "--state-dir", str(folder / "state")))]
    with open(log, "w") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT,
                                   stdin=subprocess.DEVNULL, cwd=ROOT, start_new_session=True)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for line in log.read_text(errors="replace").splitlines():
            if line.startswith("approval chat: "):
                return ChatApp(process, line.removeprefix("approval chat: ").strip(), log)
        if process.poll() is not None:
            break
        time.sleep(1)
    app = ChatApp(process, "", log)
    app.stop()
    pytest.fail(f"the approval chat did not start; its output:\n{log.read_text()[-4000:]}")


@pytest.fixture(scope="module")
def chat_app(tmp_path_factory) -> Iterator[ChatApp]:
    app = _start_app(tmp_path_factory.mktemp("approval-chat"))
    [model_server] = [line.split()[2] for line in app.log.read_text().splitlines()
                      if line.startswith("model server: ")]
    yield app
    app.stop()
    with pytest.raises(httpx.TransportError):   # the one command stopped what it started
        httpx.get(model_server.removesuffix("/v1") + "/health", timeout=10)


@pytest.fixture(scope="module")
def scripted_app(tmp_path_factory) -> Iterator[tuple[ChatApp, ScriptedResponses]]:
    """The app over :class:`ScriptedResponses` (``--base-url``): two approvals in one response."""
    folder = tmp_path_factory.mktemp("approval-chat-scripted")
    upstream = ScriptedResponses.start()
    app = _start_app(folder, "--base-url", upstream.base_url, "--grant-store",
                     str(folder / "grants.db"), timeout=120)
    yield app, upstream
    app.stop()
    upstream.stop()


@pytest.fixture(scope="module")
def shots(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("approval-chat-screenshots")
    print(f"\napproval chat screenshots: {folder}")
    return folder


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for argument in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage",
                     "--window-size=1100,900", "--disable-gpu"):
        options.add_argument(argument)
    try:   # the driver named explicitly: Selenium's own driver download cannot work offline
        driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    except WebDriverException as error:
        pytest.skip(f"chromium did not start under {CHROMEDRIVER}: {error.msg}")
    yield driver
    driver.quit()


# ---------------------------------------------------------------------------------- helpers


class Page:
    """The chat page as the test reads it: counts of entries, the page's own state flag."""

    def __init__(self, driver: Any, app: ChatApp, shots: Path) -> None:
        self.driver, self.app, self.shots = driver, app, shots

    def wait(self, condition: Callable[[], Any], what: str, timeout: float = STEP_TIMEOUT_S) -> Any:
        try:
            return WebDriverWait(self.driver, timeout, poll_frequency=0.25).until(
                lambda _: condition())
        except Exception:
            self.shot("failure")
            status = self.driver.find_elements(By.ID, "status")
            said = status[0].text if status else "(no status line)"
            pytest.fail(f"timed out waiting for {what}; the page says: {said!r}\n"
                        f"app log:\n{self.app.log.read_text()[-3000:]}")

    def state(self) -> str | None:
        return self.driver.execute_script("return document.body.dataset.state || null")

    def shot(self, name: str) -> Path:
        path = self.shots / f"{name}.png"
        self.driver.save_screenshot(str(path))
        return path

    def sign_in(self, key: str) -> None:
        self.driver.get(self.app.url)
        self.driver.delete_all_cookies()   # cookies ignore ports: another app's sign-in is not ours
        self.driver.get(self.app.url)
        self.wait(lambda: self.driver.current_url.endswith("/sign-in"), "the sign-in page")
        self.driver.find_element(By.ID, "api-key").send_keys(key, Keys.ENTER)
        self.wait(lambda: self.state() == "idle", "the chat page after signing in", 60)

    def open_chat(self) -> None:
        self.driver.get(self.app.url)
        self.wait(lambda: self.state() in ("idle", "waiting"), "the chat page", 60)

    def new_chat(self) -> None:
        self.driver.find_element(By.ID, "new-chat").click()
        self.wait(lambda: not self.entries("*"), "an empty new chat", 60)

    def entries(self, kind: str) -> list[Any]:
        return self.driver.find_elements(By.CSS_SELECTOR, f"#transcript > li.entry.{kind}"
                                         if kind != "*" else "#transcript > li.entry")

    def open_approvals(self) -> list[Any]:
        return [card for card in self.entries("approval") if "closed" not in
                card.get_attribute("class").split()]

    def desk(self, name: str) -> list[str]:
        return [li.text for li in self.driver.find_elements(By.CSS_SELECTOR, f"#desk-{name} li")
                if "empty" not in (li.get_attribute("class") or "")]

    def say(self, text: str) -> None:
        """Type a message and press Enter; wait until the assistant answered or asks."""
        before = len(self.entries("*"))
        box = self.driver.find_element(By.ID, "message")
        box.send_keys(text, Keys.ENTER)
        self.wait(lambda: len(self.entries("*")) > before and self.state() in ("idle", "waiting"),
                  f"the answer to {text!r}")

    def last(self, kind: str) -> Any:
        return self.entries(kind)[-1]

    def in_view(self, element: Any) -> bool:
        """Whether ``element`` lies wholly inside the browser's viewport."""
        return self.driver.execute_script(
            "const r = arguments[0].getBoundingClientRect();"
            "return r.top >= 0 && r.bottom <= window.innerHeight && r.height > 0;", element)

    def kinds_after(self, entry: Any) -> list[str]:
        """The kinds (user, assistant, call, ...) of the transcript entries after ``entry``."""
        return self.driver.execute_script(
            "const out = []; let e = arguments[0].nextElementSibling;"
            "while (e) { out.push(e.classList[1]); e = e.nextElementSibling; } return out;", entry)


def _option(card: Any, action: str, scope: str | None = None) -> Any:
    selector = f'button[data-action="{action}"]' + (f'[data-scope="{scope}"]' if scope else "")
    return card.find_element(By.CSS_SELECTOR, selector)


@contextlib.contextmanager
def _signed_in_client(app: ChatApp, key: str) -> Iterator[httpx.Client]:
    """An HTTP client of the app signed in with ``key`` (another person than the browser's)."""
    with httpx.Client(base_url=app.url, timeout=60) as client:
        response = client.post("/api/sign-in", json={"api_key": key})
        assert response.status_code == 200, response.text
        yield client


@pytest.fixture(scope="module")
def page(browser, chat_app, shots) -> Page:
    page = Page(browser, chat_app, shots)
    page.sign_in(KEY_A)
    return page


def _meaning(page: Page, button: Any) -> str:
    return page.driver.find_element(By.ID, button.get_attribute("aria-describedby")).text


def _arguments(card: Any) -> dict[str, str]:
    """A call's or prompt's arguments as the page lists them."""
    names = [dt.text for dt in card.find_elements(By.CSS_SELECTOR, "dl.arguments dt")]
    values = [dd.text for dd in card.find_elements(By.CSS_SELECTOR, "dl.arguments dd")]
    return dict(zip(names, values, strict=True))


def _turn_gates(note: Any) -> dict[str, str]:
    """A turn note's tools and what each does (``gate-asks``, ``gate-session``, ...)."""
    return {li.get_attribute("data-tool"): li.get_attribute("class")
            for li in note.find_elements(By.CSS_SELECTOR, "ul.turn-tools li")}


def _no_call_markup(text: str) -> bool:
    """No call or tool-output markup: the answer is words (tool_choice "none" returns what the
    model wrote, markup included, as vanilla vLLM does)."""
    return "<tool_" not in text and '"arguments"' not in text


# ---------------------------------------------------------------------------------- the tests


@pytest.mark.server
def test_the_page_asks_shows_the_turns_tools_and_a_session_grant_runs_the_next_call(page):
    page.say("Please email the meeting notes to Bob.")
    assert page.state() == "waiting"
    note = page.last("turn")
    assert note.get_attribute("data-allowed") == "send_email"
    assert note.get_attribute("data-gated") == "send_email"
    assert _turn_gates(note) == {"send_email": "gate-asks"}
    assert "asks for your approval" in note.text
    [card] = page.open_approvals()
    assert card.get_attribute("data-tool") == "send_email"
    assert "cannot be unsent" in card.find_element(By.CSS_SELECTOR, ".server-message").text
    arguments = _arguments(card)
    assert sorted(arguments) == ["body", "recipient", "subject"], arguments
    assert "bob" in arguments["recipient"].lower(), arguments   # what the person asked for
    assert arguments["subject"].strip() and arguments["body"].strip(), arguments
    labels = [b.text for b in card.find_elements(By.CSS_SELECTOR, "button.choice-button")]
    assert labels == ["Allow once", "Allow for this session", "Always allow", "Decline", "Cancel"]
    for button in card.find_elements(By.CSS_SELECTOR, "button.choice-button"):
        meaning = page.driver.find_element(By.ID, button.get_attribute("aria-describedby"))
        assert len(meaning.text) > 30, (button.text, meaning.text)   # each choice is explained
        assert page.in_view(button), f"{button.text!r} is not scrolled into view"
    assert "in this chat" in _meaning(page, _option(card, "accept", "session"))
    assert "every chat" in _meaning(page, _option(card, "accept", "always"))
    assert page.driver.find_element(By.ID, "message").get_attribute("disabled"), \
        "no new message may be sent while an approval waits (it would decline it unasked)"
    assert page.desk("outbox") == []
    page.shot("01-approval-prompt")
    size = page.driver.get_window_size()
    page.driver.set_window_size(size["width"], 1600)   # the whole card, for the example's README
    card.screenshot(str(page.shots / "approval-prompt.png"))
    page.driver.set_window_size(size["width"], size["height"])
    page.driver.execute_script("arguments[0].focus()", card.find_element(By.TAG_NAME, "h3"))

    # the keyboard alone: the prompt has focus; Tab to "Allow for this session", press Enter
    assert page.driver.switch_to.active_element.tag_name == "h3"
    session = _option(card, "accept", "session")
    for _ in range(10):
        if page.driver.switch_to.active_element == session:
            break
        page.driver.switch_to.active_element.send_keys(Keys.TAB)
    assert page.driver.switch_to.active_element == session, "Tab never reached the option"
    page.driver.switch_to.active_element.send_keys(Keys.ENTER)
    page.wait(lambda: page.state() == "idle" and page.desk("outbox"), "the approved call to run")
    assert "Allow for this session" in card.find_element(By.CSS_SELECTOR, ".answer-state").text
    assert page.kinds_after(card)[:3] == ["call", "result", "assistant"], page.kinds_after(card)
    call = page.last("call")
    assert call.get_attribute("data-released") == "approval"
    assert _arguments(call) == arguments, "the call that ran is the one the person approved"
    [sent] = page.desk("outbox")
    assert sent.startswith(f"To {arguments['recipient']}: {arguments['subject']}"), sent
    assert _no_call_markup(page.last("assistant").text), page.last("assistant").text
    page.shot("02-approved-for-the-session")

    # the grant releases the next call of this chat without asking, and the page says so
    page.say("Email Bob again to remind him about the meeting.")
    page.wait(lambda: page.state() == "idle" and len(page.desk("outbox")) == 2,
              "the second email, under the session grant")
    assert page.open_approvals() == [] and len(page.entries("approval")) == 1
    assert _turn_gates(page.last("turn")) == {"send_email": "gate-session"}
    call = page.last("call")
    assert call.get_attribute("data-released") == "session"
    assert "session grant" in call.find_element(By.CSS_SELECTOR, ".released").text
    assert "bob" in _arguments(call)["recipient"].lower()
    page.shot("03-the-grant-ran-the-next-call")


@pytest.mark.server
def test_my_approvals_lists_the_grant_only_to_its_holder_and_revoking_it_asks_again(page):
    driver = page.driver
    driver.find_element(By.LINK_TEXT, "My approvals").click()
    page.wait(lambda: driver.find_elements(By.CSS_SELECTOR, "#grant-rows tr"), "the grant list", 60)
    [row] = driver.find_elements(By.CSS_SELECTOR, "#grant-rows tr")
    cells = [td.text for td in row.find_elements(By.TAG_NAME, "td")]
    assert cells[0] == "send_email" and cells[1] == "This session (your current chat)", cells
    assert cells[3] and cells[4] and cells[4] != "never", cells   # created, expires
    page.shot("04-my-approvals")
    grant_id = row.get_attribute("data-grant-id")

    # another person (another API key) sees none of it and cannot revoke it; nobody signed out can
    with _signed_in_client(page.app, KEY_B) as other:
        assert other.get("/api/grants").json()["grants"] == []
        refused = other.post(f"/api/grants/{grant_id}/revoke", json={})
        assert refused.status_code == 404, refused.text
    assert httpx.get(page.app.url + "api/grants", timeout=30).status_code == 401
    assert httpx.post(page.app.url + "api/sign-in", json={"api_key": "nobody"},
                      timeout=30).status_code == 401

    revoke = row.find_element(By.CSS_SELECTOR, "button.revoke")
    revoke.send_keys(Keys.ENTER)
    page.wait(lambda: not driver.find_elements(By.CSS_SELECTOR, "#grant-rows tr")
              and "Revoked" in driver.find_element(By.ID, "status").text, "the revocation", 60)
    assert driver.find_element(By.ID, "no-grants").is_displayed()
    page.shot("05-revoked")

    page.open_chat()
    asked_before = len(page.entries("approval"))
    page.say("Email Bob one more time.")
    assert page.state() == "waiting"
    assert len(page.entries("approval")) == asked_before + 1, "the revoked grant must ask again"
    assert _turn_gates(page.last("turn")) == {"send_email": "gate-asks"}
    [card] = page.open_approvals()
    assert card.get_attribute("data-tool") == "send_email"
    assert len(page.desk("outbox")) == 2, "nothing ran without the person"
    page.shot("06-asked-again-after-revoking")
    _option(card, "cancel").click()   # leave the chat clean for the next test
    page.wait(lambda: page.state() == "idle", "the answer to the cancel")
    assert len(page.desk("outbox")) == 2


@pytest.mark.server
def test_a_decline_with_its_reason_typed_first_reaches_the_model_which_answers_in_words(page):
    page.open_chat()
    page.new_chat()
    page.say("Delete the file old_report.txt, please.")
    [card] = page.open_approvals()
    assert card.get_attribute("data-tool") == "delete_file"
    assert _arguments(card) == {"path": "old_report.txt"}
    labels = [b.text for b in card.find_elements(By.CSS_SELECTOR, "button.choice-button")]
    assert labels == ["Allow once", "Decline", "Cancel"], "the policy offers only once"

    # the reason comes before the Decline button: Tab from "Allow once" reaches it first
    driver = page.driver
    driver.execute_script("arguments[0].focus()", _option(card, "accept", "once"))
    driver.switch_to.active_element.send_keys(Keys.TAB)
    reason = card.find_element(By.CSS_SELECTOR, "input.reason")
    assert driver.switch_to.active_element == reason, "the reason field precedes Decline"
    assert page.in_view(reason) and page.in_view(_option(card, "decline"))
    reason.send_keys("Keep it for now")
    reason.send_keys(Keys.TAB)
    assert driver.switch_to.active_element == _option(card, "decline")
    driver.switch_to.active_element.send_keys(Keys.ENTER)
    page.wait(lambda: page.state() == "idle" and "assistant" in page.kinds_after(card),
              "the model's answer to the decline")
    assert "Decline (reason: Keep it for now)" in card.find_element(
        By.CSS_SELECTOR, ".answer-state").text
    assert page.kinds_after(card) == ["assistant"], "a decline runs nothing"
    answer = page.last("assistant").find_element(By.CSS_SELECTOR, ".text").text
    assert answer.strip() and _no_call_markup(answer), answer   # words, not call-shaped text
    assert page.desk("deleted") == []
    page.shot("07-declined-and-answered")


def test_parallel_approvals_are_sent_only_when_all_are_answered_or_submitted(browser, scripted_app,
                                                                           shots):
    app, upstream = scripted_app
    page = Page(browser, app, shots)
    page.sign_in(KEY_A)
    page.say("Email the notes and delete the old file.")
    first, second = page.open_approvals()
    assert [c.get_attribute("data-tool") for c in (first, second)] == ["send_email", "delete_file"]
    requests = len(upstream.bodies)
    _option(first, "accept", "once").click()
    page.wait(lambda: "not sent yet" in first.find_element(By.CSS_SELECTOR, ".answer-state").text,
              "the first answer, held")
    time.sleep(1)
    assert len(upstream.bodies) == requests, "sent before every approval was answered"
    assert page.state() == "waiting"
    assert "1 of 2" in page.driver.find_element(By.ID, "approval-count").text
    page.shot("08-one-of-two-answered")
    _option(second, "decline").click()
    page.wait(lambda: page.state() == "idle" and page.desk("outbox"), "both answers, sent")
    follow_up = upstream.bodies[requests]
    answers = [i for i in follow_up["input"] if i.get("type") == "elicitation_response"]
    assert [(a["action"], a.get("scope")) for a in answers] == [("accept", "once"),
                                                                 ("decline", None)]
    echoed = [i["id"] for i in follow_up["input"] if i.get("type") == "elicitation"]
    assert [a["elicitation_id"] for a in answers] == echoed, "the history keeps both elicitations"
    assert page.desk("deleted") == []

    # the person may send before answering everything, explicitly: the rest is left unanswered
    page.say("Email the notes and delete the old file.")
    first, second = page.open_approvals()
    requests = len(upstream.bodies)
    _option(second, "accept", "once").click()
    time.sleep(1)
    assert len(upstream.bodies) == requests
    page.driver.find_element(By.ID, "submit-now").send_keys(Keys.ENTER)
    page.wait(lambda: page.state() == "idle" and page.desk("deleted"), "the submitted answer")
    asked = {card.get_attribute("data-elicitation-id") for card in (first, second)}
    answers = [i for i in upstream.bodies[requests]["input"]
               if i.get("type") == "elicitation_response" and i["elicitation_id"] in asked]
    assert [a["elicitation_id"] for a in answers] == [second.get_attribute("data-elicitation-id")]
    assert "Not answered" in first.find_element(By.CSS_SELECTOR, ".answer-state").text
    page.shot("09-submitted-with-one-unanswered")
