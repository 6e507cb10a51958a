"""Chat templates shipped with the package (point ``--chat-template`` at :func:`template_path`)."""

from __future__ import annotations

from pathlib import Path

TEMPLATE_DIR = Path(__file__).resolve().parent


def template_path(name: str = "hermes") -> Path:
    """Path of a bundled template by short name (``hermes``), for ``vllm serve --chat-template``."""
    path = TEMPLATE_DIR / f"{name}.jinja"
    if not path.is_file():
        available = sorted(p.stem for p in TEMPLATE_DIR.glob("*.jinja"))
        raise FileNotFoundError(f"no bundled template {name!r}; available: {', '.join(available)}")
    return path
