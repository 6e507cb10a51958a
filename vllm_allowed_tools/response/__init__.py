"""The response path: every tool call leaving the server is judged here (no vLLM import).

Unary answers go through :func:`check_chat_completion` / :func:`check_responses_object`; streams
through :class:`GuardedSSE` over a :class:`ChatStreamGuard` or a :class:`ResponsesStream` whose
steps are the :class:`ResponsesStreamGuard` and, with approvals on, the approval step. What is
withheld, when a stream fails and how it is renumbered: ``docs/response-path.md``.
"""

from .call_names import AllowedNames, request_tools
from .chat_guard import ChatStreamGuard
from .guarded_sse import GuardedSSE
from .responses_guard import ResponsesStreamGuard
from .responses_stream import NEXT_NUMBER, ResponsesStream, run_in_threads, run_sync
from .unary import check_chat_completion, check_responses_object
from .violations import (
    CODE_VIOLATION,
    SOURCE_UNREADABLE,
    AllowedToolsViolation,
    CallFilter,
    unreadable_violation,
)

__all__ = [
    "CODE_VIOLATION",
    "NEXT_NUMBER",
    "SOURCE_UNREADABLE",
    "AllowedNames",
    "AllowedToolsViolation",
    "CallFilter",
    "ChatStreamGuard",
    "GuardedSSE",
    "ResponsesStream",
    "ResponsesStreamGuard",
    "check_chat_completion",
    "check_responses_object",
    "request_tools",
    "run_in_threads",
    "run_sync",
    "unreadable_violation",
]
