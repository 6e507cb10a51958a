"""`make demo` as a newcomer runs it: `vllm-allowed-tools demo` serves the real model (no
training) and its transcript shows each thing the plugin does, with arguments a person would
expect. One server: the demo's own."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from vllm_allowed_tools.devtools.demo import ADDRESS

pytestmark = pytest.mark.server


@pytest.fixture(scope="module")
def transcript() -> str:
    result = subprocess.run([sys.executable, "-m", "vllm_allowed_tools.devtools.commands", "demo"],
                            capture_output=True, text=True, timeout=1500)
    assert result.returncode == 0, result.stderr[-3000:]
    print(result.stdout)
    return result.stdout


def _calls(text: str) -> list[tuple[str, dict]]:
    return [(name, json.loads(arguments))
            for name, arguments in re.findall(r"assistant > call (\w+)\((\{.*\})\)", text)]


def _section(out: str, number: int) -> str:
    return out.split(f"\n== {number}.", 1)[1].split("\n== ", 1)[0]


def test_the_conversation_narrows_one_catalog_and_reuses_its_prefix(transcript):
    out = _section(transcript, 1)
    assert "catalog (sent every turn, unchanged)" in out
    turns = out.split("--- turn ")[1:]
    assert len(turns) == 3
    allowed = [re.findall(r"'(\w+)'", turn.splitlines()[0]) for turn in turns]
    assert len({tuple(names) for names in allowed}) == 3, "the subset changes every turn"
    for names, turn in zip(allowed, turns):
        calls = _calls(turn)
        assert calls and {name for name, _ in calls} <= set(names), turn
        assert "[NOT ALLOWED]" not in turn
    assert _calls(turns[0]) == [("get_weather", {"city": "Paris"})]
    (email,) = _calls(turns[1])
    assert email[1]["to"] == ADDRESS, email
    (event,) = _calls(turns[2])
    assert event[1]["date"] == "2025-06-01" and "picnic" in event[1]["title"].lower(), event
    cached = [int(n) for n in re.findall(r"(\d+) served from the prefix cache", out)]
    assert len(cached) == 3 and cached[1] > 0 and cached[2] > 0, "later turns reuse the prefix"


def test_the_policy_keeps_out_the_call_the_model_makes_without_one(transcript):
    plain, governed = _section(transcript, 2).split("allowed_tools required", 1)
    assert _calls(plain) == [("delete_file", {"path": "notes.txt"})], plain
    calls = _calls(governed)
    assert calls and all(name in ("read_file", "search_web") for name, _ in calls), governed
    assert "[NOT ALLOWED]" not in governed


def test_an_invalid_selection_is_a_400(transcript):
    assert "HTTP 400 param='tool_choice.tools[0].name'" in _section(transcript, 3)


def test_the_guard_refuses_a_strict_call_the_grammar_let_through(transcript):
    out = _section(transcript, 4)
    assert "how it is provoked" in out
    assert "HTTP 500 code='allowed_tools_violation'" in out, out
    assert "strict_arguments_invalid" in out and "not be valid under" in out, out
