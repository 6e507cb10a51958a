"""A server on vLLM's outlines backend: required turns of a JSON-array format stay on outlines.

outlines cannot compile structural tags, so our logits processor serves those; the plain JSON
schema a required turn of ``mistral`` (or ``xlam``, ``granite``: not the pythonic formats, whose
calls are no JSON) is constrained with is compiled by outlines itself. The observable is outlines'
own index cache (``VLLM_V1_USE_OUTLINES_CACHE``, one SQLite row per compiled regex): a required
turn adds the regex of the allowed subset's schema, and an auto turn (a structural tag: free text,
then ``[TOOL_CALLS]`` and allowed calls, on our processor) adds nothing.
"""

from __future__ import annotations

import random
import sqlite3
from pathlib import Path

import pytest

from vllm_allowed_tools.devtools.models.tool_pool import POOL_BY_NAME, sample_catalog

from support.calls import chat_calls
from support.servers import start_cli_server, stop_cli_server

pytestmark = pytest.mark.server

SEEDS = (0, 1, 2)


@pytest.fixture(scope="module")
def outlines_server(tmp_path_factory):
    cache = tmp_path_factory.mktemp("outlines-cache")
    server = start_cli_server(
        "random", options=["--parser", "allowed_mistral"],
        extra_args=["--structured-outputs-config.backend", "outlines"],
        env={"VLLM_V1_USE_OUTLINES_CACHE": "1", "OUTLINES_CACHE_DIR": str(cache)})
    yield server, cache / "outlines_cache.db"
    stop_cli_server(server)


def compiled_regexes(db: Path) -> list[str]:
    """The regexes outlines compiled an index for (keys are ``<vocabulary hash>_<regex>``)."""
    if not db.exists():
        return []
    with sqlite3.connect(db) as connection:
        keys = [key for (key,) in connection.execute("SELECT key FROM cache")]
    return [key.split("_", 1)[1] for key in keys if key != "__version__"]


def catalog_and_subset(seed: int):
    rng = random.Random(1000 + seed)
    catalog = sample_catalog(rng, 8)
    return catalog, sorted(tool.name for tool in rng.sample(catalog, 2))


def test_the_server_says_json_schemas_stay_on_outlines(outlines_server):
    server, _ = outlines_server
    assert "(JSON-schema grammars: the outlines backend)" in server.log_text(), server.log_tail()


def test_required_turns_are_constrained_by_outlines_to_the_allowed_subset(outlines_server):
    server, db = outlines_server
    for seed in SEEDS:
        catalog, subset = catalog_and_subset(seed)
        before = compiled_regexes(db)
        reply = chat_calls(server.client(), catalog, "required", subset, seed, max_tokens=200)
        assert len(reply.calls) == 1, (seed, reply.calls, reply.text, server.log_tail(30))
        name, arguments = reply.calls[0][:2]
        assert name in subset and POOL_BY_NAME[name].arguments_valid(arguments), (seed, name, arguments)
        new = [regex for regex in compiled_regexes(db) if regex not in before]
        # this turn's schema: every allowed name, and no other catalog name
        assert any(all(f'"{allowed}"' in regex for allowed in subset) and
                   not any(f'"{tool.name}"' in regex for tool in catalog if tool.name not in subset)
                   for regex in new), (seed, subset, [regex[:200] for regex in new])


def test_auto_turns_stay_off_outlines_and_keep_calls_inside_the_subset(outlines_server):
    server, db = outlines_server
    for seed in SEEDS[:2]:
        catalog, subset = catalog_and_subset(seed)
        before = compiled_regexes(db)
        reply = chat_calls(server.client(), catalog, "auto", subset, seed, max_tokens=40)
        assert all(call[0] in subset for call in reply.calls), (seed, reply.calls, subset)
        assert compiled_regexes(db) == before
