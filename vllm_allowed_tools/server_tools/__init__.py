"""Server-side tools: the calls vLLM runs itself (gpt-oss's browser, python and container on
``/v1/responses``), decided before they run: ``docs/server-side-tools.md``. No vLLM import."""

from .tools import ServerTools, read_server_tools, recipient_target
from .server_turn import TURN_KEY, ServerTurn, ServerTurnFilter, hook_status

__all__ = ["TURN_KEY", "ServerTools", "ServerTurn", "ServerTurnFilter", "hook_status",
           "read_server_tools", "recipient_target"]
