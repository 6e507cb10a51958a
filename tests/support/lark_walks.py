"""Walks that compare a structural tag's llguidance translation (decode/lark_tags.py) with
xgrammar's compiled tag over the synthetic walk vocabulary (support/grammar_walk.py): each
matcher's walks fed to the other."""

from __future__ import annotations

import json
import random

from vllm_allowed_tools.decode.lark_tags import lark_grammar

from .grammar_walk import GrammarWalker, WalkError

#: walks a direction a grammar (40 when the translation was written; CI runs fewer)
WALKS = 10


def _token_ids(tag_json: str, index: dict[str, int]) -> str:
    """The walk's tag with each ``token`` format named by its id in the walk vocabulary."""
    def visit(node):
        if isinstance(node, list):
            return [visit(item) for item in node]
        if not isinstance(node, dict):
            return node
        if node.get("type") == "token" and isinstance(node.get("token"), str):
            return {**node, "token": index[node["token"]]}
        return {key: visit(value) for key, value in node.items()}
    return json.dumps(visit(json.loads(tag_json)))


def translated(walker: GrammarWalker):
    """(llguidance tokenizer over the walk vocabulary, the translated grammar)."""
    import llguidance
    vocab = walker.vocab

    class Vocabulary:
        eos_token_id, bos_token_id = walker.eos_id, None
        tokens = [token.encode() for token in vocab[:-1]] + [b"\xff" + vocab[-1].encode()]
        special_token_ids = [walker.eos_id]

        def __call__(self, text):
            text = text.decode() if isinstance(text, bytes) else text
            return [walker.index[char] for char in text]
    tokenizer = llguidance.LLTokenizer(llguidance.TokenizerWrapper(Vocabulary()))
    return tokenizer, lark_grammar(_token_ids(walker.tag_json, walker.index))


def allowed_tokens(matcher, size: int) -> list[int]:
    from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask
    mask = allocate_token_bitmask(1, size)
    fill_next_token_bitmask(matcher, mask, 0)
    return [i for i in range(size) if (int(mask[0][i >> 5]) >> (i & 31)) & 1]


def compare_both_ways(walker: GrammarWalker, rng: random.Random, walks: int = WALKS) -> tuple[int, int]:
    """``walks`` walks of xgrammar's matcher fed to llguidance's, each taken whole (narrowing
    fails), and as many of llguidance's fed to xgrammar, each admitted (widening fails); how many
    of each ended (the caller's floor)."""
    import llguidance
    tokenizer, lark = translated(walker)
    assert not llguidance.LLMatcher(tokenizer, lark).is_error()
    walked = 0
    for _ in range(walks):                       # xgrammar's walks, into llguidance
        try:
            tokens = walker.walk_tokens(rng)
        except WalkError:
            continue
        matcher = llguidance.LLMatcher(tokenizer, lark)
        for token in tokens:
            assert matcher.consume_token(walker.index[token]), (
                f"llguidance refused {token!r} after {''.join(tokens)!r}: {matcher.get_error()[:300]}")
        assert matcher.consume_token(walker.eos_id) and matcher.is_stopped(), "".join(tokens)
        walked += 1
    ended = 0
    for _ in range(walks):                       # llguidance's walks, into xgrammar
        matcher = llguidance.LLMatcher(tokenizer, lark)
        written: list[str] = []
        for step in range(800):
            allowed = allowed_tokens(matcher, len(walker.vocab))
            assert allowed, "llguidance left no token allowed"
            token = walker.eos_id if step > 40 and walker.eos_id in allowed else rng.choice(allowed)
            if token == walker.eos_id:
                assert not matcher.is_error(), matcher.get_error()[:300]
                assert walker.accepts(written), f"xgrammar refused llguidance's {''.join(written)!r}"
                ended += 1
                break
            assert matcher.consume_token(token)
            written.append(walker.vocab[token])
    return walked, ended
