"""The request→vLLM contract: what the middleware writes into a request for our code inside vLLM,
the names both sides read it by, and the one reading of a client's ``tool_choice``.

The middleware (plain ASGI, in the API-server process) and our code inside vLLM share no state; they
agree on this package and nothing else:

* the turn's allowlist rides in the request body under :data:`ALLOWLIST_KEY`
  (:func:`allowlist_to_wire`), where vLLM keeps it in ``request.model_extra`` and our parser
  wrappers read it back as a :class:`WireAllowlist` (:mod:`.allowlist`);
* the parser wrappers put the turn's grammar, a must-call turn's reserve and the stop tokens its
  parser reads as text into ``vllm_xargs`` under :data:`XARGS_KEYS` (:mod:`.xargs`); vLLM hands
  them to the engine process as ``SamplingParams.extra_args``, where our logits processor reads
  them (``decode/stage.py``, ``decode/reasoning_hold.py``, ``decode/refused_tokens.py``);
* the client's ``tool_choice`` is read once, for both APIs and every tool type, into a
  :class:`ToolChoice` with the one set of 400s its shape makes (:mod:`.tool_choice`): the request
  path, the server-side tools and the vLLM-side grammar all read it so (``tests/test_code_shape.py``
  finds any other reader).

Every key here is removed from a client's request first (``request/rewrite.py``), so only the
plugin sets them. The allowlist carries :data:`WIRE_VERSION`, so a reader knows which shape it was
written in: one of another version is read as no allowlist (:meth:`WireAllowlist.from_wire` gives
None), never field by field as if it were its own; a change to a field's meaning bumps it.

Light on purpose (the standard library, ``call_filter.py`` and ``errors.py``, nothing from the role
folders): the request path and the engine's worker both import it without loading each other.
"""

from .allowlist import (
    ALLOWLIST_KEY,
    WIRE_VERSION,
    TurnPolicy,
    WireAllowlist,
    allowlist_to_wire,
    no_function_wire,
    with_server_recipients,
)
from .tool_choice import (
    CHAT_CUSTOM_ENTRY,
    CHAT_ENTRY,
    MODES,
    RESPONSES_ENTRY,
    AllowedToolsChoice,
    Mode,
    NamedChoice,
    ToolChoice,
    read_tool_choice,
    selection_error,
    tool_choice_of,
)
from .xargs import (
    XARGS_CATALOG,
    XARGS_CATALOG_DIGEST,
    XARGS_DIGEST,
    XARGS_ENVELOPE,
    XARGS_ENVELOPE_DIGEST,
    XARGS_GRAMMAR_KEYS,
    XARGS_KEYS,
    XARGS_MUST_CALL,
    XARGS_REFUSED_TOKENS,
    XARGS_SPLIT_KEYS,
    XARGS_TAG,
    XARGS_TEXT_UTF8,
)

__all__ = [
    "ALLOWLIST_KEY",
    "CHAT_CUSTOM_ENTRY",
    "CHAT_ENTRY",
    "MODES",
    "RESPONSES_ENTRY",
    "WIRE_VERSION",
    "XARGS_CATALOG",
    "XARGS_CATALOG_DIGEST",
    "XARGS_DIGEST",
    "XARGS_ENVELOPE",
    "XARGS_ENVELOPE_DIGEST",
    "XARGS_GRAMMAR_KEYS",
    "XARGS_KEYS",
    "XARGS_MUST_CALL",
    "XARGS_REFUSED_TOKENS",
    "XARGS_SPLIT_KEYS",
    "XARGS_TAG",
    "XARGS_TEXT_UTF8",
    "AllowedToolsChoice",
    "Mode",
    "NamedChoice",
    "ToolChoice",
    "TurnPolicy",
    "WireAllowlist",
    "allowlist_to_wire",
    "no_function_wire",
    "read_tool_choice",
    "selection_error",
    "tool_choice_of",
    "with_server_recipients",
]
