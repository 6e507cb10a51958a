"""``benchmarks/gpu.sh --dry-run``: the GPU run's script at tiny sizes on CPU, so it cannot rot
between GPU runs. The same code path as on a GPU (the model and its tokenizer made from code,
``--load-format dummy``, the one-flag launch, every measurement, the table), one server start
(the logits-processor stage; the native stage's columns say "not run"), about a minute.

Nothing timed is asserted: the table must have every row and a figure in each measured cell."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from vllm_allowed_tools.settings import process_environment

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.server


def test_the_gpu_script_dry_run_writes_the_table(tmp_path):
    out = tmp_path / "gpu.md"
    env = {**process_environment(), "PYTHON": sys.executable,
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), process_environment().get("PYTHONPATH")]))}
    result = subprocess.run([str(ROOT / "benchmarks" / "gpu.sh"), "--dry-run", "--out", str(out)],
                            cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    table = out.read_text()
    assert table.startswith("Device: CPU (dry run)")
    rows = {line.split(" | ")[0].lstrip("| "): line for line in table.splitlines() if line.startswith("| ")}
    for batch in (1, 4):
        row = rows[f"decode, batch {batch}"]
        cells = [cell.strip() for cell in row.strip("|").split("|")][1:]
        assert cells[1] == "not run"   # the native stage needs a second server
        for cell in (cells[0], cells[2], cells[3]):
            assert re.fullmatch(r"[\d,]+ tok/s( \(\d+\.\d\d\))?", cell), row
    assert re.search(r"\| \d+ ms \|$", rows["first-seen subset, time to first token"])
    assert re.search(r"\| \d+% \|$", rows["prompt reuse over the agent transcript (cached / prompt)"])
