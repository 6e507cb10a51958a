"""vllm-allowed-tools: `tool_choice: {"type": "allowed_tools"}` for vLLM, cache-friendly and fail-closed.

The core (policy, rendering, grammar, guard, approvals) imports no vLLM; the glue that plugs it into
vLLM lives in :mod:`vllm_allowed_tools.vllm_glue` and is loaded by vLLM through the
``vllm.general_plugins`` entry point.
"""

__version__ = "0.1.0"
