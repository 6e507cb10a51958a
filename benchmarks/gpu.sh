#!/usr/bin/env bash
# The GPU run: on a machine with a CUDA GPU and vLLM 0.33, from a fresh clone, in under 8 minutes:
# a random-weight Qwen3-8B-shaped model with a 150K-token tokenizer made offline (no download),
# served one-flag on each constraint stage, and one Markdown table of decode throughput
# (unconstrained / native / logits processor / split) at batch 1, 16 and 64, a first-seen subset's
# time to first token and prompt reuse over an agent transcript (benchmarks/gpu_run.py).
#
#   benchmarks/gpu.sh [--dry-run] [--out FILE] [gpu_run.py options]
#
# --dry-run: the same script at tiny sizes on CPU, one server (what CI runs: tests/test_gpu_script_e2e.py).
# PYTHON: the interpreter (default: python3); without vLLM and the plugin it installs ".[gpu]" first.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if ! "$PYTHON" -c "import vllm, vllm_allowed_tools, httpx, tokenizers" 2>/dev/null; then
    case " $* " in
        *" --dry-run "*) echo "gpu.sh --dry-run: install the plugin with vLLM first (docs/install.md)" >&2; exit 2 ;;
    esac
    "$PYTHON" -m pip install --quiet ".[gpu]" httpx tokenizers
fi
exec "$PYTHON" benchmarks/gpu_run.py "$@"
