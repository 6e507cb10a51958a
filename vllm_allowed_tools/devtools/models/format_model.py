"""A tiny model for a wire format: the cached tiny model with the format's markers as single tokens.

vLLM's parsers look their markers up in the vocabulary (DeepSeek's ``<｜tool▁calls▁begin｜>``, Kimi's
``<|tool_calls_section_begin|>``, ...) and refuse a tokenizer without them, and a grammar's trigger
is only one sampling step away when it is one token. So each format is served a copy of the tiny
model whose tokenizer holds the registry's ``special_tokens`` as added tokens (not "special": they
must survive detokenization, as in the real models' tokenizers); the weights are the base model's.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

from ...formats import wire_format
from .tiny_model import MARKER_FILE, building, cache_lock, default_cache_dir, ensure_model

#: formats served by another architecture than the Qwen2 tiny model: gpt-oss's harmony path is
#: chosen by the model type alone
HARMONY_FORMATS = frozenset({"openai"})


def model_for_parser(flavour: str, seed: int, parser: str, log=print) -> Path:
    """The tiny model ``serve-tiny --parser`` serves: for harmony (``allowed_openai``) the tiny
    gpt-oss model (random weights), otherwise the ``flavour`` model with the format's tokens."""
    try:
        name = wire_format(parser).name
    except ValueError:
        name = ""
    if name in HARMONY_FORMATS:
        from .gpt_oss_model import ensure_gpt_oss_model
        return ensure_gpt_oss_model(seed, log=log)
    return ensure_format_model(flavour, seed, format_tokens(parser), log=log)


def format_tokens(parser: str) -> tuple[str, ...]:
    """The tokens the format behind ``parser`` (ours or vLLM's name) needs in the vocabulary: its
    markers, and its auto trigger (Phi-4-mini's ``functools``: a real model writes it as the word
    it learnt, the random one reaches a one-token trigger only)."""
    try:
        entry = wire_format(parser)
    except ValueError:
        return ()
    return tuple(dict.fromkeys((*entry.special_tokens, *entry.grammar.auto_triggers[:1])))


def ensure_format_model(flavour: str, seed: int, tokens: tuple[str, ...], cache_dir: Path | None = None,
                        log=print) -> Path:
    """The cached ``(flavour, seed)`` tiny model, or a cached copy of it holding ``tokens``."""
    base = ensure_model(flavour, seed, cache_dir=cache_dir, log=log)
    if not tokens:
        return base
    digest = hashlib.sha256(json.dumps([base.name, json.loads((base / MARKER_FILE)
                                        .read_text()).get("recipe"), list(tokens)]).encode())
    out = (Path(cache_dir) if cache_dir else default_cache_dir()) / f"{base.name}-tokens-{digest.hexdigest()[:12]}"
    with cache_lock(out):
        if (out / "model.safetensors").is_file() and (out / "tokenizer.json").is_file():
            return out
        log(f"adding {len(tokens)} format tokens to a copy of {base} in {out}")
        with building(out) as staging:
            shutil.copytree(base, staging, dirs_exist_ok=True)
            add_tokens(staging, tokens)
    return out


def add_tokens(model_dir: Path, tokens: tuple[str, ...]) -> None:
    """Add ``tokens`` to the tokenizer in ``model_dir`` (in place); the model's vocabulary (2048
    rows, a few hundred used) has room for them."""
    from tokenizers import AddedToken, Tokenizer

    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    tokenizer.add_tokens([AddedToken(token, special=False, normalized=False) for token in tokens])
    rows = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    if tokenizer.get_vocab_size(with_added_tokens=True) > rows:
        raise ValueError(f"{model_dir}: {len(tokens)} more tokens do not fit the model's {rows} "
                         "embedding rows")
    tokenizer.save(str(model_dir / "tokenizer.json"))


def writing_nudges(model_dir: Path, markers: dict[str, float]) -> dict[str, float]:
    """``logit_bias`` that makes a random model write markers like a trained one: each of
    ``markers`` (token text: bias) as its one token (vLLM's parsers find markers by token id; a
    text grammar also admits them spelled in pieces). Nothing else: what the grammar admits beyond
    that (line breaks, whitespace, long arguments, markup inside strings) the parser must read. For
    the tests' sampled requests only."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))
    return {str(tokenizer.token_to_id(marker)): value for marker, value in markers.items()}
