"""The grammar of one tool-bearing turn, decided in one call from the request read once.

The parser wrapper (``vllm_glue/parsers.py``) reads vLLM's request into a :class:`TurnRead`
(``vllm_glue/turn_read.py``), asks :func:`decide_turn` for the turn's :class:`TurnGrammar` and
writes it back onto the request: the structured outputs vLLM decodes with (a structural tag, or a
JSON schema), or the grammar handed to our logits processor instead (its tag, digest and split), the
reserve of a turn that must call, the stop tokens its parser reads as text, and the grammar a
server-side turn takes after its first call. vLLM's parser asks for a tag of its own
(``get_structural_tag``): :func:`turn_tag_for`, the same tag. Which grammar each format and mode
gets: docs/decode-path.md. No vLLM import: what vLLM does to a tag comes in as a parameter.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from xgrammar import StructuralTag
from xgrammar.structural_tag import JSONSchemaFormat

from ..errors import CapabilityError
from ..formats import wire_format
from ..settings import STAGE_LOGITS_PROCESSOR, current
from ..wire import (
    XARGS_DIGEST,
    XARGS_MUST_CALL,
    XARGS_REFUSED_TOKENS,
    XARGS_TAG,
    XARGS_TEXT_UTF8,
    ToolChoice,
    WireAllowlist,
)
from .call_budget import cap_optional_text, reserve_tokens, shortest_array_call, shortest_call_text
from .grammar import (
    STRICT_FUNCTION,
    AllowedFunction,
    BuiltTag,
    build_structural_tag,
    built,
    call_array_schema,
    turn_tag,
)
from .outlines_schemas import backend_compiles_json_schema
from .server_recipients import with_server_calls
from .split import split_for_request
from .stage import tag_digest

logger = logging.getLogger(__name__)

#: the reserve of a turn whose shortest call could not be sized
FALLBACK_RESERVE = 64
#: harmony markup of the two preamble messages around their text (``<|channel|>``, the channel,
#: ``<|message|>``, ``<|end|>``, ``<|start|>``, ``assistant``: six tokens each)
HARMONY_PREAMBLE_MARKUP = 12


@dataclass(frozen=True)
class Outputs:
    """vLLM's structured outputs as a turn's grammar reads and writes them: a structural tag's JSON,
    or a JSON schema (neither: another kind of output, which the turn's grammar leaves alone)."""
    structural_tag: str | None = None
    json: Any = None


@dataclass(frozen=True)
class Wrapper:
    """The ``allowed_<format>`` parser wrapper that reads a turn, and how its server serves a
    policy turn's grammar."""
    wire_format: str                 # the format's name (vLLM's base parser)
    tag_model: str | None            # its ``structural_tag_model`` (None: a JSON-array format)
    own_tag: bool = False            # the tag model is the wrapper's own: it builds every tag
    #: a required turn's JSON array goes to vLLM as an ``auto`` turn, read by this parser
    #: (``parsers.py``, ``_reads_required_itself``)
    reads_required_itself: bool = False
    stage: str | None = None                  # the constraint stage (None: a plain turn, vLLM's own)
    json_schema_backend: str | None = None    # the native backend kept for JSON schemas, if any
    strict_tool_calling: bool = True          # VLLM_ENFORCE_STRICT_TOOL_CALLING
    tokenizer: Any = field(default=None, compare=False, repr=False)   # sizes a call (None: estimated)


@dataclass(frozen=True)
class TurnRead:
    """One request as its turn's grammar needs it, read once by the parser wrapper."""
    wrapper: Wrapper
    allowlist: WireAllowlist | None           # None: a plain turn, on vLLM's own grammar
    #: the function tools the model sees, in catalog order (a custom tool with the grammar the
    #: allowlist carries for its input)
    catalog: tuple[AllowedFunction, ...] = ()
    choice: ToolChoice = ToolChoice(None)     # ``tool_choice``, as wire/ reads it
    parallel_tool_calls: bool = True          # the request's own (a plain turn's)
    has_tools: bool = True
    outputs: Outputs | None = None            # the structured outputs as they stand (vLLM's, or a client's)
    client_format: bool = False               # a policy turn's client asked for a response format
                                              # (not asked once vLLM set a tag format's tag)
    xargs_tag: str | None = None              # a grammar the request already hands our processor
    max_tokens: int | None = None             # the request's output budget
    reasoning_shown: bool = True              # ``include_reasoning`` is not false
    #: each built-in's tool listing (name -> input schema) from the tool server, for its recipients
    server_listings: Mapping[str, Mapping[str, Any] | None] = field(default_factory=dict, hash=False)
    wants_grammar_after_a_call: bool = False  # the registered server-side turn has none yet
    #: the server-side turn registered for this request (server_tools/server_turn.py), which the
    #: wrapper hands the grammar after a call
    server_turn: Any = field(default=None, compare=False, repr=False)

    def allowed_functions(self) -> list[AllowedFunction]:
        """The allowed functions, in catalog order."""
        allowed = self.allowlist.allowed if self.allowlist is not None else frozenset()
        return [function for function in self.catalog if function.name in allowed]

    def schemas(self) -> dict[str, Any]:
        """Each catalog function's arguments schema, by name."""
        return {function.name: function.parameters for function in self.catalog}


@dataclass(frozen=True)
class TurnTag:
    """The structural tag of a turn (None: nothing to constrain), and, for a required server-side
    turn, the JSON of its grammar once a call ran (the same turn in ``auto`` mode)."""
    tag: StructuralTag | None
    grammar_after_a_call: str | None = None


@dataclass(frozen=True)
class TurnGrammar:
    """What the wrapper writes back onto vLLM's request for one turn."""
    rewrites_outputs: bool = False            # the structured outputs become ``outputs``
    outputs: Outputs | None = None            # (None: none; the grammar went to our processor)
    drops_client_formats: bool = False        # the client's response format goes (vLLM takes either)
    reads_as_auto: bool = False               # ``tool_choice`` goes to vLLM as ``auto``
    xargs: Mapping[str, Any] = field(default_factory=dict)   # added to ``vllm_xargs``
    grammar_after_a_call: str | None = None   # for the registered server-side turn

    def final_outputs(self, turn: TurnRead) -> Outputs | None:
        """The structured outputs the request ends with."""
        return self.outputs if self.rewrites_outputs else turn.outputs


def decide_turn(turn: TurnRead, limit_to_one_call: Callable[[Any], Any] = lambda tag: tag) -> TurnGrammar:
    """The whole grammar of the turn ``turn`` reads. ``limit_to_one_call``: vLLM's
    ``limit_to_single_tool_call``, applied in place to the tag of a turn without parallel calls as
    vLLM's native stage would (the tags built here hold one call already)."""
    allowlist, tag_model = turn.allowlist, turn.wrapper.tag_model
    grammar = TurnGrammar()
    if allowlist is None:
        return _marked(turn, grammar)   # a plain turn: vLLM's own grammar, marked
    # an auto turn with nothing callable (every tool needs approval) gets no grammar: free text,
    # and the wrapper drops every call parsed from it
    if tag_model is not None and (allowlist.allowed or allowlist.server):
        grammar = _tagged(turn, limit_to_one_call)
    elif allowlist.mode == "required" and allowlist.allowed:
        grammar = _call_array(turn)
    elif allowlist.allowed:   # auto: a JSON-array format's grammar, where it has one
        grammar = _call_list(turn)
    if turn.wrapper.stage == STAGE_LOGITS_PROCESSOR:
        grammar = _handed_to_logits_processor(turn, grammar)
    return _marked(turn, grammar)


def turn_tag_for(turn: TurnRead, strict_level: int) -> TurnTag:
    """The structural tag of a format whose grammar is a tag (what vLLM's parser asks the wrapper
    for): a plain turn's over the catalog (the wrapper's own tag model only), a policy turn's over
    the allowed functions and, on harmony, the allowed server-side recipients."""
    allowlist = turn.allowlist
    if allowlist is None:
        return TurnTag(_plain_tag(turn, strict_level))
    level = max(strict_level, STRICT_FUNCTION)   # the allowlist is a contract
    if allowlist.server and turn.wrapper.tag_model == "harmony":
        after = None
        if turn.wants_grammar_after_a_call and allowlist.mode == "required":
            after = json.dumps(_server_tag(turn, "auto", level).model_dump())
        return TurnTag(preambles_within_budget(turn, _server_tag(turn, allowlist.mode, level)), after)
    if turn.wrapper.tag_model is None or not allowlist.allowed:
        return TurnTag(None)   # nothing callable (an auto turn whose tools all need approval)
    subset = _subset_tag(turn, level)
    return TurnTag(preambles_within_budget(turn, subset.tag if subset is not None else None))


def _tagged(turn: TurnRead, limit_to_one_call: Callable[[Any], Any]) -> TurnGrammar:
    """A format whose grammar is a structural tag: the turn's (vLLM's parser may have set it)."""
    allowlist = turn.allowlist
    if not turn.wrapper.strict_tool_calling:
        raise CapabilityError(
            "allowed_tools needs structural tags, but VLLM_ENFORCE_STRICT_TOOL_CALLING=0 turns "
            "them off; unset it (or set it to 1) and restart the server", capability="structural_tag")
    if turn.outputs is not None and turn.outputs.structural_tag is not None:
        return TurnGrammar()   # vLLM's DelegatingParser already used the wrapper's get_structural_tag
    if turn.client_format:
        raise CapabilityError(
            "allowed_tools in auto mode together with a response format is not supported with "
            "non-strict tools; mark the allowed tools `strict: true` or drop the response format",
            capability="structural_tag+response_format")
    decided = turn_tag_for(turn, STRICT_FUNCTION)
    if decided.tag is None:
        raise CapabilityError(
            f"the {turn.wrapper.wire_format!r} parser produced no structural tag for the allowed "
            "subset", capability="structural_tag", status=500)
    if not allowlist.parallel_tool_calls and not allowlist.server:
        limit_to_one_call(decided.tag)
    outputs = Outputs(structural_tag=json.dumps(decided.tag.model_dump()))
    return TurnGrammar(rewrites_outputs=True, outputs=outputs, drops_client_formats=True,
                       grammar_after_a_call=decided.grammar_after_a_call)


def _call_array(turn: TurnRead) -> TurnGrammar:
    """A required turn of a JSON-array format: the array of allowed calls, on both APIs (base
    parsers set their own only on some), as a grammar; as the plain JSON schema where the backend
    kept for JSON schemas compiles it exactly (its strings may then spell a marker or a lone
    surrogate: docs/decode-path.md)."""
    allowlist, name = turn.allowlist, turn.wrapper.wire_format
    tag = _subset_tag(turn, STRICT_FUNCTION)
    if tag is None:
        raise CapabilityError(f"the {name!r} format produced no grammar for a required turn",
                              capability="structural_tag", status=500)
    schema = None
    if turn.wrapper.stage == STAGE_LOGITS_PROCESSOR and \
            wire_format(name).grammar.call_syntax == "json":   # pythonic calls are no JSON
        schema = call_array_schema(name, turn.allowed_functions(),
                                   parallel_tool_calls=allowlist.parallel_tool_calls)
    native = schema is not None and backend_compiles_json_schema(turn.wrapper.json_schema_backend, schema)
    outputs = Outputs(json=schema) if native else Outputs(structural_tag=tag.json)
    return TurnGrammar(rewrites_outputs=True, outputs=outputs, drops_client_formats=True,
                       reads_as_auto=turn.choice.string == "required" and turn.wrapper.reads_required_itself)


def _call_list(turn: TurnRead) -> TurnGrammar:
    """An auto turn of a JSON-array format: free text, and after its trigger (or at the message's
    start) only allowed calls (decode/call_lists.py); nothing for a format without one (the output
    guard holds it)."""
    tag = _subset_tag(turn, STRICT_FUNCTION)
    if tag is None:
        return TurnGrammar()
    if turn.client_format:
        raise CapabilityError(
            "allowed_tools in auto mode together with a response format is not supported on the "
            f"{turn.wrapper.wire_format!r} format (its calls and the format's JSON would be one "
            "grammar); drop the response format", capability="structural_tag+response_format")
    return TurnGrammar(rewrites_outputs=True, outputs=Outputs(structural_tag=tag.json),
                       drops_client_formats=True)


def _handed_to_logits_processor(turn: TurnRead, grammar: TurnGrammar) -> TurnGrammar:
    """The logits-processor stage: the grammar moves from vLLM's structured outputs to our
    processor's request arguments (the same grammar: a structural tag, or the JSON schema wrapped
    in one), with its split into catalog and envelope where it has one (decode/split.py). A JSON
    schema the native backend compiles exactly stays there."""
    outputs, allowlist = grammar.final_outputs(turn), turn.allowlist
    if outputs is None or (outputs.structural_tag is None and outputs.json is not None
                           and backend_compiles_json_schema(turn.wrapper.json_schema_backend, outputs.json)):
        return grammar
    if outputs.structural_tag is not None:
        tag_json = outputs.structural_tag
    elif outputs.json is not None:
        schema = json.loads(outputs.json) if isinstance(outputs.json, str) else outputs.json
        tag_json = built(StructuralTag(format=JSONSchemaFormat(json_schema=schema))).json
    else:
        return grammar
    split = split_for_request(
        turn.wrapper.wire_format, tag_json, turn.catalog, turn.allowed_functions(),
        catalog_digest=allowlist.catalog_digest, allowlist_digest=allowlist.allowlist_digest,
        mode=allowlist.mode,  # type: ignore[arg-type]
        parallel_tool_calls=allowlist.parallel_tool_calls, max_whitespace=current().whitespace_limit) \
        if outputs.structural_tag and not allowlist.server else None
    xargs = {**grammar.xargs, XARGS_TAG: tag_json, XARGS_DIGEST: tag_digest(tag_json),
             **(split.extra_args() if split is not None else {})}
    if allowlist is not None and allowlist.allowed != allowlist.catalog:
        # a turn that narrows its catalog may have its text held to valid UTF-8 (wire/xargs.py);
        # a plain turn held to its whole catalog (request/rewrite.py constrain_to_catalog) keeps
        # the text vanilla vLLM samples
        xargs[XARGS_TEXT_UTF8] = 1
    return dataclasses.replace(grammar, rewrites_outputs=True, outputs=None, xargs=xargs)


def _marked(turn: TurnRead, grammar: TurnGrammar) -> TurnGrammar:
    """What the logits processor holds a tool-bearing turn to beyond its grammar (both stages): a
    turn that must call, the reserve of its shortest call (while it reasons it cannot stop, and its
    reasoning ends while the budget holds the call: :mod:`.reasoning_hold`; ``include_reasoning:
    false`` constrains a Chat turn from its first token on the native stage, where a hold would
    refuse the stop after the call); on a format whose parser reads some stop tokens as text
    (gpt-oss's ``<|endoftext|>``), those tokens, never written (:mod:`.refused_tokens`)."""
    xargs = dict(grammar.xargs)
    if _must_call(turn) and turn.reasoning_shown:
        try:
            reserve = _call_reserve(turn, grammar)
        except Exception:   # an estimate must never fail a request: keep a generous stand-in
            logger.warning("vllm-allowed-tools: could not size the shortest call; reserving %d tokens",
                           FALLBACK_RESERVE, exc_info=True)
            reserve = FALLBACK_RESERVE
        if reserve is not None:
            xargs[XARGS_MUST_CALL] = reserve
    refused = [token for _, token in wire_format(turn.wrapper.wire_format).grammar.text_stop_tokens]
    if refused and turn.has_tools:
        xargs[XARGS_REFUSED_TOKENS] = refused
    return dataclasses.replace(grammar, xargs=xargs)


def _must_call(turn: TurnRead) -> bool:
    """An allowlist in ``required`` mode with something callable, or (no allowlist) plain
    ``required`` or a named tool."""
    if turn.allowlist is not None:
        return turn.allowlist.mode == "required" and bool(turn.allowlist.allowed or turn.allowlist.server)
    choice = turn.choice
    return choice.string == "required" or (choice.named is not None and choice.named.tool_name is not None)


def _call_reserve(turn: TurnRead, grammar: TurnGrammar) -> int | None:
    """The tokens the shortest call the turn's grammar admits needs (:mod:`.call_budget`), from
    the grammar it ends with (our processor's, or vLLM's structured outputs); None without one."""
    outputs = grammar.final_outputs(turn)
    tag = grammar.xargs.get(XARGS_TAG, turn.xargs_tag) or \
        (outputs.structural_tag if outputs is not None else None)
    if tag is not None:
        pieces = shortest_call_text(tag, turn.schemas())
    elif outputs is not None and outputs.json is not None:
        pieces = shortest_array_call(outputs.json)
    else:
        return None
    return reserve_tokens(pieces, _counter(turn.wrapper.tokenizer))


def _counter(tokenizer: Any) -> Callable[[str], int]:
    return lambda text: len(tokenizer.encode(text, add_special_tokens=False)) if tokenizer is not None \
        else len(text) // 2 + 1


def preambles_within_budget(turn: TurnRead, tag: StructuralTag | None) -> StructuralTag | None:
    """gpt-oss (the wrapper's tag model is harmony): a ``required`` turn's tag whose two preamble
    messages (analysis, commentary) leave the request's budget room for its shortest call: each
    holds at most half of what the budget has left after the call and the messages' markup (never
    more than ``VLLM_ALLOWED_TOOLS_HARMONY_PREAMBLE_TOKENS``). ``tag`` as it is when the request
    sets no budget or the bound already fits; else a copy (tags are cached)."""
    budget = turn.max_tokens
    if tag is None or budget is None or turn.wrapper.tag_model != "harmony" \
            or turn.allowlist is None or turn.allowlist.mode != "required":
        return tag
    pieces = shortest_call_text(tag.model_dump(), turn.schemas())
    reserve = reserve_tokens(pieces, _counter(turn.wrapper.tokenizer))
    bound = max(0, (budget - reserve - HARMONY_PREAMBLE_MARKUP) // 2)
    configured = current().harmony_preamble_tokens
    if configured and configured <= bound:
        return tag
    data = tag.model_dump()
    cap_optional_text(data, bound)
    return type(tag).model_validate(data)


def _plain_tag(turn: TurnRead, strict_level: int) -> StructuralTag | None:
    """A plain turn on a format whose tag is the wrapper's own: ``required`` and named choices get
    the format's grammar over the catalog (or the named function); anything else is free text, as
    vLLM leaves it without a structural tag."""
    choice = turn.choice
    named = choice.named.tool_name if choice.named is not None else None
    functions = list(turn.catalog)
    if choice.string == "required":
        mode, parallel = "required", turn.parallel_tool_calls
    elif named is not None:
        functions = [function for function in functions if function.name == named]
        mode, parallel = "required", False
    else:
        return None
    if not functions:
        return None
    return build_structural_tag(turn.wrapper.wire_format, functions, mode, parallel_tool_calls=parallel,
                                strict_level=strict_level, max_whitespace=current().whitespace_limit)


def _subset_tag(turn: TurnRead, strict_level: int, mode: str | None = None) -> BuiltTag | None:
    """The cached tag of the allowed functions (:func:`.grammar.turn_tag`), in the turn's mode or
    ``mode``."""
    allowlist = turn.allowlist
    return turn_tag(turn.wrapper.wire_format, turn.allowed_functions(),
                    catalog_digest=allowlist.catalog_digest, allowlist_digest=allowlist.allowlist_digest,
                    mode=mode or allowlist.mode,  # type: ignore[arg-type]
                    parallel_tool_calls=allowlist.parallel_tool_calls, strict_level=strict_level,
                    max_whitespace=current().whitespace_limit)


def _server_tag(turn: TurnRead, mode: str, strict_level: int) -> StructuralTag:
    """Harmony with server-side tools: the allowed functions' tag with the allowed server-side
    recipients (:mod:`.server_recipients`), in ``mode``."""
    allowlist = turn.allowlist
    function_tag = None
    if allowlist.allowed:
        subset = _subset_tag(turn, strict_level, mode)
        function_tag = subset.tag.model_copy(deep=True) if subset is not None else None
    return with_server_calls(function_tag, allowlist.server, mode, current().whitespace_limit,
                             turn.server_listings.get)
