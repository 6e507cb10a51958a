"""The operator's approval policy: which tools need a person's approval, for how long, at what scope.

One file named at launch (TOML or JSON), validated whole when it is loaded, since a typo in a
security policy must stop the server instead of being ignored. Rules match tool identities, first
match wins; a tool definition's hint (:mod:`.hints`) may only tighten what a rule says. The file's
format and matching rules are in ``docs/approvals.md``.
"""

from __future__ import annotations

import fnmatch
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..request import NAMESPACE_SEPARATOR, FunctionSpec, ToolIdentity
from .approval_errors import CODE_INVALID_APPROVAL_HINT, ApprovalInputError, PolicyFileError
from .hints import parse_hint
from .scopes import SCOPES, canonical_scopes

__all__ = [
    "SCOPES",
    "ApprovalPolicy",
    "EffectiveApproval",
    "Rule",
    "load_policy",
]

DEFAULT_EXPIRES_IN = 900
DEFAULT_GRANT_EXPIRES_IN: Mapping[str, int] = {"session": 86_400, "always": 30 * 86_400}

_TOP_KEYS = frozenset({"default_approval", "expires_in", "grant_expires_in", "scopes",
                       "bind_arguments", "rules"})
_RULE_KEYS = frozenset({"tools", "approval", "scopes", "expires_in", "bind_arguments", "message"})
_APPROVAL_VALUES = ("required", "none")


@dataclass(frozen=True)
class Rule:
    """One ``[[rules]]`` entry: globs over tool names and what applies to the tools they match."""

    tools: tuple[str, ...]
    required: bool
    scopes: tuple[str, ...] | None = None  # None: the top-level scopes
    expires_in: int | None = None  # None: the top-level expires_in
    bind_arguments: bool | None = None  # None: the top-level value
    message: str | None = None  # shown in the elicitation's message, before the standard text
    index: int = 0

    def matches(self, tool: ToolIdentity | str) -> bool:
        """Whether a pattern matches ``tool``: its flat name or, for a rule requiring approval and a
        pattern without ``__``, the bare name of a namespaced tool. A plain string is a flat name
        of unknown origin and is matched as a top-level name."""
        identity = tool if isinstance(tool, ToolIdentity) else ToolIdentity(None, tool)
        return any(self._pattern_matches(pattern, identity) for pattern in self.tools)

    def _pattern_matches(self, pattern: str, identity: ToolIdentity) -> bool:
        if fnmatch.fnmatchcase(identity.flat_name, pattern):
            return True
        # only a rule that requires approval reaches into namespaces it does not name: bare-name
        # matching may add a requirement, never lift one
        return (self.required and identity.namespace is not None
                and NAMESPACE_SEPARATOR not in pattern
                and fnmatch.fnmatchcase(identity.name, pattern))


@dataclass(frozen=True)
class EffectiveApproval:
    """What applies to one call of one tool, after the operator's rule and the definition's hint.

    ``source`` says what decided (``rules[3]``, ``default``) plus ``+definition`` when the tool
    definition tightened it; it is for logs and audit, not for decisions.
    """

    required: bool
    scopes: tuple[str, ...]
    expires_in: int
    grant_expires_in: Mapping[str, int] = field(hash=False)
    bind_arguments: bool
    message: str | None
    source: str

    def offered_scopes(self, has_session: bool) -> tuple[str, ...]:
        """The scopes an elicitation may offer: ``session`` only when there is a session."""
        return tuple(s for s in self.scopes if has_session or s != "session")

    def allows_grant(self, scope: str, has_arguments_constraint: bool) -> bool:
        """May an existing grant of ``scope`` release a call under this policy now? A grant stops
        applying when its scope is no longer offered or it lacks a now-required argument binding."""
        if scope not in self.scopes:
            return False
        return has_arguments_constraint or not self.bind_arguments


@dataclass(frozen=True)
class ApprovalPolicy:
    """The operator's policy (immutable). Build it with :func:`load_policy` or :meth:`from_mapping`."""

    rules: tuple[Rule, ...] = ()
    default_required: bool = False
    scopes: tuple[str, ...] = SCOPES
    expires_in: int = DEFAULT_EXPIRES_IN
    grant_expires_in: Mapping[str, int] = field(default_factory=lambda: dict(DEFAULT_GRANT_EXPIRES_IN),
                                                hash=False)
    bind_arguments: bool = False

    @classmethod
    def from_mapping(cls, data: Any, *, origin: str = "approval policy") -> ApprovalPolicy:
        """Validate a parsed policy document; :class:`PolicyFileError` names the bad key."""
        return _parse_policy(data, origin)

    @classmethod
    def require_all(cls, scopes: Sequence[str] = SCOPES) -> ApprovalPolicy:
        """Every tool needs approval (a convenient default for tests and strict deployments)."""
        return cls(default_required=True, scopes=tuple(scopes))

    def rule_for(self, tool: ToolIdentity | str) -> Rule | None:
        """The first rule matching ``tool`` (an identity; a string is matched as a top-level name)."""
        for rule in self.rules:
            if rule.matches(tool):
                return rule
        return None

    def effective(self, tool: FunctionSpec | ToolIdentity | str,
                  hint: Mapping[str, Any] | None = None, *,
                  hint_param: str = "approval") -> EffectiveApproval:
        """The approval that applies to ``tool`` (a spec, an identity or a flat name).

        Pass the spec or identity of a namespaced tool: a bare flat-name string is matched as a
        top-level name, so rules requiring approval by bare name would not reach it.

        ``hint`` is the tool definition's ``approval`` object (see :func:`approval_hint`), or None. It
        can only tighten the operator's rule; a malformed hint raises :class:`ApprovalInputError`
        (HTTP 400) whose ``param`` is ``hint_param`` plus the key, so the glue can point at
        ``tools[3].approval.scopes``.
        """
        identity = _identity(tool)
        flat_name = identity.flat_name
        rule = self.rule_for(identity)
        if rule is None:
            required, scopes, expires_in = self.default_required, self.scopes, self.expires_in
            bind, message, source = self.bind_arguments, None, "default"
        else:
            required = rule.required
            scopes = rule.scopes if rule.scopes is not None else self.scopes
            expires_in = rule.expires_in if rule.expires_in is not None else self.expires_in
            bind = rule.bind_arguments if rule.bind_arguments is not None else self.bind_arguments
            message, source = rule.message, f"rules[{rule.index}]"
        if hint is not None:
            h = parse_hint(hint, param=hint_param)
            tightened = False
            if h.get("required") is True and not required:
                required, tightened = True, True
            if "scopes" in h:
                narrowed = tuple(s for s in scopes if s in h["scopes"])
                if not narrowed:
                    raise ApprovalInputError(
                        f"{hint_param}.scopes {list(h['scopes'])} shares no scope with what the "
                        f"server's approval policy allows for {flat_name!r} ({list(scopes)}); such "
                        "a call could never be approved. Pick scopes from that list.",
                        param=f"{hint_param}.scopes", code=CODE_INVALID_APPROVAL_HINT)
                tightened = tightened or narrowed != scopes
                scopes = narrowed
            if "expires_in" in h and h["expires_in"] < expires_in:
                expires_in, tightened = h["expires_in"], True
            if h.get("bind_arguments") is True and not bind:
                bind, tightened = True, True
            if tightened:
                source += "+definition"
        return EffectiveApproval(required=required, scopes=tuple(scopes), expires_in=int(expires_in),
                                 grant_expires_in=dict(self.grant_expires_in), bind_arguments=bind,
                                 message=message, source=source)


def _identity(tool: FunctionSpec | ToolIdentity | str) -> ToolIdentity:
    """The identity rules match on; a string (a flat name) counts as a top-level tool."""
    if isinstance(tool, str):
        return ToolIdentity(None, tool)
    if isinstance(tool, FunctionSpec):
        return tool.identity
    if isinstance(tool, ToolIdentity):
        return tool
    raise TypeError(f"expected a FunctionSpec, ToolIdentity or flat name, got {type(tool).__name__}")


# --------------------------------------------------------------------------------------------------
# loading


def load_policy(path: str | Path) -> ApprovalPolicy:
    """Read the operator's policy file: ``.toml`` with :mod:`tomllib`, anything else as JSON.

    Raises :class:`PolicyFileError` (naming the file and the key) for unreadable, unparsable or
    invalid files.
    """
    p = Path(path)
    try:
        raw = p.read_bytes()
    except OSError as exc:
        raise PolicyFileError(f"cannot read approval policy {str(p)!r}: {exc.strerror or exc}") from exc
    if p.suffix.lower() == ".toml":
        try:
            import tomllib  # Python 3.11+
        except ModuleNotFoundError:  # pragma: no cover - Python 3.10
            try:
                import tomli as tomllib  # type: ignore[no-redef]
            except ModuleNotFoundError as exc:
                raise PolicyFileError(f"{str(p)!r} is TOML, which needs Python 3.11+ (or the `tomli` "
                                      "package); write the policy as JSON instead") from exc
        try:
            data = tomllib.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
            raise PolicyFileError(f"approval policy {str(p)!r} is not valid TOML: {exc}") from exc
    else:
        try:
            data = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, ValueError) as exc:
            raise PolicyFileError(f"approval policy {str(p)!r} is not valid JSON: {exc}") from exc
    return _parse_policy(data, str(p))


def _fail(origin: str, key: str, message: str) -> PolicyFileError:
    return PolicyFileError(f"{origin}: {key}: {message}", key=key)


def _check_keys(data: Mapping[str, Any], allowed: frozenset[str], prefix: str, origin: str) -> None:
    for key in data:
        if key not in allowed:
            where = f"{prefix}.{key}" if prefix else str(key)
            raise _fail(origin, where, f"unknown key; expected one of {sorted(allowed)}")


def _duration(value: Any, key: str, origin: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or value <= 0 or value != int(value):
        raise _fail(origin, key, f"must be a positive whole number of seconds, got {value!r}")
    return int(value)


def _bool(value: Any, key: str, origin: str) -> bool:
    if not isinstance(value, bool):
        raise _fail(origin, key, f"must be true or false, got {value!r}")
    return value


def _scopes(value: Any, key: str, origin: str) -> tuple[str, ...]:
    if not isinstance(value, list) or not value:
        raise _fail(origin, key, f"must be a non-empty list of scopes from {list(SCOPES)}")
    for i, scope in enumerate(value):
        if scope not in SCOPES:
            raise _fail(origin, f"{key}[{i}]", f"{scope!r} is not a scope; expected one of "
                                               f"{list(SCOPES)}")
    return canonical_scopes(value)


def _approval(value: Any, key: str, origin: str) -> bool:
    if value not in _APPROVAL_VALUES:
        raise _fail(origin, key, f"must be \"required\" or \"none\", got {value!r}")
    return value == "required"


def _parse_policy(data: Any, origin: str) -> ApprovalPolicy:
    if not isinstance(data, Mapping):
        raise _fail(origin, "(top level)", "must be an object / table")
    _check_keys(data, _TOP_KEYS, "", origin)
    default_required = _approval(data.get("default_approval", "none"), "default_approval", origin)
    expires_in = _duration(data.get("expires_in", DEFAULT_EXPIRES_IN), "expires_in", origin)
    scopes = _scopes(data["scopes"], "scopes", origin) if "scopes" in data else SCOPES
    bind = _bool(data.get("bind_arguments", False), "bind_arguments", origin)
    grant_ttl = dict(DEFAULT_GRANT_EXPIRES_IN)
    if "grant_expires_in" in data:
        raw_ttl = data["grant_expires_in"]
        if not isinstance(raw_ttl, Mapping):
            raise _fail(origin, "grant_expires_in", "must be an object with `session` and/or `always`")
        _check_keys(raw_ttl, frozenset({"session", "always"}), "grant_expires_in", origin)
        for scope, seconds in raw_ttl.items():
            grant_ttl[scope] = _duration(seconds, f"grant_expires_in.{scope}", origin)
    rules_raw = data.get("rules", [])
    if not isinstance(rules_raw, list):
        raise _fail(origin, "rules", "must be a list of rules ([[rules]] in TOML)")
    rules = []
    for i, raw in enumerate(rules_raw):
        key = f"rules[{i}]"
        if not isinstance(raw, Mapping):
            raise _fail(origin, key, "must be an object / table")
        _check_keys(raw, _RULE_KEYS, key, origin)
        tools = raw.get("tools")
        if isinstance(tools, str):
            tools = [tools]
        if not isinstance(tools, list) or not tools:
            raise _fail(origin, f"{key}.tools", "must be a non-empty list of tool name globs")
        for j, pattern in enumerate(tools):
            if not isinstance(pattern, str) or not pattern:
                raise _fail(origin, f"{key}.tools[{j}]", f"must be a non-empty string, got {pattern!r}")
        if "approval" not in raw:
            raise _fail(origin, f"{key}.approval", "is required (\"required\" or \"none\")")
        message = raw.get("message")
        if message is not None and not isinstance(message, str):
            raise _fail(origin, f"{key}.message", f"must be a string, got {message!r}")
        rules.append(Rule(
            tools=tuple(tools),
            required=_approval(raw["approval"], f"{key}.approval", origin),
            scopes=_scopes(raw["scopes"], f"{key}.scopes", origin) if "scopes" in raw else None,
            expires_in=(_duration(raw["expires_in"], f"{key}.expires_in", origin)
                        if "expires_in" in raw else None),
            bind_arguments=(_bool(raw["bind_arguments"], f"{key}.bind_arguments", origin)
                            if "bind_arguments" in raw else None),
            message=message, index=i))
    return ApprovalPolicy(rules=tuple(rules), default_required=default_required, scopes=scopes,
                          expires_in=expires_in, grant_expires_in=grant_ttl, bind_arguments=bind)
