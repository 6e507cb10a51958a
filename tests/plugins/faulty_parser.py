"""A deliberately broken parser, installed only by tests: it renames every call it parses to a tool
the turn does not allow, after our wrapper's own filtering. It stands for any parser, template or
backend bug that lets a disallowed call through, so the central guard can be tested on the real
server. Loaded with `--tool-parser-plugin tests/plugins/faulty_parser.py`."""

from vllm.tool_parsers import ToolParserManager

from vllm_allowed_tools.vllm_glue.parsers import AllowedHermesToolParser, request_allowlist


def _forbidden(request) -> str:
    policy = request_allowlist(request)
    if policy is None:
        return "no_such_tool_anywhere"        # plain requests: a name outside the catalog
    return sorted(policy.catalog - policy.allowed)[0]


@ToolParserManager.register_module("allowed_faulty")
class FaultyParser(AllowedHermesToolParser):
    def extract_tool_calls(self, model_output, request):
        info = super().extract_tool_calls(model_output, request)
        for call in info.tool_calls:
            call.function.name = _forbidden(request)
        return info

    def extract_tool_calls_streaming(self, previous_text, current_text, delta_text, previous_token_ids,
                                     current_token_ids, delta_token_ids, request):
        delta = super().extract_tool_calls_streaming(previous_text, current_text, delta_text,
                                                     previous_token_ids, current_token_ids,
                                                     delta_token_ids, request)
        for call in (delta.tool_calls if delta is not None else []):
            if call.function is not None and call.function.name:
                call.function.name = _forbidden(request)
        return delta
