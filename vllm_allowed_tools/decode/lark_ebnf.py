"""xgrammar's EBNF (the argument grammars of a structural tag) as llguidance Lark rules, for
:mod:`.lark_tags`: rule for rule, lookaheads dropped (hints a well-formed parse always satisfies),
``TagDispatch`` text as a left-recursive automaton, ``Regex(...)`` as a lexeme, and regular
right-recursive rules as one lexeme each (:mod:`.lark_regular`). No vLLM imports."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

from .lark_regular import RegularRules
from .safe_json import marker_automaton

__all__ = ["RULE_FOR_RULE", "EbnfRules", "UntranslatableTag", "characters", "contains_any", "literal",
           "regex"]

#: the first line of an EBNF grammar whose regular rules must not become one lexeme each: a
#: client's grammar (a custom tool's input), where a rule's text may run on in a way that also
#: starts what follows it (a class holding ``\`` before a ``\n`` in JSON's spelling), and
#: llguidance's lexer, which gives no bytes back, then refuses what xgrammar admits
#: (``tests/test_lark_custom.py`` found it); its rules are kept as rules
RULE_FOR_RULE = "# vllm-allowed-tools: translated rule for rule\n"


class UntranslatableTag(ValueError):
    """A structural tag holds something this translation does not cover (the row then uses
    xgrammar's compiled grammar)."""


def literal(text: str) -> str:
    return json.dumps(text, ensure_ascii=False) if text else '""'


def characters(text: str) -> str:
    """``text`` as one literal a character (no lexeme of it can swallow what follows)."""
    return "(" + " ".join(literal(char) for char in text) + ")" if len(text) > 1 else literal(text)


def contains_any(strings: Sequence[str]) -> str:
    """A regex matching text that holds one of ``strings``."""
    return "(?s:.*(" + "|".join(re.escape(s) for s in strings) + ").*)"


def regex(pattern: str) -> str:
    return "/" + pattern.replace("/", "\\/") + "/"


_EBNF_TOKEN = re.compile(r"""
    (?P<space>\s+|\#[^\n]*)
  | (?P<define>::=)
  | (?P<name>[A-Za-z_][A-Za-z0-9_.\-]*)
  | (?P<string>"(?:[^"\\]|\\.)*")
  | (?P<cls>\[(?:[^\]\\]|\\.)*\])
  | (?P<repeat>\{\s*\d+\s*(?:,\s*(?:-1|\d*)\s*)?\})
  | (?P<look>\(=)
  | (?P<punct>[()|*+?])
""", re.VERBOSE)

_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "\\": "\\", '"': '"', "'": "'", "[": "[", "]": "]",
            "-": "-", "^": "^", "/": "/", "b": "\b", "f": "\f", "v": "\v", "0": "\0", "e": "\x1b"}


def _unescape(body: str) -> list[str]:
    """The characters of an EBNF string or class body (escapes decoded); a class's ``-`` between
    two characters stays the string ``"-"`` marked by position, so callers see ranges."""
    out: list[str] = []
    i = 0
    while i < len(body):
        c = body[i]
        if c != "\\":
            out.append(c)
            i += 1
            continue
        nxt = body[i + 1] if i + 1 < len(body) else ""
        if nxt in ("u", "x", "U"):
            width = {"x": 2, "u": 4, "U": 8}[nxt]
            digits = body[i + 2:i + 2 + width]
            if len(digits) != width or not all(d in "0123456789abcdefABCDEF" for d in digits):
                raise UntranslatableTag(f"an EBNF escape \\{nxt}{digits}")
            out.append(chr(int(digits, 16)))
            i += 2 + width
            continue
        if nxt not in _ESCAPES and (not nxt or nxt.isalnum()):
            raise UntranslatableTag(f"an EBNF escape \\{nxt}")
        out.append("\x00ESC" + _ESCAPES.get(nxt, nxt))   # punctuation escaped: itself   # an escaped character (never a range dash)
        i += 2
    return out


def _char(c: str) -> str:
    return c[4:] if c.startswith("\x00ESC") else c


def _class_regex(body: str) -> str:
    """An EBNF character class as a regex class, every character written as ``\\x{..}``."""
    negated = body.startswith("^")
    chars = _unescape(body[1:] if negated else body)
    parts: list[str] = []
    i = 0
    while i < len(chars):
        if i + 2 < len(chars) and chars[i + 1] == "-":
            parts.append(f"\\x{{{ord(_char(chars[i])):x}}}-\\x{{{ord(_char(chars[i + 2])):x}}}")
            i += 3
        else:
            parts.append(f"\\x{{{ord(_char(chars[i])):x}}}")
            i += 1
    if not parts:
        return "/(?s:.)/" if negated else '""'
    return "/[" + ("^" if negated else "") + "".join(parts) + "]/"


#: xgrammar's ``TagDispatch`` with no tags, only excludes (free text in the XML argument styles)
_DISPATCH_TEXT = re.compile(r'TagDispatch\(\s*loop_after_dispatch\s*=\s*false\s*,\s*'
                            r'excludes\s*=\s*\((?P<excludes>(?:\s*"(?:[^"\\]|\\.)*"\s*,?)*)\)\s*\)')


#: xgrammar's ``Regex("pattern")`` / ``Regex("pattern", json_string=true)`` (JSON schema patterns)
_REGEX_CALL = re.compile(r'Regex\(\s*"(?P<pattern>(?:[^"\\]|\\.)*)"\s*'
                         r'(?:,\s*json_string\s*=\s*(?P<json>true|false)\s*)?\)')


def _repeat(suffix: str) -> str:
    """An EBNF repetition suffix in Lark (xgrammar writes an unbounded ``{m,}`` as ``{m, -1}``)."""
    suffix = re.sub(r"\s", "", suffix)
    return {"{0,-1}": "*", "{1,-1}": "+"}.get(suffix, suffix.replace(",-1}", ",}"))


class EbnfRules:
    """xgrammar EBNF text as rules of the builder (names prefixed so grammars never collide)."""

    def __init__(self, builder: _Builder) -> None:
        self.builder = builder
        self.prefix = builder.name("g") + "_"
        #: strings are written one character a lexeme (a grammar with excluding text: see
        #: :meth:`_dispatch_text`)
        self.char_level = False
        #: placeholder name -> its Lark expression (:meth:`_regex_call`)
        self.raw: dict[str, str] = {}
        self._names: dict[str, str] = {}

    def _regex_call(self, match: re.Match[str]) -> str:
        """xgrammar's ``Regex("p")`` (a JSON schema ``pattern``; ``json_string=true``: the value of
        a JSON string, its quotes outside): a lexeme of the regex, a string value's also held to
        what a JSON string holds unescaped (escapes are not written for it)."""
        pattern = match.group("pattern").replace('\\"', '"')   # the regex as written, quotes escaped
        body = regex(pattern.removeprefix("^").removesuffix("$"))
        if match.group("json") == "true":
            body += " & " + regex(r'[^"\\\x00-\x1f]*')
        name = self.builder.name("x")
        self.raw[name] = self.builder.terminal(body)
        return name

    def _dispatch_text(self, match: re.Match[str]) -> str:
        """xgrammar's ``TagDispatch`` with no tags: text holding none of its excludes, ended by
        what follows it (an exclude). One lexeme for that text would swallow the start of the
        closing string (llguidance's lexer does not give bytes back), so the text is an automaton
        over single characters (Aho-Corasick: its states the excludes' prefixes written so far),
        and the grammar's strings are written one character at a time, so no lexeme spans one. The
        automaton is :mod:`.safe_json`'s, which keeps markers out of JSON strings the same way."""
        excludes = [bytes(body, "utf-8").decode("unicode_escape") if "\\" in body else body
                    for body in re.findall(r'"((?:[^"\\]|\\.)*)"', match.group("excludes"))]
        if not excludes or any(not e for e in excludes):
            raise UntranslatableTag("a TagDispatch text without excludes")
        self.char_level = True
        name = self.builder.name("d")
        automaton = marker_automaton(tuple(excludes))
        alphabet = sorted(automaton.alphabet)
        # left-recursive rules (Earley keeps a constant number of items a character on them):
        # name_s is text whose automaton ends in state s; the text is any live state
        other = "/[^" + "".join(f"\\x{{{char:x}}}" for char in alphabet) + "]/"
        live = [state for state in range(len(automaton.goto)) if state not in automaton.dead]
        into: dict[int, list[str]] = {state: [] for state in live}
        into[0].append('""')
        for state in live:
            into[0].append(f"{name}_{state} {other}")
            for char in alphabet:
                target = automaton.step(state, char)
                if target not in automaton.dead:
                    into[target].append(f"{name}_{state} {literal(chr(char))}")
        for state in live:
            self.builder.rules.append(f"{name}_{state}: " + " | ".join(into[state]))
        self.builder.rules.append(f"{name}: " + " | ".join(f"{name}_{state}" for state in live))
        return name

    def root(self, text: str) -> str:
        text = _DISPATCH_TEXT.sub(self._dispatch_text, text)
        text = _REGEX_CALL.sub(self._regex_call, text)
        tokens = self._tokens(text)
        rules: dict[str, list[tuple[str, str]]] = {}
        i = 0
        while i < len(tokens):
            kind, value = tokens[i]
            if kind != "name" or i + 1 >= len(tokens) or tokens[i + 1][0] != "define":
                raise UntranslatableTag(f"EBNF: expected a rule definition at {value!r}")
            j = i + 2
            while j < len(tokens) and not (tokens[j][0] == "name" and j + 1 < len(tokens)
                                           and tokens[j + 1][0] == "define"):
                j += 1
            rules[value] = tokens[i + 2:j]
            i = j
        if "root" not in rules:
            raise UntranslatableTag("EBNF without a root rule")
        trees: dict[str, Any] = {}
        for name, body in rules.items():
            tree, rest = self._parse_alternatives(body, 0, rules)
            if rest != len(body):
                raise UntranslatableTag(f"EBNF: unexpected {body[rest][1]!r} in rule {name}")
            trees[name] = tree
        self.lexemes = {} if text.startswith(RULE_FOR_RULE) else RegularRules(trees).lexemes()
        for name, tree in trees.items():
            if name in self.lexemes:
                self.builder.rules.append(f"{self._name(name).upper()}: /{self.lexemes[name]}/")
            else:
                self.builder.rules.append(f"{self._name(name)}: {self._lark(tree)}")
        return self._ref("root")

    def _ref(self, name: str) -> str:
        return self._name(name).upper() if name in self.lexemes else self._name(name)

    def _lark(self, node: Any) -> str:
        kind = node[0]
        if kind == "str":
            return characters(node[1]) if self.char_level else literal(node[1])
        if kind == "cls":
            return node[1]
        if kind == "ref":
            return self._ref(node[1])
        if kind == "dispatch":
            return node[1]
        if kind == "rep":
            return f"({self._lark(node[1])}){node[2]}"
        parts = [self._lark(child) for child in node[1]]
        if not parts:
            return '""'
        if len(parts) == 1:
            return parts[0]
        return "(" + (" | " if kind == "alt" else " ").join(parts) + ")"

    def _name(self, name: str) -> str:
        """The Lark name of EBNF rule ``name``: lowercased for Lark, numbered so that no two rules
        share one (``aB`` and ``Ab`` lowercase alike)."""
        if name not in self._names:
            self._names[name] = f"{self.prefix}{re.sub(r'[^a-z0-9_]', '_', name.lower())}_{len(self._names)}"
        return self._names[name]

    @staticmethod
    def _tokens(text: str) -> list[tuple[str, str]]:
        tokens: list[tuple[str, str]] = []
        position = 0
        while position < len(text):
            match = _EBNF_TOKEN.match(text, position)
            if match is None:
                raise UntranslatableTag(f"EBNF: cannot read {text[position:position + 20]!r}")
            position = match.end()
            kind = match.lastgroup or ""
            if kind != "space":
                tokens.append((kind, match.group()))
        return tokens

    def _parse_alternatives(self, body: list[tuple[str, str]], i: int,
                            rules: Mapping[str, Any]) -> tuple[Any, int]:
        options: list[Any] = []
        while True:
            sequence, i = self._parse_sequence(body, i, rules)
            options.append(sequence)
            if i < len(body) and body[i] == ("punct", "|"):
                i += 1
                continue
            return ("alt", options), i

    def _parse_sequence(self, body: list[tuple[str, str]], i: int,
                        rules: Mapping[str, Any]) -> tuple[Any, int]:
        items: list[Any] = []
        while i < len(body) and body[i] not in (("punct", "|"), ("punct", ")")):
            kind, value = body[i]
            if kind == "look":   # a lookahead: a hint that a well-formed parse always satisfies
                depth, i = 1, i + 1
                while i < len(body) and depth:
                    depth += {("punct", ")"): -1, ("punct", "("): 1, ("look", "(="): 1}.get(body[i], 0)
                    i += 1
                continue
            if kind == "string":
                item: Any = ("str", "".join(_char(c) for c in _unescape(value[1:-1])))
                i += 1
            elif kind == "cls":
                item, i = ("cls", _class_regex(value[1:-1])), i + 1
            elif kind == "name" and re.fullmatch(r"d\d+", value) \
                    and value not in rules:   # a dispatch text's automaton (:meth:`_dispatch_text`)
                item, i = ("dispatch", value), i + 1
            elif kind == "name" and value in self.raw and value not in rules:   # a Regex(...)
                item, i = ("dispatch", self.raw[value]), i + 1
            elif kind == "name":
                if value not in rules:
                    raise UntranslatableTag(f"EBNF: rule {value!r} is not defined")
                item, i = ("ref", value), i + 1
            elif (kind, value) == ("punct", "("):
                item, i = self._parse_alternatives(body, i + 1, rules)
                if i >= len(body) or body[i] != ("punct", ")"):
                    raise UntranslatableTag("EBNF: unbalanced parentheses")
                i += 1
            else:
                raise UntranslatableTag(f"EBNF: unexpected {value!r}")
            while i < len(body) and (body[i][0] == "repeat" or body[i] in
                                     (("punct", "*"), ("punct", "+"), ("punct", "?"))):
                item, i = ("rep", item, _repeat(body[i][1])), i + 1
            items.append(item)
        return ("seq", items), i
