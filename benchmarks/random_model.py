"""A random-weight model of a real architecture, made from code, offline: Qwen3-8B's config (or a
tiny one) and a byte-level BPE tokenizer of about 150K tokens, served with vLLM's
``--load-format dummy`` (random weights, nothing written or downloaded).

The tokenizer is trained on text made here (MCP-shaped tool schemas, the chat template, calls and
generated prose) so tool JSON tokenizes about as compactly as with a real tokenizer; the merges
that corpus cannot supply are made from pairs of existing tokens until the vocabulary has its size.

    python benchmarks/random_model.py OUT [--tiny]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from mcp_tools import mcp_catalog  # noqa: E402

from vllm_allowed_tools.templates.render import load_template  # noqa: E402
from vllm_allowed_tools.devtools.models.tiny_model import (  # noqa: E402
    _PRETOKENIZE_REGEX,
    ADDED_TOKENS,
    SPECIAL_TOKENS,
)

#: Qwen3-8B's published architecture (config.json fields), weights random
QWEN3_8B = dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=151936,
                max_position_embeddings=40960, rope_theta=1000000.0, rms_norm_eps=1e-6,
                tie_word_embeddings=False, torch_dtype="bfloat16")
#: the same architecture at a size a 2-core CPU serves in seconds (head_dim 64: vLLM's CPU kernels)
TINY = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=1, head_dim=64, vocab_size=4096, max_position_embeddings=40960,
            rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=False, torch_dtype="float32")


def _corpus(rng: random.Random) -> list[str]:
    tools = mcp_catalog(64)
    texts = [json.dumps(tool) for tool in tools] + [load_template("hermes")]
    words = sorted({w.strip('.,:"()') for tool in tools for w in tool["function"]["description"].split()})
    for _ in range(3000):
        tool = rng.choice(tools)["function"]
        texts.append(" ".join(rng.choice(words) for _ in range(rng.randint(5, 30))) + ".")
        texts.append('<tool_call>\n{"name": "' + tool["name"] + '", "arguments": {"path": "/srv/'
                     + rng.choice(words) + '", "count": ' + str(rng.randint(0, 999)) + "}}\n</tool_call>")
    return texts


def build_tokenizer(out: Path, vocab_size: int, seed: int = 0) -> int:
    """Write tokenizer.json / tokenizer_config.json of ``vocab_size`` tokens (added ones included);
    returns the tokenizer's length."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    rng = random.Random(seed)
    target = vocab_size - len(SPECIAL_TOKENS) - len(ADDED_TOKENS)

    def pipeline(tokenizer: Tokenizer) -> Tokenizer:
        tokenizer.normalizer = normalizers.NFC()
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
        tokenizer.decoder = decoders.ByteLevel()
        return tokenizer

    trained = pipeline(Tokenizer(models.BPE()))
    trained.train_from_iterator(_corpus(rng), trainer=trainers.BpeTrainer(
        vocab_size=target, special_tokens=SPECIAL_TOKENS, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    model = json.loads(trained.to_str())["model"]
    vocab: dict[str, int] = dict(model["vocab"])
    merges = [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    pieces = [t for t in vocab if t not in SPECIAL_TOKENS]
    while len(vocab) < target:          # the rest: merges of pairs of existing tokens
        left, right = rng.choice(pieces), rng.choice(pieces)
        if left + right not in vocab and len(left + right) <= 16:
            vocab[left + right] = len(vocab)
            merges.append((left, right))
            pieces.append(left + right)
    tokenizer = pipeline(Tokenizer(models.BPE(vocab=vocab, merges=merges)))
    tokenizer.add_special_tokens(SPECIAL_TOKENS)
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in ADDED_TOKENS])
    tokenizer.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "Qwen2Tokenizer", "bos_token": None, "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>", "unk_token": None, "add_prefix_space": False,
        "model_max_length": 40960, "chat_template": load_template("hermes")}, indent=2))
    return tokenizer.get_vocab_size()


def build(out: Path, tiny: bool = False) -> Path:
    """The model folder: config.json (Qwen3ForCausalLM), generation_config.json, the tokenizer."""
    out.mkdir(parents=True, exist_ok=True)
    dims = dict(TINY if tiny else QWEN3_8B)
    size = build_tokenizer(out, 4000 if tiny else 150_000)
    assert size <= dims["vocab_size"], (size, dims["vocab_size"])
    from tokenizers import Tokenizer
    tokenizer = Tokenizer.from_file(str(out / "tokenizer.json"))
    config = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", **dims,
              "hidden_act": "silu", "attention_bias": False, "attention_dropout": 0.0,
              "use_sliding_window": False, "sliding_window": None, "max_window_layers": dims["num_hidden_layers"],
              "bos_token_id": tokenizer.token_to_id("<|endoftext|>"),
              "eos_token_id": tokenizer.token_to_id("<|im_end|>"), "use_cache": True}
    (out / "config.json").write_text(json.dumps(config, indent=2))
    (out / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": config["eos_token_id"], "bos_token_id": config["bos_token_id"]}))
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--tiny", action="store_true")
    args = parser.parse_args()
    build(args.out, args.tiny)
    print(args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
