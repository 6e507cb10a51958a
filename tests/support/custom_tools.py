"""The custom grammar tool's requests on a real ``vllm serve``: a bounded grammar tool next to a
function, a Responses turn that selects it, and the checks of what comes back. test_custom_tools_e2e.py
sends them to the hermes server, test_parsers_e2e.py to the qwen3_coder server it starts (an XML
format, where the input is the raw parameter value)."""

from __future__ import annotations

import json

import httpx

from vllm_allowed_tools.request.custom_tools import compile_custom_grammar

#: bounded, and framed by a quote and a backslash: what a JSON string writes escaped (hermes) and
#: an XML value carries raw (qwen3_coder)
#: Codex's own ``apply_patch`` grammar (as the pinned Codex CLI, clients/codex, sends it)
CODEX_APPLY_PATCH = r'''start: begin_patch hunk+ end_patch
begin_patch: "*** Begin Patch" LF
end_patch: "*** End Patch" LF?
hunk: add_hunk | delete_hunk | update_hunk
add_hunk: "*** Add File: " filename LF add_line+
delete_hunk: "*** Delete File: " filename LF
update_hunk: "*** Update File: " filename LF change_move? change?
filename: /(.+)/
add_line: "+" /(.*)/ LF -> line
change_move: "*** Move to: " filename LF
change: (change_context | change_line)+ eof_line?
change_context: ("@@" | "@@ " /(.+)/) LF
change_line: ("+" | "-" | " ") /(.*)/ LF
eof_line: "*** End of File" LF
%import common.LF
'''

GRAMMAR = r'start: "\"" ("a" | "b" "c"~1..3) "\\"'
SHORT = {"type": "custom", "name": "short", "description": "Say it short.",
         "format": {"type": "grammar", "syntax": "lark", "definition": GRAMMAR}}
EXEC = {"type": "function", "name": "exec_command", "description": "Run a command.",
        "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}, "required": ["cmd"]}}
ADMITTED = {f'"{core}\\' for core in ("a", "bc", "bcc", "bccc")}   # every input the grammar admits
SEEDS = (0, 1, 2)


def request_body(seed: int, stream: bool, **extra) -> dict:
    return {"model": "tiny", "input": "Go ahead.", "tools": [EXEC, SHORT],
            "tool_choice": {"type": "allowed_tools", "mode": "required",
                            "tools": [{"type": "custom", "name": "short"}]},
            "parallel_tool_calls": False, "max_output_tokens": 120, "temperature": 1.0, "seed": seed,
            "stream": stream, **extra}


def unary(server, body: dict, route: str = "responses") -> dict:
    response = httpx.post(f"{server.base_url}/{route}", json=body, timeout=180)
    assert response.status_code == 200, response.text
    return response.json()


def streamed(server, body: dict, route: str = "responses") -> list[dict]:
    """The stream's JSON events (Chat's closing ``[DONE]`` left out)."""
    with httpx.stream("POST", f"{server.base_url}/{route}", json=body, timeout=180) as response:
        assert response.status_code == 200, response.read()
        return [json.loads(line[6:]) for line in response.iter_lines()
                if line.startswith("data: ") and line != "data: [DONE]"]


def the_one_custom_call(response: dict) -> dict:
    """The response's one call: a ``custom_tool_call`` of the selected tool, its input admitted."""
    assert response["status"] == "completed", response
    calls = [item for item in response["output"] if item["type"] in ("function_call", "custom_tool_call")]
    assert [(item["type"], item["name"]) for item in calls] == [("custom_tool_call", "short")], response
    assert calls[0]["input"] in ADMITTED, calls[0]
    assert compile_custom_grammar("short", "lark", GRAMMAR).admits(calls[0]["input"])
    return calls[0]
