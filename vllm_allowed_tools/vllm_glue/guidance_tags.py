"""vLLM's ``guidance`` structured-output backend compiles structural tags: each is translated into
the llguidance Lark grammar admitting the same language (:func:`..decode.lark_tags.lark_grammar`).

Why: on the native stage vLLM's xgrammar backend compiles a first-seen tag on the request's path
(0.4-0.9 s for a rich catalog at a 150K vocabulary, 20-33 s with string ``maxLength`` bounds:
docs/benchmarks.md), while llguidance computes each mask when asked, from a matcher made in
milliseconds. vLLM 0.32/0.33's guidance backend reads only the legacy ``structures``/``triggers``
form of a tag (any other is a 400), so a server started with ``--structured-outputs-config.backend
guidance`` could not serve the native stage at all; with this hook it does, with no compile
cliff, and also where our logits processor cannot run (speculative decoding, Model Runner V2).

The hook wraps two functions of ``vllm.v1.structured_output.backend_guidance``:

* ``serialize_guidance_grammar``, which the API server calls to validate a request: a tag in
  xgrammar's form (``{"type": "structural_tag", "format": ...}``) becomes its translation (cached
  by its text), so it validates; a tag outside the translation is a 400 naming
  ``structured_outputs.structural_tag``; everything else is vLLM's own;
* ``GuidanceBackend.compile_grammar``, which the engine calls to build a request's matcher: such a
  tag's matcher is made over the vocabulary as xgrammar reads it, the tokenizer of the same
  :class:`..decode.lazy_grammars.LazyGrammars` the logits-processor stage starts first-seen rows
  on, so for the plugin's own tags the native stage admits what the logits-processor stage's
  llguidance rows admit (``tests/test_lark_tags.py`` walks those against xgrammar). vLLM's own
  llguidance tokenizer marks every added token special, markers such as ``<tool_call>``
  included, so its matcher would force a marker's token and then refuse it.

The forms only vLLM's own tags use (a plain turn's: ``star``, ``plus``, ``json_schema`` arguments)
are translated here too (``vllm_forms``), the JSON schemas as llguidance's JSON grammar (its
whitespace and number forms, not xgrammar's).

In free text llguidance admits only tokens that keep the text valid UTF-8, where xgrammar admits
any token (docs/limits.md). The grammar ends on the tokenizer's end-of-sequence token, as vLLM's
guidance backend ends any grammar. :func:`install` runs from the plugin hook in every vLLM process
of a server started with that backend."""

from __future__ import annotations

import functools
import hashlib
import inspect
import json
import logging
import threading
from typing import Any

from ..decode.lark_tags import UntranslatableTag, lark_grammar
from ..decode.lru import LRU

logger = logging.getLogger(__name__)

_MODULE = "vllm.v1.structured_output.backend_guidance"
#: translations by the sha256 of the tag's text (the API server validates each request, the engine
#: translates again when it builds the matcher)
_TRANSLATIONS = LRU(256, 64 << 20)


def unsupported_reason() -> str | None:
    """Why this vLLM's guidance backend cannot take the hook (None: it can)."""
    try:
        import importlib
        module = importlib.import_module(_MODULE)
    except Exception as exc:  # noqa: BLE001 - no guidance backend in this vLLM
        return f"{_MODULE} is not importable ({exc.__class__.__name__})"
    function = getattr(module, "serialize_guidance_grammar", None)
    if function is None:
        return f"{_MODULE}.serialize_guidance_grammar is missing"
    compile_grammar = getattr(getattr(module, "GuidanceBackend", None), "compile_grammar", None)
    if compile_grammar is None or not hasattr(module, "GuidanceGrammar"):
        return f"{_MODULE}.GuidanceBackend.compile_grammar or GuidanceGrammar is missing"
    for name, shape, expected in (("serialize_guidance_grammar", function, ["request_type", "grammar_spec"]),
                                  ("GuidanceBackend.compile_grammar", compile_grammar,
                                   ["self", "request_type", "grammar_spec"])):
        names = list(inspect.signature(inspect.unwrap(shape)).parameters)
        if names[:len(expected)] != expected:
            return f"{_MODULE}.{name} takes {names}, not ({', '.join(expected)}, ...)"
    return None


def install() -> bool:
    """Wrap vLLM's guidance serializer and its backend's ``compile_grammar`` once (idempotent);
    False where this vLLM's differ from the ones read here (nothing is patched then, and the
    capability check refuses the native stage)."""
    if unsupported_reason() is not None:
        return False
    import importlib
    module = importlib.import_module(_MODULE)
    original = module.serialize_guidance_grammar
    if getattr(original, "__wrapped_by_allowed_tools__", False):
        return True
    from vllm.v1.structured_output.backend_types import StructuredOutputOptions

    @functools.wraps(original)
    def serialize_guidance_grammar(request_type: Any, grammar_spec: Any, *args: Any, **kwargs: Any) -> str:
        if request_type == StructuredOutputOptions.STRUCTURAL_TAG:
            lark = translated_tag(grammar_spec)
            if lark is not None:
                return lark
        return original(request_type, grammar_spec, *args, **kwargs)

    compile_original = module.GuidanceBackend.compile_grammar

    @functools.wraps(compile_original)
    def compile_grammar(self: Any, request_type: Any, grammar_spec: Any, *args: Any, **kwargs: Any) -> Any:
        lark = translated_tag(grammar_spec) if request_type == StructuredOutputOptions.STRUCTURAL_TAG else None
        if lark is None:
            return compile_original(self, request_type, grammar_spec, *args, **kwargs)
        grammars = _lazy_grammars(self)
        return module.GuidanceGrammar(ll_matcher=tag_matcher(grammars, lark),
                                      ll_tokenizer=grammars.tokenizer(), vocab_size=self.vocab_size)

    serialize_guidance_grammar.__wrapped_by_allowed_tools__ = True  # type: ignore[attr-defined]
    module.serialize_guidance_grammar = serialize_guidance_grammar
    module.GuidanceBackend.compile_grammar = compile_grammar
    return True


_BUILD_LOCK = threading.Lock()


def _lazy_grammars(backend: Any) -> Any:
    """The backend's :class:`LazyGrammars`, made at its first tag (its tokenizer is built in the
    background from then on: that first request waits for it, about 1 s at 150K tokens)."""
    with _BUILD_LOCK:
        grammars = backend.__dict__.get("_allowed_tools_grammars")
        if grammars is None:
            import xgrammar

            from ..decode.lazy_grammars import LazyGrammars
            tokenizer = backend.tokenizer
            info = xgrammar.TokenizerInfo.from_huggingface(
                tokenizer, vocab_size=max(backend.vocab_size, len(tokenizer)))
            grammars = backend.__dict__["_allowed_tools_grammars"] = LazyGrammars(info, tokenizer)
    return grammars


def tag_matcher(grammars: Any, lark: str) -> Any:
    """llguidance's matcher for a tag's translation ``lark`` over ``grammars``' tokenizer (the
    engine's side of the hook); vLLM's validation error where llguidance refuses it."""
    import llguidance
    try:
        matcher = llguidance.LLMatcher(grammars.tokenizer(), lark, log_level=0)
    except UntranslatableTag as refused:   # the tokenizer could not be built
        raise _refused(f"structured_outputs.structural_tag: {refused}") from refused
    if matcher.is_error():
        raise _refused(f"structured_outputs.structural_tag: llguidance refused its translation: "
                       f"{matcher.get_error()[:200]}")
    return matcher


def _refused(message: str) -> Exception:
    """vLLM's validation error (the request's 400) for ``message``."""
    from vllm.exceptions import VLLMValidationError
    return VLLMValidationError(message)


def _text(grammar_spec: str | dict[str, Any]) -> str:
    return grammar_spec if isinstance(grammar_spec, str) else json.dumps(grammar_spec)


def translated_tag(grammar_spec: str | dict[str, Any]) -> str | None:
    """The Lark grammar of a structural tag in xgrammar's form; None for the legacy form (vLLM's own
    reader takes it). Raises vLLM's validation error (a 400) for a tag outside the translation."""
    text = _text(grammar_spec)
    key = hashlib.sha256(text.encode("utf-8")).hexdigest()
    cached = _TRANSLATIONS.get(key)
    if cached is None:
        cached = _translate(text)
        _TRANSLATIONS.put(key, cached, len(str(cached)) + 64)
    if isinstance(cached, UntranslatableTag):
        raise _refused(f"structured_outputs.structural_tag cannot be served by the guidance backend: "
                       f"{cached}; start vLLM with --structured-outputs-config.backend xgrammar for "
                       "this tag")
    return cached or None


def _translate(text: str) -> str | UntranslatableTag:
    """The translation, '' for a legacy tag, or the reason it has none (kept: a repeated request is
    refused without translating again)."""
    try:
        data = json.loads(text)
    except ValueError:
        return UntranslatableTag("its text is not JSON")
    if isinstance(data, dict) and "structures" in data and "triggers" in data:
        return ""
    try:
        return lark_grammar(text, free_text=True, vllm_forms=True)
    except UntranslatableTag as refused:
        return refused
    except Exception as malformed:  # noqa: BLE001 - a client's tag: any failure is its 400, never a 500
        return UntranslatableTag(f"malformed ({malformed.__class__.__name__}: {str(malformed)[:200]})")
