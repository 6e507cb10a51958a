"""Right-recursive EBNF rules that are regular, as one regex each (:class:`RegularRules`): how
:mod:`.lark_ebnf` keeps llguidance's Earley parser from growing an item a character on an argument
string. No vLLM imports."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["RegularRules"]


class _NotRegular(Exception):
    """A rule's language is not written as a regex here (it stays a grammar rule)."""


class RegularRules:
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
