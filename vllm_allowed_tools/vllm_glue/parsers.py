"""``allowed_<base>`` tool parsers: vLLM's built-in parsers under the turn's allowed-tools policy.

One small subclass per wire format, made by :func:`wrap_parser` from :class:`AllowedToolsMixin`.
Without a policy on the request (plain ``none`` / ``auto`` / ``required`` / named) every method is
the base parser's own, so those choices behave exactly as vanilla vLLM. With a policy (carried by the
middleware in ``request.model_extra``) the wrapper:

* compiles the structural tag from the **allowed** schemas only (required: only allowed calls, at
  least one, no text around them; auto: free text, and after a call trigger only allowed names),
  enforcing at least the call envelope whatever ``--tool-strict-level`` says, because the allowlist
  is a contract, not a hint; ``parallel_tool_calls: false`` stops after the first call;
* for parsers without a structural-tag model, builds vLLM's JSON-schema fallback from the allowed
  subset only (required mode; auto mode relies on output filtering);
* drops any parsed call outside the allowlist, unary and streaming (defense in depth), counting it as
  a ``parser`` violation.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Sequence
from typing import Any

from vllm.tool_parsers import ToolParserManager

from ..constraint import STAGE_LOGITS_PROCESSOR, XARGS_DIGEST, XARGS_TAG
from ..errors import CapabilityError
from ..grammar import (
    WIRE_FORMATS,
    AllowedFunction,
    BuiltTag,
    built,
    cap_json_whitespace,
    tag_digest,
    turn_tag,
)
from ..metrics import record_violation
from ..rewrite import POLICY_KEY, WirePolicy
from .capabilities import active_constraint_stage
from .plugin import PARSERS

try:  # vLLM 0.32 / 0.33
    from vllm.entrypoints.generate.base.protocol import DeltaMessage, ExtractedToolCallInformation
except ImportError:  # pragma: no cover - older layout
    from vllm.entrypoints.openai.engine.protocol import DeltaMessage, ExtractedToolCallInformation

from vllm.sampling_params import StructuredOutputsParams
from vllm.tool_parsers.structural_tag_registry import limit_to_single_tool_call
from vllm.tool_parsers.tool_strict_level import ToolStrictLevel

logger = logging.getLogger(__name__)

#: operator knob: the most whitespace characters allowed between JSON tokens in argument grammars
MAX_WHITESPACE_ENV = "VLLM_ALLOWED_TOOLS_MAX_JSON_WHITESPACE"


def request_policy(request: Any) -> WirePolicy | None:
    """The turn's policy, as the middleware attached it (None: a plain request)."""
    extra = getattr(request, "model_extra", None) or {}
    return WirePolicy.from_wire(extra.get(POLICY_KEY))


def _allowed_tool_choice(policy: WirePolicy):
    from openai.types.responses import ToolChoiceAllowed
    return ToolChoiceAllowed(type="allowed_tools", mode=policy.mode,
                             tools=[{"type": "function", "name": name} for name in sorted(policy.allowed)])


def _tool_name(tool: Any) -> str | None:
    function = getattr(tool, "function", None)
    return getattr(function, "name", None) if function is not None else getattr(tool, "name", None)


def _narrowed(request, policy: WirePolicy):
    """A deep copy of `request` whose tools are only the allowed ones (namespaces flattened)."""
    allowed = [tool for tool in _function_tools(request) if _tool_name(tool) in policy.allowed]
    return request.model_copy(update={"tools": allowed}, deep=True)


class AllowedToolsMixin:
    """Mixed in before a vLLM ToolParser subclass; see the module docstring."""

    allowed_tools_base_parser: str = ""

    # ---------------------------------------------------------------- grammar
    def get_structural_tag(self, request, *, reasoning: bool = False,
                           strict_level: ToolStrictLevel = ToolStrictLevel.AUTO):
        policy = request_policy(request)
        if policy is None:
            return super().get_structural_tag(request, reasoning=reasoning, strict_level=strict_level)
        if self.structural_tag_model is None:
            return None
        if self.allowed_tools_base_parser in WIRE_FORMATS:
            subset_tag = _allowed_subset_tag(self.allowed_tools_base_parser, request, policy,
                                             max(strict_level, ToolStrictLevel.FUNCTION))
            return subset_tag.tag if subset_tag is not None else None
        from vllm.tool_parsers.structural_tag_registry import get_model_structural_tag
        tag = get_model_structural_tag(
            model=self.structural_tag_model, tools=request.tools,
            tool_choice=_allowed_tool_choice(policy), reasoning=reasoning,
            strict_level=max(strict_level, ToolStrictLevel.FUNCTION))
        return _cap_whitespace(tag) if tag is not None else None

    def adjust_request(self, request):
        policy = request_policy(request)
        if policy is None:
            return super().adjust_request(request)
        # The base parser, run on a copy that holds only the allowed tools, gives its own grammar
        # for the subset (JSON-schema parsers) and its other side effects (e.g. keeping special
        # tokens such as [TOOL_CALLS] in the output); the catalog-wide grammar is never taken.
        probe = super().adjust_request(_narrowed(request, policy))
        if self.structural_tag_model is not None:
            request = self._ensure_structural_tag(request, policy)
        elif policy.mode == "required":
            for field_name in ("structured_outputs", "response_format", "text"):
                if hasattr(request, field_name):
                    setattr(request, field_name, getattr(probe, field_name))
        if getattr(probe, "skip_special_tokens", None) is False:
            request.skip_special_tokens = False
        if active_constraint_stage() == STAGE_LOGITS_PROCESSOR:
            _hand_grammar_to_logits_processor(request)
        return request

    def _ensure_structural_tag(self, request, policy: WirePolicy):
        from vllm import envs
        if not envs.VLLM_ENFORCE_STRICT_TOOL_CALLING:
            raise CapabilityError(
                "allowed_tools needs structural tags, but VLLM_ENFORCE_STRICT_TOOL_CALLING=0 turns "
                "them off; unset it (or set it to 1) and restart the server",
                capability="structural_tag")
        existing = request.structured_outputs
        if existing is not None and existing.structural_tag is not None:
            return request   # vLLM's DelegatingParser already used our get_structural_tag
        if request.extract_structured_outputs() is not None:
            raise CapabilityError(
                "allowed_tools in auto mode together with a response format is not supported with "
                "non-strict tools; mark the allowed tools `strict: true` or drop the response format",
                capability="structural_tag+response_format")
        tag = self.get_structural_tag(request, strict_level=ToolStrictLevel.FUNCTION)
        if tag is None:
            raise CapabilityError(
                f"the {self.allowed_tools_base_parser!r} parser produced no structural tag for the "
                "allowed subset", capability="structural_tag", status=500)
        if not policy.parallel_tool_calls:
            limit_to_single_tool_call(tag)
        request.structured_outputs = StructuredOutputsParams(structural_tag=json.dumps(tag.model_dump()))
        if hasattr(request, "response_format"):
            request.response_format = None
        if hasattr(request, "text") and not hasattr(request, "messages"):
            request.text = None
        return request

    # ---------------------------------------------------------------- output filtering
    def extract_tool_calls(self, model_output: str, request) -> ExtractedToolCallInformation:
        info = super().extract_tool_calls(model_output, request)
        policy = request_policy(request)
        if policy is None or not info.tools_called:
            return info
        kept = [call for call in info.tool_calls if policy.is_allowed(call.function.name)]
        dropped = [call.function.name for call in info.tool_calls if call not in kept]
        if dropped:
            record_violation("parser")
            logger.warning("vllm-allowed-tools: dropped calls outside the allowlist: %s", dropped)
        if not policy.parallel_tool_calls:
            kept = kept[:1]
        return ExtractedToolCallInformation(tools_called=bool(kept), tool_calls=kept,
                                            content=info.content)

    def extract_tool_calls_streaming(self, previous_text: str, current_text: str, delta_text: str,
                                     previous_token_ids: Sequence[int], current_token_ids: Sequence[int],
                                     delta_token_ids: Sequence[int], request) -> DeltaMessage | None:
        delta = super().extract_tool_calls_streaming(previous_text, current_text, delta_text,
                                                     previous_token_ids, current_token_ids,
                                                     delta_token_ids, request)
        policy = request_policy(request)
        if policy is None or delta is None or not delta.tool_calls:
            return delta
        state = self.__dict__.setdefault("_allowed_tools_stream", {"verdict": {}, "renumber": {}})
        kept = []
        for tool_delta in delta.tool_calls:
            name = tool_delta.function.name if tool_delta.function is not None else None
            verdict = state["verdict"].get(tool_delta.index)
            if verdict is None and name:
                verdict = policy.is_allowed(name)
                if verdict and not policy.parallel_tool_calls and state["renumber"]:
                    verdict = False   # a second call when only one is allowed
                state["verdict"][tool_delta.index] = verdict
                if verdict:
                    state["renumber"][tool_delta.index] = len(state["renumber"])
                else:
                    record_violation("parser")
                    logger.warning("vllm-allowed-tools: dropped streamed call %r", name)
            if verdict:   # unknown identity (None) or disallowed (False) never goes out
                kept.append(tool_delta.model_copy(update={"index": state["renumber"][tool_delta.index]}))
        if not kept and not delta.content and not getattr(delta, "reasoning", None):
            return None
        return delta.model_copy(update={"tool_calls": kept})


def _function_tools(request) -> list[Any]:
    """The request's function tools as the model sees them (namespace members flattened)."""
    tools = list(request.tools or [])
    try:
        from vllm.tool_parsers.utils import get_function_tools
        return list(get_function_tools(tools))
    except ImportError:  # pragma: no cover - older vLLM without namespace flattening
        return tools


def _allowed_functions(request, policy: WirePolicy) -> list[AllowedFunction]:
    """The allowed functions in catalog order."""
    functions = []
    for tool in _function_tools(request):
        function = getattr(tool, "function", None) or tool
        if function.name in policy.allowed:
            functions.append(AllowedFunction(name=function.name, parameters=function.parameters,
                                             strict=getattr(function, "strict", None)))
    return functions


def _allowed_subset_tag(wire_format: str, request, policy: WirePolicy, strict_level) -> BuiltTag | None:
    """The cached tag for this turn (see grammar.turn_tag)."""
    return turn_tag(wire_format, _allowed_functions(request, policy),
                    catalog_digest=policy.catalog_digest, allowlist_digest=policy.allowlist_digest,
                    mode=policy.mode,  # type: ignore[arg-type]
                    parallel_tool_calls=policy.parallel_tool_calls, strict_level=int(strict_level),
                    max_whitespace=_max_json_whitespace())


def _hand_grammar_to_logits_processor(request) -> None:
    """Move the grammar from vLLM's native structured outputs to our logits processor's request
    arguments (the same grammar: a structural tag, or the JSON-schema fallback wrapped in one)."""
    outputs = getattr(request, "structured_outputs", None)
    if outputs is None:
        return
    if outputs.structural_tag is not None:
        tag_json = outputs.structural_tag
    elif outputs.json is not None:
        from xgrammar import StructuralTag
        from xgrammar.structural_tag import JSONSchemaFormat
        schema = json.loads(outputs.json) if isinstance(outputs.json, str) else outputs.json
        tag_json = built(StructuralTag(format=JSONSchemaFormat(json_schema=schema))).json
    else:
        return
    request.vllm_xargs = {**(request.vllm_xargs or {}),
                          XARGS_TAG: tag_json, XARGS_DIGEST: tag_digest(tag_json)}
    request.structured_outputs = None


def _max_json_whitespace() -> int | None:
    value = os.environ.get(MAX_WHITESPACE_ENV, "").strip()
    if not value:
        return None
    try:
        return max(1, int(value))   # xgrammar needs at least 1
    except ValueError:
        raise CapabilityError(f"{MAX_WHITESPACE_ENV}={value!r} is not an integer; set a whole number "
                              "of whitespace characters or unset it", capability="config",
                              status=500) from None


def _cap_whitespace(tag):
    """Bound JSON whitespace in argument grammars when the operator asks (random-weight models pad
    JSON with whitespace until max_tokens; real models rarely need more than a little)."""
    limit = _max_json_whitespace()
    if limit is not None:
        cap_json_whitespace(tag, limit)
    return tag


def wrap_parser(base_name: str, class_name: str) -> type:
    """A subclass of vLLM's ``base_name`` parser that applies the allowed-tools policy."""
    base = ToolParserManager.get_tool_parser(base_name)
    return type(class_name, (AllowedToolsMixin, base), {
        "__doc__": f"vLLM's {base_name!r} tool parser under the allowed-tools policy.",
        "__module__": __name__,
        "allowed_tools_base_parser": base_name,
    })


for _name, _class_name in PARSERS.items():
    globals()[_class_name] = wrap_parser(_name.removeprefix("allowed_"), _class_name)
