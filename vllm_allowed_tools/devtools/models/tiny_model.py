"""Build the tiny offline models the tests and the demo serve (no hub, deterministic from a seed).

Three flavours of one architecture (Qwen2, hidden 128, 2 layers, head_dim 64 which vLLM's CPU
attention supports, 32K positions so a real client's ~20K-token prompt fits):

* ``random``: random weights. An adversary: whatever noise it emits, the contract must hold.
* ``tool-happy``: trained for a few minutes on CPU, by this module, on transcripts rendered with our
  own chat template in which the assistant calls a tool from the prompt's catalog, ignoring the
  turn's policy block. It emits well-formed hermes calls, most of them to tools a 2-of-8 allowlist
  does not allow: that is what makes auto-mode enforcement tests meaningful.
* ``thinking``: tool-happy fine-tuned (a quarter of its steps) so that every assistant turn it writes opens with a short
  reasoning block, ``<think>\n<a few words>\n</think>\n\n``, then calls (or answers). ``<think>``
  and ``</think>`` are single added tokens, as in Qwen3, so vLLM's ``qwen3`` reasoning parser (which
  looks them up in the vocabulary) separates the reasoning; earlier turns are trained as our
  template renders them, without their reasoning. Serve it with ``--reasoning-parser qwen3``.

Usage: ``python -m vllm_allowed_tools.devtools.models.tiny_model OUT [--flavour random|tool-happy|thinking]``.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import inspect
import json
import math
import os
import random
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator

from ...templates.render import load_template, render_chat
from . import transcripts
from .helper_settings import HelperSettings
from .tool_pool import POOL, sample_catalog
from .transcripts import USER_ASKS, assistant_spans, render_training_text

FLAVOURS = ("random", "tool-happy", "thinking")
TRAINED_FLAVOURS = ("tool-happy", "thinking")
BUILDER_VERSION = "5"   # bump when the recipe changes, so cached models are rebuilt
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
ADDED_TOKENS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>",
                "<think>", "</think>", "<tools>", "</tools>"]
# Qwen2's pre-tokenizer: transformers rebuilds any qwen2 tokenizer with exactly this pipeline on load,
# so the BPE must be trained with it or the served tokenizer silently differs from the trained one.
_PRETOKENIZE_REGEX = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+"""
                      r"""[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""")
VOCAB_SIZE = 2048
MARKER_FILE = "vllm_allowed_tools_model.json"
TRAIN_STEPS = HelperSettings.from_environ().train_steps
THINKING_STEPS_DIVISOR = 4   # thinking fine-tunes tool-happy for a quarter of its steps

class TinyModelError(RuntimeError):
    """A tiny-model folder is missing, incomplete or not ours; the message says how to fix it."""


# --------------------------------------------------------------------------- tokenizer

def _train_tokenizer(corpus: list[str], out: Path) -> None:
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers
    from tokenizers import pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE - len(SPECIAL_TOKENS) - len(ADDED_TOKENS),
                                  special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(corpus, trainer=trainer)
    tokenizer.add_tokens([AddedToken(token, special=False, normalized=False) for token in ADDED_TOKENS])
    tokenizer.save(str(out / "tokenizer.json"))
    chat_template = load_template("hermes")
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "Qwen2Tokenizer",
        "bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
        "unk_token": None, "add_prefix_space": False, "model_max_length": 32768,
        "chat_template": chat_template,
    }, indent=2))


def _check_tokenizer_roundtrip(out: Path, samples: list[str]) -> None:
    """transformers must load exactly the tokenizer we trained (see _PRETOKENIZE_REGEX)."""
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    raw = Tokenizer.from_file(str(out / "tokenizer.json"))
    loaded = AutoTokenizer.from_pretrained(str(out))
    for text in samples:
        if raw.encode(text).ids != loaded(text)["input_ids"]:
            raise TinyModelError("the tokenizer changed when transformers reloaded it; "
                                 "the pre-tokenizer no longer matches Qwen2's")


# --------------------------------------------------------------------------- model

def _config(tokenizer_dir: Path):
    from tokenizers import Tokenizer
    from transformers import Qwen2Config

    tok = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    return Qwen2Config(
        vocab_size=VOCAB_SIZE, hidden_size=128, intermediate_size=384, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=64, max_position_embeddings=32768,
        max_window_layers=2, use_sliding_window=False, tie_word_embeddings=False,
        rope_theta=10000.0, rms_norm_eps=1e-6, torch_dtype="float32",
        bos_token_id=tok.token_to_id("<|endoftext|>"), eos_token_id=tok.token_to_id("<|im_end|>"),
        pad_token_id=tok.token_to_id("<|endoftext|>"),
    )


def _example(tok, rng: random.Random, k: int, thinking: bool) -> tuple[list[int], list[float]]:
    """One transcript's token ids and loss weights (assistant tokens only; the first token of a
    called tool's name, which carries the choice, weighted up)."""
    text = render_training_text(rng, sample_catalog(rng, k), thinking)
    encoding = tok.encode(text)
    weights = [0.0] * len(encoding.ids)
    spans = list(assistant_spans(text))
    unscored = {start for start, _ in spans[:-1]} if thinking else set()
    name_starts = [m.end() for m in re.finditer(r'\{"name": "', text)
                   if any(a <= m.start() < b for a, b in spans)]
    for index, (start, end) in enumerate(encoding.offsets):
        if any(a <= start < b for a, b in spans) and start not in unscored:
            weights[index] = 4.0 if any(start <= pos < end for pos in name_starts) else 1.0
    return encoding.ids, weights


def _train(model, tokenizer_dir: Path, seed: int, steps: int, log=print,
           thinking: bool = False, curriculum: bool = True) -> dict[str, Any]:
    """Teach the model to emit hermes calls to catalog tools (curriculum over catalog size unless it
    already calls from whole catalogs). ``thinking``: earlier turns have no reasoning, so their
    first token is left out of the loss. One thread: the weights do not depend on the machine's
    cores, and next to a test run (where it is built) it takes a quarter less CPU than two."""
    import torch
    from tokenizers import Tokenizer

    torch.manual_seed(seed)
    torch.set_num_threads(1)
    tok = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    rng = random.Random(seed)
    batch_size, peak_lr, warmup = 16, 5e-3, 20
    optimizer = torch.optim.AdamW(model.parameters(), lr=peak_lr, betas=(0.9, 0.95), weight_decay=0.0)
    model.train()
    started = time.monotonic()
    for step in range(steps):
        # curriculum: the largest catalog grows from 2 to 8 tools over the first half of training
        max_k = 2 + min(6, int(12 * step / max(1, steps))) if curriculum else 8
        k = rng.randint(2, max_k) if rng.random() < 0.5 else max_k
        examples = [_example(tok, rng, k, thinking) for _ in range(batch_size)]
        ids_batch, weight_batch = [ids for ids, _ in examples], [w for _, w in examples]
        length = max(len(ids) for ids in ids_batch)
        pad = tok.token_to_id("<|endoftext|>")
        input_ids = torch.tensor([ids + [pad] * (length - len(ids)) for ids in ids_batch])
        weights = torch.tensor([w + [0.0] * (length - len(w)) for w in weight_batch])
        attention = torch.tensor([[1] * len(ids) + [0] * (length - len(ids)) for ids in ids_batch])
        # project to the vocabulary only where the loss looks (assistant tokens): a third of the cost
        hidden = model.model(input_ids=input_ids, attention_mask=attention).last_hidden_state[:, :-1]
        targets, target_weights = input_ids[:, 1:], weights[:, 1:]
        scored = target_weights > 0
        logits = model.lm_head(hidden[scored])
        losses = torch.nn.functional.cross_entropy(logits, targets[scored], reduction="none")
        loss = (losses * target_weights[scored]).sum() / target_weights.sum().clamp(min=1.0)
        lr = peak_lr * (step + 1) / warmup if step < warmup else \
            peak_lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, steps - warmup))))
        for group in optimizer.param_groups:
            group["lr"] = lr
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        if step % 100 == 0 or step == steps - 1:
            log(f"  step {step:5d}/{steps} k<={max_k} loss {loss.item():.3f} "
                f"({time.monotonic() - started:.0f}s)")
    model.eval()
    return {"steps": steps, "seconds": round(time.monotonic() - started, 1)}


# --------------------------------------------------------------------------- build / cache

@contextlib.contextmanager
def cache_lock(path: Path) -> Iterator[None]:
    """Hold the build lock of the cached model ``path``: processes that need the same model
    (parallel test workers, two servers started at once) build it once, never over a folder another
    one serves from; the others wait, then find it built."""
    import fcntl
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.parent / f".{path.name}.lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


@contextlib.contextmanager
def building(out: Path) -> Iterator[Path]:
    """A staging folder next to ``out`` that becomes ``out`` when the block succeeds (replacing an
    old one), and is removed when it fails: a half-built model folder is never left behind."""
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".building-", dir=out.parent))
    try:
        yield staging
        if out.exists():
            shutil.rmtree(out)
        staging.rename(out)
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)


def recipe_digest(flavour: str, seed: int, steps: int) -> str:
    """Identifies everything the model depends on, so a cached build is reused only when valid."""
    digest = hashlib.sha256()
    digest.update(f"{BUILDER_VERSION}|{flavour}|{seed}|{steps}|".encode())
    digest.update(load_template("hermes").encode())
    # the code that makes the weights (not the whole module: a change to how the cache is found
    # does not rebuild the models)
    for part in (_train_tokenizer, _config, _example, _train, build):
        digest.update(inspect.getsource(part).encode())
    digest.update(repr((VOCAB_SIZE, SPECIAL_TOKENS, ADDED_TOKENS, _PRETOKENIZE_REGEX)).encode())
    digest.update(Path(transcripts.__file__).read_bytes())
    digest.update(json.dumps([(t.name, t.parameters) for t in POOL], sort_keys=True).encode())
    if flavour == "thinking":   # fine-tuned from tool-happy
        digest.update(recipe_digest("tool-happy", seed, default_steps("tool-happy")).encode())
    return digest.hexdigest()[:16]


def default_steps(flavour: str) -> int:
    """Training steps of a flavour's recipe (thinking: its fine-tune of tool-happy)."""
    if flavour == "thinking":
        return max(1, TRAIN_STEPS // THINKING_STEPS_DIVISOR)
    return TRAIN_STEPS if flavour in TRAINED_FLAVOURS else 0


def build(out: Path, flavour: str = "random", seed: int = 0, steps: int | None = None,
          log=print) -> Path:
    """Build a model folder at `out` (atomically: a half-built folder is never left behind)."""
    if flavour not in FLAVOURS:
        raise TinyModelError(f"unknown flavour {flavour!r}; choose one of {', '.join(FLAVOURS)}")
    import torch
    from transformers import GenerationConfig, Qwen2ForCausalLM

    steps = default_steps(flavour) if steps is None else steps
    out = Path(out)
    thinking = flavour == "thinking"
    # thinking starts from tool-happy (its tokenizer already has <think> and </think>), which
    # already calls from whole catalogs: it only learns to reason first, in a fraction of the steps
    base = ensure_model("tool-happy", seed, log=log) if thinking else None
    with building(out) as staging:
        if base is not None:
            for name in ("tokenizer.json", "tokenizer_config.json"):
                shutil.copyfile(base / name, staging / name)
            config = _config(staging)
            model = Qwen2ForCausalLM.from_pretrained(str(base), torch_dtype=torch.float32)
        else:
            rng = random.Random(seed)
            corpus = [render_training_text(rng, sample_catalog(rng, rng.randint(1, 8)))
                      for _ in range(3000)]
            corpus += [render_chat([{"role": "user", "content": ask}]) for ask in USER_ASKS]
            _train_tokenizer(corpus, staging)
            _check_tokenizer_roundtrip(staging, corpus[:50])
            config = _config(staging)
            torch.manual_seed(seed)
            model = Qwen2ForCausalLM(config).float()
        training = None
        if flavour in TRAINED_FLAVOURS:
            log(f"training the {flavour} model ({steps} steps, seed {seed}"
                f"{', from ' + base.name if base is not None else ''})")
            training = _train(model, staging, seed, steps, log=log, thinking=thinking,
                              curriculum=base is None)
        model.save_pretrained(str(staging), safe_serialization=True)
        GenerationConfig(eos_token_id=[config.eos_token_id, config.bos_token_id],
                         pad_token_id=config.pad_token_id).save_pretrained(str(staging))
        (staging / MARKER_FILE).write_text(json.dumps({
            "flavour": flavour, "seed": seed, "recipe": recipe_digest(flavour, seed, steps),
            "training": training, "tools": [tool.name for tool in POOL]}, indent=2))
    return out


def validate_model_dir(path: Path) -> dict[str, Any]:
    """Check a folder is a complete tiny model of ours; raise TinyModelError saying what to do."""
    path = Path(path)
    if not path.is_dir():
        raise TinyModelError(f"tiny-model folder {path} does not exist; build it with "
                             f"`python -m vllm_allowed_tools.devtools.models.tiny_model {path}`")
    missing = [name for name in ("config.json", "tokenizer.json", "tokenizer_config.json",
                                 "model.safetensors", MARKER_FILE) if not (path / name).is_file()]
    if missing:
        raise TinyModelError(f"{path} is not a complete tiny model (missing {', '.join(missing)}); "
                             f"delete it and rebuild with "
                             f"`python -m vllm_allowed_tools.devtools.models.tiny_model {path}`")
    try:
        return json.loads((path / MARKER_FILE).read_text())
    except ValueError as exc:
        raise TinyModelError(f"{path / MARKER_FILE} is not valid JSON ({exc}); delete {path} "
                             "and rebuild it") from exc


def positions_of(path: Path) -> int | None:
    """The model folder's ``max_position_embeddings`` (the real model's 8K caps what is served)."""
    with contextlib.suppress(OSError, ValueError):
        positions = json.loads((Path(path) / "config.json").read_text()).get("max_position_embeddings")
        return positions if isinstance(positions, int) and positions > 0 else None
    return None


def default_cache_dir() -> Path:
    helpers = HelperSettings.from_environ()
    root = helpers.cache or os.path.join(
        helpers.xdg_cache_home or os.path.expanduser("~/.cache"), "vllm-allowed-tools")
    return Path(root) / "models"


def vllm_cache_dir() -> Path:
    """The ``VLLM_CACHE_ROOT`` the servers we start share (next to the models)."""
    return default_cache_dir().parent / "vllm"


def cached_model(flavour: str, seed: int = 0, cache_dir: Path | None = None) -> Path | None:
    """The cached model for (flavour, seed) when it is complete and built by today's recipe."""
    path = (Path(cache_dir) if cache_dir else default_cache_dir()) / f"{flavour}-seed{seed}"
    try:
        marker = validate_model_dir(path)
    except TinyModelError:
        return None
    return path if marker.get("recipe") == recipe_digest(flavour, seed, default_steps(flavour)) else None


def ensure_model(flavour: str = "random", seed: int = 0, cache_dir: Path | None = None,
                 log=print) -> Path:
    """The cached model for (flavour, seed), built if missing or built by an older recipe."""
    steps = default_steps(flavour)
    cache_dir = Path(cache_dir) if cache_dir else default_cache_dir()
    path = cache_dir / f"{flavour}-seed{seed}"
    with cache_lock(path):
        if cached_model(flavour, seed, cache_dir) is not None:
            return path
        if path.exists():
            log(f"rebuilding {path}: incomplete or built by an older recipe")
        log(f"building the {flavour} tiny model in {path}")
        return build(path, flavour=flavour, seed=seed, steps=steps, log=log)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m vllm_allowed_tools.devtools.models.tiny_model",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, nargs="?", help="folder to write the model to")
    parser.add_argument("--ensure", nargs="+", choices=FLAVOURS, metavar="FLAVOUR",
                        help="build these flavours into the model cache unless cached (no OUT)")
    parser.add_argument("--flavour", choices=FLAVOURS, default="random")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=None,
                        help=f"training steps for {' and '.join(TRAINED_FLAVOURS)} (default {TRAIN_STEPS})")
    args = parser.parse_args(argv)
    if (args.out is None) == (args.ensure is None):
        parser.error("give either OUT or --ensure FLAVOUR ...")
    try:
        if args.ensure:
            for flavour in args.ensure:
                print(ensure_model(flavour, args.seed), flush=True)
            return 0
        build(args.out, args.flavour, args.seed, args.steps if args.flavour in TRAINED_FLAVOURS else 0)
    except TinyModelError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
