"""The served-model tests' catalogs and the tool-happy model's measured figures: an 8-tool catalog
with a 2-tool allowlist per seed, and how often the tool-happy model calls outside that allowlist
with and without the policy. The serving, constraint-stage and multi-API-server tests ask the
same questions of their own servers."""

from __future__ import annotations

import json
import random

from vllm_allowed_tools.devtools.models.tool_pool import sample_catalog

from support.calls import chat_selection


def catalog_and_subset(seed: int) -> tuple[list, list[str]]:
    """An 8-tool catalog of the tool pool and 2 of its tools, drawn from ``seed``."""
    rng = random.Random(seed)
    catalog = sample_catalog(rng, 8)
    return catalog, [tool.name for tool in rng.sample(catalog, 2)]


def happy_model_violation_figures(client, trials: int) -> dict:
    """Same prompts, with and without the policy, against the tool-happy model: how often a
    response calls outside a 2-of-8 allowlist on its own, and with the policy in auto mode."""
    without, with_policy, calls_with = 0, 0, 0
    for seed in range(trials):
        catalog, allowed = catalog_and_subset(100 + seed)
        messages = [{"role": "system", "content": "You are a helpful agent."},
                    {"role": "user", "content": "Go ahead."}]
        tools = [tool.chat_tool() for tool in catalog]
        plain = client.chat.completions.create(model="tiny", messages=messages, tools=tools,
                                               max_tokens=60, temperature=1.0, seed=seed)
        names = [c.function.name for c in plain.choices[0].message.tool_calls or []]
        without += any(name not in allowed for name in names)
        governed = client.chat.completions.create(model="tiny", messages=messages, tools=tools,
                                                  tool_choice=chat_selection("auto", allowed),
                                                  max_tokens=60, temperature=1.0, seed=seed)
        names = [c.function.name for c in governed.choices[0].message.tool_calls or []]
        calls_with += bool(names)
        with_policy += any(name not in allowed for name in names)
    figures = {"trials": trials, "violation_rate_without_policy": without / trials,
               "violation_rate_with_policy": with_policy / trials,
               "responses_with_allowed_calls": calls_with / trials}
    print(json.dumps(figures))
    assert figures["violation_rate_without_policy"] >= 0.5, \
        "the adversary got weak: the test would be hollow"
    return figures
