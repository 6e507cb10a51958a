"""Under a policy a streamed turn gives exactly the calls the unary parse gives (no server): the
wrapper streams the unary parse's calls (vllm_glue/stream_calls.py), where vLLM's own streaming
parsers misread some chunkings (DeepSeek with several tokens a delta, an engine-based parser's
marker spelled in ordinary tokens). Each output runs through vLLM's ``DelegatingParser`` as the
serving layer drives it (``parse`` / ``parse_delta``), with the stop token as the last delta.
"""

from __future__ import annotations

import pytest

from support.parsers import TWO_TOOLS, glue, policy_request, served, unary  # noqa: F401 (glue: a fixture)

DEEPSEEK = ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_ticket\n```json\n"
            "{\"priority\": \"high\"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>")
GLM = "get_ticket<arg_key>priority</arg_key><arg_value>high</arg_value></tool_call>"
HERMES = '<tool_call>\n{"name": "get_ticket", "arguments": {"priority": "high"}}\n</tool_call>'


def streamed(tokenizer, parser: str, pieces: list[str], request, size: int):
    """(content, calls as (index, id, name, arguments), the delta number each call came in) for
    ``pieces`` each tokenized alone (a marker written as a piece is its own token; split, it is
    ordinary tokens), fed ``size`` tokens a delta, then the stop token alone."""
    tokens = [(tokenizer.decode([i]), i) for piece in pieces
              for i in tokenizer.encode(piece, add_special_tokens=False)]
    chunks = [tokens[n:n + size] for n in range(0, len(tokens), size)] + [[("", tokenizer.eos_token_id)]]
    parser_obj = served(tokenizer, parser, request)
    content, calls, when = "", {}, {}
    for number, chunk in enumerate(chunks):
        delta = parser_obj.parse_delta("".join(text for text, _ in chunk), [i for _, i in chunk],
                                       request, prompt_token_ids=[0], finished=number == len(chunks) - 1)
        if delta is None:
            continue
        content += delta.content or ""
        for call in delta.tool_calls or ():
            entry = calls.setdefault(call.index, ["", "", ""])
            entry[0] = entry[0] or call.id or ""
            entry[1] += call.function.name or ""
            entry[2] += call.function.arguments or ""
            when.setdefault(call.index, number)
    return content, [(index, *calls[index]) for index in sorted(calls)], when, len(chunks)


def _read(calls) -> list[tuple[str, str]]:
    return [(name, arguments) for _, _, name, arguments in calls]


@pytest.mark.parametrize("size", [1, 2, 3, 4, 7])
def test_deepseek_streams_the_unary_call_whatever_the_delta_size(glue, size):
    """vLLM's deepseek streaming parser loses the arguments' tail when a delta holds the last '}'
    together with the call-end marker."""
    tokenizer = glue("allowed_deepseek_v3")
    request, _ = policy_request("required", ["get_ticket"], TWO_TOOLS)
    _, calls = unary(tokenizer, "allowed_deepseek_v3", DEEPSEEK, request)
    content, read, _, _ = streamed(tokenizer, "allowed_deepseek_v3", [DEEPSEEK], request, size)
    assert _read(read) == [(c.name, c.arguments) for c in calls] == [("get_ticket", '{"priority": "high"}')]
    assert read[0][0] == 0 and read[0][1]
    assert not content


@pytest.mark.parametrize("size", [1, 3])
def test_an_engine_parsers_marker_in_pieces_streams_the_call_not_markup(glue, size):
    """glm45's engine reads markers by token id and is handed each delta alone: a <tool_call>
    spelled in ordinary tokens streamed as content, and no call."""
    tokenizer = glue("allowed_glm45")
    request, _ = policy_request("required", ["get_ticket"], TWO_TOOLS)
    text = "<tool_call>" + GLM
    _, calls = unary(tokenizer, "allowed_glm45", text, request)
    content, read, _, _ = streamed(tokenizer, "allowed_glm45", ["<", "tool", "_call>", GLM], request, size)
    assert _read(read) == [(c.name, c.arguments) for c in calls]
    assert [name for name, _ in _read(read)] == ["get_ticket"]
    assert "tool_call" not in content and "get_ticket" not in content


def test_a_call_goes_out_when_its_end_arrives_not_at_the_end_of_the_stream(glue):
    tokenizer = glue("allowed_hermes")
    request, _ = policy_request("required", ["get_ticket", "delete_note"], TWO_TOOLS, parallel=True)
    second = HERMES.replace("get_ticket", "delete_note")
    content, read, when, deltas = streamed(tokenizer, "allowed_hermes", [HERMES, "\n", second], request, 1)
    assert [(index, name) for index, _, name, _ in read] == [(0, "get_ticket"), (1, "delete_note")]
    assert read[0][1] != read[1][1]
    first_end = len(tokenizer.encode(HERMES, add_special_tokens=False))
    assert when[0] == first_end - 1 and when[1] < deltas - 1   # each with its '</tool_call>'
    assert not content.strip()


def test_one_call_when_parallel_calls_are_off_and_refused_calls_are_renumbered(glue):
    tokenizer = glue("allowed_hermes")
    request, _ = policy_request("required", ["get_ticket"], TWO_TOOLS)
    refused = HERMES.replace("get_ticket", "delete_note")
    _, read, _, _ = streamed(tokenizer, "allowed_hermes", [refused, "\n", HERMES, "\n", HERMES], request, 2)
    assert [(index, name) for index, _, name, _ in read] == [(0, "get_ticket")]


def test_prose_before_the_call_still_streams_as_content(glue):
    tokenizer = glue("allowed_hermes")
    request, _ = policy_request("auto", ["get_ticket"], TWO_TOOLS)
    content, read, _, _ = streamed(tokenizer, "allowed_hermes", ["Sure. ", HERMES], request, 1)
    assert content.strip() == "Sure."
    assert _read(read) == [("get_ticket", '{"priority": "high"}')]


def test_without_a_policy_the_base_parser_streams(glue):
    """A plain request gets the base parser's own streamed deltas (several per call)."""
    tokenizer = glue("allowed_hermes")
    _, plain = policy_request("required", ["get_ticket"], TWO_TOOLS)
    ours = streamed(tokenizer, "allowed_hermes", [HERMES], plain, 1)
    base = streamed(tokenizer, "hermes", [HERMES], plain, 1)
    assert ours[0] == base[0] and _read(ours[1]) == _read(base[1])
    assert ours[2] == base[2]


GRANITE = '[{"name": "get_ticket", "parameters": {"priority": "high"}}]'


@pytest.mark.parametrize("size", [1, 4])
def test_granites_required_array_streams_its_call(glue, size):
    """granite's base parser is engine-based and leaves required turns to vLLM's JSON-array reader,
    which a DelegatingParser over an engine-based parser hands each delta alone: no call streamed.
    Under a policy the request, adjusted as the server adjusts it, is read by the wrapper
    (vllm_glue/parsers.py _reads_required_itself); a plain request keeps vLLM's path."""
    tokenizer = glue("allowed_granite")
    request, plain = policy_request("required", ["get_ticket"], TWO_TOOLS)
    request = served(tokenizer, "allowed_granite", request).adjust_request(request)
    _, calls = unary(tokenizer, "allowed_granite", GRANITE, request)
    content, read, _, _ = streamed(tokenizer, "allowed_granite", [GRANITE], request, size)
    assert _read(read) == [(c.name, c.arguments) for c in calls] == [("get_ticket", '{"priority": "high"}')]
    assert read[0][0] == 0 and read[0][1]
    assert not content
    assert served(tokenizer, "allowed_granite", plain).adjust_request(plain).tool_choice == "required"
