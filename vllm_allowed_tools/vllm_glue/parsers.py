"""``allowed_<base>`` tool parsers: vLLM's built-in parsers under the turn's allowed-tools policy.

One subclass per registered wire format (:mod:`vllm_allowed_tools.formats`), built on first use from
:class:`AllowedToolsMixin`. Without a policy on the request every method is the base parser's own, so
plain tool choices behave exactly as vanilla vLLM. With one, the wrapper constrains decoding to the
allowed subset, drops any parsed call outside it, and never returns call markup as text; why and how:
docs/decode-path.md. :meth:`AllowedToolsMixin.adjust_request` reads the request once
(:mod:`.turn_read`), decides the turn's grammar in one call into ``decode/``
(:mod:`..decode.turn_grammar`) and writes the decision back.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from os.path import commonprefix
from typing import Any

from vllm import envs
from vllm.tool_parsers import ToolParserManager

from ..decode.turn_grammar import Wrapper, decide_turn, turn_tag_for
from ..formats import WireFormat, wire_format, wire_formats
from ..metrics import record_violation
from ..wire import ALLOWLIST_KEY, WireAllowlist
from .capabilities import active_constraint_stage, json_schema_backend
from .markup_reads import log_unread_markup, read_required_array, reread_calls
from .stream_calls import ReleasedStream, UnaryStream, call_start, with_calls
from .turn_read import function_tools, read_turn, tool_name, tools_held_to_schema

try:  # vLLM 0.32 / 0.33
    from vllm.entrypoints.generate.base.protocol import DeltaMessage, ExtractedToolCallInformation
except ImportError:  # pragma: no cover - older layout
    from vllm.entrypoints.openai.engine.protocol import DeltaMessage, ExtractedToolCallInformation

from vllm.sampling_params import StructuredOutputsParams
from vllm.tool_parsers.structural_tag_registry import limit_to_single_tool_call
from vllm.tool_parsers.tool_strict_level import ToolStrictLevel

logger = logging.getLogger(__name__)

def request_allowlist(request: Any) -> WireAllowlist | None:
    """The turn's allowlist, as the middleware attached it (None: a plain request)."""
    extra = getattr(request, "model_extra", None) or {}
    return WireAllowlist.from_wire(extra.get(ALLOWLIST_KEY))


def _narrowed(request, allowlist: WireAllowlist):
    """A deep copy of `request` whose tools are only the allowed ones (namespaces flattened)."""
    allowed = [tool for tool in function_tools(request) if tool_name(tool) in allowlist.allowed]
    return request.model_copy(update={"tools": allowed}, deep=True)


class AllowedToolsMixin:
    """Mixed in before a vLLM ToolParser subclass; see the module docstring."""

    allowed_tools_base_parser: str = ""
    #: the ``structural_tag_model`` of a wrapper whose base parser has no structural tag of its own
    #: while its format has one (ours, e.g. Seed-OSS's): vLLM then asks the wrapper for every tag
    allowed_tools_own_tag_model: str | None = None

    # ---------------------------------------------------------------- grammar
    def get_structural_tag(self, request, *, reasoning: bool = False,
                           strict_level: ToolStrictLevel = ToolStrictLevel.AUTO):
        allowlist = request_allowlist(request)
        wrapper = self._wrapper(allowlist)
        if allowlist is None and not wrapper.own_tag:
            return super().get_structural_tag(tools_held_to_schema(request), reasoning=reasoning,
                                              strict_level=strict_level)
        turn = read_turn(request, allowlist, wrapper)
        decided = turn_tag_for(turn, int(strict_level))
        if decided.grammar_after_a_call is not None:
            turn.server_turn.grammar_after_a_call = decided.grammar_after_a_call
        return decided.tag

    def adjust_request(self, request):
        """The turn's grammar: the request read once (:func:`.turn_read.read_turn`), the grammar
        decided in one call (:func:`..decode.turn_grammar.decide_turn`), the decision written back
        here."""
        allowlist = request_allowlist(request)
        wrapper = self._wrapper(allowlist)
        if allowlist is None:
            request = super().adjust_request(request)   # a plain turn: vLLM's own grammar
            keeps_special_tokens = False
        else:
            # The base parser, run on a copy that holds only the allowed tools, for its other side
            # effects (e.g. keeping special tokens such as [TOOL_CALLS] in the output); its grammar,
            # the catalog's, is never taken.
            probe = super().adjust_request(_narrowed(request, allowlist))
            keeps_special_tokens = getattr(probe, "skip_special_tokens", None) is False
        turn = read_turn(request, allowlist, wrapper)
        grammar = decide_turn(turn, limit_to_one_call=limit_to_single_tool_call)
        if grammar.rewrites_outputs:
            outputs = grammar.outputs
            request.structured_outputs = None if outputs is None else StructuredOutputsParams(
                structural_tag=outputs.structural_tag, json=outputs.json)
        if grammar.drops_client_formats:   # vLLM would take either as the one structured output
            if hasattr(request, "response_format"):
                request.response_format = None
            if hasattr(request, "text") and not hasattr(request, "messages"):
                request.text = None
        if grammar.reads_as_auto:   # see _reads_required_itself
            request.tool_choice = "auto"
        if keeps_special_tokens:
            request.skip_special_tokens = False
        if grammar.xargs:
            request.vllm_xargs = {**(request.vllm_xargs or {}), **grammar.xargs}
        if grammar.grammar_after_a_call is not None:
            turn.server_turn.grammar_after_a_call = grammar.grammar_after_a_call
        return request

    def _wrapper(self, allowlist: WireAllowlist | None) -> Wrapper:
        """This wrapper, and how its server serves a policy turn's grammar (a plain turn's is
        vLLM's: its stage is not asked)."""
        policy = allowlist is not None
        return Wrapper(wire_format=self.allowed_tools_base_parser, tag_model=self.structural_tag_model,
                       own_tag=self.structural_tag_model == self.allowed_tools_own_tag_model,
                       reads_required_itself=self._reads_required_itself(),
                       stage=active_constraint_stage() if policy else None,
                       json_schema_backend=json_schema_backend() if policy else None,
                       strict_tool_calling=bool(envs.VLLM_ENFORCE_STRICT_TOOL_CALLING),
                       tokenizer=getattr(self, "model_tokenizer", None))

    @classmethod
    def _reads_required_itself(cls) -> bool:
        """A required turn of a JSON-array format whose base parser is engine-based (granite), or
        whose calls are pythonic, is read by this parser, as an auto turn is: vLLM's serving layer
        reads a required turn of a ``supports_required_and_named`` parser with its own JSON-array
        reader, which in a stream reads ``current_text``, and a DelegatingParser over an
        engine-based parser hands it each delta alone, so no call ever streamed (pythonic calls
        are no JSON at all). vLLM decides by ``request.tool_choice`` (the stream's parser is another
        instance than this one, built after :meth:`adjust_request`): the request says ``auto``; the
        grammar still forces the array of allowed calls, the allowlist (``mode: required``) still
        tells this wrapper the output is all call, and the middleware echoes the client's own
        ``tool_choice``. Requests without a policy never get there."""
        return cls._array_starves_in_a_stream() or cls._calls_are_pythonic()

    @classmethod
    def _calls_are_pythonic(cls) -> bool:
        """Required turns are written as Python calls (decode/call_lists.py), which vLLM's
        JSON-array reader cannot read: the format's own parser reads them."""
        return wire_format(cls.allowed_tools_base_parser).grammar.call_syntax == "pythonic"

    # ---------------------------------------------------------------- no call markup as text
    def _call_triggers(self) -> tuple[str, ...]:
        return wire_format(self.allowed_tools_base_parser).call_triggers

    def _all_call(self, allowlist: WireAllowlist) -> bool:
        """The whole output is call (required mode of a bare-JSON-array format)."""
        return allowlist.mode == "required" and \
            wire_format(self.allowed_tools_base_parser).required_output_is_all_call

    def _reads_the_array(self, allowlist: WireAllowlist) -> bool:
        """Whether this wrapper reads a required turn's JSON array itself, as vLLM's serving layer
        would (:meth:`_reads_required_itself`: a base parser that reads only the array after
        its marker, granite's, sees none in a bare array)."""
        return allowlist.mode == "required" and self._array_starves_in_a_stream()

    @classmethod
    def _array_starves_in_a_stream(cls) -> bool:
        """A JSON-array format whose base parser leaves required turns to vLLM's JSON-array reader
        and is engine-based (the class's flag: a stream sets the instance's, see
        :meth:`extract_tool_calls_streaming`)."""
        return cls.supports_required_and_named and cls.engine_based_streaming \
            and wire_format(cls.allowed_tools_base_parser).grammar.kind == "json_array"

    def _text_before_calls(self, content: str | None, raw: str, allowlist: WireAllowlist) -> str | None:
        """The ``content`` the base parser made of ``raw``, without anything from the first call
        start in ``raw`` on: only what both say comes before it (base parsers may drop a marker
        token and hand the rest of a cut-off call out as text). None when nothing is left."""
        if not content or self._all_call(allowlist):
            return None
        start = call_start(raw, self._call_triggers())
        if start is not None:
            content = commonprefix([content, raw[:start]])
        return content if content.strip() else None

    def _parse_without_markup(self, model_output: str, request,
                              allowlist: WireAllowlist) -> ExtractedToolCallInformation:
        """The base parse with no call markup in its text, its calls read from the first call
        trigger on (text before it the base parser misreads neither hides nor makes calls), and
        where none parsed but one started, the calls before the last start (complete calls survive
        a cut-off one after them): :func:`.markup_reads.reread_calls`.

        ``tools_called`` is True whenever the output held call markup, even when no call is left
        (cut off, or refused below): vLLM's serving layer (``DelegatingParser._extract_tool_calls``)
        ignores the content of a parse without calls and sends the raw model output as text, markup
        and all; with ``tools_called`` it takes this content and the (possibly empty) call list.
        """
        info = read_required_array(model_output) if self._reads_the_array(allowlist) else \
            super().extract_tool_calls(model_output, request)
        if not self._reads_the_array(allowlist):
            info = reread_calls(lambda text: super(AllowedToolsMixin, self).extract_tool_calls(text, request),
                                model_output, self._call_triggers(), info)
        content = self._text_before_calls(info.content, model_output, allowlist)
        markup = bool(model_output.strip()) if self._all_call(allowlist) else \
            call_start(model_output, self._call_triggers()) is not None
        tools_called = info.tools_called or markup
        if content == info.content and tools_called == info.tools_called:
            return info
        return ExtractedToolCallInformation(tools_called=tools_called, tool_calls=info.tool_calls,
                                            content=content)

    def _released(self) -> ReleasedStream:
        """What this stream has released so far (text and each call's verdict)."""
        return self.__dict__.setdefault("_allowed_tools_released", ReleasedStream())

    # ---------------------------------------------------------------- output filtering
    def extract_tool_calls(self, model_output: str, request) -> ExtractedToolCallInformation:
        allowlist = request_allowlist(request)
        if allowlist is None:
            return super().extract_tool_calls(model_output, request)
        info = self._parse_without_markup(model_output, request, allowlist)
        if not info.tool_calls:
            log_unread_markup(wire_format(self.allowed_tools_base_parser), model_output, info)
            return info
        kept = [call for call in info.tool_calls if allowlist.is_allowed(call.function.name)]
        dropped = [call.function.name for call in info.tool_calls if call not in kept]
        if dropped:
            record_violation("parser")
            logger.warning("vllm-allowed-tools: dropped calls outside the allowlist: %s", dropped)
        if not allowlist.parallel_tool_calls:
            kept = kept[:1]
        # tools_called stays True with every call refused: the text is then what came before the
        # calls, never the refused calls' markup (see _parse_without_markup)
        return ExtractedToolCallInformation(tools_called=True, tool_calls=kept, content=info.content)

    def extract_tool_calls_streaming(self, previous_text: str, current_text: str, delta_text: str,
                                     previous_token_ids: Sequence[int], current_token_ids: Sequence[int],
                                     delta_token_ids: Sequence[int], request) -> DeltaMessage | None:
        delta = super().extract_tool_calls_streaming(previous_text, current_text, delta_text,
                                                     previous_token_ids, current_token_ids,
                                                     delta_token_ids, request)
        allowlist = request_allowlist(request)
        if allowlist is None:
            return delta
        stream = self._unary_stream()
        if stream is None:
            self.__dict__["_allowed_tools_last"] = (allowlist, current_text, request)
            return self._filter_stream(delta, current_text, allowlist)
        # vLLM calls finish_streaming at the end of a stream only for a parser that says it is
        # engine-based (DelegatingParser._flush_engine_parsers reads the instance's flag, after
        # its own streaming state was set up from the class's): this one needs the call, to send
        # what the unary parse of the whole text reads
        self.engine_based_streaming = True
        prefix = stream.feed(delta_text)
        self.__dict__["_allowed_tools_last"] = (allowlist, stream.text, request)
        calls = stream.new_calls(self._unary_twin()._parse_without_markup(
            prefix, request, allowlist).tool_calls) if prefix is not None else []
        return self._filter_stream(with_calls(delta, calls), stream.text, allowlist)

    def _unary_stream(self) -> UnaryStream | None:
        """This stream's :class:`UnaryStream` (None for a format that streams its own way)."""
        stream = self.__dict__.get("_allowed_tools_unary")
        if stream is None:
            entry = wire_format(self.allowed_tools_base_parser)
            if not entry.stream_from_unary:
                return None
            stream = self.__dict__["_allowed_tools_unary"] = UnaryStream(entry.call_ends)
        return stream

    def _unary_twin(self):
        """A second parser for the unary reads of a stream: an engine-based parser's unary parse
        resets the engine its streaming runs on."""
        twin = self.__dict__.get("_allowed_tools_twin")
        if twin is None:
            twin = type(self)(self.model_tokenizer, self.tools)
            if hasattr(self, "skip_reasoning_parsing"):
                twin.skip_reasoning_parsing = self.skip_reasoning_parsing
            self.__dict__["_allowed_tools_twin"] = twin
        return twin

    def get_remaining_unstreamed_args(self) -> str:
        """Nothing under a policy: the calls streamed are whole (vLLM would append the base
        parser's view of the last call's arguments to the last delta)."""
        if self.__dict__.get("_allowed_tools_unary") is not None:
            return ""
        return super().get_remaining_unstreamed_args()

    def finish_streaming(self) -> DeltaMessage | None:
        """The end of a stream: engine-based base parsers (vLLM's qwen3) flush what they still
        hold here, past :meth:`extract_tool_calls_streaming`, so the same filtering applies; under
        a policy, every call the unary parse of the whole text reads and the stream has not sent
        goes out here. A name cut off by the token limit comes out here as a piece of an allowed
        name: it is dropped without counting a violation."""
        flush = getattr(super(), "finish_streaming", None)
        delta = flush() if flush is not None else None
        last = self.__dict__.get("_allowed_tools_last")
        if last is None:
            return delta
        allowlist, current_text, request = last
        stream = self.__dict__.get("_allowed_tools_unary")
        if stream is not None:
            info = self._unary_twin()._parse_without_markup(stream.text, request, allowlist)
            delta = with_calls(delta, stream.new_calls(info.tool_calls))
            log_unread_markup(wire_format(self.allowed_tools_base_parser), stream.text, info)
        return self._filter_stream(delta, current_text, allowlist, final=True)

    def _filter_stream(self, delta: DeltaMessage | None, current_text: str, allowlist: WireAllowlist,
                       final: bool = False) -> DeltaMessage | None:
        released = self._released()
        delta = released.text(delta, current_text, self._call_triggers(), self._all_call(allowlist))
        return released.calls(delta, allowlist, final=final)


_CLASSES_LOCK = threading.Lock()
#: grammar kinds that build a structural tag in every mode (``json_array`` is a JSON schema)
TAG_KINDS = frozenset({"tags", "xgrammar", "vllm", "code"})


def parser_class(entry: WireFormat) -> type:
    """Our wrapper of vLLM's parser for ``entry``, built (importing the base parser) on first use."""
    with _CLASSES_LOCK:
        existing = globals().get(entry.parser_class_name)
        if existing is not None:
            return existing
        base = ToolParserManager.get_tool_parser(entry.name)
        namespace: dict[str, Any] = {
            "__doc__": f"vLLM's {entry.name!r} tool parser under the allowed-tools policy.",
            "__module__": __name__,
            "allowed_tools_base_parser": entry.name,
        }
        if base.structural_tag_model is None and entry.grammar.kind in TAG_KINDS:
            # vLLM asks for a structural tag only when the class names a model (and then parses
            # required and named choices with the parser, not as a JSON array)
            namespace["structural_tag_model"] = namespace["allowed_tools_own_tag_model"] = \
                entry.parser_name
        cls = type(entry.parser_class_name, (AllowedToolsMixin, base), namespace)
        globals()[entry.parser_class_name] = cls
        return cls


def __getattr__(name: str) -> Any:
    """vLLM's lazy registration imports this module and asks for a class by name: build only that
    one. ``CALL_TRIGGERS`` is each format's call triggers, by format name."""
    if name == "CALL_TRIGGERS":
        return {entry.name: entry.call_triggers for entry in wire_formats()}
    for entry in wire_formats():
        if entry.parser_class_name == name:
            return parser_class(entry)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
