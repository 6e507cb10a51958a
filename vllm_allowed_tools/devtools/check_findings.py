"""One verdict per guarantee for a ``vllm serve`` command line, decided by the functions the server
runs at start-up (or, where the server decides per request, the ones it runs then).

Each ``*_finding`` function asks the start-up code, not a copy of it: vLLM's own validators
(:mod:`..vllm_glue.vllm_validation`), the middleware's start-up checks
(:func:`~..vllm_glue.capabilities.check_tool_parser`,
:func:`~..vllm_glue.capabilities.serving_capabilities`,
:func:`~..vllm_glue.served_template.check_tokenizer_mode`,
:func:`~..vllm_glue.served_template.choose_placement`), the registry's facts about the format
(:mod:`..formats`), and the grammar builder and compiler a constrained request goes through
(:func:`~..decode.grammar.build_structural_tag`, :class:`~..decode.masks.CompiledGrammars`). So
the check and the server cannot disagree. ``refused`` is what stops the server; ``warn`` is a
server that starts but does not hold everything (requests that fail, a limit of the format).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from ..errors import CapabilityError
from ..settings import PLAIN_CATALOG, Settings, SettingsError

Verdict = Literal["ok", "warn", "refused", "skipped"]

#: the guarantees, in the order they are reported, each with the words the report shows
GUARANTEES: Mapping[str, str] = {
    "tool_parser": "tool parser",
    "reasoning_parser": "reasoning parser",
    "tokenizer_mode": "tokenizer mode",
    "constraint_stage": "constraint stage",
    "placement": "policy placement",
    "format_limits": "format limits",
    "grammar": "grammar compile",
    "configuration": "configuration",
}


@dataclass(frozen=True)
class Finding:
    """The verdict on one guarantee, why, and the facts behind it (for ``--json``)."""
    guarantee: str
    verdict: Verdict
    reason: str
    details: Mapping[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"guarantee": self.guarantee, "verdict": self.verdict, "reason": self.reason,
                "details": dict(self.details)}


def _ok(guarantee: str, reason: str, **details: Any) -> Finding:
    return Finding(guarantee, "ok", reason, details)


def _warn(guarantee: str, reason: str, **details: Any) -> Finding:
    return Finding(guarantee, "warn", reason, details)


def _refused(guarantee: str, reason: str, **details: Any) -> Finding:
    return Finding(guarantee, "refused", reason, details)


def _skipped(guarantee: str, reason: str) -> Finding:
    return Finding(guarantee, "skipped", reason)


def _format(parser: str | None) -> Any:
    """The registry entry behind ``parser`` (ours or vLLM's name); None for a vouched parser."""
    from ..formats import wire_format
    try:
        return wire_format(parser or "")
    except ValueError:
        return None


def tool_parser_finding(settings: Settings, tokenizer: Any) -> Finding:
    """vLLM knows the parser, the middleware accepts it, and vLLM can build it with this tokenizer
    (with every marker the format's parser looks up held as one token)."""
    from ..vllm_glue.capabilities import check_tool_parser
    from ..vllm_glue.vllm_validation import tool_parser_failure, tool_parser_refusal
    parser = settings.launch.tool_call_parser or ""
    refusals = [why for why in (tool_parser_refusal(parser),) if why]
    try:
        check_tool_parser(parser, settings)
    except CapabilityError as exc:
        refusals.append(str(exc))
    if refusals:
        return _refused("tool_parser", "; ".join(refusals), parser=parser)
    entry = _format(parser)
    failure = tool_parser_failure(parser, tokenizer)
    if failure is not None:
        return _warn("tool_parser", f"the server starts, but every request with tools fails: vLLM "
                     f"cannot build {parser} with this tokenizer ({failure})", parser=parser)
    missing = [marker for marker in (entry.special_tokens if entry else ())
               if len(tokenizer.encode(marker, add_special_tokens=False)) != 1]
    if missing:
        return _warn("tool_parser", f"the tokenizer does not hold {missing} as single tokens; "
                     f"vLLM's {entry.name} parser looks each up in the vocabulary, so calls may not "
                     "be parsed", parser=parser, missing_tokens=missing)
    what = f"vLLM's {entry.name} parser under the allowed-tools policy" if entry else \
        "a parser vouched for in VLLM_ALLOWED_TOOLS_EXTRA_PARSERS"
    return _ok("tool_parser", f"{parser}: {what}; it builds with this tokenizer", parser=parser,
               wire_format=entry.name if entry else None)


def reasoning_parser_finding(settings: Settings, tokenizer: Any) -> Finding:
    """vLLM knows the reasoning parser and can build it with this tokenizer."""
    from ..vllm_glue.vllm_validation import reasoning_parser_failure, reasoning_parser_refusal
    parser = settings.launch.reasoning_parser
    if not parser:
        return _ok("reasoning_parser", "none: grammars apply from the first output token")
    refusal = reasoning_parser_refusal(parser)
    if refusal is not None:
        return _refused("reasoning_parser", refusal, parser=parser)
    failure = reasoning_parser_failure(parser, tokenizer)
    if failure is not None:
        return _warn("reasoning_parser", f"the server starts, but vLLM cannot build the {parser} "
                     f"reasoning parser with this tokenizer ({failure})", parser=parser)
    return _ok("reasoning_parser", f"{parser}: the allowed-subset grammar applies once reasoning "
               "ends, on both stages", parser=parser)


def tokenizer_mode_finding(settings: Settings) -> Finding:
    """vLLM knows the mode, and its prompts are rendered by a chat template the probe can read."""
    from ..vllm_glue.served_template import check_tokenizer_mode
    from ..vllm_glue.vllm_validation import tokenizer_mode_refusal
    mode = settings.launch.tokenizer_mode or "auto"
    refusal = tokenizer_mode_refusal(mode)
    if refusal is not None:
        return _refused("tokenizer_mode", refusal, mode=mode)
    try:
        check_tokenizer_mode(settings.launch)
    except CapabilityError as exc:
        return _refused("tokenizer_mode", str(exc), mode=mode)
    return _ok("tokenizer_mode", f"{mode}: vLLM has a tokenizer for it", mode=mode)


def constraint_stage_finding(settings: Settings) -> Finding:
    """vLLM accepts the backend, and a constraint stage can apply the grammar on this device."""
    from ..vllm_glue.capabilities import serving_capabilities
    from ..vllm_glue.vllm_validation import backend_refusal
    backend = settings.launch.structured_outputs_backend
    refusal = backend_refusal(backend)
    if refusal is not None:
        return _refused("constraint_stage", refusal, backend=backend)
    try:
        capabilities = serving_capabilities(settings)
    except CapabilityError as exc:
        return _refused("constraint_stage", str(exc), backend=backend)
    device = settings.target_device
    where = f"{Settings.variable('target_device')}={device}" if device else \
        "the device vLLM detects here"
    native_json = capabilities.json_schema_backend
    also = f"; JSON-schema grammars {native_json} compiles exactly stay on it" if native_json else ""
    return _ok("constraint_stage", f"the {capabilities.constraint_stage} stage applies the "
               f"allowed-subset grammar (backend {backend}, {where}){also}",
               stage=capabilities.constraint_stage, backend=backend, json_schema_backend=native_json)


def placement_finding(settings: Settings, served: Any) -> Finding:
    """The probe finds where the per-turn policy enters the served prompt after a stable prefix;
    a warning where a new user turn moves part of that prefix (reuse then holds within an agent
    loop only), and the reasoning a user turn drops said in the verdict's reason."""
    from ..request.placement import FILTER_CATALOG
    from ..vllm_glue.served_template import choose_placement
    try:
        choice = choose_placement(settings, load=lambda _launch: served)
    except CapabilityError as exc:
        return _refused("placement", str(exc))
    if choice.placement == FILTER_CATALOG:
        how = "as the operator asks" if settings.placement == FILTER_CATALOG \
            else "the fallback: no placement fits the template"
        return _warn("placement", f"filter-catalog ({how}): the model sees only the allowed tools, so "
                     "prompt-cache reuse breaks whenever the allowed subset changes",
                     placement=choice.placement, origin=choice.origin)
    notes = "; ".join(choice.notes)
    details = {"placement": choice.placement, "origin": choice.origin, "reuse_notes": choice.notes}
    if choice.probe is not None and choice.probe.user_turn:
        return _warn("placement", f"{choice.placement} in {choice.origin}: {notes}", **details)
    return _ok("placement", f"{choice.placement} in {choice.origin}: the policy follows a stable, "
               f"cacheable history{'; ' + notes if notes else ''}", **details)


def format_limits_finding(parser: str | None) -> Finding:
    """What the format's grammar can hold while decoding (registry facts, no computation)."""
    entry = _format(parser)
    if entry is None:
        return _skipped("format_limits", f"no wire format is registered for {parser}")
    spec = entry.grammar
    if not spec.holds_auto:
        return _warn("format_limits", f"{entry.name}'s auto turns get no grammar: a call outside "
                     "the allowed subset is dropped by the parser and refused by the output guard, "
                     "not prevented while decoding; required turns are a JSON array of allowed calls",
                     wire_format=entry.name, grammar_kind=spec.kind)
    one_line = "; arguments are written on one line" if spec.arguments_on_one_line else ""
    return _ok("format_limits", f"auto and required turns can call only the allowed tools while "
               f"decoding ({spec.kind} grammar){one_line}", wire_format=entry.name,
               grammar_kind=spec.kind)


#: the sample catalog whose allowed subset (the first two) is compiled: typed, nested, bounded
SAMPLE_CATALOG: tuple[tuple[str, dict[str, Any], bool | None], ...] = (
    ("get_weather", {"type": "object", "properties": {
        "city": {"type": "string", "minLength": 1},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city"], "additionalProperties": False}, True),
    ("search_docs", {"type": "object", "properties": {
        "query": {"type": "string"},
        "limit": {"type": "integer", "minimum": 1, "maximum": 50},
        "filters": {"type": "array", "items": {"type": "object", "properties": {
            "field": {"type": "string"}, "value": {"type": ["string", "number", "boolean"]}},
            "required": ["field", "value"]}}},
        "required": ["query"]}, True),
    ("send_email", {"type": "object", "properties": {"to": {"type": "string"}}}, None),
)


def grammar_finding(settings: Settings, tokenizer: Any, vocab_size: int) -> Finding:
    """The format's allowed-subset grammar for the sample catalog, both modes, built and compiled
    by xgrammar against this tokenizer as a constrained request's grammar is."""
    import xgrammar as xgr

    from ..decode.grammar import AllowedFunction, build_structural_tag, built
    from ..decode.masks import CompiledGrammars
    from ..decode.stage import GrammarText
    parser = settings.launch.tool_call_parser
    entry = _format(parser)
    if entry is None:
        return _skipped("grammar", f"no wire format is registered for {parser}")
    allowed = [AllowedFunction(name, schema, strict) for name, schema, strict in SAMPLE_CATALOG[:2]]
    started, compiled = time.monotonic(), []
    try:
        grammars = CompiledGrammars(xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size))
        for mode in ("required", "auto"):
            tag = build_structural_tag(entry.name, allowed, mode, parallel_tool_calls=True,
                                       max_whitespace=settings.whitespace_limit)
            if tag is not None:
                text = built(tag)
                grammars.get(GrammarText(tag_json=text.json, digest=text.digest))
                compiled.append(mode)
    except Exception as exc:  # noqa: BLE001 - xgrammar and the builders raise what they like
        return _warn("grammar", f"the server starts, but requests with allowed_tools fail: the "
                     f"{entry.name} grammar does not build or compile for this tokenizer "
                     f"({type(exc).__name__}: {exc})", wire_format=entry.name)
    seconds = time.monotonic() - started
    return _ok("grammar", f"the {' and '.join(compiled)} grammars of a {len(allowed)}-of-"
               f"{len(SAMPLE_CATALOG)} sample subset compile against this tokenizer ({vocab_size} "
               f"tokens) in {seconds:.2f} s", modes=compiled, vocab_size=vocab_size,
               seconds=round(seconds, 3))


def configuration_finding(settings: Settings, refusal: SettingsError | None = None) -> Finding:
    """The plugin's settings the server parses at start-up (every variable: a value it cannot use
    stops ``register()`` and the middleware, ``refusal``) and the approval policy file it loads."""
    from ..approvals import ENV_POLICY, PolicyFileError, load_policy
    if refusal is not None:
        return _refused("configuration", str(refusal), variables=list(refusal.variables))
    policy = settings.approval_policy
    if policy is not None:
        try:
            load_policy(policy)
        except PolicyFileError as exc:
            return _refused("configuration", f"{ENV_POLICY}: {exc}")
    approvals = f"approvals on ({policy}; its grant store is opened at start-up, not by this " \
        "check)" if policy else "approvals off"
    decoding = "can call only the request's own tools" if settings.plain_decoding == PLAIN_CATALOG \
        else "decode as vLLM decodes them (the output guard still refuses names outside the catalog)"
    return _ok("configuration", f"plain auto turns {decoding}; {approvals}",
               plain_decoding=settings.plain_decoding,
               approval_policy=str(policy) if policy is not None else None)
