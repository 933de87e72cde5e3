"""A model folder, loaded once at start-up: tokenizer, chat template, special tokens, context length.

The folder holds Hugging Face's files (the ones vLLM's render server reads for a text model):
``tokenizer.json`` (required), ``tokenizer_config.json`` (``bos_token``/``eos_token``, maybe the chat
template), ``chat_template.jinja`` (preferred over the config's template, as transformers does),
``config.json`` (``max_position_embeddings`` = the context length, ``eos_token_id``) and
``generation_config.json`` (``eos_token_id`` and the sampling defaults vLLM takes from it).

The served model name defaults to the folder's name, as vLLM names a local model by its path
(``--served-model-name`` overrides it). ``RenderModel`` is read-only and shared by every request.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import tokenizers

from contract.errors import ConfigError
from rendering.detokenize import byte_level_decoder, clean_step_texts

#: the shipped model (tiny-llama's tokenizer files), found from this package's own location; the
#: package is installed editable, so this is the repository's ``models/tiny-llama``
DEFAULT_MODEL_DIR = Path(__file__).resolve().parent.parent / "models" / "tiny-llama"

#: generation_config.json keys vLLM uses as default sampling parameters (``max_new_tokens`` becomes
#: ``max_tokens``), as its ``ModelConfig.get_diff_sampling_param`` reads them
_SAMPLING_KEYS = {
    "repetition_penalty": "repetition_penalty",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
    "temperature": "temperature",
    "top_k": "top_k",
    "top_p": "top_p",
    "min_p": "min_p",
    "max_new_tokens": "max_tokens",
}

#: tokenizer_config.json's special-token keys; the chat template sees each as a variable
_SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


@dataclass(frozen=True)
class RenderModel:
    """What render and derender need to know about one model; built by ``load_model``."""

    name: str
    path: Path
    tokenizer: tokenizers.Tokenizer
    #: ``tokenizer.get_vocab_size(with_added_tokens=True)``
    vocab_size: int
    max_model_len: int
    bos_token: str | None
    eos_token: str | None
    #: the tokenizer's id of ``eos_token`` (else generation_config.json's / config.json's)
    eos_token_id: int | None
    chat_template: str | None
    #: sampling defaults from generation_config.json (vLLM's "diff" sampling params)
    default_sampling: dict[str, Any] = field(default_factory=dict)
    #: the largest valid token id: the tokenizer's or config.json's ``vocab_size`` - 1, the larger
    max_token_id: int = 0
    #: the longest token's length in characters (vLLM bounds a text prompt by it before encoding)
    max_chars_per_token: int = 1
    #: every special token tokenizer_config.json names (``bos_token``, ``eos_token``, ``pad_token``, ...)
    special_tokens: dict[str, str] = field(default_factory=dict)
    #: ``truncation_side`` of tokenizer_config.json ("right" unless it says "left")
    truncation_side: str = "right"
    #: the tokenizer's decoder is byte-level (``rendering.detokenize.byte_level_decoder``): a whole
    #: answer can be detokenized in one ``decode`` instead of a stream step per id
    byte_level_decoder: bool = False
    #: per token id, the text a decode stream emits for it from a clean state, with a byte-level
    #: decoder (``rendering.detokenize.clean_step_texts``); None for other decoders
    clean_step_texts: tuple[str | None, ...] | None = field(default=None, repr=False)


def load_model(
    path: str | Path, *, served_model_name: str | None = None, max_model_len: int | None = None
) -> RenderModel:
    """Load the model folder ``path``; ``ConfigError`` names what is missing or broken."""
    folder = Path(path).expanduser()
    if not folder.is_dir():
        raise ConfigError(f"model folder {str(folder)!r} does not exist or is not a directory; "
                          "give --model-dir a folder with tokenizer.json and tokenizer_config.json")
    tokenizer_file = folder / "tokenizer.json"
    if not tokenizer_file.is_file():
        raise ConfigError(f"model folder {str(folder)!r} has no tokenizer.json (Hugging Face fast "
                          "tokenizer file); only folders with one are supported")
    try:
        tokenizer = tokenizers.Tokenizer.from_file(str(tokenizer_file))
    except Exception as exc:  # tokenizers raises a bare Exception on a malformed file
        raise ConfigError(f"{tokenizer_file} is not a valid tokenizer file: {exc}") from exc

    tok_config = _read_json(folder / "tokenizer_config.json", required=False)
    model_config = _read_json(folder / "config.json", required=False)
    gen_config = _read_json(folder / "generation_config.json", required=False)

    template = _chat_template(folder, tok_config)
    context = max_model_len if max_model_len is not None else _context_length(folder, model_config, tok_config)
    if context < 1:
        raise ConfigError(f"max_model_len must be at least 1, got {context}")

    vocab = tokenizer.get_vocab(with_added_tokens=True)
    if not vocab:
        raise ConfigError(f"{tokenizer_file} has an empty vocabulary")
    eos_token = _token_text(tok_config.get("eos_token"))
    eos_token_id = tokenizer.token_to_id(eos_token) if eos_token is not None else None
    if eos_token_id is None:
        eos_token_id = _eos_token_id(gen_config, model_config)
    config_vocab = model_config.get("vocab_size")
    max_token_id = max(vocab.values())
    if isinstance(config_vocab, int) and not isinstance(config_vocab, bool):
        max_token_id = max(max_token_id, config_vocab - 1)
    specials = {key: text for key in _SPECIAL_TOKEN_KEYS if (text := _token_text(tok_config.get(key))) is not None}
    name = served_model_name or folder.name
    if not name:
        raise ConfigError(f"cannot name the model of folder {str(folder)!r}; give --served-model-name")
    return RenderModel(
        name=name,
        path=folder,
        tokenizer=tokenizer,
        vocab_size=tokenizer.get_vocab_size(with_added_tokens=True),
        max_model_len=context,
        bos_token=_token_text(tok_config.get("bos_token")),
        eos_token=eos_token,
        eos_token_id=eos_token_id,
        chat_template=template,
        default_sampling={
            ours: gen_config[theirs] for theirs, ours in _SAMPLING_KEYS.items() if gen_config.get(theirs) is not None
        },
        max_token_id=max_token_id,
        max_chars_per_token=max(len(token) for token in vocab),
        special_tokens=specials,
        truncation_side="left" if tok_config.get("truncation_side") == "left" else "right",
        byte_level_decoder=byte_level_decoder(tokenizer),
        clean_step_texts=clean_step_texts(tokenizer),
    )


def _read_json(path: Path, *, required: bool) -> dict[str, Any]:
    if not path.is_file():
        if required:
            raise ConfigError(f"model folder has no {path.name} ({path})")
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"{path} is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"{path} must hold a JSON object, got {type(data).__name__}")
    return data


def _chat_template(folder: Path, tok_config: dict[str, Any]) -> str | None:
    jinja_file = folder / "chat_template.jinja"
    if jinja_file.is_file():
        try:
            return jinja_file.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"cannot read {jinja_file}: {exc}") from exc
    template = tok_config.get("chat_template")
    if template is None:
        return None
    if isinstance(template, str):
        return template
    # a list of named templates (transformers' format): the one named "default"
    if isinstance(template, list):
        for entry in template:
            if isinstance(entry, dict) and entry.get("name") == "default" and isinstance(entry.get("template"), str):
                return entry["template"]
    raise ConfigError(f"{folder / 'tokenizer_config.json'}: chat_template must be a string "
                      "(or a list of named templates with a 'default' one)")


def _context_length(folder: Path, model_config: dict[str, Any], tok_config: dict[str, Any]) -> int:
    for key in ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length", "max_sequence_length"):
        value = model_config.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    value = tok_config.get("model_max_length")
    if isinstance(value, int) and not isinstance(value, bool) and 0 < value < 10**9:
        return value
    raise ConfigError(f"model folder {str(folder)!r}: config.json names no context length "
                      "(max_position_embeddings); give --max-model-len")


def _eos_token_id(gen_config: dict[str, Any], model_config: dict[str, Any]) -> int | None:
    for source in (gen_config, model_config):
        value = source.get("eos_token_id")
        if isinstance(value, list):
            value = value[0] if value else None
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken dict."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None
