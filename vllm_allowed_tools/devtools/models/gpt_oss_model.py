"""A tiny gpt-oss model, built offline: vLLM serves it on its harmony path (``GptOssForCausalLM``).

vLLM switches every gpt-oss request to harmony (prompts rendered by ``openai_harmony``, output parsed
by its ``HarmonyParser`` and the ``openai`` tool parser) on ``model_type == "gpt_oss"`` alone, so a
model of that architecture, however small, exercises the same request and response code as the real
one. Its weights are random (seeded) and unquantized (no mxfp4: vLLM's CPU build has no mxfp4 MoE);
it keeps what vLLM's model code reads: attention sinks, a sliding window on every other layer, yarn
RoPE parameters, biased experts with the ``swigluoai`` activation, and the full 201088-row vocabulary
(the harmony tokens sit at 199998-201087, so the vocabulary cannot shrink).

The tokenizer is the ``o200k_harmony`` encoding itself: ``openai_harmony`` ships the vocabulary
inside its extension module (no download), and this module converts it to a ``tokenizer.json``
(byte-level BPE, merges recovered from the ranks as transformers' ``TikTokenConverter`` does), which
vLLM needs for detokenization.

Usage: ``python -m vllm_allowed_tools.devtools.models.gpt_oss_model OUT [--seed N]``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path
from typing import Any

from .tiny_model import MARKER_FILE, TinyModelError, building, cache_lock, default_cache_dir

BUILDER_VERSION = "1"   # bump when the recipe changes, so cached models are rebuilt
VOCAB_SIZE = 201088     # gpt-oss's embedding rows: o200k_base (199998) + harmony's special tokens
FIRST_SPECIAL = 199998
# o200k's pre-tokenizer (the pattern openai_harmony and the real gpt-oss tokenizer.json split with)
O200K_PATTERN = "|".join([
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"\p{N}{1,3}",
    r" ?[^\s\p{L}\p{N}]+[\r\n/]*",
    r"\s*[\r\n]+",
    r"\s+(?!\S)",
    r"\s+",
])
# harmony's stop tokens: <|return|>, <|endoftext|>, <|call|> (the real model's generation_config)
EOS_TOKEN_IDS = [200002, 199999, 200012]
CONFIG = dict(hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
              num_key_value_heads=1, head_dim=64, num_local_experts=4, num_experts_per_tok=2,
              sliding_window=128, max_position_embeddings=131072)
# the real model's RoPE (vLLM's gpt_oss.py reads every one of these keys)
ROPE = {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0,
        "beta_slow": 1.0, "original_max_position_embeddings": 4096, "truncate": False}
SAMPLES = ["Hello, world! It's 2025.", "def f(x):\n    return x ** 2\n",
           "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
           "<|message|>{\"city\": \"Paris\"}<|call|>", "naïve café – 東京 🚀  trailing  "]


def harmony_encoding():
    from openai_harmony import HarmonyEncodingName, load_harmony_encoding

    return load_harmony_encoding(HarmonyEncodingName.HARMONY_GPT_OSS)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-to-printable-character table, the alphabet of byte-level BPE vocabularies."""
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
                 + list(range(ord("®"), ord("ÿ") + 1)))
    table, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            table[byte] = chr(byte)
        else:
            table[byte] = chr(256 + extra)
            extra += 1
    return table


def _vocab_and_merges(ranks: dict[bytes, int]) -> tuple[dict[str, int], list[list[str]]]:
    """Byte-level BPE vocabulary and merges from tiktoken ranks: a token of rank r is the merge of
    the split of it whose two halves are both tokens (ordered by the halves' ranks)."""
    table = _bytes_to_unicode()

    def text(token: bytes) -> str:
        return "".join(table[byte] for byte in token)

    vocab, merges = {}, []
    for token, rank in ranks.items():
        vocab[text(token)] = rank
        splits = [(token[:i], token[i:]) for i in range(1, len(token))
                  if token[:i] in ranks and token[i:] in ranks]
        merges.extend((rank, ranks[left], ranks[right], left, right) for left, right in splits)
    merges.sort(key=lambda merge: merge[:3])
    return vocab, [[text(left), text(right)] for _, _, _, left, right in merges]


def write_tokenizer(out: Path) -> None:
    """``tokenizer.json`` + ``tokenizer_config.json`` for ``o200k_harmony`` (vocabulary from
    openai_harmony, no download)."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

    encoding = harmony_encoding()
    ranks = {encoding._inner.decode_bytes([rank]): rank for rank in range(FIRST_SPECIAL)}
    vocab, merges = _vocab_and_merges(ranks)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[tuple(m) for m in merges],
                                     fuse_unk=False, ignore_merges=True))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(O200K_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False),
    ])
    tokenizer.decoder = decoders.ByteLevel()
    specials = [encoding._inner.decode_bytes([token]).decode() for token in range(FIRST_SPECIAL, VOCAB_SIZE)]
    tokenizer.add_special_tokens([AddedToken(token, special=True, normalized=False) for token in specials])
    tokenizer.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|startoftext|>",
        "eos_token": "<|return|>", "pad_token": "<|endoftext|>", "model_max_length": 131072,
        "add_bos_token": False, "add_eos_token": False,
    }, indent=2))


def check_tokenizer(out: Path) -> None:
    """The served tokenizer must split text exactly as openai_harmony does, and keep the ids."""
    from transformers import AutoTokenizer

    encoding = harmony_encoding()
    loaded = AutoTokenizer.from_pretrained(str(out))
    for text in SAMPLES:
        expected = encoding.encode(text, allowed_special="all")
        got = loaded(text, add_special_tokens=False)["input_ids"]
        if got != expected:
            raise TinyModelError(f"tokenizer.json disagrees with openai_harmony on {text!r}: "
                                 f"{got} != {expected}; delete {out} and rebuild it")
        if loaded.decode(got) != text:
            raise TinyModelError(f"tokenizer.json does not round-trip {text!r}")


def gpt_oss_config():
    from transformers import GptOssConfig

    layers = CONFIG["num_hidden_layers"]
    return GptOssConfig(
        vocab_size=VOCAB_SIZE, rope_parameters=dict(ROPE), tie_word_embeddings=False,
        layer_types=["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)],
        eos_token_id=EOS_TOKEN_IDS[0], pad_token_id=199999, bos_token_id=FIRST_SPECIAL,
        torch_dtype="float32", **CONFIG)


def _write_model(out: Path, seed: int) -> None:
    import torch
    from transformers import GenerationConfig, GptOssForCausalLM

    torch.manual_seed(seed)
    model = GptOssForCausalLM(gpt_oss_config()).float()
    with torch.no_grad():   # sinks and expert tensors are left uninitialised by _init_weights' defaults
        for name, param in model.named_parameters():
            if name.endswith("sinks") or "experts" in name or name.endswith("bias"):
                param.normal_(0.0, 0.02)
    model.save_pretrained(str(out), safe_serialization=True)
    GenerationConfig(eos_token_id=EOS_TOKEN_IDS, pad_token_id=199999,
                     bos_token_id=FIRST_SPECIAL).save_pretrained(str(out))


def recipe_digest(seed: int) -> str:
    digest = hashlib.sha256(f"{BUILDER_VERSION}|gpt-oss|{seed}|".encode())
    digest.update(Path(__file__).read_bytes())
    return digest.hexdigest()[:16]


def build(out: Path, seed: int = 0, log=print) -> Path:
    """Build the model folder at ``out`` atomically (a half-built folder is never left behind)."""
    out = Path(out)
    with building(out) as staging:
        log("converting the o200k_harmony vocabulary to tokenizer.json")
        write_tokenizer(staging)
        check_tokenizer(staging)
        log(f"writing random gpt-oss weights (seed {seed})")
        _write_model(staging, seed)
        (staging / MARKER_FILE).write_text(json.dumps(
            {"flavour": "gpt-oss-random", "seed": seed, "recipe": recipe_digest(seed)}, indent=2))
    return out


def _marker(path: Path) -> dict[str, Any]:
    try:
        return json.loads((path / MARKER_FILE).read_text())
    except (OSError, ValueError):
        return {}


def ensure_gpt_oss_model(seed: int = 0, cache_dir: Path | None = None, log=print) -> Path:
    """The cached tiny gpt-oss model for ``seed``, built if missing or built by an older recipe."""
    path = (Path(cache_dir) if cache_dir else default_cache_dir()) / f"gpt-oss-seed{seed}"
    with cache_lock(path):
        complete = all((path / name).is_file() for name in ("config.json", "tokenizer.json",
                                                             "model.safetensors"))
        if complete and _marker(path).get("recipe") == recipe_digest(seed):
            return path
        log(f"building the tiny gpt-oss model in {path}")
        return build(path, seed=seed, log=log)


def ensure_gpt_oss_tokenizer(cache_dir: Path | None = None, log=print) -> Path:
    """A cached folder with gpt-oss's tokenizer and a ``config.json`` naming its model type and
    vocabulary, no weights: what ``vllm-allowed-tools check`` reads of a gpt-oss model."""
    path = (Path(cache_dir) if cache_dir else default_cache_dir()) / "gpt-oss-tokenizer"
    with cache_lock(path):
        if (path / "tokenizer.json").is_file() and _marker(path).get("recipe") == recipe_digest(0):
            return path
        log(f"converting the o200k_harmony vocabulary to tokenizer.json in {path}")
        with building(path) as staging:
            write_tokenizer(staging)
            (staging / "config.json").write_text(json.dumps(
                {"model_type": "gpt_oss", "vocab_size": VOCAB_SIZE}, indent=2))
            (staging / MARKER_FILE).write_text(json.dumps(
                {"flavour": "gpt-oss-tokenizer", "recipe": recipe_digest(0)}, indent=2))
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m vllm_allowed_tools.devtools.models.gpt_oss_model",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, nargs="?", help="folder to write the model to "
                        "(default: the shared model cache)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    try:
        path = build(args.out, args.seed) if args.out else ensure_gpt_oss_model(args.seed)
    except TinyModelError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
