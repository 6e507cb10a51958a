"""gpt-oss: a call ends only on a stop token the harmony parser reads as its end (no server).

gpt-oss's generation config stops on ``<|endoftext|>`` as well as on ``<|call|>`` and ``<|return|>``,
and a harmony call's grammar ends where "a stop token follows", so it admits each of them after the
arguments. The ``HarmonyParser`` reads token ids, and ``<|endoftext|>`` is message text to it: the
call's arguments came back as ``{...}<|endoftext|>`` (not JSON: the output guard's 500
``arguments_not_object``, on 4 of 12 seeds of the tiny gpt-oss without the marker nudges). The
format names that token (``grammars/openai.json``, ``text_stop_tokens``), the parser wrapper puts
it on every tool-bearing request and the logits processor refuses it at every step, on both
constraint stages (:mod:`vllm_allowed_tools.decode.refused_tokens`). The end-to-end case is in
``tests/test_gpt_oss_e2e.py``.
"""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

import pytest

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

torch = pytest.importorskip("torch")
xgr = pytest.importorskip("xgrammar")

from vllm_allowed_tools.decode.grammar import AllowedFunction, build_structural_tag, built
from vllm_allowed_tools.decode.masks import CompiledGrammars, MaskedBatch
from vllm_allowed_tools.decode.refused_tokens import MAX_REFUSED_TOKENS, read_refused_tokens, refusable
from vllm_allowed_tools.decode.split import constraint_extra_args
from vllm_allowed_tools.decode.stage import ConstraintArgsError, read_extra_args
from vllm_allowed_tools.formats import wire_format
from vllm_allowed_tools.wire import XARGS_REFUSED_TOKENS

VOCAB = 201088                     # o200k_harmony's, every gpt-oss's
END_OF_TEXT, RETURN, CALL = 199999, 200002, 200012
#: gpt-oss's generation config (the real model's and the tiny one's): vLLM's ``all_stop_token_ids``
STOPS = [RETURN, END_OF_TEXT, CALL]
WEATHER = {"type": "object", "properties": {"city": {"type": "string"},
                                            "unit": {"type": "string", "enum": ["c", "f"]}},
           "required": ["city", "unit"], "additionalProperties": False}
#: what the tiny gpt-oss wrote (seed 6, no nudges, required, get_weather allowed): a call on the
#: analysis channel, `` to=functions.get_weather<|channel|>analysis json<|message|>{...}``; its
#: next token was ``<|endoftext|>``
WRITTEN = [260, 78, 28, 44580, 1940, 292, 62, 28393, 200005, 1480, 423, 4778, 82, 10974, 78, 77,
           200008, 745, 1, 17500, 178558, 84, 77, 278, 1, 25, 198, 1, 66, 1, 198, 92]
ARGUMENTS = '{\n"city":"","unit":\n"c"\n}'


def _harmony_message(tokens: list[int]):
    from openai_harmony import HarmonyEncodingName, Role, StreamableParser, load_harmony_encoding
    parser = StreamableParser(load_harmony_encoding(HarmonyEncodingName.HARMONY_GPT_OSS), role=Role.ASSISTANT)
    for token in tokens:
        parser.process(token)
    parser.process_eos()
    [message] = parser.messages
    return message


def test_the_harmony_parser_reads_endoftext_as_arguments_and_the_format_names_it():
    """The cause, on the recorded tokens: after ``<|call|>`` or ``<|return|>`` the arguments are
    the JSON the grammar admitted; after ``<|endoftext|>`` they hold the token's text. The stops
    the parser reads as text are exactly the format's ``text_stop_tokens``."""
    read_as_text = set()
    for stop in STOPS:
        message = _harmony_message(WRITTEN + [stop])
        assert message.recipient == "functions.get_weather"
        text = message.content[0].text
        if text != ARGUMENTS:
            assert text == ARGUMENTS + "<|endoftext|>"
            read_as_text.add(stop)
    assert read_as_text == {END_OF_TEXT}
    assert wire_format("openai").grammar.text_stop_tokens == (("<|endoftext|>", END_OF_TEXT),)
    from openai_harmony import HarmonyEncodingName, load_harmony_encoding
    encoding = load_harmony_encoding(HarmonyEncodingName.HARMONY_GPT_OSS)
    assert encoding.encode("<|endoftext|>", allowed_special="all") == [END_OF_TEXT]
    assert not any(spec.grammar.text_stop_tokens for spec in map(wire_format, ("hermes", "mistral")))


@pytest.fixture(scope="module")
def grammars():
    from transformers import AutoTokenizer

    from vllm_allowed_tools.devtools.models.gpt_oss_model import ensure_gpt_oss_model
    tokenizer = AutoTokenizer.from_pretrained(str(ensure_gpt_oss_model(0, log=lambda *_: None)))
    # xgrammar's masks from the first token: the recorded tokens are the harmony encoder's, and a
    # first-seen row on llguidance admits forced text only as the tokenizer writes it alone
    return CompiledGrammars(xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=VOCAB), lazy=False)


def _harmony_grammar(mode: str):
    import vllm.parser.harmony  # noqa: F401  (registers vLLM's harmony tag builder)

    from vllm_allowed_tools.vllm_glue.plugin import register
    register()
    tag = built(build_structural_tag("openai", [AllowedFunction("get_weather", WEATHER, strict=True)],
                                     mode, parallel_tool_calls=False, max_whitespace=1))
    return read_extra_args(constraint_extra_args(tag))


def _allowed_after(batch: MaskedBatch, output: list[int], tokens: list[int]) -> list[int]:
    """Write ``tokens`` (each one the row's mask admits), then the tokens the row may write next."""
    for token in [*tokens, None]:
        batch.sync()
        logits = torch.zeros(1, VOCAB)
        batch.apply(logits)
        allowed = torch.isfinite(logits[0])
        if token is None:
            return allowed.nonzero().flatten().tolist()
        assert allowed[token], token
        output.append(token)
    raise AssertionError("unreachable")


@pytest.mark.parametrize("mode", ["required", "auto"])
@pytest.mark.parametrize("stage", ["logits-processor", "native"])
def test_a_call_ends_only_on_a_stop_token_the_parser_reads_as_its_end(grammars, mode, stage):
    """The grammar admits the written call and then every stop token (it cannot tell them apart);
    with the format's refused tokens the row may end only on ``<|return|>`` or ``<|call|>``. On
    the native stage vLLM applies the grammar and this processor only refuses the tokens."""
    grammar = _harmony_grammar(mode)
    unrefused = MaskedBatch(grammars, VOCAB, max_rows=1)
    unrefused.add(0, grammar, [], STOPS)
    assert _allowed_after(unrefused, unrefused.rows[0].output_ids, WRITTEN) == sorted(STOPS)   # the hole

    batch = MaskedBatch(grammars, VOCAB, max_rows=1)
    output: list[int] = []
    batch.add(0, grammar if stage == "logits-processor" else None, output, STOPS, refused=[END_OF_TEXT])
    allowed = _allowed_after(batch, output, WRITTEN)
    if stage == "logits-processor":
        assert allowed == [RETURN, CALL]
    else:   # everything but the refused token: vLLM's own mask does the rest
        assert len(allowed) == VOCAB - 1 and END_OF_TEXT not in allowed
    assert 0 in batch.rows   # kept for the whole request, after the grammar's end too


def test_refused_tokens_are_read_strictly_and_never_take_every_stop():
    assert read_refused_tokens(None) == () and read_refused_tokens({"other": 1}) == ()
    assert read_refused_tokens({XARGS_REFUSED_TOKENS: [7, 3, 7]}) == (3, 7)
    for bad in ("199999", [True], [-1], [1.5], list(range(MAX_REFUSED_TOKENS + 1))):
        with pytest.raises(ConstraintArgsError, match=XARGS_REFUSED_TOKENS):
            read_refused_tokens({XARGS_REFUSED_TOKENS: bad})
    assert refusable([END_OF_TEXT], STOPS, VOCAB) == (END_OF_TEXT,)
    assert refusable([END_OF_TEXT, VOCAB + 5], [], VOCAB) == (END_OF_TEXT,)
    assert refusable([END_OF_TEXT, RETURN], [RETURN, END_OF_TEXT], VOCAB) == ()   # it could never stop
    from vllm_allowed_tools.vllm_glue.logits_processor import AllowedToolsLogitsProcessor
    with pytest.raises(ValueError, match=XARGS_REFUSED_TOKENS):
        AllowedToolsLogitsProcessor.validate_params(SimpleNamespace(extra_args={XARGS_REFUSED_TOKENS: "x"}))


def test_the_wrapper_marks_tool_bearing_harmony_turns_and_a_client_cannot():
    """Every tool-bearing request of the ``allowed_openai`` wrapper (an ``allowed_tools``
    selection, plain ``auto`` or ``required``; Chat and Responses) carries the refused token; a
    request without tools and another format's do not; a client's own key is stripped."""
    from transformers import AutoTokenizer
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.entrypoints.openai.responses.protocol import ResponsesRequest
    from vllm.tool_parsers import ToolParserManager

    from vllm_allowed_tools.devtools.models.gpt_oss_model import ensure_gpt_oss_model
    from vllm_allowed_tools.devtools.models.tool_pool import POOL_BY_NAME
    from vllm_allowed_tools.request.rewrite import rewrite_request
    from vllm_allowed_tools.vllm_glue.plugin import register

    register()
    tokenizer = AutoTokenizer.from_pretrained(str(ensure_gpt_oss_model(0, log=lambda *_: None)))
    wrapper = ToolParserManager.get_tool_parser("allowed_openai")(tokenizer)
    names = sorted(POOL_BY_NAME)[:3]
    selection = {"type": "allowed_tools", "allowed_tools": {
        "mode": "auto", "tools": [{"type": "function", "function": {"name": names[0]}}]}}
    marked = {}
    for label, choice in [("selection", selection), ("plain auto", "auto"), ("plain required", "required"),
                          ("no tools", None)]:
        body = {"model": "tiny", "messages": [{"role": "user", "content": "x"}],
                "vllm_xargs": {XARGS_REFUSED_TOKENS: [5]}}
        if choice is not None:
            body.update(tools=[POOL_BY_NAME[name].chat_tool() for name in names], tool_choice=choice)
        request = ChatCompletionRequest(**rewrite_request(body, "chat").body)
        assert XARGS_REFUSED_TOKENS not in (request.vllm_xargs or {}), label
        marked[label] = (wrapper.adjust_request(request).vllm_xargs or {}).get(XARGS_REFUSED_TOKENS)
    assert marked == {"selection": [END_OF_TEXT], "plain auto": [END_OF_TEXT],
                      "plain required": [END_OF_TEXT], "no tools": None}
    body = {"model": "tiny", "input": "x", "tools": [POOL_BY_NAME[names[0]].responses_tool()],
            "tool_choice": {"type": "allowed_tools", "mode": "required",
                            "tools": [{"type": "function", "name": names[0]}]}}
    request = ResponsesRequest(**rewrite_request(body, "responses").body)
    assert wrapper.adjust_request(request).vllm_xargs[XARGS_REFUSED_TOKENS] == [END_OF_TEXT]
    hermes = ToolParserManager.get_tool_parser("allowed_hermes")(tokenizer)
    body = {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "tool_choice": selection,
            "tools": [POOL_BY_NAME[name].chat_tool() for name in names]}
    request = hermes.adjust_request(ChatCompletionRequest(**rewrite_request(body, "chat").body))
    assert XARGS_REFUSED_TOKENS not in (request.vllm_xargs or {})
    assert json.dumps(END_OF_TEXT) not in json.dumps(request.vllm_xargs or {})
