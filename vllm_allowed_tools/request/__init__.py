"""The request path: read a request's tools and tool_choice into the turn's allowlist, and rewrite
the request so vLLM renders a stable catalog and the parser sees the allowlist.

The names most of the package uses are re-exported here; a module's own detail is imported from
that module."""
from .turn_allowlist import Choice, TurnAllowlist, resolve_allowlist, resolve_callable_catalog
from .catalog import Api, catalog_digest
from .digest import NotCanonicalJSON, canonical_json_bytes, text_digest, value_digest
from .identity import NAMESPACE_SEPARATOR, FunctionSpec, ToolIdentity, flat_name, function_digest
from .json_text import NotStrictJSON, strict_json_loads

__all__ = [
    "NAMESPACE_SEPARATOR",
    "Api",
    "Choice",
    "FunctionSpec",
    "NotCanonicalJSON",
    "NotStrictJSON",
    "ToolIdentity",
    "TurnAllowlist",
    "canonical_json_bytes",
    "catalog_digest",
    "flat_name",
    "function_digest",
    "resolve_allowlist",
    "resolve_callable_catalog",
    "strict_json_loads",
    "text_digest",
    "value_digest",
]
