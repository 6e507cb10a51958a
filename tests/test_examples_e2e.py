"""The agent-loop examples run against a real `vllm serve` (the tool-happy tiny model), so they
cannot rot: both finish, and every call the dispatcher ran was in that turn's allowed subset."""

from __future__ import annotations

import pytest

from support.servers import load_script


def load_example(name: str):
    return load_script("examples", name)   # they share examples/agent_app.py, as scripts do


@pytest.mark.server
@pytest.mark.parametrize("name", ["responses_agent", "chat_agent"])
def test_example_agent_loop(happy_server, name):
    example = load_example(name)
    transcript: list[str] = []
    records = example.run(happy_server.base_url, out=transcript.append)
    print("\n".join(transcript))

    assert [r.allowed for r in records] == [t.allowed for t in example.TURNS]
    assert len({tuple(r.allowed) for r in records}) > 1, "the subset must change between turns"
    calls = [(record, call) for record in records for call in record.calls]
    assert calls, "the tool-happy model should call tools"
    for record, call in calls:
        # the server never returns a call outside the subset, and nothing outside it ever ran
        assert call.name in record.allowed, (record.index, call)
        assert call.ok, (record.index, call)   # schema-valid (grammar), authorized, granted
    for record in records:
        if record.mode == "required":
            assert record.calls, f"turn {record.index} is required mode but made no call"
    assert any(line.startswith("dispatch  : ran") for line in transcript)


@pytest.mark.server
def test_agents_sdk_example(happy_server):
    """The OpenAI Agents SDK example: allowed_tools rides in ModelSettings.extra_args on every
    request of each run (follow-ups after a tool result included), every call the SDK was asked to
    run went through the dispatch guard and was in that turn's subset, and every run finishes.
    (Not on the random model: its text runs to max_output_tokens, and the SDK fails a run whose
    response is `incomplete`, on vanilla vLLM as here.)"""
    server, server_name = happy_server, "happy_server"
    example = load_example("agents_sdk_agent")
    transcript: list[str] = []
    records = example.run(server.base_url, out=transcript.append)
    print("\n".join(transcript))

    assert [r.allowed for r in records] == [t.allowed for t in example.TURNS]
    assert len({tuple(r.allowed) for r in records}) > 1, "the subset must change between turns"
    for record in records:
        expected = {"type": "allowed_tools", "mode": record.mode,
                    "tools": [{"type": "function", "name": n} for n in record.allowed]}
        assert record.tool_choices, f"turn {record.index} sent no request"
        assert all(choice == expected for choice in record.tool_choices), (record.index,
                                                                           record.tool_choices)
        if record.mode == "required":
            assert record.calls, f"turn {record.index} is required mode but made no call"
    calls = [(record, call) for record in records for call in record.calls]
    if server_name == "happy_server":
        assert any(len(r.tool_choices) > 1 for r in records), \
            "no run sent a follow-up request after a tool result (the auto turns should)"
        assert calls, "the tool-happy model should call tools"
    for record, call in calls:
        assert call.name in record.allowed, (record.index, call)
        assert call.ok, (record.index, call)
    assert any(line.startswith("dispatch  : ran") for line in transcript)
    assert all(r.final_output for r in records), "every run must finish with a final output"
