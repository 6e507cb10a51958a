"""What the grammar benchmarks share: agent-like tool schemas, the tiny model's and a synthetic
150K-token vocabulary (built from code, no hub), a greedy tokenizer over the latter, and how a
timing column is printed."""

from __future__ import annotations

import random
import statistics
import string
from typing import Any

from vllm_allowed_tools.decode.grammar import AllowedFunction


def rich_functions(count: int, seed: int = 0, strict: bool = True) -> list[AllowedFunction]:
    """Agent-like tools: strings, enums, integers with bounds, arrays, a nested object; ``strict``
    False: arguments are any JSON object (a plain ``auto`` request's catalog-names grammar)."""
    rng = random.Random(seed)
    functions = []
    for index in range(count):
        properties: dict[str, Any] = {
            "path": {"type": "string", "description": "a file or URL"},
            "mode": {"type": "string", "enum": rng.sample(["fast", "safe", "dry", "full", "quick"], 3)},
            "limit": {"type": "integer", "minimum": 1, "maximum": 1000},
            "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 8},
            "options": {"type": "object", "properties": {
                "recursive": {"type": "boolean"}, "depth": {"type": "integer", "minimum": 0}},
                "required": ["recursive"], "additionalProperties": False},
        }
        keep = rng.sample(sorted(properties), rng.randint(2, 5))
        functions.append(AllowedFunction(
            name=f"tool_{index:03d}_{rng.choice(['read', 'write', 'search', 'list', 'run'])}",
            parameters={"type": "object", "properties": {k: properties[k] for k in keep},
                        "required": keep[:2], "additionalProperties": False},
            strict=strict))
    return functions


# ------------------------------------------------------------------------------------------ vocabularies
def tiny_tokenizer_info():
    import xgrammar as xgr
    from transformers import AutoTokenizer

    from vllm_allowed_tools.devtools.models.tiny_model import ensure_model
    tokenizer = AutoTokenizer.from_pretrained(str(ensure_model("random")))
    return xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=len(tokenizer)), tokenizer


def synthetic_tokenizer_info(size: int = 150_000, seed: int = 0):
    """A byte-level-like vocabulary of ``size`` tokens built from code: every printable character,
    common JSON/markup pieces, and random words and fragments up to 12 characters (no hub)."""
    import xgrammar as xgr
    rng = random.Random(seed)
    alphabet = string.ascii_letters + string.digits
    vocab: list[str] = []
    seen: set[str] = set()

    def add(token: str) -> None:
        if token not in seen:
            seen.add(token)
            vocab.append(token)

    for char in string.printable:
        add(char)
    for piece in ['{"', '"}', '":', '", "', '<tool_call>', '</tool_call>', '"name', '"arguments',
                  ' {"', '}}', '\n', '  ', 'true', 'false', 'null']:
        add(piece)
    while len(vocab) < size - 1:
        length = rng.choice([2, 3, 3, 4, 4, 5, 6, 7, 8, 10, 12])
        word = "".join(rng.choice(alphabet) for _ in range(length))
        add(rng.choice(["", " ", "_", '"', "."]) + word)
    vocab.append("<|endoftext|>")
    info = xgr.TokenizerInfo(vocab, vocab_type=xgr.VocabType.RAW, vocab_size=len(vocab),
                             stop_token_ids=[len(vocab) - 1])
    index = {token: i for i, token in enumerate(vocab)}
    return info, index


def greedy_encode(text: str, index: dict[str, int], longest: int = 13) -> list[int]:
    ids, position = [], 0
    while position < len(text):
        for length in range(min(longest, len(text) - position), 0, -1):
            token = index.get(text[position:position + length])
            if token is not None:
                ids.append(token)
                position += length
                break
        else:
            raise ValueError(f"no token for {text[position]!r}")
    return ids


def median_p90(values: list[float], scale: float = 1e3) -> str:
    ordered = sorted(values)
    return f"{statistics.median(ordered) * scale:.1f} / {ordered[int(len(ordered) * 0.9)] * scale:.1f}"
