"""The variables the dev tools read (the models' cache and the tiny models' training, the start
ledger): ``serve-tiny``, ``build-model`` and the demo build and cache their models by them, and the
test session sets the ledger. Typed and documented like the plugin's own
(:class:`...settings.EnvironmentSettings`) but kept out of the server's
:class:`...settings.Settings`: a served plugin never reads them."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from ...settings import EnvironmentSettings, WholeNumber, env_field, process_environment


class HelperSettings(EnvironmentSettings):
    """What the dev tools (the model builders, the server starter) read of the environment."""

    server_ledger: Path | None = env_field("VLLM_ALLOWED_TOOLS_SERVER_LEDGER", (
        "Every server the helpers start is recorded in this JSON-lines file (the test session's "
        "start ledger)."))
    train_steps: WholeNumber = env_field(
        "VLLM_ALLOWED_TOOLS_TRAIN_STEPS",
        "Training steps of the trained tiny models (`tool-happy`, `thinking`).", 700)
    cache: Path | None = env_field("VLLM_ALLOWED_TOOLS_CACHE", (
        "Where the tiny models are built and kept (in `models/` below it)."),
        shown="`$XDG_CACHE_HOME/vllm-allowed-tools`")
    xdg_cache_home: Path | None = env_field("XDG_CACHE_HOME", (
        "The tiny models' cache is below it when `VLLM_ALLOWED_TOOLS_CACHE` is unset."),
        shown="`~/.cache`")
    pytest_current_test: str | None = env_field("PYTEST_CURRENT_TEST", (
        "Set by pytest: the test a server start is recorded under in the start ledger."))

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> HelperSettings:
        """Read now, from this process's environment by default (the ledger and the test change
        during a session); SettingsError names a variable whose value cannot be used."""
        return cls.parsed(process_environment() if environ is None else environ)
