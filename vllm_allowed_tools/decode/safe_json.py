"""JSON argument grammars whose every admitted text reads back as written: strings that cannot spell
the format's markers, no lone surrogate escapes, and numbers that stay finite float64s.

xgrammar's JSON EBNF (``str(Grammar.from_json_schema(...))``) admits, inside a string, any raw text
but a quote, a backslash and control characters. vLLM's parsers find a wire format's markers
(``</tool_call>``, ``<|tool_call_end|>``, ``<parameter name=``, harmony's ``<|end|>`` ...) in the
raw text, a JSON string's inside included, and take a marker there for the end of the call: the
arguments come back cut or not at all. :func:`safe_json_ebnf` rewrites that EBNF so that

* the raw text of a string admitted by ``basic_string_sub`` (every string the schema leaves free:
  any key and value of a non-strict tool's object, a strict tool's plain ``string`` properties)
  never holds one of ``markers``, the closing quote included (``<parameter name=`` then ``"``).
  What a format's tag passes is :func:`string_markers`: each markup marker's first two characters,
  which keep every marker out at a fraction of the compile cost (below).
  The string's content is a DFA over the raw characters (Aho-Corasick states over the markers, one
  EBNF rule per state) that drops every step completing a marker. A marker's JSON-escaped spelling
  stays admitted (``\\u003c`` for ``<``): every string value keeps a spelling (its markers' first
  characters escaped), so long as no marker starts with a character an escape spells after its
  backslash (``u``, hex digits, ``bfnrt``, ``/``, ``"``; no format's does). No marker holds a
  backslash, so an escape starts the automaton over; a marker that could begin inside an escape's
  own characters is followed through it exactly;
* a ``\\uXXXX`` escape of a UTF-16 surrogate is admitted only as a pair (a high one followed by a low
  one): a lone surrogate is no Unicode text, and readers such as pydantic refuse the whole JSON;
* ``basic_number`` admits only finite float64 values (:data:`NUMBER_BOUND`): ``5e600`` is valid
  JSON, but a parser that reads the arguments with ``json.loads`` and writes them back with
  ``json.dumps`` turns it into ``Infinity``, which is no JSON; ``basic_integer`` is bounded alike.

What is left as xgrammar built it (say so where it matters): strings the schema pins otherwise
(``enum``/``const`` literals and declared key literals are the schema's own text; ``pattern`` and
``format`` strings and ``minLength``/``maxLength`` strings use their own rules) and numbers with
``minimum``/``maximum`` bounds (xgrammar writes those as range rules). No vLLM imports.

Cost. Structural-tag ``grammar`` nodes share no rules, so every JSON slot of a tag carries its own
copy of the string rules: they are printed compactly (:func:`string_rules`: one rule per class of
equivalent automaton states, short rule names, negated classes, the escapes and the ways shared
with state 0 one rule each: about 1.2k characters for hermes' markers, 3.3k for kimi_k2's, where
the first version printed 7.5k and 9.8k), the rules nothing reaches are dropped (:func:`reachable`),
and ``grammar.py`` caches each slot's grammar by its node and markers. 128 MCP-shaped strict tools,
required mode (``benchmarks/safe_json_cost.py``, docs/benchmarks.md), tag JSON characters before
this module, with its first version, now: hermes 175k / 2.87M / 733k, kimi_k2 103k / 3.02M / 673k,
qwen3_coder 447k / 2.94M / 974k, deepseek_v3 334k / 2.17M / 472k; a rebuild of the same catalog
0.01 s (first version 0.5-0.9 s unloaded). Compiling is the cost that matters: xgrammar sorts the
vocabulary per rule position, and an automaton over whole markers adds dozens per slot (4 kimi_k2
tools at a 150K vocabulary: 13.6 s, 0.2 s before this module); over the markers' first two
characters it adds one step (0.77 s).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import lru_cache

from .json_string import MAX_CODEPOINT, Ranges, _class_text, _complement, _merged

#: the bound on admitted JSON numbers: an integer part of at most 20 digits (any 64-bit integer), a
#: fraction of at most 20 digits, a positive decimal exponent of at most 287, so every number is
#: below 1e20 * 1e287 = 1e307 < 1.79e308 (float64's largest): finite. A negative exponent may take
#: three digits (a tiny number reads as a subnormal or 0.0, never an overflow), so every finite
#: float64 below 1e307 in magnitude keeps a spelling. ``basic_integer``: at most 20 digits.
NUMBER_BOUND = {"integer_digits": 20, "fraction_digits": 20, "max_exponent": 287, "min_exponent": -999}
_BOUNDED_NUMBER = (
    '("-")? ("0" | [1-9] [0-9]{0,19}) ("." [0-9]{1,20})? '
    '([eE] (("-" [0-9]{1,3}) | ("+"? ([0-9] | [0-9] [0-9] | [01] [0-9] [0-9] | "2" [0-7] [0-9] | "28" [0-7]))))?')
_BOUNDED_INTEGER = '("0") | (("-")? [1-9] [0-9]{0,19})'

_HEX = [(0x30, 0x39), (0x41, 0x46), (0x61, 0x66)]
#: the characters of an escape after its backslash, as sequences of character classes: the short
#: escapes, a non-surrogate \\uXXXX, and a surrogate pair (high \\uD800-\\uDBFF, then low
#: \\uDC00-\\uDFFF); the ``None`` step is the pair's second backslash (it restarts the automaton)
_ESCAPES: tuple[tuple[Ranges | None, ...], ...] = (
    (_merged([(ord(c), ord(c)) for c in '"\\/bfnrt']),),
    ([(0x75, 0x75)], _merged([(0x30, 0x39), (0x41, 0x43), (0x45, 0x46), (0x61, 0x63), (0x65, 0x66)]),
     _HEX, _HEX, _HEX),
    ([(0x75, 0x75)], [(0x44, 0x44), (0x64, 0x64)], [(0x30, 0x37)], _HEX, _HEX),
    ([(0x75, 0x75)], [(0x44, 0x44), (0x64, 0x64)], _merged([(0x38, 0x39), (0x41, 0x42), (0x61, 0x62)]),
     _HEX, _HEX, None, [(0x75, 0x75)], [(0x44, 0x44), (0x64, 0x64)],
     _merged([(0x43, 0x46), (0x63, 0x66)]), _HEX, _HEX),
)
#: what a string's content may hold raw: no control character, quote or backslash (xgrammar's own
#: ``[^\\0-\\u001f\\"\\\\\\r\\n]``)
_RAW = [(0x20, 0x21), (0x23, 0x5B), (0x5D, MAX_CODEPOINT)]
_QUOTE = 0x22


@dataclass(frozen=True)
class MarkerAutomaton:
    """Aho-Corasick over the markers: ``step(state, char)``; ``dead`` states complete a marker."""
    goto: tuple[dict[int, int], ...]
    fail: tuple[int, ...]
    dead: frozenset[int]
    alphabet: frozenset[int]

    def step(self, state: int, char: int) -> int:
        while state and char not in self.goto[state]:
            state = self.fail[state]
        return self.goto[state].get(char, 0)


@lru_cache(maxsize=64)
def marker_automaton(markers: tuple[str, ...]) -> MarkerAutomaton:
    """Aho-Corasick over ``markers`` (cached): a text that reaches a ``dead`` state holds one."""
    goto: list[dict[int, int]] = [{}]
    terminal = [False]
    for marker in markers:
        state = 0
        for char in map(ord, marker):
            if char not in goto[state]:
                goto.append({})
                terminal.append(False)
                goto[state][char] = len(goto) - 1
            state = goto[state][char]
        terminal[state] = True
    fail = [0] * len(goto)
    queue = list(goto[0].values())
    while queue:
        state = queue.pop(0)
        terminal[state] = terminal[state] or terminal[fail[state]]
        for char, target in goto[state].items():
            back = fail[state]
            while back and char not in goto[back]:
                back = fail[back]
            fail[target] = goto[back].get(char, 0) if goto[back].get(char, 0) != target else 0
            queue.append(target)
    dead = frozenset(state for state, is_dead in enumerate(terminal) if is_dead)
    return MarkerAutomaton(tuple(goto), tuple(fail), dead, frozenset(c for m in markers for c in map(ord, m)))


def _split(automaton: MarkerAutomaton, state: int, ranges: Ranges) -> dict[int, Ranges]:
    """``ranges`` split by the state each character leads to from ``state`` (dead ones dropped)."""
    special = sorted(c for c in automaton.alphabet if any(low <= c <= high for low, high in ranges))
    targets: dict[int, Ranges] = {}
    rest = ranges
    for char in special:
        target = automaton.step(state, char)
        targets.setdefault(target, []).append((char, char))
        rest = _cut(rest, char)
    if rest:
        targets.setdefault(0, []).extend(rest)
    return {target: _merged(chars) for target, chars in targets.items() if target not in automaton.dead}


@lru_cache(maxsize=64)
def _representatives(markers: tuple[str, ...]) -> dict[int, int]:
    """Each live state of the markers' automaton -> the least state that behaves the same on every
    text (Moore's partition refinement): the trie keeps a state per prefix, but the states after
    ``<t`` and ``</t`` (``<tool_call>``, ``</tool_call>``) only differ in a marker they have both
    yet to finish, and one rule serves them. Every character outside the markers leads to state
    0 and an escape starts over, so the markers' characters (and the quote) tell states apart."""
    automaton = marker_automaton(markers)
    live = [state for state in range(len(automaton.goto)) if state not in automaton.dead]
    chars = sorted(automaton.alphabet | {_QUOTE})
    block = {state: 0 for state in live}
    while True:
        signatures = {state: (block[state], *(block.get(automaton.step(state, char), -1) for char in chars))
                      for state in live}
        numbers: dict[tuple[int, ...], int] = {}
        refined = {state: numbers.setdefault(signature, len(numbers))
                   for state, signature in signatures.items()}
        if len(numbers) == len(set(block.values())):
            break
        block = refined
    least: dict[int, int] = {}
    for state in live:
        least.setdefault(block[state], state)
    return {state: least[block[state]] for state in live}


def _cut(ranges: Ranges, point: int) -> Ranges:
    out: Ranges = []
    for low, high in ranges:
        if low <= point <= high:
            out.extend(r for r in ((low, point - 1), (point + 1, high)) if r[0] <= r[1])
        else:
            out.append((low, high))
    return out


def _class(ranges: Ranges) -> str:
    """The shorter of ``ranges`` as a class and as the negated class of its complement (a state's
    "any other character" class is all but a few characters)."""
    if ranges == [(_QUOTE, _QUOTE)]:
        return '"\\""'
    if len(ranges) == 1 and ranges[0][0] == ranges[0][1] and ranges[0][0] != _QUOTE:
        char = chr(ranges[0][0])
        if 0x20 < ranges[0][0] < 0x7F and char != "\\":
            return f'"{char}"'
    plain = "[" + _ranges_text(ranges) + "]"
    complement = _complement(ranges)
    negated = "[^" + _ranges_text(complement) + "]"
    return negated if complement and len(negated) < len(plain) else plain


def _ranges_text(ranges: Ranges) -> str:
    return "".join(_class_text(low) if low == high else f"{_class_text(low)}-{_class_text(high)}"
                   for low, high in ranges)


def clean_markers(markers: Iterable[str]) -> tuple[str, ...]:
    """The markers a string's raw text is kept from spelling: non-empty, without a backslash (JSON
    writes a backslash escaped, so no raw text holds one unescaped), sorted, each once."""
    return tuple(sorted({marker for marker in markers if marker and "\\" not in marker}))


def string_rules(markers: Sequence[str], name: str = "basic_string_sub", lookahead: str = "",
                 prefix: str | None = None) -> str:
    """EBNF rules (the entry rule ``name``) for a JSON string's content and closing quote whose raw
    text never holds one of ``markers``; ``lookahead`` (``(=...)`` or empty) is put on the entry
    rule, as xgrammar puts its own on ``basic_string_sub`` (every state rule is in tail position,
    so it ends where the entry rule does). The other rules are named ``prefix`` then a number
    (``name + "_"`` unless given: a caller that knows the grammar's other names passes a short one).

    Printed compactly, for the text goes into every JSON slot of a tag: one rule per automaton
    state (states that behave the same are one: :func:`_representatives`), its alternatives
    unparenthesized, each character class the shorter of itself and its negated complement, the
    escapes (which start the automaton over) one shared rule, a chain of single steps one sequence,
    and the ways every state shares with state 0 (the closing quote, an escape, a marker's first
    character) one rule."""
    return _string_rules(clean_markers(markers), name, lookahead, f"{name}_" if prefix is None else prefix)


class _Printer:
    """The rules of one marker set's string automaton, printed as :func:`string_rules` says."""

    def __init__(self, markers: tuple[str, ...], prefix: str) -> None:
        self.automaton = marker_automaton(markers)
        self.same = _representatives(markers)
        self.prefix = prefix
        self.rules: dict[str, str] = {}
        self.escapes: dict[tuple[int, int, int], str | None] = {}
        self.pending = [0]

    def split(self, state: int, ranges: Ranges) -> dict[int, Ranges]:
        """:func:`_split` with each target its representative."""
        merged: dict[int, Ranges] = {}
        for target, chars in _split(self.automaton, state, ranges).items():
            merged.setdefault(self.same[target], []).extend(chars)
        return {target: _merged(chars) for target, chars in merged.items()}

    def state_rule(self, state: int) -> str:
        rule = f"{self.prefix}{state}"
        if rule not in self.rules and state not in self.pending:
            self.pending.append(state)
        return rule

    def escape_expr(self, steps: tuple[Ranges | None, ...], index: int, position: int,
                    state: int) -> str | None:
        """The rest of escape ``index`` from ``position`` in automaton ``state``, then the content,
        as an expression (a rule where it branches); None where every way on completes a marker."""
        key = (index, position, state)
        if key in self.escapes:
            return self.escapes[key]
        if position == len(steps):
            expr: str | None = self.state_rule(state)
        elif steps[position] is None:
            rest = self.escape_expr(steps, index, position + 1, 0)
            expr = None if rest is None else '"\\\\" ' + rest
        else:
            ways = [(chars, self.escape_expr(steps, index, position + 1, target))
                    for target, chars in sorted(self.split(state, steps[position]).items())]
            ways = [f"{_class(chars)} {rest}" for chars, rest in ways if rest is not None]
            if len(ways) > 1:
                rule = f"{self.prefix}e{index}_{position}_{state}"
                self.rules[rule] = " | ".join(ways)
                expr = rule
            else:
                expr = ways[0] if ways else None
        self.escapes[key] = expr
        return expr

    def alternatives(self, state: int, escape: str | None) -> list[str]:
        found = ['"\\""'] if self.automaton.step(state, _QUOTE) not in self.automaton.dead else []
        found += [f"{_class(chars)} {self.state_rule(target)}"
                  for target, chars in sorted(self.split(state, _RAW).items())]
        return found + ([f'"\\\\" {escape}'] if escape else [])


@lru_cache(maxsize=64)
def _string_rules(markers: tuple[str, ...], name: str, lookahead: str, prefix: str) -> str:
    printer = _Printer(markers, prefix)
    rules = printer.rules
    escape_ways = [way for index, steps in enumerate(_ESCAPES)
                   if (way := printer.escape_expr(steps, index, 0, 0)) is not None]
    escape = f"{prefix}e" if escape_ways else None
    if escape:
        rules[escape] = " | ".join(escape_ways)

    def tail(ways: list[str]) -> str:
        # the lookahead on every rule that can end the string: xgrammar reads it when it sorts the
        # vocabulary per rule position, and without it far more tokens stay context-dependent
        return f"({' | '.join(ways)}) {lookahead}" if lookahead else " | ".join(ways)

    # the ways of state 0 but its "any other character" one (the quote, the escapes, each marker's
    # first character): most states share them all (their failure link is state 0), so one rule
    restart = f"{prefix}r"
    shared = [way for way in printer.alternatives(0, escape) if not way.endswith(f" {prefix}0")]
    while printer.pending:
        rule = printer.state_rule(state := printer.pending.pop())
        if rule in rules:
            continue
        rules[rule] = ""
        ways = printer.alternatives(state, escape)
        if len(shared) > 1 and all(way in ways for way in shared):
            ways = [way for way in ways if way not in shared] + [restart]
            rules[restart] = tail(shared)
        rules[rule] = tail(ways)
    entry = f"{name} ::= {prefix}0" + (f" {lookahead}" if lookahead else "")
    return "\n".join([entry, *(f"{rule} ::= {body}" for rule, body in rules.items())]) + "\n"


_RULE = re.compile(r"^(\w+) ::= (.*)$", re.MULTILINE)
_LOOKAHEAD = re.compile(r"\s(\(=.*\))\s*$")


#: the characters a marker a parser finds inside argument text starts with (markup)
MARKUP_STARTS = "<[{"


def string_markers(markers: Iterable[str]) -> tuple[str, ...]:
    """What a JSON string's raw text is kept from spelling for a format's ``markers``: the first
    two characters of each marker that starts with markup (:data:`MARKUP_STARTS`). Every such
    marker starts with its two, so none is spelled; every value keeps a spelling (the first
    character escaped, ``\\u003c``); and the automaton stays one step deep: with the markers in
    full, xgrammar compiled a tag 15-65x slower at a 150K vocabulary (4 MCP tools, one thread:
    kimi_k2 13.6 s, deepseek_v3 6.6 s, hermes 3.4 s; with two characters 0.77, 0.54, 0.47 s;
    without the rewrite 0.21, 0.25, 0.20 s). A marker that starts otherwise is read where no
    argument string is: harmony's `` to=functions.`` in a message header, phi4's ``functools[``
    before the array its serving layer reads as JSON."""
    return clean_markers(marker[:2] for marker in markers if marker[:1] in MARKUP_STARTS)


#: xgrammar 0.2.8's character of a string with ``minLength``/``maxLength`` (``root_prop_0_characters
#: ::= (([^\"\\\r\n]))``, repeated ``{m, n}``): it admits raw control characters (a tab, U+0001),
#: which no JSON string holds (the parser then refuses the call), and no escape
_BOUNDED_STRING_CHARACTER = r'(([^\"\\\r\n]))'
#: a JSON string's character: printable text, or one escape (one character of the value, as
#: JSON Schema counts a string's length)
_JSON_STRING_CHARACTER = r'(([^\0-\x1f\"\\]) | ("\\" basic_escape))'
_BASIC_ESCAPE = r'(([\"\\/bfnrt]) | ("u" [A-Fa-f0-9] [A-Fa-f0-9] [A-Fa-f0-9] [A-Fa-f0-9]))'


def safe_json_ebnf(ebnf: str, markers: Sequence[str], exact: Sequence[str] = ()) -> str:
    """xgrammar's JSON EBNF ``ebnf`` (whole, or with XML around it) with ``basic_string_sub`` kept
    from spelling ``markers`` (:func:`string_markers`: their first two characters) and ``exact``
    (as they are: a parser that finds a string not starting with markup, xLAM's code fences) and
    surrogate escapes paired, and ``basic_number`` / ``basic_integer`` bounded (the module
    docstring); a grammar without these rules is returned as it is."""
    bodies = {match.group(1): match.group(2) for match in _RULE.finditer(ebnf)}

    def replace(rule: str, body: str, text: str) -> str:
        return re.sub(rf"^{rule} ::= .*$", lambda _: f"{rule} ::= {body}", text, count=1, flags=re.MULTILINE)

    if "basic_string_sub" in bodies:
        found = _LOOKAHEAD.search(bodies["basic_string_sub"])
        lookahead = found.group(1) if found else ""
        ebnf = re.sub(r"^basic_string_sub ::= .*\n?", "", ebnf, count=1, flags=re.MULTILINE)
        prefix = next(p for p in ("q", "qs_", "basic_string_sub_")
                      if not any(rule.startswith(p) for rule in bodies))
        kept_out = string_markers(markers) + tuple(exact)
        ebnf = ebnf.rstrip("\n") + "\n" + string_rules(kept_out, "basic_string_sub", lookahead, prefix)
    bounded = [rule for rule, body in bodies.items() if body.strip() == _BOUNDED_STRING_CHARACTER]
    for rule in bounded:   # a length-bounded string's character: no raw control character
        ebnf = replace(rule, _JSON_STRING_CHARACTER, ebnf)
    if bounded and "basic_escape" not in bodies:
        ebnf = ebnf.rstrip("\n") + "\n" + f"basic_escape ::= {_BASIC_ESCAPE}\n"
    if "basic_number" in bodies:
        ebnf = replace("basic_number", _BOUNDED_NUMBER, ebnf)
    if "basic_integer" in bodies:
        ebnf = replace("basic_integer", _BOUNDED_INTEGER, ebnf)
    return reachable(ebnf)


_LITERAL = re.compile(r'"(?:[^"\\]|\\.)*"|\[(?:[^\]\\]|\\.)*\]')
_NAME = re.compile(r"\b[A-Za-z_]\w*\b")


def reachable(ebnf: str, root: str = "root") -> str:
    """``ebnf`` without the rules ``root`` never reaches (xgrammar prints its whole JSON toolkit:
    ``basic_escape``, ``basic_number_1`` ... once the rewrite replaced what used them), in its
    order; returned as it is where a line is no ``name ::= body`` rule or there is no ``root``."""
    lines = [line for line in ebnf.splitlines() if line.strip()]
    rules = [_RULE.match(line) for line in lines]
    if not all(rules) or root not in {rule.group(1) for rule in rules if rule}:
        return ebnf
    bodies = {rule.group(1): _LITERAL.sub(" ", rule.group(2)) for rule in rules if rule}
    seen, pending = {root}, [root]
    while pending:
        for name in _NAME.findall(bodies[pending.pop()]):
            if name in bodies and name not in seen:
                seen.add(name)
                pending.append(name)
    return "\n".join(line for line, rule in zip(lines, rules) if rule and rule.group(1) in seen) + "\n"
