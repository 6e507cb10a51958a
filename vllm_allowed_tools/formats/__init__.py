"""The wire formats our parsers, grammars, templates and reports know: one registry, one entry each.

Look a format up with :func:`wire_format`, list them with :func:`wire_formats`, add one with
:func:`register_wire_format` (or a data file in ``vllm_allowed_tools/grammars/``).
"""

from __future__ import annotations

from .registry import (
    NAME_PLACEHOLDER,
    CallShape,
    GrammarSpec,
    WireFormat,
    format_from_data,
    load_data_files,
    parser_names,
    register_wire_format,
    wire_format,
    wire_formats,
)

load_data_files()

__all__ = [
    "NAME_PLACEHOLDER",
    "CallShape",
    "GrammarSpec",
    "WireFormat",
    "format_from_data",
    "load_data_files",
    "parser_names",
    "register_wire_format",
    "wire_format",
    "wire_formats",
]
