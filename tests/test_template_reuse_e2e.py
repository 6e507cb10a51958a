"""A model's own template, served unmodified, keeps the prompt cache when only the allowed subset
changes: ``benchmarks/template_reuse.py``'s driver against real servers, at CI size.

Two real templates (Qwen3's official one and vLLM's Llama 3.1 JSON one), each served twice on the
random tiny model: with the placement the start-up probe picks, and with
``VLLM_ALLOWED_TOOLS_PLACEMENT=filter-catalog``. The same 6-turn agent transcript (full 8-tool
catalog every turn, a different allowed subset each turn, a call and its result appended per turn)
is replayed on each with the official ``openai`` SDK, ``max_tokens=1``, temperature 0.

The bound (``must``, computed by the driver from the server's own ``/tokenize``, outside the engine):
a turn must be served from the cache for the whole previous turn's history, i.e. the previous
conversation rendered by the template up to the end of its last message's content, cut to what the
template itself keeps from one turn to the next, less one token that a tokenizer may merge across
that boundary, in whole 32-token blocks: what the start-up probe guarantees. Only the last message's
closing markup, the previous turn's policy block and its generation prompt may fall outside it, so
it is also checked to lie within four blocks of the previous prompt's length (the policy message
naming three tools is about 60 of the tiny tokenizer's tokens, the rest is block rounding), and to
grow every turn.
"""

from __future__ import annotations

import pytest

from support.servers import load_script

pytestmark = pytest.mark.server

#: template (corpus name) -> the placement the probe picks for it
TEMPLATES = {"Qwen-Qwen3-0.6B": "system-message", "tool_chat_template_llama3.1_json": "system-message"}


@pytest.fixture(scope="module")
def bench():
    return load_script("benchmarks", "template_reuse")


@pytest.fixture(scope="module")
def model_dir():
    from vllm_allowed_tools.devtools.models.tiny_model import ensure_model
    return ensure_model("random", log=lambda *_: None)


@pytest.fixture(scope="module", params=sorted(TEMPLATES))
def runs(request, bench, model_dir, tmp_path_factory):
    """(probe's placement, filter-catalog) runs of one template; each server started and stopped
    by the driver (a server that does not start is a run with ``error`` set)."""
    template = bench.CORPUS / f"{request.param}.jinja"
    transcript = bench.make_transcript()
    logs = tmp_path_factory.mktemp("template-reuse")
    auto = bench.serve_and_drive(model_dir, template, bench.AUTO, transcript, logs)
    filtered = bench.serve_and_drive(model_dir, template, bench.FILTER, transcript, logs)
    return request.param, auto, filtered


def test_probed_placement_serves_the_whole_previous_history_from_the_cache(bench, runs) -> None:
    name, auto, _ = runs
    assert auto.error is None, f"{name}: {auto.error}"
    assert auto.chosen == TEMPLATES[name]
    assert len(auto.turns) == bench.TURNS
    for previous, turn in zip(auto.turns, auto.turns[1:]):
        assert previous.allowed != turn.allowed   # only the subset changes
        # the bound is the previous history, not something smaller
        assert turn.must >= previous.prompt_tokens - 4 * bench.BLOCK_SIZE, (name, previous, turn)
        assert previous.must is None or turn.must > previous.must, (name, previous, turn)
        assert turn.cached_tokens >= turn.must, (
            f"{name} turn {turn.turn}: the cache served {turn.cached_tokens} tokens, the previous "
            f"turn's history is {turn.must} (prompt {turn.prompt_tokens})")


def test_filter_catalog_reuses_less_when_the_subset_changes(runs) -> None:
    name, auto, filtered = runs
    assert filtered.error is None, f"{name}: {filtered.error}"
    assert filtered.chosen == "filter-catalog"
    for with_policy, filtering in zip(auto.later(), filtered.later()):
        assert filtering.cached_tokens < with_policy.cached_tokens, (name, with_policy, filtering)
    assert filtered.reuse() < auto.reuse()
