"""Choose, at start-up, where the per-turn policy enters the served chat template's prompt.

The template is the model's own (the tokenizer's, or ``--chat-template``), served unmodified; the
probe (:mod:`..request.template_probe`) renders probe conversations through it with the served
tokenizer and picks the first placement that keeps the history a stable, cacheable prefix. A
template for which none passes stops the server with a capability error naming it and why, unless
the operator opted into catalog filtering. Requests that bring their own ``chat_template`` (only
honoured by vLLM with ``--trust-request-chat-template``) are probed the same way, once per template.
gpt-oss has no template on vLLM's harmony path: its prompts are probed as harmony renders them
(:mod:`.harmony_prompt`).
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import CapabilityError
from ..launch import LaunchArgs
from ..request.placement import FILTER_CATALOG, PROBE_ORDER
from ..request.template_probe import PROBE_TOOLS, ProbeResult, probe_template
from ..settings import Settings
from .harmony_prompt import HarmonyPrompt, serves_harmony

logger = logging.getLogger("vllm.allowed_tools")

#: opt-in fallback where no placement passes the probe: ``filter-catalog``
FALLBACK_ENV = Settings.variable("fallback")

Render = Callable[[list, list, dict], str]


@dataclass(frozen=True)
class ServedTemplate:
    """The served template, rendered the way vLLM renders it (tokenizer's ``apply_chat_template``)."""
    origin: str
    text: str | None
    tokenizer: Any

    def render(self, messages: list, tools: list, variables: dict) -> str:
        return self.tokenizer.apply_chat_template(
            messages, tools=tools, chat_template=self.resolved(), tokenize=False,
            add_generation_prompt=True, **variables)

    def resolved(self) -> str:
        return self.tokenizer.get_chat_template(self.text, tools=PROBE_TOOLS)

    def tokenize(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def with_text(self, text: str, origin: str) -> ServedTemplate:
        return ServedTemplate(origin=origin, text=text, tokenizer=self.tokenizer)


@dataclass
class PlacementChoice:
    """The placement this server uses for its template, and the probe for request templates."""
    placement: str
    origin: str
    served: ServedTemplate | None = None
    #: the probe that chose the placement (None: not probed), with what it cannot keep reusable
    probe: ProbeResult | None = None
    _request_templates: dict[str, ProbeResult] | None = None

    @property
    def filter_catalog(self) -> bool:
        return self.placement == FILTER_CATALOG

    @property
    def notes(self) -> list[str]:
        """What the prefix cache cannot reuse under this template although the placement passed."""
        return self.probe.reuse_notes() if self.probe else []

    def for_request_template(self, text: str) -> ProbeResult:
        """The placement for a template a request brings (cached by content, at most 64)."""
        cache = self._request_templates = self._request_templates or {}
        key = hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()
        if key not in cache:
            if self.served is None:
                return ProbeResult(None, {"probe": "the served tokenizer could not be loaded"})
            if len(cache) >= 64:
                cache.pop(next(iter(cache)))
            template = self.served.with_text(text, "the request's chat_template")
            cache[key] = probe_template(template.render, template.tokenize)
        return cache[key]


def _template_text(launch: LaunchArgs) -> tuple[str | None, str | None]:
    value = launch.chat_template
    if value is None:
        return None, None
    path = Path(value)
    if path.is_file():
        return path.read_text(encoding="utf-8"), str(path)
    return value, "the --chat-template literal"


def load_served_template(launch: LaunchArgs) -> ServedTemplate:
    """The served tokenizer and template; raises CapabilityError saying what could not be read."""
    source = launch.tokenizer or launch.model
    if source is None:
        raise CapabilityError("cannot tell which model this server serves (no model argument)",
                              capability="chat_template", status=500)
    try:
        from transformers import AutoTokenizer
        tokenizer = AutoTokenizer.from_pretrained(
            source, revision=launch.tokenizer_revision, trust_remote_code=launch.trust_remote_code)
    except Exception as exc:
        raise CapabilityError(f"could not load the tokenizer of {source!r} to probe its chat "
                              f"template ({type(exc).__name__}: {exc})", capability="chat_template",
                              status=500) from exc
    text, origin = _template_text(launch)
    return ServedTemplate(origin=origin or f"{source}'s own chat template", text=text,
                          tokenizer=tokenizer)


def choose_placement(settings: Settings,
                     load: Callable[[LaunchArgs], ServedTemplate] = load_served_template
                     ) -> PlacementChoice:
    """The placement for this server's template (see the module docstring); logs the choice."""
    requested, launch = settings.placement, settings.launch
    if requested == FILTER_CATALOG:
        return _chosen(PlacementChoice(FILTER_CATALOG, "the operator's choice"), "forced")
    if not launch.is_server:
        # not a server command line (a test app): our templates' variable, nothing to probe
        return PlacementChoice(PROBE_ORDER[0], "no served template")
    check_tokenizer_mode(launch)
    served = HarmonyPrompt() if serves_harmony(launch) else load(launch)
    order = PROBE_ORDER if requested == "auto" else (requested,)
    result = probe_template(served.render, served.tokenize, order)
    if result.placement is not None:
        return _chosen(PlacementChoice(result.placement, served.origin, served, result), "probed")
    if settings.fallback == FILTER_CATALOG:
        logger.warning("vllm-allowed-tools: no policy placement fits %s (%s); filtering the "
                       "catalog instead, as %s asks", served.origin, result.explain(), FALLBACK_ENV)
        return PlacementChoice(FILTER_CATALOG, served.origin, served)
    advice = "a template that renders every message of an agent conversation, tool calls and " \
        "results included" if result.dropped else "a template that can"
    raise CapabilityError(
        f"the chat template ({served.origin}) cannot take the per-turn allowed-tools policy after "
        f"a stable prompt prefix: {result.explain()}. Serve {advice} (ours: "
        "vllm_allowed_tools.templates), or opt in to catalog filtering with "
        f"{FALLBACK_ENV}={FILTER_CATALOG} (breaks prompt-cache reuse when the subset changes)",
        capability="chat_template", status=500)


def check_tokenizer_mode(launch: LaunchArgs) -> None:
    """Raise CapabilityError for a tokenizer mode whose prompts no chat template renders."""
    if launch.tokenizer_mode == "mistral":
        raise CapabilityError(
            "--tokenizer-mode mistral renders prompts with mistral-common, which takes no chat "
            "template, so the per-turn allowed-tools policy cannot be placed (and vLLM refuses "
            "chat_template_kwargs there). Serve the model with --tokenizer-mode auto and its "
            "Hugging Face chat template (or ours: vllm_allowed_tools.templates)",
            capability="chat_template", status=500)


def _chosen(choice: PlacementChoice, how: str) -> PlacementChoice:
    logger.info("vllm-allowed-tools: chat template %s: the per-turn policy goes in by %s (%s)",
                choice.origin, choice.placement, how)
    if choice.probe is not None and choice.probe.user_turn_note:
        logger.warning("vllm-allowed-tools: chat template %s: %s", choice.origin,
                       choice.probe.user_turn_note)
    if choice.probe is not None and choice.probe.reasoning_note:
        logger.info("vllm-allowed-tools: chat template %s: %s", choice.origin,
                    choice.probe.reasoning_note)
    return choice
