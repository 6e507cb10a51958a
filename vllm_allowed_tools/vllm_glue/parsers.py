"""``allowed_<base>`` tool parsers: vLLM's built-in parsers, wrapped.

One small subclass per wire format, made by :func:`wrap_parser`. The wrapper keeps the base
parser's wire format and streaming behaviour; what it adds is the allowed-tools policy (compiling
grammars from the allowed subset only and dropping any parsed call outside it).
"""

from __future__ import annotations

from vllm.tool_parsers import ToolParserManager

from .plugin import PARSERS


def wrap_parser(base_name: str, class_name: str) -> type:
    """A subclass of vLLM's ``base_name`` parser that carries the allowed-tools policy."""
    base = ToolParserManager.get_tool_parser(base_name)
    return type(class_name, (base,), {
        "__doc__": f"vLLM's {base_name!r} tool parser under the allowed-tools policy.",
        "__module__": __name__,
        "allowed_tools_base_parser": base_name,
    })


for _name, _class_name in PARSERS.items():
    globals()[_class_name] = wrap_parser(_name.removeprefix("allowed_"), _class_name)
