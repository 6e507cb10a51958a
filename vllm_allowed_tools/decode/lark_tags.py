"""A structural tag as an llguidance Lark grammar: the same language, with no compile ahead.

xgrammar (vLLM 0.32/0.33 pin 0.2.8) precomputes a token-mask cache when it compiles a grammar, and
at a 150K vocabulary that takes 0.1-0.5 s a tool with free strings, more for a whole catalog
(docs/benchmarks.md, the compile cliff). llguidance computes each mask when it is asked for, from
a lexer and an Earley parser, so a matcher is ready in about a millisecond. The logits-processor
stage (:mod:`.compiled`) serves a row whose grammar is not compiled yet with this translation,
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
import re
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["UntranslatableTag", "lark_grammar"]


class UntranslatableTag(ValueError):
    """A structural tag holds something this translation does not cover (the row then uses
    xgrammar's compiled grammar)."""


def lark_grammar(tag_json: str) -> str:
    """The llguidance Lark grammar admitting what the structural tag ``tag_json`` admits."""
    tag = json.loads(tag_json)
    node = tag.get("format", tag) if isinstance(tag, Mapping) else tag
    builder = _Builder()
    start = builder.node(node, last=True)
    return "\n".join(["%llguidance {}", f"start: {start}", *builder.rules]) + "\n"


_TEXT_ANY = r"(?s:.*)"


def _literal(text: str) -> str:
    return json.dumps(text, ensure_ascii=False) if text else '""'


def _characters(text: str) -> str:
    """``text`` as one literal a character (no lexeme of it can swallow what follows)."""
    return "(" + " ".join(_literal(char) for char in text) + ")" if len(text) > 1 else _literal(text)


def _contains_any(strings: Sequence[str]) -> str:
    """A regex matching text that holds one of ``strings``."""
    return "(?s:.*(" + "|".join(re.escape(s) for s in strings) + ").*)"


def _regex(pattern: str) -> str:
    return "/" + pattern.replace("/", "\\/") + "/"


class _Builder:
    """Rules of the translation, named in order (``r0``, ``r1``, ...)."""

    def __init__(self) -> None:
        self.rules: list[str] = []
        self._count = 0

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
        body = _regex(_TEXT_ANY if max_chars is None else f"(?s:.{{0,{int(max_chars)}}})")
        if excludes:
            body += " & ~" + _regex(_contains_any(excludes))
        return self.terminal(body)

    # ------------------------------------------------------------------ nodes
    def node(self, node: Any, *, last: bool = False) -> str:
        """An expression for ``node``; ``last``: nothing follows it (free text may run to the end)."""
        if not isinstance(node, Mapping):
            raise UntranslatableTag(f"a structural tag node must be an object, got {node!r}")
        kind = node.get("type")
        if kind == "const_string":
            return _literal(node["value"])
        if kind == "token":
            return self.token(node)
        if kind == "regex":
            return _regex(node["pattern"])
        if kind == "grammar":
            return _Ebnf(self).root(node["grammar"])
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
            return self.free_text(node)
        if kind == "triggered_tags":
            return self.triggered(node, last=last)
        if kind == "tags_with_separator":
            return self.separated(node)
        raise UntranslatableTag(f"structural tag format {kind!r} is not translated")

    def free_text(self, node: Mapping[str, Any]) -> str:
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
            return _literal(value), [value]
        if isinstance(value, list) and value and all(isinstance(v, str) for v in value):
            return "(" + " | ".join(_literal(v) for v in value) + ")", list(value)
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
                return f"({begin_expr} {self.free_text(content)})"
            if end_strings is None:   # a special token: text can never spell it
                return f"({begin_expr} {self.free_text(content)} {end_expr})"
            if content.get("max_tokens") is not None:
                raise UntranslatableTag("free text bounded in tokens (any_text max_tokens) up to "
                                        "an end written as text")
            # the text runs to the first end (xgrammar's reading): one lazy lexeme, text and end
            text = self.text([*(content.get("excludes") or ()), *end_strings], content.get("max_chars"))
            return f"({begin_expr} {self.rule(f'{text} {end_expr}', '[lazy]')})"
        if isinstance(content, Mapping) and content.get("type") == "grammar" and end_strings:
            # an argument grammar may end in a short lexeme (whitespace) that starts the end too:
            # llguidance's lexer gives no bytes back, so the end is written a character a lexeme
            end_expr = "(" + " | ".join(_characters(text) for text in end_strings) + ")"
        return f"({begin_expr} {self.node(content)} {end_expr})"

    def triggered(self, node: Mapping[str, Any], *, last: bool) -> str:
        """Free text, a tag at each trigger (the trigger ends the text: one lazy lexeme), free text
        after it, as xgrammar reads ``at_least_one`` (no text before the first tag) and
        ``stop_after_first`` (nothing after the first tag)."""
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
            lead = self.rule(f"{text} {_literal(trigger)}", "[lazy]")
            rest = begin[len(trigger):]
            entered.append(self.tag(tag, begin=f"{lead} {_literal(rest)}" if rest else lead))
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
        many = f"{one} ({_literal(node['separator'])} {one})*"
        return f"({many})" if node.get("at_least_one") else f"({many})?"


# ---------------------------------------------------------------------- xgrammar EBNF
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


class _Ebnf:
    """xgrammar EBNF text as rules of the builder (names prefixed so grammars never collide)."""

    def __init__(self, builder: _Builder) -> None:
        self.builder = builder
        self.prefix = builder.name("g") + "_"
        #: strings are written one character a lexeme (a grammar with excluding text: see
        #: :meth:`_dispatch_text`)
        self.char_level = False
        #: placeholder name -> its Lark expression (:meth:`_regex_call`)
        self.raw: dict[str, str] = {}

    def _regex_call(self, match: re.Match[str]) -> str:
        """xgrammar's ``Regex("p")`` (a JSON schema ``pattern``; ``json_string=true``: the value of
        a JSON string, its quotes outside): a lexeme of the regex, a string value's also held to
        what a JSON string holds unescaped (escapes are not written for it)."""
        pattern = match.group("pattern").replace('\\"', '"')   # the regex as written, quotes escaped
        body = _regex(pattern.removeprefix("^").removesuffix("$"))
        if match.group("json") == "true":
            body += " & " + _regex(r'[^"\\\x00-\x1f]*')
        name = self.builder.name("x")
        self.raw[name] = self.builder.terminal(body)
        return name

    def _dispatch_text(self, match: re.Match[str]) -> str:
        """xgrammar's ``TagDispatch`` with no tags: text holding none of its excludes, ended by
        what follows it (an exclude). One lexeme for that text would swallow the start of the
        closing string (llguidance's lexer does not give bytes back), so the text is an automaton
        over single characters (Aho-Corasick: its states the excludes' prefixes written so far),
        and the grammar's strings are written one character at a time, so no lexeme spans one."""
        excludes = [bytes(body, "utf-8").decode("unicode_escape") if "\\" in body else body
                    for body in re.findall(r'"((?:[^"\\]|\\.)*)"', match.group("excludes"))]
        if not excludes or any(not e for e in excludes):
            raise UntranslatableTag("a TagDispatch text without excludes")
        self.char_level = True
        name = self.builder.name("d")
        # the trie of the excludes: state -> {char: state}; a state that spells a whole exclude is dead
        children: list[dict[str, int]] = [{}]
        dead = [False]
        for exclude in excludes:
            state = 0
            for char in exclude:
                if char not in children[state]:
                    children.append({})
                    dead.append(False)
                    children[state][char] = len(children) - 1
                state = children[state][char]
            dead[state] = True
        fail = [0] * len(children)
        order = list(children[0].values())
        for state in order:   # breadth first: a state's failure link is shorter than it
            for char, child in children[state].items():
                link = fail[state]
                while link and char not in children[link]:
                    link = fail[link]
                fail[child] = children[link].get(char, 0) if children[link].get(char, 0) != child else 0
                dead[child] = dead[child] or dead[fail[child]]
                order.append(child)
        alphabet = sorted({char for exclude in excludes for char in exclude})

        def step(state: int, char: str) -> int:
            while state and char not in children[state]:
                state = fail[state]
            return children[state].get(char, 0)

        # left-recursive rules (Earley keeps a constant number of items a character on them):
        # name_s is text whose automaton ends in state s; the text is any live state
        other = "/[^" + "".join(f"\\x{{{ord(c):x}}}" for c in alphabet) + "]/"
        live = [state for state in range(len(children)) if not dead[state]]
        into: dict[int, list[str]] = {state: [] for state in live}
        into[0].append('""')
        for state in live:
            into[0].append(f"{name}_{state} {other}")
            for char in alphabet:
                target = step(state, char)
                if not dead[target]:
                    into[target].append(f"{name}_{state} {_literal(char)}")
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
        self.lexemes = _RegularRules(trees).lexemes()
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
            return _characters(node[1]) if self.char_level else _literal(node[1])
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
        return self.prefix + re.sub(r"[^a-z0-9_]", "_", name.lower()) + "_" + format(
            sum(ord(c) for c in name) % 997, "x")

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


class _NotRegular(Exception):
    """A rule's language is not written as a regex here (it stays a grammar rule)."""


class _RegularRules:
    """Right-recursive EBNF rules that are regular (``q0 ::= [^"\\] q0 | qr`` spelling a JSON
    string one character a rule) as one regex each: llguidance's Earley parser keeps an item a
    character for each open right recursion, and stops a row past 2,000 (a long string argument),
    while a lexeme's regex costs nothing a character. A group of mutually recursive rules is
    regular when every alternative is terminals, then at most one rule of the group at its end;
    its equations ``X = a X' | b`` are solved by elimination (Arden's rule)."""

    def __init__(self, trees: Mapping[str, Any]) -> None:
        self.trees = trees
        self.refs = {name: set(self._refs(tree)) for name, tree in trees.items()}

    def _refs(self, node: Any) -> Any:
        if node[0] == "ref":
            yield node[1]
        elif node[0] in ("alt", "seq"):
            for child in node[1]:
                yield from self._refs(child)
        elif node[0] == "rep":
            yield from self._refs(node[1])

    def _reach(self, name: str) -> set[str]:
        seen: set[str] = set()
        stack = [name]
        while stack:
            for ref in self.refs[stack.pop()]:
                if ref not in seen:
                    seen.add(ref)
                    stack.append(ref)
        return seen

    def lexemes(self) -> dict[str, str]:
        """Rule -> regex, for each rule of a regular recursive group referenced from outside it."""
        reach = {name: self._reach(name) for name in self.trees}
        found: dict[str, str] = {}
        done: set[str] = set()
        for name in self.trees:
            if name in done or name not in reach[name]:
                continue
            group = {other for other in reach[name] if name in reach[other]} | {name}
            done |= group
            entries = {member for member in group if member == "root" or any(
                member in self.refs[other] for other in self.trees if other not in group)}
            try:
                for entry in entries:
                    found[entry] = self._solve(group, entry)
            except _NotRegular:
                continue
        return found

    def _alternatives(self, node: Any) -> list[list[Any]]:
        """A rule's body as alternatives of items (single groups unwrapped)."""
        if node[0] == "alt":
            out: list[list[Any]] = []
            for sequence in node[1]:
                out += self._alternatives(sequence)
            return out
        if node[0] == "seq" and len(node[1]) == 1 and node[1][0][0] in ("alt", "seq"):
            return self._alternatives(node[1][0])
        return [list(node[1])] if node[0] == "seq" else [[node]]

    def _regex(self, node: Any, group: set[str]) -> str:
        kind = node[0]
        if kind == "str":
            return "".join(f"\\x{{{ord(c):x}}}" for c in node[1])
        if kind == "cls":
            if not node[1].startswith("/"):
                raise _NotRegular()
            return node[1][1:-1]
        if kind == "rep":
            return f"(?:{self._regex(node[1], group)}){node[2]}"
        if kind in ("alt", "seq"):
            parts = [self._regex(child, group) for child in node[1]]
            return "(?:" + ("|" if kind == "alt" else "").join(parts) + ")"
        raise _NotRegular()   # a rule reference (or a dispatch text) inside

    def _solve(self, group: set[str], entry: str) -> str:
        order = [entry] + sorted(group - {entry})
        # X_i = sum_j a[i][j] X_j | b[i]
        a: dict[str, dict[str, list[str]]] = {x: {} for x in order}
        b: dict[str, list[str]] = {x: [] for x in order}
        for x in order:
            for items in self._alternatives(self.trees[x]):
                last = items[-1] if items else None
                if last is not None and last[0] == "ref" and last[1] in group:
                    prefix = "".join(self._regex(item, group) for item in items[:-1])
                    a[x].setdefault(last[1], []).append(prefix)
                else:
                    b[x].append("".join(self._regex(item, group) for item in items))

        def union(parts: list[str]) -> str:
            return parts[0] if len(parts) == 1 else "(?:" + "|".join(parts) + ")"
        for k in reversed(order[1:]):
            loop = a[k].pop(k, None)
            star = f"(?:{union(loop)})*" if loop else ""
            for i in order:
                if i == k or k not in a[i]:
                    continue
                via = union(a[i].pop(k)) + star
                for j, coefficient in a[k].items():
                    a[i].setdefault(j, []).append(via + union(coefficient))
                if b[k]:
                    b[i].append(via + union(b[k]))
            del a[k]
            order = [x for x in order if x != k]
        loop = a[entry].pop(entry, None)
        if a[entry] or not b[entry]:
            raise _NotRegular()
        return (f"(?:{union(loop)})*" if loop else "") + union(b[entry])
