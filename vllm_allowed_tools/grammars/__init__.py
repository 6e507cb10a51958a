"""Wire formats as data: one JSON file per format, read by :mod:`vllm_allowed_tools.formats`.

The file format and how to add one: docs/decode-path.md.
"""

from __future__ import annotations

from pathlib import Path

GRAMMAR_DIR = Path(__file__).resolve().parent
