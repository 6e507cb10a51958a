"""A turn's grammar split in two, so a new allowed subset of a known catalog compiles little.

Agents change the allowed subset every turn; the catalog stays. The catalog's grammar (every tool,
argument schemas pinned as the turn pins them) is compiled once per catalog, off the request path;
each subset adds an envelope (only the allowed names, arguments unpinned) that is cheaper to compile.
A row whose two masks are intersected admits exactly what the subset's own grammar admits (names
from the envelope, arguments from the catalog; tests/test_subset_masks.py checks it). How the
logits-processor stage uses it, and why only there: docs/decode-path.md. No vLLM imports.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass

from ..formats import wire_format
from .grammar import STRICT_FUNCTION, STRICT_PARAMETER, AllowedFunction, BuiltTag, Mode, turn_tag
from ..wire import (
    XARGS_CATALOG,
    XARGS_CATALOG_DIGEST,
    XARGS_DIGEST,
    XARGS_ENVELOPE,
    XARGS_ENVELOPE_DIGEST,
    XARGS_TAG,
    XARGS_TEXT_UTF8,
)

logger = logging.getLogger(__name__)

#: grammar kinds whose language is "calls, each an allowed name with that tool's arguments", so the
#: catalog grammar intersected with the envelope is the subset's grammar (``code`` builders are
#: opaque: they keep the per-subset grammar)
SPLIT_KINDS = frozenset({"tags", "xgrammar", "json_array"})

#: stand-ins for the allowlist digest in the tag cache's key, so a split never shares an entry
#: with a turn's own tag
_CATALOG_KEY = "split:catalog"
_ENVELOPE_KEY = "split:envelope:"


@dataclass(frozen=True)
class SplitTags:
    """The catalog's grammar and the subset's envelope; their intersection is the subset's grammar."""
    catalog: BuiltTag
    envelope: BuiltTag

    def extra_args(self) -> dict[str, str]:
        """The request arguments that carry the split (next to the whole tag's)."""
        return {XARGS_CATALOG: self.catalog.json, XARGS_CATALOG_DIGEST: self.catalog.digest,
                XARGS_ENVELOPE: self.envelope.json, XARGS_ENVELOPE_DIGEST: self.envelope.digest}


def constraint_extra_args(tag: BuiltTag, split: SplitTags | None = None, *,
                          utf8_text: bool = False) -> dict[str, str | int]:
    """What to put in ``SamplingParams.extra_args`` (or a request's ``vllm_xargs``) so the
    logits-processor stage constrains the request with ``tag``; ``split`` (the same grammar as
    catalog + envelope, :func:`split_tags`) spares a new subset the compile of ``tag``;
    ``utf8_text``: the free text may be held to valid UTF-8, so a first-seen ``auto`` grammar
    starts at once on llguidance (:data:`..wire.XARGS_TEXT_UTF8`) instead of waiting for its
    compile."""
    return {XARGS_TAG: tag.json, XARGS_DIGEST: tag.digest, **(split.extra_args() if split else {}),
            **({XARGS_TEXT_UTF8: 1} if utf8_text else {})}


def split_tags(wire_format_name: str, catalog: Sequence[AllowedFunction],
               allowed: Sequence[AllowedFunction], *, catalog_digest: str, allowlist_digest: str,
               mode: Mode, parallel_tool_calls: bool, strict_level: int = STRICT_FUNCTION,
               max_whitespace: int | None = None) -> SplitTags | None:
    """The split of the turn's grammar (what :func:`.grammar.turn_tag` builds for ``allowed``);
    None where the format's grammar kind cannot be split or the mode has no grammar.

    Both halves are cached like turn tags. A ``tags`` format's catalog grammar is always the auto,
    parallel shape (free text, any number of calls), so every mode of a catalog shares one compile:
    the envelope carries the mode and ``parallel_tool_calls``."""
    spec = wire_format(wire_format_name).grammar
    kind = spec.kind
    if kind not in SPLIT_KINDS or (kind == "json_array" and (mode == "auto" or spec.call_syntax != "json")):
        return None   # a list's auto dispatch, or calls whose free arguments are no keywords
    catalog_mode, catalog_parallel = ("auto", True) if kind == "tags" else (mode, parallel_tool_calls)
    catalog_tag = turn_tag(wire_format_name, catalog, catalog_digest=catalog_digest,
                           allowlist_digest=_CATALOG_KEY, mode=catalog_mode,
                           parallel_tool_calls=catalog_parallel, strict_level=strict_level,
                           max_whitespace=max_whitespace)
    envelope = turn_tag(wire_format_name, [AllowedFunction(f.name, None, False) for f in allowed],
                        catalog_digest=catalog_digest, allowlist_digest=_ENVELOPE_KEY + allowlist_digest,
                        mode=mode, parallel_tool_calls=parallel_tool_calls,
                        strict_level=STRICT_FUNCTION, max_whitespace=max_whitespace)
    if catalog_tag is None or envelope is None:
        return None
    return SplitTags(catalog=catalog_tag, envelope=envelope)


def split_for_request(wire_format_name: str, enforced_tag_json: str, catalog: Sequence[AllowedFunction],
                      allowed: Sequence[AllowedFunction], *, catalog_digest: str, allowlist_digest: str,
                      mode: Mode, parallel_tool_calls: bool,
                      max_whitespace: int | None = None) -> SplitTags | None:
    """The split of the tag a request is already constrained with, or None: it is only offered when
    that tag is exactly the one :func:`.grammar.turn_tag` builds for this turn (at either strict
    level), so the split can never admit something the request's own grammar would not."""
    if not allowed:   # no allowlist grammar (an auto turn whose every tool needs approval)
        return None
    try:
        enforced = json.loads(enforced_tag_json)
    except ValueError:
        return None
    for level in (STRICT_FUNCTION, STRICT_PARAMETER):
        own = turn_tag(wire_format_name, allowed, catalog_digest=catalog_digest,
                       allowlist_digest=allowlist_digest, mode=mode,
                       parallel_tool_calls=parallel_tool_calls, strict_level=level,
                       max_whitespace=max_whitespace)
        if own is not None and json.loads(own.json) == enforced:
            try:   # a tool outside the subset may have a schema the builder refuses
                return split_tags(wire_format_name, catalog, allowed, catalog_digest=catalog_digest,
                                  allowlist_digest=allowlist_digest, mode=mode,
                                  parallel_tool_calls=parallel_tool_calls, strict_level=level,
                                  max_whitespace=max_whitespace)
            except Exception:   # the request keeps its own grammar, which enforces the same
                logger.warning("vllm-allowed-tools: no catalog grammar for this catalog; its turns "
                               "compile their own grammars", exc_info=True)
                return None
    return None
