"""The wire-format registry: every fact about one tool-call wire format, in one typed entry.

The parser wrappers, the grammar builder, the test server's template choice and the prefix report
all read a format's facts from here, so adding a format is one entry: a data file in
``vllm_allowed_tools/grammars/`` or :func:`register_wire_format` from code (docs/decode-path.md).
No vLLM or xgrammar imports: the devtools read it too.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from ..grammars import GRAMMAR_DIR

GrammarKind = Literal["tags", "xgrammar", "vllm", "json_array", "code"]
GRAMMAR_KINDS: tuple[str, ...] = ("tags", "xgrammar", "vllm", "json_array", "code")
#: where a call shape's ``begin`` puts the function's name
NAME_PLACEHOLDER = "{name}"


@dataclass(frozen=True)
class CallShape:
    """One way a call is written: ``begin`` (with :data:`NAME_PLACEHOLDER`), the arguments, ``end``."""
    begin: str
    end: str


@dataclass(frozen=True)
class GrammarSpec:
    """How the allowed-subset grammar is built for a format.

    ``tags``: calls as ``calls`` shapes, after ``trigger`` in auto mode; ``xgrammar``: xgrammar's
    builtin template ``xgrammar_model``, its markup strings optionally renamed by ``rename`` (a
    format that shares another's grammar with other wrapper tokens); ``vllm``: the builder vLLM
    registers for ``vllm_model`` (formats whose grammar vLLM owns); ``json_array``: a JSON array of
    calls in required mode, no grammar in auto mode; ``code``: ``builder(functions, mode,
    parallel_tool_calls, strict_level, max_whitespace)`` returns the tag (or None). Whatever the
    kind, a JSON argument slot admits only an object (``arguments_on_one_line``: with no line
    break, for parsers that read none)."""
    kind: GrammarKind
    trigger: str | None = None
    calls: tuple[CallShape, ...] = ()
    argument_style: str = "json"
    xgrammar_model: str | None = None
    rename: tuple[tuple[str, str], ...] = ()
    vllm_model: str | None = None
    #: the format's parser reads no line break inside arguments: they are written on one line
    arguments_on_one_line: bool = False
    #: ``json_array``: the key of a call's arguments in required mode's array, as its reader reads
    #: it (vLLM's serving layer: ``parameters``; a parser that reads required output itself, such
    #: as Mistral's: its own key)
    arguments_key: str = "parameters"
    #: (marker, token id) for markers the format's parser reads by token id (gpt-oss's harmony
    #: tokens, ids of its fixed vocabulary): the grammar admits each only as that one token, never
    #: spelled in pieces (:mod:`vllm_allowed_tools.decode.marker_tokens`)
    marker_tokens: tuple[tuple[str, int], ...] = ()
    #: (token, id) for stop tokens the format's parser reads as message text, not as an end: the
    #: model never writes them under our parser (gpt-oss's generation config stops on
    #: ``<|endoftext|>``, which the harmony parser takes into the message: a call's arguments
    #: become ``{...}<|endoftext|>``); the logits processor refuses them on both constraint stages
    #: (:mod:`vllm_allowed_tools.decode.refused_tokens`)
    text_stop_tokens: tuple[tuple[str, int], ...] = ()
    #: ``json_array``: how a call is spelled, ``json`` (``{"name", <arguments_key>}`` objects) or
    #: ``pythonic`` (``[get_weather(city="Paris")]``, in required mode too)
    call_syntax: Literal["json", "pythonic"] = "json"
    #: ``json_array``, auto mode: the markers after which the parser reads an array of calls (free
    #: text before them); the key of a call's arguments there
    auto_triggers: tuple[str, ...] = ()
    auto_arguments_key: str = "arguments"
    #: ``json_array``, auto mode without triggers: the calls only at the message's start (the
    #: parser reads a whole output that is a call list), or text whose first character is none of
    #: ``auto_text_first_excluded`` (empty: no auto grammar) and which holds none of
    #: ``auto_text_excludes``
    auto_text_first_excluded: str = ""
    auto_text_excludes: tuple[str, ...] = ()
    #: ``json_array``: texts a JSON string inside the calls may not spell as they are (a parser
    #: that finds them in the raw output although they start with no markup: xLAM's code fences)
    string_excludes: tuple[str, ...] = ()
    #: ``json_array``, auto mode: the parser ends the list at the first ``]`` (Phi-4-mini), so
    #: arguments hold no array (:func:`vllm_allowed_tools.decode.call_lists.without_arrays`)
    auto_no_arrays: bool = False
    builder: Callable[..., Any] | None = field(default=None, compare=False)

    @property
    def holds_auto(self) -> bool:
        """Auto turns get a grammar (a ``json_array`` format only where its calls have an opening:
        a trigger, or the message's start)."""
        return self.kind != "json_array" or bool(self.auto_triggers or self.auto_text_first_excluded)


@dataclass(frozen=True)
class WireFormat:
    """A tool-call wire format: ``name`` is vLLM's parser for it, ``allowed_<name>`` ours."""
    name: str
    base_parser_class: str
    #: our bundled template for the format; None where vLLM renders no chat template (gpt-oss's
    #: harmony path)
    template: str | None
    policy_block_marker: str
    call_triggers: tuple[str, ...]
    grammar: GrammarSpec
    #: markers the base parser looks up in the vocabulary, so the model's tokenizer must hold each
    #: as one token (the tiny test models get them added)
    special_tokens: tuple[str, ...] = ()
    #: texts that end a call in the output: where a stream under a policy re-reads the text so far
    #: to release the calls it completes (none: the calls go out at the end of the stream)
    call_ends: tuple[str, ...] = ()
    #: under a policy, streamed calls are the unary parse's (:mod:`..vllm_glue.stream_calls`); off
    #: for a format whose streaming vLLM reads on a path of its own (gpt-oss's harmony)
    stream_from_unary: bool = True

    @property
    def parser_name(self) -> str:
        return f"allowed_{self.name}"

    @property
    def parser_class_name(self) -> str:
        return "Allowed" + "".join(part.capitalize() for part in self.name.split("_")) + "ToolParser"

    @property
    def required_output_is_all_call(self) -> bool:
        """Required mode's output is a bare JSON array of calls: all of it is call, none is text."""
        return self.grammar.kind == "json_array"


_FORMATS: dict[str, WireFormat] = {}
_LOCK = threading.Lock()


def register_wire_format(entry: WireFormat, *, replace: bool = False) -> WireFormat:
    """Add ``entry`` to the registry (``replace`` to redefine one); returns it."""
    _check(entry)
    with _LOCK:
        if entry.name in _FORMATS and not replace and _FORMATS[entry.name] != entry:
            raise ValueError(f"wire format {entry.name!r} is already registered; pass replace=True "
                             "to redefine it")
        _FORMATS[entry.name] = entry
    return entry


def wire_format(name: str) -> WireFormat:
    """The format called ``name`` (vLLM's parser name, or ours: ``allowed_<name>``)."""
    entry = _FORMATS.get(name) or _FORMATS.get(name.removeprefix("allowed_"))
    if entry is None:
        raise ValueError(f"unknown wire format {name!r}; expected one of "
                         f"{', '.join(sorted(_FORMATS))} (or register it: docs/decode-path.md)")
    return entry


def parser_names() -> list[str]:
    """Our parser names (``allowed_<base>``), one per registered wire format."""
    return [entry.parser_name for entry in wire_formats()]


def wire_formats() -> tuple[WireFormat, ...]:
    """Every registered format, by name."""
    with _LOCK:
        return tuple(_FORMATS[name] for name in sorted(_FORMATS))


def _check(entry: WireFormat) -> None:
    spec = entry.grammar
    problems = []
    if spec.kind not in GRAMMAR_KINDS:
        problems.append(f"grammar kind {spec.kind!r} is not one of {', '.join(GRAMMAR_KINDS)}")
    if spec.kind == "tags" and (not spec.trigger or not spec.calls
                                or any(NAME_PLACEHOLDER not in call.begin for call in spec.calls)):
        problems.append(f"a 'tags' grammar needs a trigger and calls whose begin holds {NAME_PLACEHOLDER}")
    if spec.kind == "xgrammar" and not spec.xgrammar_model:
        problems.append("an 'xgrammar' grammar needs xgrammar_model (an xgrammar builtin template)")
    if spec.kind == "vllm" and not spec.vllm_model:
        problems.append("a 'vllm' grammar needs vllm_model (a structural tag model vLLM registers)")
    if spec.kind == "code" and not callable(spec.builder):
        problems.append("a 'code' grammar needs a builder function")
    if problems:
        raise ValueError(f"wire format {entry.name!r}: " + "; ".join(problems))


def format_from_data(data: Mapping[str, Any], source: str = "data") -> WireFormat:
    """A :class:`WireFormat` from one data file's JSON (docs/decode-path.md, "Data files")."""
    try:
        grammar = dict(data["grammar"])
        calls = tuple(CallShape(call["begin"], call["end"]) for call in grammar.pop("calls", ()))
        rename = tuple((old, new) for old, new in grammar.pop("rename", ()))
        markers = tuple((marker, int(token)) for marker, token in grammar.pop("marker_tokens", ()))
        grammar["text_stop_tokens"] = tuple((text, int(token))
                                            for text, token in grammar.pop("text_stop_tokens", ()))
        for key in ("auto_triggers", "auto_text_excludes", "string_excludes"):
            if key in grammar:
                grammar[key] = tuple(grammar[key])
        return WireFormat(name=data["name"], base_parser_class=data["base_parser_class"],
                          template=data["template"], policy_block_marker=data["policy_block_marker"],
                          call_triggers=tuple(data["call_triggers"]),
                          grammar=GrammarSpec(calls=calls, rename=rename, marker_tokens=markers, **grammar),
                          special_tokens=tuple(data.get("special_tokens", ())),
                          call_ends=tuple(data.get("call_ends", ())),
                          stream_from_unary=bool(data.get("stream_from_unary", True)))
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"{source}: not a wire-format file ({exc!s}); see docs/decode-path.md for "
                         "the keys each file needs") from None


def load_data_files(folder: Path = GRAMMAR_DIR) -> list[WireFormat]:
    """Register every ``*.json`` format file in ``folder``; returns what was registered."""
    return [register_wire_format(format_from_data(json.loads(path.read_text(encoding="utf-8")),
                                                  source=str(path)))
            for path in sorted(folder.glob("*.json"))]
