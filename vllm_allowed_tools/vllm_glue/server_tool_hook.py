"""The hook in vLLM's server-side tool loop: every call is decided before vLLM runs it.

vLLM 0.32/0.33 run gpt-oss's built-in tools inside the Responses handler
(``OpenAIServingResponses._generate_with_builtin_tools``): after each generation it asks
``context.need_builtin_tool_call()`` and, when that says yes, ``await context.call_tool()`` runs
the call on the tool server's session. The narrowest place to decide is that predicate, on
``HarmonyContext``: it is asked once per call, right before the call runs, with the exact message
(``context.messages[-1]``: recipient and arguments) that ``call_tool`` dispatches; answering False
ends the loop there, so the response ends with the call, unexecuted (the output guard then sends
the approval item, or refuses the turn). ``call_tool`` is wrapped as the backstop: a message the
predicate did not decide "execute" (for this very message object, once) is refused, never run.

A third, small wrapper runs only on a request that resumes an approved call: before the loop's
first generation it appends the recorded call to the conversation and runs it through the same
``call_tool`` (or, when the store says it ran already, appends its recorded output), then renders
the prompt as the loop does between turns (``render_responses_harmony_messages``).

:func:`install` checks that these methods exist with the shapes read here; where they do not
(another vLLM), nothing is patched and server-side tools are refused while a policy applies.
"""

from __future__ import annotations

import functools
import inspect
import logging
from typing import Any

from ..metrics import record_server_tool_failure
from ..server_tools.server_turn import HookStatus, ServerTurn, registered, set_hook_status
from . import harmony_tools
from ..server_tools.runs import (
    failure_text,
    incomplete_reason,
    note_end,
    tool_error,
    watching_errors,
)

logger = logging.getLogger("vllm.allowed_tools.server_tools")  # under vLLM's logger

_INSTALLED: list[bool] = []
#: the tool servers of this process's Responses handlers (their tool listings feed the grammar)
_TOOL_SERVERS: list[Any] = []

#: vLLM versions whose loop this hook was read against (0.33: checked in its source)
VERIFIED_ON = ("0.32", "0.33")


def _turn_of(context: Any) -> ServerTurn | None:
    request = getattr(context, "request", None)
    return registered(getattr(request, "model_extra", None) or {})


def _arguments(message: Any) -> str:
    try:
        return message.content[0].text
    except (AttributeError, IndexError, TypeError):
        return ""


def _refusal_messages(message: Any, text: str) -> list[Any]:
    """What the model sees for a call that was not run (the shape vLLM gives a tool's output)."""
    from openai_harmony import Author, Message, Role, TextContent
    return [Message(author=Author(role=Role.TOOL, name=message.recipient),
                    content=[TextContent(text=text)], recipient=Role.ASSISTANT,
                    channel=message.channel)]


def _output_text(messages: Any) -> str:
    try:
        return "".join(c.text for m in messages for c in m.content if hasattr(c, "text"))
    except TypeError:
        return ""


def check() -> HookStatus:
    """Whether vLLM's loop has the methods the hook wraps, with the shapes read here."""
    try:
        import vllm
        from vllm.entrypoints.openai.responses.context import HarmonyContext
        from vllm.entrypoints.openai.responses.serving import OpenAIServingResponses
    except ImportError as exc:
        return HookStatus(False, f"vLLM's Responses loop cannot be imported ({exc})")
    version = getattr(vllm, "__version__", "?")
    problems = []
    for owner, name, is_async in ((HarmonyContext, "need_builtin_tool_call", False),
                                  (HarmonyContext, "call_tool", True),
                                  (HarmonyContext, "append_tool_output", False),
                                  (HarmonyContext, "append_output", False),
                                  (OpenAIServingResponses, "_generate_with_builtin_tools", None)):
        method = getattr(owner, name, None)
        if method is None:
            problems.append(f"{owner.__name__}.{name} is missing")
        elif is_async is True and not inspect.iscoroutinefunction(method):
            problems.append(f"{owner.__name__}.{name} is not a coroutine function")
        elif is_async is None and not inspect.isasyncgenfunction(method):
            problems.append(f"{owner.__name__}.{name} is not an async generator")
    params = inspect.signature(OpenAIServingResponses._generate_with_builtin_tools).parameters \
        if hasattr(OpenAIServingResponses, "_generate_with_builtin_tools") else {}
    for name in ("engine_input", "sampling_params", "context", "tok_params"):
        if name not in params:
            problems.append(f"_generate_with_builtin_tools has no {name!r} parameter")
    problems += [f"{name} is missing" for name in harmony_tools.missing()]
    if problems:
        return HookStatus(False, f"vLLM {version}: " + "; ".join(problems), VERIFIED_ON)
    if not any(version.startswith(v) for v in VERIFIED_ON):
        return HookStatus(False, f"vLLM {version}: the server-side tool hook is verified on vLLM "
                                 f"{', '.join(VERIFIED_ON)} only", VERIFIED_ON)
    return HookStatus(True, f"vLLM {version}: need_builtin_tool_call / call_tool wrapped",
                      VERIFIED_ON)


def install() -> HookStatus:
    """Wrap the loop's methods once per process (idempotent); the result is what the middleware
    reads to accept or refuse server-side tools."""
    status = check()
    if not status.installed:
        set_hook_status(status)
        logger.warning("vllm-allowed-tools: server-side tools are refused while a policy applies: %s",
                       status.reason)
        return status
    if _INSTALLED:
        set_hook_status(status)
        return status
    from vllm.entrypoints.openai.responses.context import HarmonyContext, ParsableContext
    from vllm.entrypoints.openai.responses.serving import OpenAIServingResponses

    harmony_tools.install()
    HarmonyContext.append_output = _noting_the_end(HarmonyContext.append_output)
    HarmonyContext.need_builtin_tool_call = _deciding(HarmonyContext.need_builtin_tool_call)
    HarmonyContext.call_tool = _backstopped(HarmonyContext.call_tool)
    OpenAIServingResponses._generate_with_builtin_tools = _resuming(
        OpenAIServingResponses._generate_with_builtin_tools, HarmonyContext)
    ParsableContext.need_builtin_tool_call = _never_with_a_turn(ParsableContext.need_builtin_tool_call)
    OpenAIServingResponses.__init__ = _remembering(OpenAIServingResponses.__init__)
    _INSTALLED.append(True)
    set_hook_status(status)
    logger.info("vllm-allowed-tools: server-side tool hook installed (%s)", status.reason)
    return status


def _remembering(init: Any) -> Any:
    @functools.wraps(init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        if getattr(self, "tool_server", None) is not None:
            _TOOL_SERVERS.append(self.tool_server)
    return __init__


def tool_schemas(builtin: str) -> dict[str, Any] | None:
    """The tools the tool server lists for ``builtin`` (name -> input JSON schema), as vLLM read
    them at start-up; None when unknown (no tool server, or no listing for it)."""
    for server in _TOOL_SERVERS:
        try:
            if not server.has_tool(builtin):
                continue
            config = server.get_tool_description(builtin)
        except Exception:   # noqa: BLE001, S112 - a listing we cannot read is no listing
            continue
        tools = getattr(config, "tools", None)
        if tools:
            return {tool.name: getattr(tool, "parameters", None) or {"type": "object"}
                    for tool in tools}
    return None


def _deciding(need: Any) -> Any:
    """``need_builtin_tool_call``: vLLM's answer, then the turn's decision (the call runs only
    when it is "execute")."""
    @functools.wraps(need)
    def need_builtin_tool_call(self: Any) -> bool:
        if not need(self):
            return False   # vLLM runs nothing for this message
        message = self.messages[-1]
        turn = _turn_of(self)
        if turn is None:   # no decision can be taken: never run it
            logger.error("vllm-allowed-tools: a server-side call to %r reached vLLM's loop "
                         "without a decision; it was not run", message.recipient)
            return False
        broken = incomplete_reason(self, message, _arguments(message))
        if broken is not None:   # decided only when complete: never run, never asked about
            metric, why = broken
            if turn.incomplete(message.recipient, _arguments(message), why) is not None:
                record_server_tool_failure(metric)
                logger.info("vllm-allowed-tools: server-side call %r not run: %s",
                            message.recipient, why)
            return False
        decision = turn.decide(message.recipient, _arguments(message), message)
        if decision is None:
            return False
        if decision.verdict != "execute":
            logger.info("vllm-allowed-tools: server-side call %r %s: %s", message.recipient,
                        "paused" if decision.verdict == "pause" else "refused", decision.reason)
        return decision.verdict == "execute"
    return need_builtin_tool_call


def _backstopped(call: Any) -> Any:
    """``call_tool``: runs only a message decided "execute", once; anything else is refused."""
    @functools.wraps(call)
    async def call_tool(self: Any) -> list[Any]:
        message = self.messages[-1] if self.messages else None
        turn = _turn_of(self)
        decision = turn.authorize(message, message.recipient, _arguments(message)) \
            if turn is not None and message is not None else None
        if decision is None:   # the backstop: undecided, refused, or run already
            logger.error("vllm-allowed-tools: refused to run an undecided server-side call %r",
                         getattr(message, "recipient", None))
            return _refusal_messages(message, "This tool call was not allowed; it was not run.") \
                if message is not None else []
        try:
            with watching_errors(self, decision.target.builtin) as replies:
                output = await call(self)
        except Exception as exc:   # noqa: BLE001 - the model sees the failure; the loop goes on
            text = failure_text(exc)
            turn.record(decision, None, text)
            record_server_tool_failure("raised")
            logger.warning("vllm-allowed-tools: server-side call %r failed: %s", message.recipient,
                           text)
            _relax_after_a_call(turn)
            return _refusal_messages(message, text)
        if any(tool_error(reply) for reply in replies):
            turn.record(decision, None, _output_text(output) or "the tool answered with an error")
            record_server_tool_failure("tool_error")
        else:
            turn.record(decision, _output_text(output))
        _relax_after_a_call(turn)
        return output
    return call_tool


def _noting_the_end(append_output: Any) -> Any:
    """``append_output``: remembers how each generation ended (the hook decides a call only when
    it ended with harmony's call end)."""
    @functools.wraps(append_output)
    def wrapped(self: Any, output: Any) -> None:
        append_output(self, output)
        note_end(self, output)
    return wrapped


def _relax_after_a_call(turn: ServerTurn) -> None:
    """A ``required`` turn's later generations in vLLM's loop (which reuses one SamplingParams
    object for all of them) take the turn's ``auto`` grammar: the call it required ran."""
    params, grammar = turn.sampling_params, turn.grammar_after_a_call
    if params is None or grammar is None:
        return
    from ..decode.stage import tag_digest
    from ..wire import XARGS_DIGEST, XARGS_TAG
    extra = getattr(params, "extra_args", None)
    if isinstance(extra, dict) and XARGS_TAG in extra:   # the logits-processor stage's grammar
        extra[XARGS_TAG], extra[XARGS_DIGEST] = grammar, tag_digest(grammar)
    elif getattr(params, "structured_outputs", None) is not None \
            and params.structured_outputs.structural_tag is not None:
        from vllm.sampling_params import StructuredOutputsParams
        params.structured_outputs = StructuredOutputsParams(structural_tag=grammar)
    turn.grammar_after_a_call = None


def _resuming(generate: Any, harmony_context: type) -> Any:
    """``_generate_with_builtin_tools``: a request resuming an approved call has it run (or
    shown refused) first, and its prompt rendered as the loop renders between turns."""
    @functools.wraps(generate)
    async def _generate_with_builtin_tools(self: Any, *args: Any, **kwargs: Any):
        bound = inspect.signature(generate).bind(self, *args, **kwargs)
        context = bound.arguments.get("context")
        turn = _turn_of(context) if isinstance(context, harmony_context) else None
        if turn is not None:
            turn.sampling_params = bound.arguments.get("sampling_params")
        if turn is not None and turn.resume is not None:
            await _resume(self, turn, context)
            # the resumed call is the one a required turn asked for, however it ended (run now,
            # run before, declined, no longer allowed): the generations after it are auto
            _relax_after_a_call(turn)
            engine_input = bound.arguments["engine_input"]
            bound.arguments["engine_input"] = self.online_renderer.render_responses_harmony_messages(
                context.messages, cache_salt=engine_input.get("cache_salt"),
                tok_params=bound.arguments.get("tok_params"))
        async for item in generate(*bound.args, **bound.kwargs):
            yield item
    return _generate_with_builtin_tools


def _never_with_a_turn(need: Any) -> Any:
    """ParsableContext (a non-harmony model under VLLM_USE_EXPERIMENTAL_PARSER_CONTEXT): the
    middleware refuses server-side tools there while a policy applies; one that still carries a
    turn is never run."""
    @functools.wraps(need)
    def need_builtin_tool_call(self: Any) -> bool:
        return False if _turn_of(self) is not None else need(self)
    return need_builtin_tool_call


async def _resume(serving: Any, turn: ServerTurn, context: Any) -> None:
    """Append the approved call and its output (run now exactly once, or recorded) to the
    conversation, before the loop's first generation."""
    import asyncio

    from openai_harmony import Author, Message, Role, TextContent
    resume = turn.resume
    assert resume is not None
    message = Message(author=Author(role=Role.ASSISTANT), content=[TextContent(text=resume.arguments)],
                      channel="commentary", recipient=resume.target.recipient,
                      content_type=None if resume.target.builtin == "python" else "<|constrain|>json")
    context.messages.append(message)
    if resume.refusal is not None:
        context.append_tool_output(_refusal_messages(message, resume.refusal))
        return
    decision = turn.resumed_decision(message)
    if decision.verdict != "execute":
        context.append_tool_output(_refusal_messages(message, "This tool call is not allowed this "
                                                     "turn; it was not run."))
        return
    earlier = await asyncio.to_thread(turn.claim, resume.elicitation_id, resume.target,
                                      resume.arguments)
    if earlier is not None:   # run before: its recorded output, never a second execution
        turn.authorize(message, message.recipient, resume.arguments)   # taken: it will not run
        text = earlier.output if earlier.output is not None else (
            "This tool call was started earlier and its outcome is unknown (the server stopped "
            "while it ran); it was not run again.")
        turn.record(decision, earlier.output, None if earlier.output is not None else "unknown")
        context.append_tool_output(_refusal_messages(message, text))
        return
    try:
        output = await context.call_tool()
    except Exception as exc:   # noqa: BLE001 - the model sees the failure; it is never run again
        text = f"This tool call failed: {type(exc).__name__}: {exc}"
        await asyncio.to_thread(turn.finish, resume.elicitation_id, text)
        context.append_tool_output(_refusal_messages(message, text))
        return
    await asyncio.to_thread(turn.finish, resume.elicitation_id, _output_text(output))
    context.append_tool_output(output)
