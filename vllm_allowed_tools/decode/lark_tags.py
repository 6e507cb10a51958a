"""A structural tag as an llguidance Lark grammar: the same language, with no compile ahead.

xgrammar (vLLM 0.32/0.33 pin 0.2.8) precomputes a token-mask cache when it compiles a grammar, and
at a 150K vocabulary that takes 0.1-0.5 s a tool with free strings, more for a whole catalog
(docs/benchmarks.md, the compile cliff). llguidance computes each mask when it is asked for, from
a lexer and an Earley parser, so a matcher is ready in about a millisecond. The logits-processor
stage (:mod:`.compiled`) serves a policy turn's row whose grammar is not compiled yet with this
translation (an ``auto`` turn's free text then held to valid UTF-8: :func:`lark_grammar`),
while xgrammar compiles in the background, and moves the row onto xgrammar's matcher once it is
ready (the tokens so far replayed): the translation must admit exactly what the tag admits, which
``tests/test_lark_tags.py`` checks by walking both matchers over every format's grammars.

What is translated is what the plugin's builders produce (:mod:`.grammar`): ``const_string``,
``token``, ``regex``, ``grammar`` (xgrammar EBNF, its lookaheads dropped: they are performance
hints in the argument grammars, which a well-formed parse always satisfies), ``sequence``, ``or``,
``optional``, ``tag``, ``triggered_tags``, ``tags_with_separator`` and ``any_text`` (in a tag, where
the end closes it, or last, to the end of the output). Anything else raises
:class:`UntranslatableTag`, and the row waits for xgrammar's compile as before. No vLLM imports."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from .lark_ebnf import EbnfRules, UntranslatableTag, characters, contains_any, literal, regex

__all__ = ["UntranslatableTag", "lark_grammar"]


def lark_grammar(tag_json: str, *, free_text: bool = True, vllm_forms: bool = False) -> str:
    """The llguidance Lark grammar admitting what the structural tag ``tag_json`` admits.

    ``free_text=False`` refuses a tag with free text outside its calls (an ``auto`` turn's): there
    llguidance admits only text that is valid UTF-8 token by token, where xgrammar admits any token
    (a model may write a character's bytes in tokens that are not), so the text would not be what
    the model samples under xgrammar. (llguidance's ``allow_invalid_utf8`` option is no way out:
    1.7.6 then admits any token at a literal's start, special tokens in text included.)

    ``vllm_forms``: the forms of vLLM's own tags (a plain turn's; GLM's and MiniMax's) are
    translated too: ``star`` and ``plus``, and ``json_schema`` nodes as llguidance's JSON-schema
    grammar, whose whitespace and number forms are llguidance's, not xgrammar's: for vLLM's
    guidance backend, never for a row that moves onto xgrammar's matcher."""
    tag = json.loads(tag_json)
    node = tag.get("format", tag) if isinstance(tag, Mapping) else tag
    builder = _Builder(vllm_forms=vllm_forms)
    start = builder.node(node, last=True)
    if not free_text and builder.free_text:
        raise UntranslatableTag("free text outside the calls (an auto turn: llguidance admits only "
                                "valid UTF-8 there, xgrammar any token)")
    return "\n".join(["%llguidance {}", f"start: {start}", *builder.rules]) + "\n"


_TEXT_ANY = r"(?s:.*)"


class _Builder:
    """Rules of the translation, named in order (``r0``, ``r1``, ...)."""

    def __init__(self, *, vllm_forms: bool = False) -> None:
        self.vllm_forms = vllm_forms
        self.rules: list[str] = []
        self._count = 0
        #: free text outside any call (triggered tags' text, text to the end of the output)
        self.free_text = False

    def name(self, prefix: str = "r") -> str:
        self._count += 1
        return f"{prefix}{self._count}"

    def rule(self, body: str, attributes: str = "") -> str:
        name = self.name()
        self.rules.append(f"{name}{attributes}: {body}")
        return name

    def terminal(self, body: str) -> str:
        name = self.name("T")
        self.rules.append(f"{name}: {body}")
        return name

    def text(self, excludes: Sequence[str] = (), max_chars: int | None = None) -> str:
        """A terminal of free text holding none of ``excludes``."""
        body = regex(_TEXT_ANY if max_chars is None else f"(?s:.{{0,{int(max_chars)}}})")
        if excludes:
            body += " & ~" + regex(contains_any(excludes))
        return self.terminal(body)

    # ------------------------------------------------------------------ nodes
    def node(self, node: Any, *, last: bool = False) -> str:
        """An expression for ``node``; ``last``: nothing follows it (free text may run to the end)."""
        if not isinstance(node, Mapping):
            raise UntranslatableTag(f"a structural tag node must be an object, got {node!r}")
        kind = node.get("type")
        if kind == "const_string":
            return literal(node["value"])
        if kind == "token":
            return self.token(node)
        if kind == "regex":
            return regex(node["pattern"])
        if kind == "grammar":
            return EbnfRules(self).root(node["grammar"])
        if kind == "json_schema" and self.vllm_forms and node.get("style", "json") == "json":
            schema = node["json_schema"]
            if not isinstance(schema, (Mapping, bool)):
                raise UntranslatableTag("a json_schema node whose schema is not an object")
            return self.rule("%json " + json.dumps(schema))
        if kind in ("star", "plus") and self.vllm_forms:
            return "(" + self.node(node["content"]) + (")*" if kind == "star" else ")+")
        if kind == "sequence":
            elements = node["elements"]
            if not elements:
                return '""'
            parts = [self.node(e, last=last and i == len(elements) - 1) for i, e in enumerate(elements)]
            return "(" + " ".join(parts) + ")"
        if kind == "or":
            return "(" + " | ".join(self.node(e, last=last) for e in node["elements"]) + ")"
        if kind == "optional":
            return "(" + self.node(node["content"], last=last) + ")?"
        if kind == "tag":
            return self.tag(node, last=last)
        if kind == "any_text":
            if not last:
                raise UntranslatableTag("free text (any_text) that something follows, outside a tag")
            self.free_text = True
            return self.text_node(node)
        if kind == "triggered_tags":
            return self.triggered(node, last=last)
        if kind == "tags_with_separator":
            return self.separated(node)
        raise UntranslatableTag(f"structural tag format {kind!r} is not translated")

    def text_node(self, node: Mapping[str, Any]) -> str:
        text = self.text(node.get("excludes") or (), node.get("max_chars"))
        if node.get("max_tokens") is None:
            return text
        return self.rule(text, f"[max_tokens={int(node['max_tokens'])}]")

    def token(self, node: Mapping[str, Any]) -> str:
        token = node["token"]
        if isinstance(token, int) and not isinstance(token, bool):
            return f"<[{token}]>"
        raise UntranslatableTag("a token named by its text (token formats must carry the id)")

    def _edge(self, value: Any) -> tuple[str, list[str] | None]:
        """A tag's begin or end: (expression, its strings or None for a token)."""
        if isinstance(value, str):
            return literal(value), [value]
        if isinstance(value, list) and value and all(isinstance(v, str) for v in value):
            return "(" + " | ".join(literal(v) for v in value) + ")", list(value)
        if isinstance(value, Mapping) and value.get("type") == "token":
            return self.token(value), None
        raise UntranslatableTag(f"a tag edge {value!r}")

    def tag(self, node: Mapping[str, Any], *, begin: str | None = None, last: bool = False) -> str:
        """``begin content end``; ``begin`` overrides the node's (a trigger already written)."""
        begin_expr = begin if begin is not None else self._edge(node["begin"])[0]
        end_expr, end_strings = self._edge(node["end"])
        content = node["content"]
        if isinstance(content, Mapping) and content.get("type") == "any_text":
            if end_strings is not None and not any(end_strings):   # no end: text to the output's
                if not last:
                    raise UntranslatableTag("a tag of free text with an empty end that something follows")
                self.free_text = True   # an answer's text (harmony's final channel)
                return f"({begin_expr} {self.text_node(content)})"
            if end_strings is None:   # a special token: text can never spell it
                return f"({begin_expr} {self.text_node(content)} {end_expr})"
            if content.get("max_tokens") is not None:
                raise UntranslatableTag("free text bounded in tokens (any_text max_tokens) up to "
                                        "an end written as text")
            # the text runs to the first end (xgrammar's reading): one lazy lexeme, text and end
            text = self.text([*(content.get("excludes") or ()), *end_strings], content.get("max_chars"))
            return f"({begin_expr} {self.rule(f'{text} {end_expr}', '[lazy]')})"
        if isinstance(content, Mapping) and content.get("type") in ("grammar", "json_schema") and end_strings:
            # an argument grammar may end in a short lexeme (whitespace) that starts the end too:
            # llguidance's lexer gives no bytes back, so the end is written a character a lexeme
            end_expr = "(" + " | ".join(characters(text) for text in end_strings) + ")"
        return f"({begin_expr} {self.node(content)} {end_expr})"

    def triggered(self, node: Mapping[str, Any], *, last: bool) -> str:
        """Free text, a tag at each trigger (the trigger ends the text: one lazy lexeme), free text
        after it, as xgrammar reads ``at_least_one`` (no text before the first tag) and
        ``stop_after_first`` (nothing after the first tag)."""
        self.free_text = True
        triggers: list[str] = list(node["triggers"])
        tags = node["tags"]
        excludes = list(node.get("excludes") or ())
        text = self.text([*triggers, *excludes])
        entered: list[str] = []    # a tag reached from text: the text and its trigger, lazily
        direct: list[str] = []     # a tag written first, with no text before it
        for tag in tags:
            begin = tag.get("begin")
            if not isinstance(begin, str):
                raise UntranslatableTag("a triggered tag whose begin is not text")
            trigger = next((t for t in triggers if begin.startswith(t)), None)
            if trigger is None:
                raise UntranslatableTag(f"a tag begin {begin!r} that no trigger starts")
            lead = self.rule(f"{text} {literal(trigger)}", "[lazy]")
            rest = begin[len(trigger):]
            entered.append(self.tag(tag, begin=f"{lead} {literal(rest)}" if rest else lead))
            direct.append(self.tag(tag))
        any_entered = self.rule(" | ".join(entered))
        any_direct = self.rule(" | ".join(direct))
        at_least_one, stop_after_first = bool(node.get("at_least_one")), bool(node.get("stop_after_first"))
        if not last and not (at_least_one and stop_after_first):
            raise UntranslatableTag("triggered tags with free text that something follows")
        if at_least_one and stop_after_first:
            return any_direct
        if stop_after_first:
            return f"({text} | {any_entered})"
        if at_least_one:
            return f"({any_direct} {any_entered}* {text})"
        return f"({any_entered}* {text})"

    def separated(self, node: Mapping[str, Any]) -> str:
        one = self.rule(" | ".join(self.tag(tag) for tag in node["tags"]))
        if node.get("stop_after_first"):
            return one if node.get("at_least_one") else f"({one})?"
        many = f"{one} ({literal(node['separator'])} {one})*"
        return f"({many})" if node.get("at_least_one") else f"({many})?"
