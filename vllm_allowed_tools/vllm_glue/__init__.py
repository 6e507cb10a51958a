"""The thin, version-aware layer between the core and vLLM (0.32 CPU build, 0.33 GPU build)."""
