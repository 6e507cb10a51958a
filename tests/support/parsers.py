"""The parser wrappers without a server: the tiny model's tokenizer as ``serve-tiny --parser``
serves it (the format's markers as tokens), a request as vLLM sees it after our middleware, and
vLLM's serving-side parser around a wrapper (``DelegatingParser``: ``parse`` / ``parse_delta``, what
the serving layer calls). The wrapper tests of test_parsers_e2e.py, the call-markup, streamed-call
and family tests all build on them."""

from __future__ import annotations

from pathlib import Path

import pytest

from vllm_allowed_tools.devtools.models.tool_pool import POOL_BY_NAME

from support.calls import chat_selection


def format_model(parser: str) -> Path:
    """The tiny random model as serve-tiny serves it for ``parser``: with the format's markers
    (``<|python_tag|>``, ``[TOOL_CALLS]``) as tokens where vLLM's parser needs them."""
    from vllm_allowed_tools.devtools.models.format_model import model_for_parser
    return model_for_parser("random", 0, parser, log=lambda *_: None)


@pytest.fixture(scope="module")
def glue(tmp_path_factory):
    """(tokenizer for a parser, request builder) with our parsers registered."""
    from transformers import AutoTokenizer

    from vllm_allowed_tools.vllm_glue.plugin import register

    register()
    cache: dict[tuple[str, ...], object] = {}

    def tokenizer_for(parser: str):
        if parser not in cache:
            cache[parser] = AutoTokenizer.from_pretrained(str(format_model(parser)))
        return cache[parser]

    return tokenizer_for


@pytest.fixture(scope="module")
def tokenizer_for():
    """A format's name -> the tiny model's tokenizer with that format's markers as tokens (as
    ``model_for_parser`` builds it), our parsers registered."""
    from transformers import AutoTokenizer

    from vllm_allowed_tools.devtools.models.format_model import model_for_parser
    from vllm_allowed_tools.vllm_glue.plugin import register
    register()
    cache: dict = {}

    def load(family: str):
        if family not in cache:
            cache[family] = AutoTokenizer.from_pretrained(
                str(model_for_parser("random", 0, family, log=lambda *_: None)))
        return cache[family]
    return load


def policy_request(mode: str, allowed: list[str], tool_names: list[str], parallel: bool = False):
    """A ChatCompletionRequest as vLLM sees it after our middleware (policy attached)."""
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

    from vllm_allowed_tools.request.rewrite import rewrite_request

    body = {"model": "tiny", "messages": [{"role": "user", "content": "x"}],
            "tools": [POOL_BY_NAME[name].chat_tool() for name in tool_names],
            "parallel_tool_calls": parallel, "tool_choice": chat_selection(mode, allowed)}
    plain = ChatCompletionRequest(**{**body, "tool_choice": mode})
    return ChatCompletionRequest(**rewrite_request(body, "chat").body), plain


TWO_TOOLS = ["get_ticket", "delete_note"]   # both take one enum argument, `priority`


def served(tokenizer, parser: str, request):
    """vLLM's serving-side parser around tool parser ``parser`` (a fresh one per output)."""
    from vllm.parser.parser_manager import ParserManager
    return ParserManager.get_parser(tool_parser_name=parser, enable_auto_tools=True)(
        tokenizer, request.tools)


def unary(tokenizer, parser: str, text: str, request) -> tuple[str | None, list]:
    """(the message text, the calls) the server would send for the output ``text``."""
    _, content, calls = served(tokenizer, parser, request).parse(text, request,
                                                                 enable_auto_tools=True)
    return content, list(calls or ())
