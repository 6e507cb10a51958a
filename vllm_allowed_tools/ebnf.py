"""xgrammar's EBNF as text that xgrammar reads back as the same grammar.

Both sides print grammars: the request path compiles a custom tool's Lark or regex grammar to EBNF
once (and carries that text), the decode path splices schemas' EBNF into its own. xgrammar's
printer writes U+00E9 followed by ``a`` as ``\\xe9a``, which its reader takes for U+0E9A, so every
printed grammar goes through :func:`ebnf_text`. No vLLM or xgrammar import: it reads ``str()``.
"""

from __future__ import annotations

import re

_PRINTED_X = re.compile(r"(?<!\\)((?:\\\\)*)\\x([0-9A-Fa-f]{2})")


def ebnf_text(grammar: object) -> str:
    """``str(grammar)`` of an xgrammar ``Grammar``, every ``\\xHH`` written as the exact
    ``\\u00HH``."""
    return _PRINTED_X.sub(lambda match: f"{match.group(1)}\\u00{match.group(2)}", str(grammar))
