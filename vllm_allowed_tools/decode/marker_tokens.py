"""Markers written as their one token: a post-pass over a built structural tag.

A format whose parser reads its markers by token id (gpt-oss: vLLM's ``HarmonyParser`` reads
harmony's ``<|start|>``, ``<|channel|>``, ``<|message|>``, ``<|constrain|>``, ``<|end|>`` through
``openai_harmony``) cannot take a marker spelled in ordinary tokens: a tag that matches markers as
text lets a model write ``<|start|>`` as ``<``, ``|``, ``start``, ... and the parser then reads no
message. :func:`with_marker_tokens` rewrites a built tag so each such marker is admitted only as its
token (xgrammar's ``token`` format, by id):

* a ``const_string`` that holds a marker becomes a ``sequence`` of its text and token pieces;
* a ``tag`` whose ``begin`` holds a marker becomes a ``sequence``: the begin's pieces up to its last
  marker, then a ``tag`` that begins with that marker's token (or with the text after it); an
  ``end`` that is one marker becomes its token, and a list of ends (a marker and ``""``, the stop) a
  tag per end under an ``or``;
* free text (``any_text``) inside such a tag excludes every marker's text, so neither the token nor
  its spelling can appear inside a message.

Ids, not strings: vLLM validates a request's structural tag without a tokenizer
(``Grammar.from_structural_tag``), which resolves no token string, so the registry gives each
marker's id in the format's fixed vocabulary (harmony's ``o200k_harmony``:
``grammars/openai.json``, ``marker_tokens``). Where the installed xgrammar has no ``token`` format
(:data:`TOKEN_FORMATS`), the tag is left as text. Both constraint stages compile the same JSON with
the served tokenizer. No vLLM imports.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import xgrammar.structural_tag as _structural_tag
from xgrammar import StructuralTag

#: the installed xgrammar has the ``token`` format (0.2.8 does; an older one leaves markers as text)
TOKEN_FORMATS: bool = hasattr(_structural_tag, "TokenFormat")


def with_marker_tokens(tag: StructuralTag | None, markers: Mapping[str, int | str]) -> StructuralTag | None:
    """``tag`` with every marker of ``markers`` (text -> token id) admitted only as its token;
    ``tag`` itself where there is nothing to rewrite or no ``token`` format. Idempotent."""
    if tag is None or not markers or not TOKEN_FORMATS:
        return tag
    return StructuralTag.model_validate(_Rewrite(markers).visit(tag.model_dump()))


class _Rewrite:
    def __init__(self, markers: Mapping[str, int | str]) -> None:
        self.markers = dict(markers)
        self.pattern = re.compile("|".join(re.escape(m) for m in sorted(self.markers, key=len, reverse=True)))

    def pieces(self, text: str) -> list[dict[str, Any]]:
        """``text`` as ``const_string`` and ``token`` nodes, in order (no empty piece)."""
        out: list[dict[str, Any]] = []
        position = 0
        for match in self.pattern.finditer(text):
            if match.start() > position:
                out.append({"type": "const_string", "value": text[position:match.start()]})
            out.append(self.token(match.group(0)))
            position = match.end()
        if position < len(text):
            out.append({"type": "const_string", "value": text[position:]})
        return out

    def token(self, marker: str) -> dict[str, Any]:
        return {"type": "token", "token": self.markers[marker]}

    @staticmethod
    def sequence(elements: list[dict[str, Any]]) -> dict[str, Any]:
        return elements[0] if len(elements) == 1 else {"type": "sequence", "elements": elements}

    def visit(self, node: Any, in_message: bool = False) -> Any:
        if isinstance(node, list):
            return [self.visit(item, in_message) for item in node]
        if not isinstance(node, dict):
            return node
        kind = node.get("type")
        if kind == "const_string" and self.pattern.search(node["value"]):
            return self.sequence(self.pieces(node["value"]))
        if kind == "any_text" and in_message:
            excludes = list(dict.fromkeys([*node.get("excludes", []), *self.markers]))
            return {**node, "excludes": excludes}
        if kind == "tag":
            return self.tag(node)
        return {key: self.visit(value, in_message) for key, value in node.items()}

    def tag(self, node: dict[str, Any]) -> dict[str, Any]:
        begin, end = node["begin"], node["end"]
        ends = end if isinstance(end, list) else [end]
        marked_begin = isinstance(begin, str) and self.pattern.search(begin) is not None
        marked_end = any(isinstance(e, str) and self.pattern.search(e) for e in ends)
        if not marked_begin and not marked_end:
            return {**node, "content": self.visit(node["content"])}
        content = self.visit(node["content"], in_message=True)
        prefix: list[dict[str, Any]] = []
        if marked_begin:
            prefix = self.pieces(begin)
            last = prefix.pop()
            begin = {"type": "token", "token": last["token"]} if last["type"] == "token" else last["value"]
        tags = [{**node, "begin": begin, "content": content, "end": self.end(e) if marked_end else end}
                for e in (ends if marked_end else [end])]
        inner = tags[0] if len(tags) == 1 else {"type": "or", "elements": tags}
        return self.sequence([*prefix, inner])

    def end(self, end: Any) -> Any:
        """One end: a marker alone becomes its token; text without a marker (``""``, the stop)
        stays; text around a marker cannot be a tag's end and stays text."""
        if isinstance(end, str) and end in self.markers:
            return self.token(end)
        return end
