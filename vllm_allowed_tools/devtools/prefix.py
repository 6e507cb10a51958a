"""Prefix-stability check anyone can run: how much of the prompt survives a change of allowed subset?

Given a transcript (``{"messages": [...], "tools": [...]}`` as JSON, tools in Chat Completions or
Responses shape), one of our chat templates, a tokenizer (a tiny-model folder or any Hugging Face
``tokenizer.json``) and two per-turn policies, it renders both prompts exactly as the server does,
tokenizes them, and reports the token-level longest common prefix (LCP), where it ends (token index
and character offset) and where each prompt's policy block starts::

    python -m vllm_allowed_tools.devtools.prefix transcript.json --model-dir DIR --template hermes \\
        --a get_weather,list_files --b send_email --mode-a auto --mode-b required [--json]

``--a ""`` (or ``--b ""``) renders a plain request, without a policy block. With our templates the
LCP always reaches the policy block: changing the subset (or the mode) changes no token before it.
The exit status is 0 when it does, 1 when it does not, 2 on bad input.

No vLLM import: rendering goes through :mod:`vllm_allowed_tools.templates.render` and tokenization through the
``tokenizers`` library (``add_special_tokens=False``, as vLLM tokenizes a rendered chat prompt).
Before rendering, messages get the one normalization vLLM applies to every template's input: assistant
``tool_calls[].function.arguments`` given as JSON text become objects (invalid or non-object JSON
becomes ``{}``).

:func:`policy_block_offset` is what other code (benchmarks) uses to find the block in a rendered
prompt.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import jinja2

from ..formats import wire_formats
from ..request.template_probe import common_prefix_length
from ..templates.render import render_chat

__all__ = [
    "POLICY_BLOCK_MARKERS",
    "PrefixReport",
    "compare_policies",
    "load_tokenizer",
    "load_transcript",
    "normalize_messages",
    "policy_block_offset",
    "render_with_policy",
]

#: the text every bundled template's policy block starts with, by template name
POLICY_BLOCK_MARKERS: dict[str, str] = {entry.template: entry.policy_block_marker
                                        for entry in wire_formats() if entry.template is not None}


def policy_block_offset(rendered: str, template: str | None = None) -> int | None:
    """Character offset where the per-turn policy block starts in `rendered`, or None without one.

    The block is the last one in the prompt (it sits at the tail), so a user message that merely
    quotes the marker text earlier in the history is not mistaken for it. Without `template`, every
    bundled template's marker is tried.
    """
    markers = [POLICY_BLOCK_MARKERS[template]] if template in POLICY_BLOCK_MARKERS else \
        sorted(set(POLICY_BLOCK_MARKERS.values()))
    found = [rendered.rfind(marker) for marker in markers]
    best = max(found)
    return None if best < 0 else best


def normalize_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """A copy of `messages` as vLLM hands them to a template (tool-call arguments as objects)."""
    out = copy.deepcopy([dict(message) for message in messages])
    for message in out:
        if message.get("role") != "assistant" or not isinstance(message.get("tool_calls"), list):
            continue
        if not message["tool_calls"]:
            del message["tool_calls"]
            continue
        for call in message["tool_calls"]:
            function = call.get("function") if isinstance(call, dict) else None
            if not isinstance(function, dict):
                continue
            arguments = function.get("arguments")
            if isinstance(arguments, str):
                try:
                    arguments = json.loads(arguments) if arguments else {}
                except ValueError:
                    arguments = {}
            function["arguments"] = arguments if isinstance(arguments, dict) else {}
    return out


def _chat_tool(tool: Mapping[str, Any]) -> dict[str, Any]:
    """A tool in Chat Completions shape (Responses function tools are converted)."""
    if "function" in tool:
        return dict(tool)
    if tool.get("type") == "function" and "name" in tool:
        function = {key: tool[key] for key in ("name", "description", "parameters", "strict")
                    if key in tool}
        return {"type": "function", "function": function}
    raise ValueError(f"not a function tool: {json.dumps(tool)[:120]}")


def load_transcript(path: str | Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(messages, tools) from a JSON file ``{"messages": [...], "tools": [...]}``."""
    data = json.loads(Path(path).read_text(encoding="utf-8"))
    if not isinstance(data, dict) or not isinstance(data.get("messages"), list):
        raise TypeError(f"{path}: expected a JSON object with a `messages` list (and `tools`)")
    tools = data.get("tools") or []
    if not isinstance(tools, list):
        raise TypeError(f"{path}: `tools` must be a list")
    return data["messages"], [_chat_tool(tool) for tool in tools]


class _Tokenizer:
    """The bits of a Hugging Face tokenizer the check needs (ids and character offsets)."""

    def __init__(self, tokenizer_json: Path, config: Mapping[str, Any]):
        from tokenizers import Tokenizer
        self._tokenizer = Tokenizer.from_file(str(tokenizer_json))
        self.template_kwargs = {key: _token_text(config.get(key)) for key in ("bos_token", "eos_token")
                                if _token_text(config.get(key))}

    def encode(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        encoding = self._tokenizer.encode(text, add_special_tokens=False)
        return list(encoding.ids), [tuple(span) for span in encoding.offsets]


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):   # AddedToken serialized as {"content": ...}
        value = value.get("content")
    return value if isinstance(value, str) and value else None


def load_tokenizer(path: str | Path) -> _Tokenizer:
    """A tokenizer from a model folder (tokenizer.json + tokenizer_config.json) or a tokenizer.json."""
    path = Path(path)
    tokenizer_json = path / "tokenizer.json" if path.is_dir() else path
    if not tokenizer_json.is_file():
        raise FileNotFoundError(f"no tokenizer.json at {tokenizer_json}; pass a model folder that has "
                                "one (e.g. a tiny model: `vllm-allowed-tools build-model DIR`) or the "
                                "file itself")
    config_path = tokenizer_json.parent / "tokenizer_config.json"
    config = json.loads(config_path.read_text(encoding="utf-8")) if config_path.is_file() else {}
    return _Tokenizer(tokenizer_json, config)


def render_with_policy(messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]],
                       template: str, policy: Mapping[str, Any] | None,
                       **template_kwargs: Any) -> str:
    """The prompt the server renders for this turn (`policy` None: a plain request)."""
    kwargs = dict(template_kwargs)
    if policy is not None:
        kwargs["allowed_tools_policy"] = {"mode": policy["mode"], "names": sorted(policy["names"])}
    return render_chat(normalize_messages(messages), tools, template=template,
                       add_generation_prompt=True, **kwargs)


@dataclass(frozen=True)
class PrefixReport:
    """The result of one comparison; offsets are into prompt A unless named otherwise."""
    template: str
    tokens_a: int
    tokens_b: int
    lcp_tokens: int               # token-level longest common prefix
    lcp_char_end: int             # characters of A covered by the common tokens
    first_diff_char: int          # first character where the two texts differ
    policy_block_char_a: int | None
    policy_block_char_b: int | None
    policy_block_token_a: int | None   # index of the first token of A that touches A's block
    policy_block_token_b: int | None
    tokens_before_block: int      # tokens before the earlier of the two blocks (or the divergence)
    reaches_policy_block: bool    # every token before the block is shared

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def text(self) -> str:
        lines = [
            f"template            {self.template}",
            f"tokens              A={self.tokens_a}  B={self.tokens_b}",
            (f"common prefix       {self.lcp_tokens} tokens, ends at char {self.lcp_char_end} of A "
             f"(texts first differ at char {self.first_diff_char})"),
            (f"policy block        A: char {_fmt(self.policy_block_char_a)}, token "
             f"{_fmt(self.policy_block_token_a)}; B: char {_fmt(self.policy_block_char_b)}, token "
             f"{_fmt(self.policy_block_token_b)}"),
        ]
        if self.reaches_policy_block:
            lines.append(f"before the block    {self.tokens_before_block} tokens, all shared (the common "
                         f"prefix runs {self.lcp_tokens - self.tokens_before_block} tokens past it)")
        else:
            lines.append(f"before the block    {self.tokens_before_block} tokens, only {self.lcp_tokens} "
                         "shared: PREFIX BROKEN before the block")
        return "\n".join(lines)


def _fmt(value: int | None) -> str:
    return "-" if value is None else str(value)


def _first_token_at(offsets: Sequence[tuple[int, int]], char: int) -> int:
    """Index of the first token whose span ends after `char` (the token touching that character)."""
    for index, (_, end) in enumerate(offsets):
        if end > char:
            return index
    return len(offsets)


def compare_texts(text_a: str, text_b: str, tokenizer: _Tokenizer, template: str) -> PrefixReport:
    """Token-level LCP of two rendered prompts, with the policy blocks located."""
    ids_a, offsets_a = tokenizer.encode(text_a)
    ids_b, offsets_b = tokenizer.encode(text_b)
    lcp = common_prefix_length(ids_a, ids_b)
    lcp_char_end = offsets_a[lcp - 1][1] if lcp else 0
    first_diff = common_prefix_length(text_a, text_b)
    block_a = policy_block_offset(text_a, template)
    block_b = policy_block_offset(text_b, template)
    token_a = None if block_a is None else _first_token_at(offsets_a, block_a)
    token_b = None if block_b is None else _first_token_at(offsets_b, block_b)
    # what must be shared: every token before the first block, or (two plain prompts) before the
    # first token that touches the first differing character
    candidates = [t for t in (token_a, token_b) if t is not None]
    limit = min(candidates) if candidates else _first_token_at(offsets_a, first_diff)
    return PrefixReport(template=template, tokens_a=len(ids_a), tokens_b=len(ids_b), lcp_tokens=lcp,
                        lcp_char_end=lcp_char_end, first_diff_char=first_diff,
                        policy_block_char_a=block_a, policy_block_char_b=block_b,
                        policy_block_token_a=token_a, policy_block_token_b=token_b,
                        tokens_before_block=limit, reaches_policy_block=lcp >= limit)


def compare_policies(messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]],
                     tokenizer: _Tokenizer, template: str, policy_a: Mapping[str, Any] | None,
                     policy_b: Mapping[str, Any] | None) -> PrefixReport:
    """Render the transcript under two policies (None: plain) and compare the prompts' tokens."""
    text_a = render_with_policy(messages, tools, template, policy_a, **tokenizer.template_kwargs)
    text_b = render_with_policy(messages, tools, template, policy_b, **tokenizer.template_kwargs)
    return compare_texts(text_a, text_b, tokenizer, template)


def _policy(names: str, mode: str, catalog: set[str]) -> dict[str, Any] | None:
    selected = sorted({name.strip() for name in names.split(",") if name.strip()})
    if not selected:
        return None
    unknown = [name for name in selected if name not in catalog]
    if unknown:
        raise ValueError(f"not in the transcript's tools: {', '.join(unknown)} "
                         f"(catalog: {', '.join(sorted(catalog)) or 'empty'})")
    return {"mode": mode, "names": selected}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m vllm_allowed_tools.devtools.prefix",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("transcript", type=Path, help='JSON file: {"messages": [...], "tools": [...]}')
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--model-dir", type=Path, help="model folder with tokenizer.json")
    source.add_argument("--tokenizer", type=Path, help="a tokenizer.json file")
    parser.add_argument("--template", default="hermes",
                        help="bundled template name or a .jinja path (default: hermes)")
    parser.add_argument("--a", default="", help='subset A, comma-separated names ("" = plain request)')
    parser.add_argument("--b", default="", help="subset B, comma-separated names")
    parser.add_argument("--mode-a", choices=("auto", "required"), default="auto")
    parser.add_argument("--mode-b", choices=("auto", "required"), default="auto")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    args = parser.parse_args(argv)
    try:
        messages, tools = load_transcript(args.transcript)
        catalog = {tool["function"]["name"] for tool in tools}
        policy_a = _policy(args.a, args.mode_a, catalog)
        policy_b = _policy(args.b, args.mode_b, catalog)
        tokenizer = load_tokenizer(args.model_dir or args.tokenizer)
        report = compare_policies(messages, tools, tokenizer, args.template, policy_a, policy_b)
    except (OSError, ValueError, KeyError, TypeError, jinja2.TemplateError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(report.as_dict(), indent=2) if args.json else report.text())
    return 0 if report.reaches_policy_block else 1


if __name__ == "__main__":
    sys.exit(main())
