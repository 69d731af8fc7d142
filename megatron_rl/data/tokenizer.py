"""Tokenizer and chat template, rebuilt from a GGUF header or read from an HF `tokenizer.json`.

Only `tokenizers` and `jinja2` are used at run time (no transformers). The GGUF path rebuilds the
byte-level BPE exactly as SmolLM2's `tokenizer.json` defines it (individual digits, then GPT-2 byte
level), checked against transformers in tests/test_trainer_parity.py.
"""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Sequence

import jinja2
import jinja2.sandbox
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from megatron_rl.config import ConfigError


@dataclasses.dataclass
class TokenizerSpec:
    """Everything needed to rebuild a tokenizer: vocabulary, merges and the special tokens."""

    tokens: list[str]
    merges: list[str]
    token_types: list[int]
    bos_token_id: int | None
    eos_token_id: int
    pad_token_id: int | None
    chat_template: str | None
    pre_tokenizer: str = "smollm"


class ChatTokenizer:
    """Encode/decode text and render chat messages with the model's own template."""

    def __init__(self, tokenizer: Any, *, bos_token_id: int | None, eos_token_id: int,
                 pad_token_id: int | None, chat_template: str | None):
        self.backend = tokenizer
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        self.pad_token_id = eos_token_id if pad_token_id is None else pad_token_id
        self.chat_template = chat_template
        self._template = _compile_template(chat_template)

    def __getstate__(self) -> dict[str, Any]:
        # The compiled jinja template does not pickle; executors in other processes recompile it.
        return {k: v for k, v in self.__dict__.items() if k != "_template"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._template = _compile_template(self.chat_template)

    # --- construction -----------------------------------------------------------------------------
    @classmethod
    def from_spec(cls, spec: TokenizerSpec) -> "ChatTokenizer":
        vocab = {t: i for i, t in enumerate(spec.tokens)}
        merges = [tuple(m.split(" ", 1)) for m in spec.merges]
        tk = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
        steps = [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]
        if spec.pre_tokenizer == "smollm":
            steps.insert(0, pre_tokenizers.Digits(individual_digits=True))
        tk.pre_tokenizer = pre_tokenizers.Sequence(steps)
        tk.decoder = decoders.ByteLevel()
        control = [spec.tokens[i] for i, kind in enumerate(spec.token_types) if int(kind) == 3]
        tk.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in control])
        return cls(tk, bos_token_id=spec.bos_token_id, eos_token_id=spec.eos_token_id,
                   pad_token_id=spec.pad_token_id, chat_template=spec.chat_template)

    @classmethod
    def from_hf_dir(cls, path: str | os.PathLike) -> "ChatTokenizer":
        file = os.path.join(path, "tokenizer.json")
        if not os.path.isfile(file):
            raise ConfigError(f"{path}: no tokenizer.json in the model directory")
        tk = Tokenizer.from_file(file)
        cfg: dict[str, Any] = {}
        cfg_file = os.path.join(path, "tokenizer_config.json")
        if os.path.isfile(cfg_file):
            with open(cfg_file, encoding="utf-8") as f:
                cfg = json.load(f)

        def token_id(key: str) -> int | None:
            token = cfg.get(key)
            if isinstance(token, dict):
                token = token.get("content")
            return tk.token_to_id(token) if token else None

        eos = token_id("eos_token")
        if eos is None:
            raise ConfigError(f"{cfg_file}: field 'eos_token' is missing or not in the vocabulary")
        return cls(tk, bos_token_id=token_id("bos_token"), eos_token_id=eos,
                   pad_token_id=token_id("pad_token"), chat_template=cfg.get("chat_template"))

    def save_hf(self, path: str | os.PathLike) -> None:
        """Write tokenizer.json + tokenizer_config.json so transformers and SGLang can load them."""
        os.makedirs(path, exist_ok=True)
        self.backend.save(os.path.join(path, "tokenizer.json"))
        name = lambda i: None if i is None else self.backend.id_to_token(i)  # noqa: E731
        cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": name(self.bos_token_id),
               "eos_token": name(self.eos_token_id), "pad_token": name(self.pad_token_id),
               "unk_token": None, "add_bos_token": False, "clean_up_tokenization_spaces": False,
               "model_max_length": 1_000_000_000}
        if self.chat_template:
            cfg["chat_template"] = self.chat_template
        with open(os.path.join(path, "tokenizer_config.json"), "w", encoding="utf-8") as f:
            json.dump(cfg, f, indent=2)

    # --- use --------------------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        return self.backend.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        return self.backend.decode([token_id], skip_special_tokens=False)

    def render_chat(self, messages: Sequence[dict[str, str]], add_generation_prompt: bool = True) -> str:
        if self._template is None:
            raise ConfigError("this tokenizer has no chat template; pass raw prompts instead")
        token = lambda i: "" if i is None else self.backend.id_to_token(i)  # noqa: E731
        return self._template.render(messages=list(messages), add_generation_prompt=add_generation_prompt,
                                     bos_token=token(self.bos_token_id), eos_token=token(self.eos_token_id))

    def encode_chat(self, messages: Sequence[dict[str, str]], add_generation_prompt: bool = True) -> list[int]:
        return self.encode(self.render_chat(messages, add_generation_prompt))


def _compile_template(chat_template: str | None):
    if not chat_template:
        return None
    # The same environment transformers renders chat templates with (sandboxed, trimmed blocks).
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = _raise_template_error
    return env.from_string(chat_template)


def _raise_template_error(message: str) -> None:
    raise ConfigError(f"chat template: {message}")
