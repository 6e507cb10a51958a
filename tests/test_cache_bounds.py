"""The caches are bounded by bytes as well as by entries: a compiled grammar at a 150K vocabulary
takes 2-15 MB, so a count alone lets memory grow by gigabytes (benchmarks/scale_memory.py). The
LRU's bookkeeping, and that both caches take their bounds from the settings."""

from __future__ import annotations

import pytest

from vllm_allowed_tools import settings
from vllm_allowed_tools.decode import grammar
from vllm_allowed_tools.decode.grammar import TAG_BYTES_PER_JSON_CHAR, AllowedFunction, turn_tag
from vllm_allowed_tools.decode.lru import LRU


def test_entries_bound_evicts_the_least_recently_used():
    cache = LRU(capacity=2)
    cache.put("a", 1, 10)
    cache.put("b", 2, 10)
    assert cache.get("a") == 1          # "b" is now the oldest
    cache.put("c", 3, 10)
    assert cache.peek("b") is None and cache.peek("a") == 1 and cache.peek("c") == 3
    assert cache.bytes == 20 and len(cache) == 2


def test_bytes_bound_evicts_until_it_holds_and_keeps_the_newest():
    cache = LRU(capacity=100, max_bytes=25)
    for key in "abc":
        cache.put(key, key, 10)
    assert [k for k in "abc" if cache.peek(k)] == ["b", "c"] and cache.bytes == 20
    cache.put("huge", "huge", 1000)     # larger than the bound alone: it stays, the rest go
    assert len(cache) == 1 and cache.peek("huge") == "huge" and cache.bytes == 1000
    cache.put("huge", "again", 5)       # a replaced entry's size is counted once
    assert cache.bytes == 5


def test_peek_counts_nothing_and_does_not_refresh():
    cache = LRU(capacity=2)
    cache.put("a", 1)
    cache.put("b", 2)
    assert cache.peek("a") == 1 and (cache.hits, cache.misses) == (0, 0)
    cache.put("c", 3)                   # "a" was only peeked at: still the oldest
    assert cache.peek("a") is None


def test_clear_forgets_sizes():
    cache = LRU(capacity=4, max_bytes=100)
    cache.put("a", 1, 60)
    cache.clear()
    cache.put("b", 2, 60)
    assert cache.bytes == 60 and cache.peek("b") == 2


@pytest.fixture
def clean_tag_cache():
    grammar.clear_tag_cache()
    yield
    grammar.clear_tag_cache()
    settings.reset_for_tests()


def _tag(index: int) -> None:
    function = AllowedFunction(f"tool_{index}", {"type": "object", "properties": {
        "path": {"type": "string"}}, "required": ["path"]}, True)
    turn_tag("hermes", [function], catalog_digest=f"catalog-{index}", allowlist_digest="all",
             mode="required", parallel_tool_calls=True)


def test_the_tag_cache_follows_its_entries_setting(monkeypatch, clean_tag_cache):
    monkeypatch.setenv("VLLM_ALLOWED_TOOLS_TAG_CACHE_ENTRIES", "3")
    settings.reset_for_tests()
    for index in range(6):
        _tag(index)
    assert grammar.tag_cache_stats()[2] == 3


def test_the_tag_cache_follows_its_megabytes_setting(monkeypatch, clean_tag_cache):
    _tag(0)
    one = grammar.tag_cache_bytes()
    assert one > 0 and one % TAG_BYTES_PER_JSON_CHAR == 0
    grammar.clear_tag_cache()
    monkeypatch.setenv("VLLM_ALLOWED_TOOLS_TAG_CACHE_MB", "0")   # the newest entry alone stays
    settings.reset_for_tests()
    for index in range(4):
        _tag(index)
    assert grammar.tag_cache_stats()[2] == 1


def test_compiled_grammars_are_bounded_by_their_bytes():
    xgr = pytest.importorskip("xgrammar")
    from vllm_allowed_tools.decode.masks import CompiledGrammars
    from vllm_allowed_tools.decode.split import constraint_extra_args
    from vllm_allowed_tools.decode.stage import read_extra_args

    vocab = [chr(ord("a") + i) for i in range(26)] + ['{"', '"}', '":', "<tool_call>", "</tool_call>",
                                                       "\n", " ", '"', "{", "}", ",", ":", "<eos>"]
    info = xgr.TokenizerInfo(vocab, vocab_type=xgr.VocabType.RAW, vocab_size=len(vocab),
                             stop_token_ids=[len(vocab) - 1])

    def request(index: int):
        function = AllowedFunction(f"t{index}", {"type": "object"}, True)
        return read_extra_args(constraint_extra_args(turn_tag(
            "hermes", [function], catalog_digest=f"bounded-{index}", allowlist_digest="all",
            mode="required", parallel_tool_calls=True)))

    probe = CompiledGrammars(info)
    size = probe.get(request(0)).memory_size_bytes
    assert probe.memory_bytes == size > 0
    grammars = CompiledGrammars(info, capacity=100, max_bytes=int(size * 2.5))
    for index in range(5):
        grammars.get(request(index))
    assert grammars.stats[2] == 2 and grammars.memory_bytes <= size * 2.5
    assert grammars.ready(request(4)) is not None and grammars.ready(request(0)) is None
