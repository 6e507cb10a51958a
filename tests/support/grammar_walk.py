"""Random walks of an xgrammar matcher: strings a structural tag admits, spelled as a model could.

A model decoding under a grammar writes, token by token, any string the grammar admits: the
whitespace it allows, a marker as its one token or in pieces, any escape or number form JSON has.
The parser then has to read it. :class:`GrammarWalker` compiles a structural tag against a small
synthetic vocabulary (xgrammar ``TokenizerInfo`` over raw string tokens: every printable ASCII
character, space, ``\\n``, ``\\t``, ``\\r``, a few non-ASCII characters, and the format's markers and
markup strings and each of their characters, so each marker can be written both as one token and in
pieces; plus an end-of-sequence token) and walks it: fill the next-token bitmask, pick an allowed
token from a seeded :class:`random.Random`, accept it, until the matcher accepts the end-of-sequence
token.

:func:`.grammar_read.read_calls` is the other half: what a walked string *means* under the tag
(which call tag, which function, the exact text of its arguments), read from the tag's own
structure, not by any parser, so a test can compare it with what a parser reads.

xgrammar only (no vLLM import): ``vllm_allowed_tools.formats`` for a format's markers.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import xgrammar

from .grammar_read import WHITESPACE, grammar_style, tag_dict

#: the characters every walk vocabulary holds, one token each
ASCII_TOKENS: tuple[str, ...] = tuple(chr(code) for code in range(0x20, 0x7F)) + ("\n", "\t", "\r")
#: a few non-ASCII characters (2, 3 and 4 UTF-8 bytes; a no-break space)
NON_ASCII_TOKENS: tuple[str, ...] = ("é", "ß", "—", "中", "😀", "\u00a0")
#: the end-of-sequence token (a stop token of the synthetic vocabulary; never written as text)
EOS = "<|walk_eos|>"

#: markup inside the argument styles of xgrammar's ``json_schema`` format (not in the tag's JSON)
STYLE_MARKUP: dict[str, tuple[str, ...]] = {
    "qwen_xml": ("<parameter=", ">", "</parameter>"),
    "minimax_xml": ('<parameter name="', '">', "</parameter>"),
    "glm_xml": ("<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>"),
}
#: the tag fields that hold markup (never a schema)
_MARKUP_KEYS = ("begin", "end", "separator", "triggers", "value")
#: marker-looking pieces of a markup string: <|x|>, <｜x｜>, <x>, </x>, <x:y>, [X_Y]
_MARKER_RE = re.compile(r"<[|｜][^<>]*?[|｜]>|</?[A-Za-z_][A-Za-z0-9_:]*>|\[[A-Z_]+\]")


def markup_strings(tag: Any) -> list[str]:
    """Every markup string of a structural tag (``begin``, ``end``, ``separator``, ``triggers``,
    ``const_string`` values; never a schema's text), the markers inside them, and the markup of the
    argument styles it uses (``<parameter=`` ...), in first-seen order."""
    found: list[str] = []

    def add(text: str) -> None:
        if text and text not in found:
            found.append(text)

    def visit(node: Any) -> None:
        if isinstance(node, list):
            for item in node:
                visit(item)
            return
        if not isinstance(node, dict):
            return
        kind = node.get("type")
        if kind == "token" and isinstance(node.get("token"), str):
            add(node["token"])
            return
        if kind in ("json_schema", "grammar", "regex"):
            style = grammar_style(node["grammar"]) if kind == "grammar" else node.get("style", "")
            for text in STYLE_MARKUP.get(style, ()):
                add(text)
            return
        for key in _MARKUP_KEYS:
            value = node.get(key)
            for text in value if isinstance(value, list) else [value]:
                if isinstance(text, str):
                    add(text)
                    for marker in _MARKER_RE.findall(text):
                        add(marker)
        for key, value in node.items():
            if key not in _MARKUP_KEYS:
                visit(value)

    visit(tag_dict(tag))
    return found


def marker_texts(format_name: str) -> dict[int, str]:
    """A registered format's markers read by token id (its ``marker_tokens``): id -> text."""
    from vllm_allowed_tools.formats import wire_format
    return {token: marker for marker, token in wire_format(format_name).grammar.marker_tokens}


def tokens_by_text(tag: Any, texts: Mapping[int, str]) -> dict[str, Any]:
    """``tag`` (as a dict) with each ``token`` format's id replaced by its text in ``texts``, which
    a walk vocabulary resolves (an id of the model's vocabulary names nothing there)."""
    def visit(node: Any) -> Any:
        if isinstance(node, list):
            return [visit(item) for item in node]
        if not isinstance(node, dict):
            return node
        if node.get("type") == "token" and isinstance(node.get("token"), int) and node["token"] in texts:
            return {**node, "token": texts[node["token"]]}
        return {key: visit(value) for key, value in node.items()}
    return visit(tag_dict(tag))


def format_tokens(format_name: str, tag: Any) -> list[str]:
    """The extra walk tokens for a registered wire format: its ``special_tokens``, the markers it
    reads by token id and its ``call_triggers``, then the markup strings (and markers) of ``tag``."""
    from vllm_allowed_tools.formats import wire_format
    entry = wire_format(format_name)
    tokens: list[str] = []
    for text in (*entry.special_tokens, *marker_texts(format_name).values(), *entry.call_triggers,
                 *markup_strings(tag)):
        if text and text not in tokens:
            tokens.append(text)
    return tokens


def vocabulary(extra_tokens: Sequence[str]) -> list[str]:
    """The synthetic vocabulary: the single characters (with every character of ``extra_tokens``,
    so each can be spelled in pieces), ``extra_tokens``, then :data:`EOS`."""
    vocab: list[str] = []
    seen: set[str] = set()
    pieces = [char for token in extra_tokens for char in token]
    for token in (*ASCII_TOKENS, *NON_ASCII_TOKENS, *pieces, *extra_tokens):
        if token and token not in seen and token != EOS:
            seen.add(token)
            vocab.append(token)
    vocab.append(EOS)
    return vocab


@dataclass
class WalkPolicy:
    """How a walk picks among the allowed tokens.

    A step is *free* where the grammar allows most printable characters (inside a string, free
    text), *structural* elsewhere. ``pieces``: at a structural step a marker (a format's special
    token, ``<|x|>``, ``<x>``, ``[X]``) may be spelled in pieces, its first character instead of its
    token; without it the marker is written as its one token. ``markup_in_text``: at a free step a
    markup token (marker or markup string of the tag) may be written as part of the text (inside a
    string argument); without it markup is written only where it ends the free text (a closing tag).

    Before ``soft_limit`` tokens every candidate has weight 1, whitespace ``whitespace``, and a
    marker token ``marker``, and at a free step a token that closes the text (``"``, ``}``, ``]``)
    ``close``; from ``soft_limit`` on the walk heads for the end (but one step in ten picks as
    before): the end-of-sequence token when allowed, else (free steps) markup that ends the text,
    else a closing token (``"``, ``}``, ``]``, markup), else anything but whitespace and openers
    (``,``, ``{``, ``[``, ``\\``)."""
    soft_limit: int = 60
    whitespace: float = 0.3
    marker: float = 1.0
    close: float = 1.0
    pieces: bool = True
    markup_in_text: bool = True

    @classmethod
    def random(cls, rng: random.Random, *, pieces: bool = True, markup_in_text: bool = True) -> WalkPolicy:
        """A policy drawn per walk, so walks differ in length, whitespace, marker weight and how
        soon free text (a string) closes."""
        return cls(soft_limit=rng.choice((10, 30, 60, 120)),
                   whitespace=rng.choice((0.02, 0.3, 1.0)),
                   marker=rng.choice((0.5, 1.0, 4.0)), close=rng.choice((1.0, 10.0, 40.0)),
                   pieces=pieces, markup_in_text=markup_in_text)


_CLOSERS = frozenset('"}]')
_AVOID = frozenset(',{[\\') | WHITESPACE
#: a step is free when at least this many of the 95 printable ASCII characters are allowed
_FREE_PRINTABLE = 60


def is_marker(token: str) -> bool:
    """A marker-looking token (``<|x|>``, ``<｜x｜>``, ``<x>``, ``</x>``, ``<x:y>``, ``[X_Y]``)."""
    return bool(_MARKER_RE.fullmatch(token))


class WalkError(RuntimeError):
    """No walk reached the end within the limits (or the grammar left no token allowed)."""


class GrammarWalker:
    """A structural tag compiled against the synthetic vocabulary of ``extra_tokens``.

    ``markers``: the tokens that are markers (default: the multi-character ``extra_tokens`` that
    look like one, see :func:`is_marker`); every other multi-character token is markup.
    ``token_texts``: the text of each token id the tag's ``token`` formats name (a format's
    :func:`marker_texts`), walked as that token of the synthetic vocabulary."""

    def __init__(self, tag: Any, extra_tokens: Sequence[str], *, markers: Sequence[str] | None = None,
                 token_texts: Mapping[int, str] | None = None) -> None:
        self.tag_json = json.dumps(tokens_by_text(tag, token_texts)) if token_texts else \
            tag if isinstance(tag, str) else json.dumps(tag_dict(tag))
        self.vocab = vocabulary(extra_tokens)
        self.index = {token: i for i, token in enumerate(self.vocab)}
        self.eos_id = len(self.vocab) - 1
        marker_list = [t for t in extra_tokens if is_marker(t)] if markers is None else markers
        self.markers = frozenset(self.index[t] for t in marker_list if t in self.index and len(t) > 1)
        self.markup = frozenset(i for i, t in enumerate(self.vocab) if len(t) > 1 and i != self.eos_id)
        self._printable = frozenset(self.index[chr(code)] for code in range(0x20, 0x7F))
        self._closers = frozenset(self.index[t] for t in _CLOSERS)
        self._avoid = frozenset(i for i, t in enumerate(self.vocab) if t in _AVOID)
        self._whitespace = frozenset(i for i, t in enumerate(self.vocab) if t in WHITESPACE)
        info = xgrammar.TokenizerInfo(self.vocab, xgrammar.VocabType.RAW, stop_token_ids=[self.eos_id])
        self.compiled = xgrammar.GrammarCompiler(info, cache_enabled=False).compile_structural_tag(
            self.tag_json)
        self._bitmask = xgrammar.allocate_token_bitmask(1, len(self.vocab))

    # ------------------------------------------------------------------ walking
    def _allowed(self, matcher: xgrammar.GrammarMatcher) -> list[int]:
        matcher.fill_next_token_bitmask(self._bitmask)
        words = self._bitmask[0].tolist()
        return [i for i in range(len(self.vocab)) if (words[i >> 5] >> (i & 31)) & 1]

    def _free(self, allowed: Sequence[int]) -> bool:
        return sum(1 for i in allowed if i in self._printable) >= _FREE_PRINTABLE

    def _ends_text(self, matcher: xgrammar.GrammarMatcher, token: int) -> bool:
        """Writing ``token`` at a free step leaves free text (a closing tag, not text)."""
        probe = matcher.fork()
        return probe.accept_token(token) and not self._free(self._allowed(probe))

    def _pick(self, matcher: xgrammar.GrammarMatcher, allowed: list[int], steps: int,
              policy: WalkPolicy, rng: random.Random) -> int:
        free = self._free(allowed)
        candidates = allowed
        if not free and not policy.pieces:
            starts = {self.vocab[i][0] for i in allowed if i in self.markers}
            candidates = [i for i in allowed if len(self.vocab[i]) > 1 or self.vocab[i] not in starts] or allowed
        heading_for_the_end = steps >= policy.soft_limit and (rng.random() >= 0.1 or steps >= 2 * policy.soft_limit)
        if heading_for_the_end and self.eos_id in candidates:
            return self.eos_id
        refused: set[int] = set()
        while True:
            left = [i for i in candidates if i not in refused] or candidates
            token = self._choose(matcher, left, steps, policy, rng, free, heading_for_the_end)
            # at a free step, markup is written only where it ends the text (unless markup_in_text)
            if (not free or policy.markup_in_text or token not in self.markup or token in refused
                    or self._ends_text(matcher, token)):
                return token
            refused.add(token)

    def _choose(self, matcher: xgrammar.GrammarMatcher, candidates: list[int], steps: int,
                policy: WalkPolicy, rng: random.Random, free: bool, heading_for_the_end: bool) -> int:
        if heading_for_the_end:
            groups = [[i for i in candidates if i in self.markup and self._ends_text(matcher, i)]] if free else []
            groups += [[i for i in candidates if i in self._closers or (i in self.markup and not free)],
                       [i for i in candidates if i not in self._avoid], candidates]
            for group in groups:
                if group:
                    return rng.choice(group)
        weights = [0.0 if i == self.eos_id and steps < 3 and len(candidates) > 1 else
                   policy.whitespace if i in self._whitespace else
                   policy.marker if i in self.markers else
                   policy.close if free and i in self._closers else 1.0 for i in candidates]
        if not any(weights):
            weights = [1.0] * len(candidates)
        return rng.choices(candidates, weights)[0]

    def walk_tokens(self, rng: random.Random, *, policy: WalkPolicy | None = None, pieces: bool = True,
                    markup_in_text: bool = True, max_tokens: int = 600, tries: int = 20,
                    prefix: Sequence[str] = ()) -> tuple[str, ...]:
        """One walk: the tokens written (without the end-of-sequence token), starting with the
        tokens of ``prefix`` (which the grammar must admit). Each try draws its own policy (unless
        ``policy`` is given; ``pieces`` and ``markup_in_text`` go to the drawn one); a try longer
        than ``max_tokens`` is dropped."""
        for _ in range(tries):
            chosen = policy or WalkPolicy.random(rng, pieces=pieces, markup_in_text=markup_in_text)
            matcher = xgrammar.GrammarMatcher(self.compiled)
            for token in prefix:
                if not matcher.accept_token(self.index[token]):
                    raise WalkError(f"the grammar does not start with {''.join(prefix)!r}")
            written: list[str] = list(prefix)
            while len(written) <= max_tokens:
                allowed = self._allowed(matcher)
                if not allowed:
                    break
                token = self._pick(matcher, allowed, len(written), chosen, rng)
                if not matcher.accept_token(token):
                    raise WalkError(f"the matcher refused token {self.vocab[token]!r} its mask allowed")
                if token == self.eos_id:
                    if matcher.is_terminated():
                        return tuple(written)
                    break
                written.append(self.vocab[token])
        raise WalkError(f"no walk ended within {max_tokens} tokens in {tries} tries")

    def walk(self, rng: random.Random, **options: Any) -> str:
        return "".join(self.walk_tokens(rng, **options))

    def accepts(self, tokens: Sequence[str], *, masked: bool = False) -> bool:
        """The grammar admits exactly ``tokens`` followed by the end of sequence (``masked``: each
        token also in the matcher's mask before it, as a model decoding under the grammar sees it;
        xgrammar enforces a token budget, ``max_tokens``, only there)."""
        matcher = xgrammar.GrammarMatcher(self.compiled)
        for token in tokens:
            if token not in self.index or (masked and self.index[token] not in self._allowed(matcher)) \
                    or not matcher.accept_token(self.index[token]):
                return False
        return matcher.accept_token(self.eos_id) and matcher.is_terminated()

    def shrink(self, tokens: Sequence[str], fails: Callable[[tuple[str, ...]], bool],
               rounds: int = 4) -> tuple[str, ...]:
        """A shorter token sequence the grammar still admits and ``fails`` still holds for: drop
        runs of tokens (halving the run length down to one) while both hold, then try replacing
        each token by a simpler one (``a``, ``0``), again until nothing changes (``rounds`` at most)."""
        current = tuple(tokens)
        for _ in range(rounds):
            before = current
            size = max(1, len(current) // 2)
            while size >= 1:
                start = 0
                while start < len(current):
                    candidate = current[:start] + current[start + size:]
                    if self.accepts(candidate) and fails(candidate):
                        current = candidate
                    else:
                        start += 1
                size //= 2
            for position in range(len(current)):
                for simpler in ("a", "0"):
                    if current[position] in ("a", "0") or len(current[position]) > 1:
                        break
                    candidate = current[:position] + (simpler,) + current[position + 1:]
                    if self.accepts(candidate) and fails(candidate):
                        current = candidate
                        break
            if current == before:
                break
        return current


def walk(tag_json: str, extra_tokens: Sequence[str], rng: random.Random, **options: Any) -> str:
    """One string the structural tag admits (compiles the tag each call: use
    :class:`GrammarWalker` for many walks)."""
    return GrammarWalker(tag_json, extra_tokens).walk(rng, **options)
