"""Every environment variable and server flag the plugin reads, parsed once into one frozen object.

A value that cannot be used stops start-up (the plugin's ``register()`` and the middleware parse
it) with a :class:`SettingsError` naming the variable and what it takes, instead of failing
later, on some request, or being silently ignored. :func:`current` is the process's settings,
read from ``os.environ`` and ``sys.argv`` on first use and kept; :meth:`Settings.from_environ`
builds them from any mapping and command line (tests, or a command line not this process's).
The descriptions below are the documentation: ``docs/settings.md`` holds
:func:`markdown_table`'s output, and a test keeps the two equal.

Nothing else in the package reads ``os.environ`` or ``sys.argv``: code that starts a child
process copies the environment with :func:`process_environment`, and the plugin's one change to
the server's command line goes through :func:`replace_server_command`.
"""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from functools import lru_cache
from pathlib import Path
from typing import Annotated, Any

from pydantic import BeforeValidator, Field, ValidationError
from pydantic_settings import BaseSettings, EnvSettingsSource, SettingsConfigDict

from .errors import CapabilityError
from .launch import LaunchArgs
from .request.placement import FILTER_CATALOG, PLACEMENTS

__all__ = ["EnvironmentSettings", "LaunchArgs", "Settings", "SettingsError", "current", "markdown_table",
           "env_field", "process_environment", "replace_server_command", "reset_for_tests", "variable_rows"]

#: which constraint stage serves allowed-tools grammars (``VLLM_ALLOWED_TOOLS_CONSTRAINT``; how
#: ``auto`` picks one: :func:`.decode.stage.choose_stage`)
STAGE_ENV = "VLLM_ALLOWED_TOOLS_CONSTRAINT"
STAGE_AUTO = "auto"
STAGE_NATIVE = "native"
STAGE_LOGITS_PROCESSOR = "logits-processor"
STAGES = (STAGE_AUTO, STAGE_NATIVE, STAGE_LOGITS_PROCESSOR)
PLAIN_CATALOG, PLAIN_VANILLA = "catalog", "vanilla"
#: ``VLLM_ALLOWED_TOOLS_ARGUMENT_SCHEMAS``: every tool's arguments held to its schema, or only
#: ``strict`` tools' (vLLM's own default)
SCHEMAS_ALL, SCHEMAS_STRICT = "all", "strict"
#: ``VLLM_ALLOWED_TOOLS_FIRST_SEEN_GRAMMARS``: how the logits-processor stage masks a row whose
#: grammar xgrammar has not compiled yet
FIRST_SEEN_LLGUIDANCE, FIRST_SEEN_XGRAMMAR = "llguidance", "xgrammar"


class SettingsError(CapabilityError):
    """A variable holds a value the plugin cannot use; the message names it and what it takes
    (``variables``: every variable refused)."""

    def __init__(self, message: str, variables: Sequence[str] = ()) -> None:
        super().__init__(message, capability="config", status=500, param=None)
        self.variables = tuple(variables)


# ------------------------------------------------------------------------- value parsers

def _choice(*allowed: str, what: str) -> Callable[[Any], Any]:
    def parse(value: Any) -> Any:
        if not isinstance(value, str):
            return value
        text = value.strip().lower()
        if text not in allowed:
            raise ValueError(f"is not {what}; set one of {', '.join(allowed)} or unset it")
        return text
    return parse


def _whole_number(value: Any) -> Any:
    if not isinstance(value, str):
        return value
    try:
        number = int(value.strip())
    except ValueError:
        number = -1
    if number < 0:
        raise ValueError("must be a non-negative integer (a whole number, 0 or more), or unset")
    return number


def _positive_seconds(value: Any) -> Any:
    if not isinstance(value, str):
        return value
    try:
        number = float(value)
    except ValueError:
        number = math.nan
    if not 0 < number < math.inf:   # also refuses NaN
        raise ValueError("must be a positive number of seconds, or unset")
    return number


def _names(value: Any) -> Any:
    """A comma-separated list of names."""
    if not isinstance(value, str):
        return value
    return frozenset(name.strip() for name in value.split(",") if name.strip())


def _optional_flag(value: Any) -> Any:
    """vLLM's ``maybe_convert_bool`` (0 or 1), and the words false/true."""
    if not isinstance(value, str):
        return value
    text = value.strip().lower()
    if text in ("false", "true"):
        return text == "true"
    try:
        return bool(int(text))
    except ValueError:
        raise ValueError("must be 0 or 1 (vLLM reads it as an integer), or unset") from None


def _present(value: Any) -> Any:
    """Whether a value is set at all (a secret the plugin does not keep)."""
    return bool(value.strip()) if isinstance(value, str) else value


def _lowered(value: Any) -> Any:
    return (value.strip().lower() or None) if isinstance(value, str) else value


def _vllm_true(value: Any) -> Any:
    """True for ``true`` or ``1`` only, as vLLM reads its boolean switches."""
    return value.strip().lower() in ("true", "1") if isinstance(value, str) else value


def _fallback(value: Any) -> Any:
    if isinstance(value, str) and value.strip() != FILTER_CATALOG:
        raise ValueError(f"is not a known fallback; the only one is {FILTER_CATALOG!r}")
    return value.strip() if isinstance(value, str) else value


def env_field(variable: str, description: str, default: Any = None, shown: str | None = None) -> Any:
    """A settings field read from ``variable``; ``shown``: the default as the docs state it."""
    extra = {"default_text": shown} if shown is not None else None
    return Field(default, alias=variable, description=description, json_schema_extra=extra)


Stage = Annotated[str, BeforeValidator(_choice(*STAGES, what="a constraint stage"))]
Placement = Annotated[str, BeforeValidator(_choice("auto", *PLACEMENTS, what="a placement"))]
PlainDecoding = Annotated[str, BeforeValidator(_choice(PLAIN_CATALOG, PLAIN_VANILLA,
                                                       what="a plain-request decoding"))]
ArgumentSchemas = Annotated[str, BeforeValidator(_choice(SCHEMAS_ALL, SCHEMAS_STRICT,
                                                         what="an argument-schema choice"))]
FirstSeenGrammars = Annotated[str, BeforeValidator(_choice(FIRST_SEEN_LLGUIDANCE, FIRST_SEEN_XGRAMMAR,
                                                           what="a first-seen grammar choice"))]
WholeNumber = Annotated[int, BeforeValidator(_whole_number)]
Seconds = Annotated[float, BeforeValidator(_positive_seconds)]
Names = Annotated[frozenset[str], BeforeValidator(_names)]
OptionalFlag = Annotated[bool | None, BeforeValidator(_optional_flag)]


# ------------------------------------------------------------------------- the environment

class _MappingSource(EnvSettingsSource):
    """pydantic-settings' environment source over a given mapping instead of ``os.environ``."""

    def __init__(self, settings_cls: type[BaseSettings], environ: Mapping[str, str]) -> None:
        self._environ = dict(environ)
        super().__init__(settings_cls)

    def _load_env_vars(self) -> Mapping[str, str | None]:
        # an empty value counts as unset (env_ignore_empty, which os.environ's reader applies too)
        return {name: value for name, value in self._environ.items() if value != ""}


class EnvironmentSettings(BaseSettings):
    """One field per environment variable (:func:`env_field`; an empty value counts as unset),
    read from a given mapping only (:meth:`read`): the plugin's :class:`Settings`, and the dev
    tools' own (``devtools/models/helper_settings.py``)."""

    model_config = SettingsConfigDict(frozen=True, case_sensitive=True, env_ignore_empty=True,
                                      enable_decoding=False, extra="ignore")

    @classmethod
    def settings_customise_sources(cls, settings_cls: type[BaseSettings], init_settings: Any,
                                   env_settings: Any, dotenv_settings: Any,
                                   file_secret_settings: Any) -> tuple[Any, ...]:
        # values come from the given mapping only: no .env file, no secrets folder
        return (init_settings,)

    @classmethod
    def variables(cls) -> dict[str, str]:
        """Field name -> the environment variable it is read from."""
        return {name: info.alias for name, info in cls.model_fields.items() if info.alias}

    @classmethod
    def variable(cls, field: str) -> str:
        return cls.variables()[field]

    @classmethod
    def parsed(cls, environ: Mapping[str, str], **fields: Any) -> Any:
        """The settings ``environ`` makes (with ``fields`` that come from elsewhere); raises
        SettingsError naming every variable whose value cannot be used."""
        names = set(cls.variables().values())
        read = _MappingSource(cls, {key: value for key, value in environ.items() if key in names})()
        try:
            return cls(**read, **fields)
        except ValidationError as exc:
            raise SettingsError(_explain(exc, environ), _refused_variables(exc)) from None


class Settings(EnvironmentSettings):
    """The plugin's settings: one field per environment variable (an empty value counts as unset),
    and the server's command line as :class:`LaunchArgs`."""

    constraint: Stage = env_field("VLLM_ALLOWED_TOOLS_CONSTRAINT", (
        "Which stage constrains decoding to the allowed tools: `auto` (our logits processor on "
        "CPU and where the structured-output backend cannot compile structural tags, vLLM's "
        "native structured outputs elsewhere), `native` or `logits-processor`."), "auto")
    placement: Placement = env_field("VLLM_ALLOWED_TOOLS_PLACEMENT", (
        "Where the per-turn policy enters the prompt: `auto` (the first placement the start-up "
        "probe finds keeping the history a stable prefix), or one of `template-variable`, "
        "`system-message`, `last-message`, `filter-catalog` (probed all the same)."), "auto")
    fallback: Annotated[str | None, BeforeValidator(_fallback)] = env_field(
        "VLLM_ALLOWED_TOOLS_FALLBACK", (
            "`filter-catalog`: where no placement passes the probe, send only the allowed tools "
            "instead of stopping start-up (breaks prompt-cache reuse when the subset changes)."))
    plain_decoding: PlainDecoding = env_field("VLLM_ALLOWED_TOOLS_PLAIN_DECODING", (
        "How a plain `auto` request decodes: `catalog` (only the request's own tool names can be "
        "called) or `vanilla` (as vLLM decodes it; the output guard still refuses a name outside "
        "the catalog)."), PLAIN_CATALOG)
    argument_schemas: ArgumentSchemas = env_field("VLLM_ALLOWED_TOOLS_ARGUMENT_SCHEMAS", (
        "Which calls' arguments the grammar holds to the tool's JSON schema (in `required` and "
        "named turns, and after an `auto` trigger): `all` (every tool, `strict` or not, as vLLM's "
        "`--tool-strict-level parameter`; a schema xgrammar cannot compile is held to an object, "
        "said once in the log) or `strict` (only `strict: true` tools, vLLM's default). The guard "
        "refuses only what `strict` promises either way."), SCHEMAS_ALL)
    max_json_whitespace: WholeNumber | None = env_field("VLLM_ALLOWED_TOOLS_MAX_JSON_WHITESPACE", (
        "The most whitespace characters the grammar admits between JSON tokens of a call's "
        "arguments (0 counts as 1, xgrammar's least); unset: no limit."))
    harmony_preamble_tokens: WholeNumber = env_field("VLLM_ALLOWED_TOOLS_HARMONY_PREAMBLE_TOKENS", (
        "gpt-oss: the most tokens each of the two preamble messages (analysis, then commentary) "
        "of a `required` turn may hold before its call, lowered per request to half of what its "
        "`max_tokens` leaves after the shortest allowed call, so that call always fits; 0: only "
        "that (`auto` turns have none)."), 2048)
    extra_parsers: Names = env_field("VLLM_ALLOWED_TOOLS_EXTRA_PARSERS", (
        "Comma-separated parser names the operator vouches for (their own subclasses of our "
        "parser wrappers, loaded with `--tool-parser-plugin`): accepted at start-up like ours."),
        frozenset())
    approval_policy: Path | None = env_field("VLLM_ALLOWED_TOOLS_APPROVAL_POLICY", (
        "The operator's approval policy file (docs/approvals.md); unset: approvals off. A policy "
        "file that cannot be read stops start-up."))
    grant_store: str | None = env_field("VLLM_ALLOWED_TOOLS_GRANT_STORE", (
        "The grant store: a SQLite path, `sqlite:PATH` or a `postgresql://` DSN (also the "
        "default `--db` of the grants command)."), shown="`grants.db` next to the policy file")
    max_server_tool_calls: WholeNumber = env_field("VLLM_ALLOWED_TOOLS_MAX_SERVER_TOOL_CALLS", (
        "The most server-side tool calls vLLM's loop runs in one response (vLLM's own loop has "
        "no bound); the call past it ends the response unrun, as `max_tool_calls` does, which a "
        "request can set lower."), 16)
    grant_store_timeout_s: Seconds = env_field("VLLM_ALLOWED_TOOLS_GRANT_STORE_TIMEOUT", (
        "Seconds a grant-store operation may wait (SQLite busy timeout, PostgreSQL connect and "
        "lock timeouts) before the store counts as unavailable."), 5.0)
    conformance_log: Path | None = env_field("VLLM_ALLOWED_TOOLS_CONFORMANCE_LOG", (
        "Open Responses check mode: every Responses object and event the server sends is "
        "validated after all rewriting, one JSON line each appended to this file."))
    xgrammar_cache_mb: WholeNumber = env_field("VLLM_XGRAMMAR_CACHE_MB", (
        "vLLM's: the logits-processor stage gives its xgrammar compiler the cache budget vLLM's "
        "xgrammar backend takes (megabytes)."), 512)
    tag_cache_entries: WholeNumber = env_field("VLLM_ALLOWED_TOOLS_TAG_CACHE_ENTRIES", (
        "The most built structural tags the API server keeps (one per catalog, subset and mode "
        "seen; least recently used go first)."), 512)
    tag_cache_mb: WholeNumber = env_field("VLLM_ALLOWED_TOOLS_TAG_CACHE_MB", (
        "The most memory (megabytes, estimated from each tag's JSON) the built tags take; the "
        "least recently used go first (docs/benchmarks.md has the growth)."), 64)
    first_seen_grammars: FirstSeenGrammars = env_field("VLLM_ALLOWED_TOOLS_FIRST_SEEN_GRAMMARS", (
        "How the logits-processor stage masks a policy turn's row whose grammar xgrammar has "
        "not compiled yet: `llguidance` (the same grammar translated for llguidance, whose masks "
        "need no compile ahead, while xgrammar compiles in the background; the row moves onto "
        "xgrammar once that is ready) or `xgrammar` (the row waits for the compile: 0.1-2.5 s at "
        "a 150K vocabulary). A grammar with free text handed in without leave to hold that text to "
        "valid UTF-8 (`constraint_extra_args(..., utf8_text=False)`, the offline `LLM`'s "
        "default), and a grammar the translation does not cover, wait either way."),
        FIRST_SEEN_LLGUIDANCE)
    grammar_cache_entries: WholeNumber = env_field("VLLM_ALLOWED_TOOLS_GRAMMAR_CACHE_ENTRIES", (
        "The most compiled grammars (subsets, envelopes, catalogs) the logits-processor stage "
        "keeps per tokenizer."), 256)
    grammar_cache_mb: WholeNumber = env_field("VLLM_ALLOWED_TOOLS_GRAMMAR_CACHE_MB", (
        "The most memory (megabytes, xgrammar's own count) those compiled grammars take per "
        "tokenizer: one takes 2-15 MB at a 150K vocabulary."), 512)
    api_key_set: Annotated[bool, BeforeValidator(_present)] = env_field("VLLM_API_KEY", (
        "vLLM's API key (the plugin reads only whether one is set): vLLM's authentication must "
        "run before the middleware, or the server does not start."), False, shown="unset")
    target_device: Annotated[str | None, BeforeValidator(_lowered)] = env_field(
        "VLLM_TARGET_DEVICE", (
            "vLLM's: `cpu` makes `auto` choose the logits-processor stage; unset: the device vLLM "
            "detects."))
    use_v2_model_runner: OptionalFlag = env_field("VLLM_USE_V2_MODEL_RUNNER", (
        "vLLM's: our logits processor runs on the V1 model runner only, so off CPU the "
        "logits-processor stage needs 0 here; unset: vLLM's default."))
    enforce_strict_tool_calling: Annotated[bool, BeforeValidator(_vllm_true)] = env_field(
        "VLLM_ENFORCE_STRICT_TOOL_CALLING", (
            "vLLM's (on only as `true` or `1`, as vLLM reads it): off turns structural tags off, "
            "so start-up stops."), True, shown="`true`")

    launch: LaunchArgs = Field(default_factory=LaunchArgs, exclude=True,
                               description="the server's command line")

    @classmethod
    def from_environ(cls, environ: Mapping[str, str], argv: Sequence[str] = ()) -> Settings:
        """The settings an environment and a command line make; raises SettingsError naming every
        variable whose value cannot be used."""
        return cls.parsed(environ, launch=LaunchArgs.from_argv(argv))

    def with_command_line(self, argv: Sequence[str]) -> Settings:
        """These settings with another server command line (``vllm-allowed-tools check`` builds
        the command line it decides for from settings of the environment alone)."""
        return self.model_copy(update={"launch": LaunchArgs.from_argv(argv)})

    @property
    def whitespace_limit(self) -> int | None:
        """:attr:`max_json_whitespace` as xgrammar takes it (at least 1)."""
        return None if self.max_json_whitespace is None else max(1, self.max_json_whitespace)

    @property
    def api_key_configured(self) -> bool:
        """An API key by variable or flag: vLLM's authentication middleware is then mounted."""
        return self.api_key_set or self.launch.api_key_given


def _refused_variables(error: ValidationError) -> list[str]:
    return list(dict.fromkeys(str(item["loc"][0]) for item in error.errors() if item["loc"]))


def _explain(error: ValidationError, environ: Mapping[str, str]) -> str:
    problems = []
    for item in error.errors():
        variable = str(item["loc"][0]) if item["loc"] else "?"
        reason = item.get("ctx", {}).get("error") or item["msg"]
        problems.append(f"{variable}={environ.get(variable, item.get('input'))!r} {reason}")
    return "vllm-allowed-tools cannot start: " + "; ".join(problems)


# ------------------------------------------------------------------------- the process's settings

@lru_cache(maxsize=1)
def current() -> Settings:
    """This process's settings: ``os.environ`` and ``sys.argv``, parsed on first use and kept."""
    return Settings.from_environ(os.environ, sys.argv)


def reset_for_tests() -> None:
    """Forget :func:`current`'s settings, so the next call reads the environment again (tests that
    change the environment or ``sys.argv`` between servers they build in one process)."""
    current.cache_clear()


def replace_server_command(argv: Sequence[str]) -> None:
    """The plugin's one change to the server's command line (``--middleware`` for ours): vLLM
    parses ``sys.argv`` after it loaded the plugins. :func:`current` reads it again."""
    sys.argv[:] = list(argv)
    current.cache_clear()


def process_environment() -> dict[str, str]:
    """A copy of this process's environment, for the child processes test helpers start."""
    return dict(os.environ)


# ------------------------------------------------------------------------- the documentation

def _shown_default(info: Any) -> str:
    extra = info.json_schema_extra or {}
    if "default_text" in extra:
        return str(extra["default_text"])
    default = info.default
    if default is None or default == frozenset():
        return "unset"
    if isinstance(default, bool):
        return f"`{str(default).lower()}`"
    return f"`{default:g}`" if isinstance(default, float) else f"`{default}`"


def variable_rows() -> dict[str, str]:
    """Each variable's row of the table (variable -> ``| name | default | what it changes |``), in
    the model's order; the README shows a few of them as they are here."""
    return {info.alias: f"| `{info.alias}` | {_shown_default(info)} | {info.description} |"
            for info in Settings.model_fields.values() if info.alias}


def markdown_table() -> str:
    """The tables ``docs/settings.md`` holds: every variable (default, what it changes), then every
    server flag the plugin reads."""
    lines = ["| Variable | Default | What it changes |", "|---|---|---|", *variable_rows().values()]
    lines += ["", "| Server flag | What the plugin does with it |", "|---|---|"]
    for info in LaunchArgs.model_fields.values():
        flags = (info.json_schema_extra or {}).get("flags")
        if flags:
            shown = ", ".join(f"`{flag}`" for flag in flags)
            lines.append(f"| {shown} | {info.description[0].upper()}{info.description[1:]} |")
    return "\n".join(lines) + "\n"
