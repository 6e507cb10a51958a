"""Fast checks of the foundation pieces that need no server."""

from __future__ import annotations

import importlib.metadata
import random
import subprocess
import sys
from pathlib import Path

import pytest

from vllm_allowed_tools.devtools.models import tiny_model
from vllm_allowed_tools.devtools.models.tool_pool import POOL, sample_catalog
from vllm_allowed_tools.devtools.serve import free_port
from vllm_allowed_tools.templates import template_path
from vllm_allowed_tools.templates.render import render_chat


def test_templates_ship_inside_the_package():
    path = template_path("hermes")
    assert path.is_file() and "vllm_allowed_tools" in path.parts
    with pytest.raises(FileNotFoundError, match="available: .*hermes"):
        template_path("nope")


def test_entry_point_is_registered_and_idempotent():
    entry = [e for e in importlib.metadata.entry_points(group="vllm.general_plugins")
             if e.name == "allowed_tools"]
    assert entry, "the vllm.general_plugins entry point is not installed"
    register = entry[0].load()
    register()
    register()
    from vllm.tool_parsers import ToolParserManager
    names = ToolParserManager.list_registered()
    for name in ("allowed_hermes", "allowed_llama3_json", "allowed_qwen3_coder",
                 "allowed_mistral", "allowed_pythonic"):
        assert name in names
    parser = ToolParserManager.get_tool_parser("allowed_hermes")
    assert "Hermes2ProToolParser" in [k.__name__ for k in parser.__mro__]


def test_training_text_matches_serving_render():
    rng = random.Random(0)
    text = tiny_model.render_training_text(rng, sample_catalog(rng, 4))
    assert text.startswith("<|im_start|>system\n") and text.endswith("</tool_call><|im_end|>\n")
    spans = list(tiny_model.assistant_spans(text))
    assert spans and all(text[a:b].endswith("<|im_end|>") for a, b in spans)


@pytest.fixture(scope="module")
def random_model_dir(tmp_path_factory) -> Path:
    return tiny_model.build(tmp_path_factory.mktemp("m") / "random", "random", seed=3,
                            log=lambda *_: None)


def test_random_model_builds_deterministically(random_model_dir, tmp_path):
    again = tiny_model.build(tmp_path / "again", "random", seed=3, log=lambda *_: None)
    assert (again / "model.safetensors").read_bytes() == \
        (random_model_dir / "model.safetensors").read_bytes()
    assert (again / "tokenizer.json").read_bytes() == (random_model_dir / "tokenizer.json").read_bytes()
    import json
    config = json.loads((random_model_dir / "config.json").read_text())
    assert config["head_dim"] == 64 and config["max_position_embeddings"] >= 32768


def test_tokenizer_survives_transformers_reload(random_model_dir):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(str(random_model_dir))
    text = render_chat([{"role": "user", "content": "hi"}], [POOL[0].chat_tool()])
    ids = tok(text)["input_ids"]
    assert tok.decode(ids) == text
    for marker in ("<tool_call>", "</tool_call>", "<|im_start|>", "<|im_end|>"):
        assert len(tok(marker)["input_ids"]) == 1, marker
    assert "<tool_call>" not in tok.all_special_tokens   # non-special: string triggers work


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "vllm_allowed_tools.devtools.commands", *args],
                          capture_output=True, text=True, timeout=120)


def test_cli_missing_model_folder_is_a_clear_error(tmp_path):
    result = _cli("serve-tiny", "--model-dir", str(tmp_path / "missing"))
    assert result.returncode == 2
    assert "does not exist" in result.stderr and "Traceback" not in result.stderr


def test_cli_invalid_model_folder_is_a_clear_error(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    result = _cli("serve-tiny", "--model-dir", str(tmp_path))
    assert result.returncode == 2
    assert "not a complete tiny model" in result.stderr and "Traceback" not in result.stderr


def test_cli_port_in_use_is_a_clear_error(random_model_dir):
    import socket
    port = free_port()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))
        sock.listen()
        result = _cli("serve-tiny", "--model-dir", str(random_model_dir), "--port", str(port))
    assert result.returncode == 2
    assert f"port {port}" in result.stderr and "already in use" in result.stderr
    assert "Traceback" not in result.stderr
