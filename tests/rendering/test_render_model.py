"""``load_model``: what it reads from a model folder, and a clear ``ConfigError`` for a bad one."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from contract.errors import ConfigError
from rendering.model import DEFAULT_MODEL_DIR, load_model

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    """A copy of the shipped model folder, to break."""
    target = tmp_path / "my-model"
    shutil.copytree(DEFAULT_MODEL_DIR, target)
    return target


def test_the_default_model_is_the_repos_tiny_llama() -> None:
    assert DEFAULT_MODEL_DIR == REPO / "models" / "tiny-llama"
    model = load_model(DEFAULT_MODEL_DIR)
    assert model.name == "tiny-llama"  # the folder's name, as vLLM names a local model
    assert model.max_model_len == 2048  # config.json max_position_embeddings
    assert (model.bos_token, model.eos_token, model.eos_token_id) == ("<s>", "</s>", 2)
    assert model.vocab_size == model.tokenizer.get_vocab_size(with_added_tokens=True) == 393
    assert model.max_token_id == 392
    assert model.max_chars_per_token == max(len(t) for t in model.tokenizer.get_vocab(with_added_tokens=True))
    assert model.chat_template == (DEFAULT_MODEL_DIR / "chat_template.jinja").read_text()
    assert model.special_tokens["pad_token"] == "<pad>"
    assert model.default_sampling == {}


def test_flags_override_the_name_and_the_context_length() -> None:
    model = load_model(DEFAULT_MODEL_DIR, served_model_name="other", max_model_len=100)
    assert (model.name, model.max_model_len) == ("other", 100)


def test_the_template_falls_back_to_tokenizer_config(folder: Path) -> None:
    (folder / "chat_template.jinja").unlink()
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = "{{ messages[0]['content'] }}"
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    assert load_model(folder).chat_template == "{{ messages[0]['content'] }}"
    config["chat_template"] = [{"name": "tool_use", "template": "x"}, {"name": "default", "template": "y"}]
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    assert load_model(folder).chat_template == "y"
    del config["chat_template"]
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    assert load_model(folder).chat_template is None


def test_generation_config_gives_sampling_defaults(folder: Path) -> None:
    gen = json.loads((folder / "generation_config.json").read_text())
    gen.update(temperature=0.7, top_p=0.8, max_new_tokens=50)
    (folder / "generation_config.json").write_text(json.dumps(gen))
    assert load_model(folder).default_sampling == {"temperature": 0.7, "top_p": 0.8, "max_tokens": 50}


def test_missing_folder(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_model(tmp_path / "nowhere")


def test_missing_tokenizer(folder: Path) -> None:
    (folder / "tokenizer.json").unlink()
    with pytest.raises(ConfigError, match="no tokenizer.json"):
        load_model(folder)


def test_broken_tokenizer(folder: Path) -> None:
    (folder / "tokenizer.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not a valid tokenizer file"):
        load_model(folder)


def test_broken_config_json(folder: Path) -> None:
    (folder / "config.json").write_text("[1, 2")
    with pytest.raises(ConfigError, match="config.json is not valid JSON"):
        load_model(folder)


def test_no_context_length_anywhere(folder: Path) -> None:
    (folder / "config.json").write_text("{}")
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config.pop("model_max_length", None)
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="--max-model-len"):
        load_model(folder)
    assert load_model(folder, max_model_len=64).max_model_len == 64


def test_a_template_that_does_not_compile_fails_at_start_up(folder: Path) -> None:
    from rendering.render import Renderer

    (folder / "chat_template.jinja").write_text("{% for m in messages %}")
    with pytest.raises(ConfigError, match="does not compile"):
        Renderer(load_model(folder))
