"""The model families' served tests: requests to a ``serve-tiny --parser allowed_<format>`` server,
the format's marker nudges, and the auto-mode check that pushes the random model onto the format's
call opening. test_families_e2e.py runs it on every format's server, test_parsers_e2e.py on the
Mistral and pythonic servers it starts."""

from __future__ import annotations

import random

import pytest

from vllm_allowed_tools.devtools.models.tool_pool import sample_catalog
from vllm_allowed_tools.formats import wire_format

from support.calls import chat_selection, responses_calls

MAX_TOKENS = 160


def catalog_and_subset(seed: int):
    """An 8-tool catalog of the tool pool and a sorted 2-tool subset, drawn from ``2000 + seed``."""
    rng = random.Random(2000 + seed)
    catalog = sample_catalog(rng, 8)
    return catalog, sorted(tool.name for tool in rng.sample(catalog, 2))


def served_model(family: str):
    """The model folder serve-tiny serves for the family (cached: built by the fixture's server)."""
    from vllm_allowed_tools.devtools.models.format_model import model_for_parser
    return model_for_parser("random", 0, f"allowed_{family}", log=lambda *_: None)


_NUDGES: dict[str, dict[str, float]] = {}


def nudges(family: str) -> dict[str, float]:
    """``logit_bias`` that makes the random model write each format marker as its one token, as a
    trained model does (vLLM's parsers find markers by token id when streaming; the grammar also
    admits them spelled in pieces). Nothing else is nudged: whatever else the grammar admits, the
    parser reads."""
    if family not in _NUDGES:
        from vllm_allowed_tools.devtools.models.format_model import writing_nudges
        _NUDGES[family] = writing_nudges(served_model(family), dict.fromkeys(
            wire_format(family).special_tokens, 30.0))
    return _NUDGES[family]


#: the formats whose random model, left alone in an auto turn (``nudges`` only, nothing pushed),
#: opens calls its parser reads: the auto trigger is one of the markers ``nudges`` writes as its one
#: token. An unpushed auto test holds a floor on the calls it sees there (``unpushed_floor``).
#: Measured with those tests' requests, seeds 0-7 (both stages where served): a call on every seed.
#: DeepSeek V3 and V3.1 opened a call on most seeds too, but after free text holding other DeepSeek
#: markers, which the served parser then read as no call (1 and 2 calls in 8 seeds); since the auto
#: grammar keeps every marker but the trigger out of the text (decode/free_text.py), the trigger is
#: the one nudged marker left, and they call on 8 of 8 seeds (allowed_tools auto and plain auto on
#: Responses, allowed_tools auto on Chat; both stages). Seed-OSS likewise since its trigger is
#: ``<seed:tool_call>`` (a nudged marker; it was ``<seed:tool_call>\n<function=``) and its other
#: markers are out of the text: 8 of 8, the same requests, both stages. Elsewhere no marker opens an
#: auto call (hermes, qwen3_coder, llama3_json, pythonic, llama4_pythonic, granite4, phi4_mini_json,
#: xlam, longcat): no call in 8 to 12 seeds (granite4, phi4_mini_json: one); the random model's next
#: token is near uniform (a one-token trigger about 0.08% a step), and only the pushed test
#: (``assert_auto_pushed_calls_only_allowed``) can hold a floor.
CALLS_UNPUSHED = frozenset({"kimi_k2", "glm47", "minimax_m2", "granite", "mistral", "deepseek_v3",
                            "deepseek_v31", "seed_oss"})


def unpushed_floor(family: str) -> int:
    """The fewest calls an unpushed auto test must see on ``family``'s server over its seeds: one
    where the model calls on its own (``CALLS_UNPUSHED``: it called on every seed), else none."""
    return 1 if family in CALLS_UNPUSHED else 0


def chat_request(family: str, catalog, mode: str, subset, seed: int, bias: dict | None = None) -> dict:
    return dict(model="tiny", messages=[{"role": "user", "content": "Go ahead."}],
                tools=[tool.chat_tool() for tool in catalog], tool_choice=chat_selection(mode, subset),
                parallel_tool_calls=False, max_tokens=MAX_TOKENS, temperature=1.0, seed=seed,
                logit_bias={**nudges(family), **(bias or {})})


def chat_answer(client, request: dict, stream: bool) -> list[tuple[str, str]]:
    if not stream:
        message = client.chat.completions.create(**request).choices[0].message
        return [(call.function.name, call.function.arguments) for call in message.tool_calls or []]
    calls: dict[int, list[str]] = {}
    for chunk in client.chat.completions.create(stream=True, **request):
        for call in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            entry = calls.setdefault(call.index, ["", ""])
            entry[0] += (call.function.name or "") if call.function else ""
            entry[1] += (call.function.arguments or "") if call.function else ""
    return [tuple(calls[index]) for index in sorted(calls)]


def opening_bias(family: str) -> dict[str, float] | None:
    """``logit_bias`` that opens calls in an auto turn: the trigger's token where the auto grammar
    has a one-token trigger; where calls open the message (a dispatch: ``[`` or text), ``[`` and
    the quote (strings then close soon: ``[`` is admitted inside them); None where neither is one
    token of the served vocabulary."""
    from vllm_allowed_tools.decode.grammar import AllowedFunction, build_structural_tag
    tag = build_structural_tag(family, [AllowedFunction("t", None)], "auto")
    if tag is None:
        return None
    triggers = getattr(tag.format, "triggers", None)
    openings = [triggers[0]] if triggers else ["[", '"'] if tag.format.type == "or" else []
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(str(served_model(family)))
    ids = [tokenizer.encode(opening, add_special_tokens=False) for opening in openings]
    if not ids or any(len(found) != 1 for found in ids):
        return None
    return {str(found[0]): 100 for found in ids}


def assert_auto_pushed_calls_only_allowed(family: str, server) -> None:
    """With the call opening favoured (a trigger token, or a dispatch's ``[``), the random model
    opens calls in auto turns, and each call it finishes is to an allowed tool, on both APIs, unary
    and streamed (a floor on the calls seen); a skip where the format has no one-token opening."""
    bias = opening_bias(family)
    if bias is None:
        pytest.skip(f"{family}: the auto grammar has no one-token opening to push the model onto")
    called = {"chat": 0, "responses": 0}
    for seed in range(6):
        catalog, subset = catalog_and_subset(seed)
        if seed < 4:
            calls = chat_answer(server.client(), chat_request(family, catalog, "auto", subset, seed,
                                                              bias=bias), stream=seed % 2 == 1)
        else:
            calls = [call[:2] for call in responses_calls(
                server.client(), catalog, "auto", subset, seed, max_tokens=MAX_TOKENS,
                extra_body={"logit_bias": {**nudges(family), **bias}}, stream=seed % 2 == 1).calls]
        assert all(name in subset for name, _ in calls), (family, seed, calls, subset)
        called["chat" if seed < 4 else "responses"] += len(calls)
    assert called["chat"] >= 2 and called["responses"] >= 1, (family, called, server.log_tail(30))
