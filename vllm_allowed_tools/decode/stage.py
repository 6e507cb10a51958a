"""Which constraint stage serves the allowed-tools grammar, and how a request carries its grammar to
the logits-processor stage (``SamplingParams.extra_args``, ``vllm_xargs`` on the wire, under the
keys of :mod:`..wire`; built by :func:`.split.constraint_extra_args`).

Light on purpose (no xgrammar, no torch): the settings read the stage names here at start-up in
every process. The masking itself is in :mod:`.masks`."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..settings import STAGE_AUTO, STAGE_ENV, STAGE_LOGITS_PROCESSOR, STAGE_NATIVE
from ..wire import (
    XARGS_CATALOG,
    XARGS_CATALOG_DIGEST,
    XARGS_DIGEST,
    XARGS_ENVELOPE,
    XARGS_ENVELOPE_DIGEST,
    XARGS_GRAMMAR_KEYS,
    XARGS_SPLIT_KEYS,
    XARGS_TAG,
    XARGS_TEXT_UTF8,
)


class ConstraintArgsError(ValueError):
    """Malformed constraint arguments on a request (reported as a 400 naming the key)."""


def choose_stage(requested: str, *, backend: str, backend_compiles_tags: bool, on_cpu: bool,
                 logits_processor_blocked: str | None) -> str:
    """Which stage serves the grammar, from the switch and what this server can run.

    ``auto`` (the default) takes the logits-processor stage where the native path cannot serve (a
    backend that cannot compile structural tags) or where ``benchmarks/constraint_stage.py``
    measured it faster (on CPU: ahead at batch 1, level at batch 16, 13x cheaper a step at 64 rows
    of a 150K vocabulary, and a new allowed subset of a known catalog compiles only its envelope
    there: docs/decode-path.md), and vLLM's native path everywhere else: on GPUs its masks are
    filled in the scheduler, overlapped with the forward pass, while ours run inside the step, and
    the CPU share of ours is no smaller (benchmarks/scale_rows.py, grammar only); GPU decode
    figures are unmeasured (benchmarks/gpu.sh makes them). The native path also works with
    speculative decoding and Model Runner V2. ``logits_processor_blocked`` says why vLLM would not run the processor
    (None: it would). Raises CapabilityError when the choice cannot enforce the allowlist."""
    from ..errors import CapabilityError
    if requested == STAGE_LOGITS_PROCESSOR or (requested == STAGE_AUTO and not backend_compiles_tags):
        if logits_processor_blocked is None:
            return STAGE_LOGITS_PROCESSOR
        if requested == STAGE_AUTO:
            raise CapabilityError(
                f"the {backend!r} structured-output backend cannot compile the structural tags "
                f"that constrain decoding to the allowed tools, and our logits processor cannot "
                f"stand in: {logits_processor_blocked}; start vLLM with "
                "--structured-outputs-config.backend xgrammar", capability="constraint_stage",
                status=500)
        raise CapabilityError(f"{STAGE_ENV}={STAGE_LOGITS_PROCESSOR} cannot be served: "
                              f"{logits_processor_blocked}; unset {STAGE_ENV} to use vLLM's native "
                              "structured-output path", capability="constraint_stage", status=500)
    if not backend_compiles_tags:
        raise CapabilityError(
            f"the {backend!r} structured-output backend cannot compile the structural tags that "
            "constrain decoding to the allowed tools; start vLLM with "
            "--structured-outputs-config.backend xgrammar (or auto), or let our logits processor "
            f"serve the grammar ({STAGE_ENV}=auto or {STAGE_LOGITS_PROCESSOR})",
            capability="structured_output_backend", status=500)
    if requested == STAGE_AUTO and on_cpu and logits_processor_blocked is None:
        return STAGE_LOGITS_PROCESSOR
    return STAGE_NATIVE


@dataclass(frozen=True)
class GrammarText:
    """A structural tag's JSON and the sha256 it claims (checked before it is ever compiled)."""
    tag_json: str
    digest: str


@dataclass(frozen=True)
class RequestGrammar(GrammarText):
    """The grammar a request is constrained with; ``catalog`` and ``envelope`` (both or neither)
    are the same grammar split in two (:mod:`.split`); ``utf8_text``: its free text may be held
    to valid UTF-8 (a policy turn: :data:`..wire.XARGS_TEXT_UTF8`)."""
    catalog: GrammarText | None = None
    envelope: GrammarText | None = None
    utf8_text: bool = False


def read_extra_args(extra_args: Mapping[str, Any] | None, *, verify: bool = True) -> RequestGrammar | None:
    """The request's grammar, None for an unconstrained request; raises ConstraintArgsError naming
    the key when the arguments are malformed. ``verify`` hashes the tag against its digest (done once
    per request at admission; the engine side skips it and :class:`CompiledGrammars` checks again
    whenever it compiles, so no grammar is ever cached under a digest it does not hash to)."""
    if not extra_args or not any(key in extra_args for key in XARGS_GRAMMAR_KEYS):
        return None
    whole = _grammar_text(extra_args, XARGS_TAG, XARGS_DIGEST, verify)
    utf8_text = extra_args.get(XARGS_TEXT_UTF8, 0)
    if utf8_text not in (0, 1) or isinstance(utf8_text, float):
        raise ConstraintArgsError(f"extra_args.{XARGS_TEXT_UTF8} must be 1 or absent")
    if not any(key in extra_args for key in XARGS_SPLIT_KEYS):
        return RequestGrammar(whole.tag_json, whole.digest, utf8_text=bool(utf8_text))
    return RequestGrammar(whole.tag_json, whole.digest,
                          catalog=_grammar_text(extra_args, XARGS_CATALOG, XARGS_CATALOG_DIGEST, verify),
                          envelope=_grammar_text(extra_args, XARGS_ENVELOPE, XARGS_ENVELOPE_DIGEST, verify),
                          utf8_text=bool(utf8_text))


def _grammar_text(extra_args: Mapping[str, Any], tag_key: str, digest_key: str, verify: bool) -> GrammarText:
    tag_json, digest = extra_args.get(tag_key), extra_args.get(digest_key)
    if not isinstance(tag_json, str) or not tag_json:
        raise ConstraintArgsError(f"extra_args.{tag_key} must be the structural tag's JSON text")
    if not isinstance(digest, str) or len(digest) != 64 or (verify and digest != tag_digest(tag_json)):
        raise ConstraintArgsError(f"extra_args.{digest_key} must be the sha256 of "
                                  f"extra_args.{tag_key}; build both with constraint_extra_args()")
    return GrammarText(tag_json=tag_json, digest=digest)



def tag_digest(tag_json: str) -> str:
    """The digest that travels next to a grammar in ``extra_args`` (here so no xgrammar is needed
    to check it)."""
    return hashlib.sha256(tag_json.encode("utf-8")).hexdigest()
