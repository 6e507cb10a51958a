"""Whether a wire format can hold a custom tool's calls to its grammar, asked before generation.

The grammar builder refuses a custom grammar tool it cannot constrain (:mod:`.custom_inputs`), but
on the vLLM side that refusal comes from inside vLLM's request handling; the request path asks here
first, so the client gets a 400 naming the format and the tool before anything is decoded. The
answer is a property of the format and the mode, probed once with a stand-in tool. Light: xgrammar
is only imported when a turn has a custom grammar tool to check.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

from ..errors import CapabilityError

if TYPE_CHECKING:
    from ..request.turn_allowlist import TurnAllowlist

#: the stand-in custom tool of the probe, and its grammar (xgrammar EBNF)
_PROBE_NAME = "custom_input_probe"
_PROBE_GRAMMAR = 'root ::= "a"'


@functools.lru_cache(maxsize=128)
def carries_custom_inputs(wire_format_name: str, mode: str) -> bool:
    """Whether the format's grammar in ``mode`` constrains a custom tool's input (True where the
    mode has no grammar at all: nothing is constrained there, a custom call no less than others)."""
    from .grammar import AllowedFunction, build_structural_tag
    probe = AllowedFunction(_PROBE_NAME, None, None, input_grammar=_PROBE_GRAMMAR)
    try:
        build_structural_tag(wire_format_name, [probe], mode,  # type: ignore[arg-type]
                             parallel_tool_calls=False)
    except CapabilityError:
        return False
    return True


def refuse_uncarried_custom_tools(allowlist: TurnAllowlist | None, parser: str | None) -> None:
    """Raise CapabilityError (400, naming the format and the tool) when the turn can call a custom
    grammar tool that ``parser``'s format cannot hold to its grammar in the turn's mode (an
    ``allowed_tools`` selection, a plain ``required`` or ``auto`` turn's catalog, a named choice);
    nothing for a parser that is not one of ours (its grammar is not ours to build)."""
    if allowlist is None or parser is None:
        return
    # a named choice decodes as one required call (rewrite.custom_inputs_allowlist)
    mode = "required" if allowlist.choice == "named" else allowlist.mode
    if mode is None:
        return
    grammar_tools = [spec.flat_name for spec in allowlist.allowed_specs
                     if spec.kind == "custom" and spec.grammar is not None]
    if not grammar_tools:
        return
    from ..formats import wire_format
    try:
        name = wire_format(parser).name
    except ValueError:
        return
    if not carries_custom_inputs(name, mode):
        from .custom_inputs import uncarried
        raise uncarried(name, grammar_tools[0])
