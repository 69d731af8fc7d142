"""Tokenizer and chat templates through transformers' own tokenizer, so a training prompt is the text and
the token ids that transformers, vLLM and SGLang produce for the same messages.

An HF model directory is read by `AutoTokenizer` (tokenizer.json, tokenizer_config.json,
chat_template.jinja, named templates). A GGUF file's vocabulary is rebuilt as a `tokenizers` BPE (the
same byte-level BPE SmolLM2's tokenizer.json defines) and wrapped in `PreTrainedTokenizerFast` with the
file's chat template, so both sources render through `apply_chat_template`.
"""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Sequence

from jinja2 import TemplateError
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

from megatron_rl.config import ConfigError

ChatTemplate = str | dict[str, str] | list[dict[str, str]] | None


@dataclasses.dataclass
class TokenizerSpec:
    """Everything needed to rebuild a tokenizer: vocabulary, merges and the special tokens."""

    tokens: list[str]
    merges: list[str]
    token_types: list[int]
    bos_token_id: int | None
    eos_token_id: int
    pad_token_id: int | None
    chat_template: ChatTemplate
    pre_tokenizer: str = "smollm"
    end_of_turn_ids: list[int] = dataclasses.field(default_factory=list)
    """Tokens besides eos that end a response (GGUF `tokenizer.ggml.eot_token_id` / `eom_token_id`; Gemma's
    <end_of_turn>, which its published generation config lists as an eos)."""
    gguf_file: str | None = None
    """A SentencePiece vocabulary (GGUF `tokenizer.ggml.model` llama, e.g. Gemma): transformers' GGUF tokenizer
    converter builds the tokenizer from this file; tokens, merges and the special ids above are not used."""


class ChatTokenizer:
    """Encode/decode text and render chat messages with the model's own template (transformers'
    `apply_chat_template`). `template` names one of a model's named templates (e.g. "tool_use") and
    `chat_template_kwargs` are extra template variables (e.g. enable_thinking) used by every call
    unless a call overrides them. Pickles as is, for executors in other processes."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, *, template: str | None = None,
                 chat_template_kwargs: dict[str, Any] | None = None, source: str = "tokenizer",
                 end_of_turn_ids: Sequence[int] = ()):
        if tokenizer.eos_token_id is None:
            raise ConfigError(f"{source}: the tokenizer has no eos_token (or it is not in the vocabulary)")
        self.hf_tokenizer = tokenizer
        self.end_of_turn_ids = [int(t) for t in end_of_turn_ids if int(t) != tokenizer.eos_token_id]
        self.source = source
        self.template = template
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        if template is not None:
            self._named_template(template)  # refuse an unknown name now, not at the first prompt

    def use_template(self, template: str | None, chat_template_kwargs: dict[str, Any]) -> None:
        """Render every later prompt with the named `template` (None: the default one) and these extra
        template variables (a run's `model.chat_template` / `model.chat_template_kwargs`). A `template` ending in
        .jinja is a template file that replaces the model's own (a base model ships none)."""
        if template is not None and template.endswith(".jinja"):
            try:
                with open(template, encoding="utf-8") as f:
                    self.hf_tokenizer.chat_template = f.read()
            except (OSError, UnicodeDecodeError) as exc:
                raise ConfigError(f"model.chat_template: cannot read {template} ({exc})", field="chat_template") \
                    from None
            template = None
        if template is not None:
            self._named_template(template)
        self.template = template
        self.chat_template_kwargs = dict(chat_template_kwargs)

    # --- construction -----------------------------------------------------------------------------
    @classmethod
    def from_spec(cls, spec: TokenizerSpec, **options: Any) -> "ChatTokenizer":
        if spec.gguf_file is not None:
            folder, name = os.path.split(os.path.abspath(spec.gguf_file))
            try:
                hf = AutoTokenizer.from_pretrained(folder, gguf_file=name, local_files_only=True)
            except Exception as exc:  # noqa: BLE001 - any failure of the converter is this file's, in one line
                raise ConfigError(f"{spec.gguf_file}: transformers cannot build the GGUF tokenizer "
                                  f"({type(exc).__name__}: {_first_line(exc)})") from None
            if spec.chat_template is not None:
                hf.chat_template = spec.chat_template
            return cls(hf, source=spec.gguf_file, end_of_turn_ids=spec.end_of_turn_ids, **options)
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
        eos = spec.tokens[spec.eos_token_id]
        bos = None if spec.bos_token_id is None else spec.tokens[spec.bos_token_id]
        pad = eos if spec.pad_token_id is None else spec.tokens[spec.pad_token_id]
        hf = PreTrainedTokenizerFast(tokenizer_object=tk, chat_template=spec.chat_template, bos_token=bos,
                                     eos_token=eos, pad_token=pad, clean_up_tokenization_spaces=False)
        return cls(hf, source="GGUF tokenizer", end_of_turn_ids=spec.end_of_turn_ids, **options)

    @classmethod
    def from_hf_dir(cls, path: str | os.PathLike, **options: Any) -> "ChatTokenizer":
        path = os.fspath(path)
        file = os.path.join(path, "tokenizer.json")
        if not os.path.isfile(file):
            raise ConfigError(f"{path}: no tokenizer.json in the model directory")
        # A broken file is named in one line, not buried in a transformers traceback.
        for name in ("tokenizer_config.json", "chat_template.json"):
            _check_json(os.path.join(path, name))
        try:
            hf = AutoTokenizer.from_pretrained(path, local_files_only=True)
        except Exception as exc:
            _check_tokenizer_file(file)  # the usual culprit (checked only now: parsing it costs a second)
            raise ConfigError(f"{path}: transformers cannot load the tokenizer "
                              f"({type(exc).__name__}: {_first_line(exc)})") from None
        return cls(hf, source=path, end_of_turn_ids=_generation_eos_ids(path), **options)

    def save_hf(self, path: str | os.PathLike) -> None:
        """Write the tokenizer as transformers' `save_pretrained` does (tokenizer.json,
        tokenizer_config.json, chat_template.jinja), loadable by AutoTokenizer, vLLM and SGLang."""
        self.hf_tokenizer.save_pretrained(os.fspath(path))

    # --- use --------------------------------------------------------------------------------------
    @property
    def chat_template(self) -> str | dict[str, str] | None:
        return self.hf_tokenizer.chat_template

    def template_for(self, tools: bool) -> str | None:
        """The template text a request renders with, as transformers picks it: the named `template` if
        set, else with tools a model's "tool_use" template where it has one, else its default."""
        if not self.chat_template:
            return None
        name = None if self.template is None else self._named_template(self.template)
        return self.hf_tokenizer.get_chat_template(name, tools=[{}] if tools else None)

    @property
    def bos_token_id(self) -> int | None:
        return self.hf_tokenizer.bos_token_id

    @property
    def eos_token_id(self) -> int:
        return self.hf_tokenizer.eos_token_id

    @property
    def stop_token_ids(self) -> list[int]:
        """Every token that ends a response: eos, then the model's end-of-turn tokens (`end_of_turn_ids`)."""
        return [self.eos_token_id, *self.end_of_turn_ids]

    @property
    def pad_token_id(self) -> int:
        pad = self.hf_tokenizer.pad_token_id
        return self.eos_token_id if pad is None else pad

    @property
    def vocab_size(self) -> int:
        return len(self.hf_tokenizer)  # added tokens included

    def encode(self, text: str) -> list[int]:
        return self.hf_tokenizer.encode(text, add_special_tokens=False)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.hf_tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        return self.hf_tokenizer.decode([token_id], skip_special_tokens=False)

    def render_chat(self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool | None = None, *,
                    tools: Sequence[dict[str, Any]] | None = None, documents: Sequence[dict[str, Any]] | None = None,
                    continue_final_message: bool = False, template: str | None = None,
                    **template_kwargs: Any) -> str:
        """The prompt text, exactly as `apply_chat_template(..., tokenize=False)` renders it. A generation
        prompt is added unless `add_generation_prompt=False` or the final message is continued."""
        return self._apply(messages, add_generation_prompt, tools, documents, continue_final_message, template,
                           template_kwargs, tokenize=False)

    def encode_chat(self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool | None = None, *,
                    tools: Sequence[dict[str, Any]] | None = None, documents: Sequence[dict[str, Any]] | None = None,
                    continue_final_message: bool = False, template: str | None = None,
                    **template_kwargs: Any) -> list[int]:
        """The prompt ids, exactly as `apply_chat_template(..., tokenize=True)` returns them (the template
        writes any BOS itself; no special tokens are added on top)."""
        return self._apply(messages, add_generation_prompt, tools, documents, continue_final_message, template,
                           template_kwargs, tokenize=True)

    # --- internals --------------------------------------------------------------------------------
    def _apply(self, messages, add_generation_prompt, tools, documents, continue_final_message, template,
               template_kwargs, *, tokenize: bool):
        if not self.chat_template:
            raise ConfigError(f"{self.source}: this tokenizer has no chat template; pass raw prompts instead")
        if add_generation_prompt is None:
            add_generation_prompt = not continue_final_message
        elif add_generation_prompt and continue_final_message:
            raise ConfigError("chat template: add_generation_prompt and continue_final_message exclude each other")
        name = template if template is not None else self.template
        kwargs = {**self.chat_template_kwargs, **template_kwargs}
        try:
            out = self.hf_tokenizer.apply_chat_template(
                list(messages), tools=None if tools is None else list(tools),
                documents=None if documents is None else list(documents),
                chat_template=None if name is None else self._named_template(name),
                add_generation_prompt=add_generation_prompt, continue_final_message=continue_final_message,
                tokenize=tokenize, return_dict=False, **kwargs)
        except (TemplateError, ValueError) as exc:
            # raise_exception(...) in the template, a template bug, or transformers refusing the messages
            # (e.g. a continued final message that the template rewrites)
            raise ConfigError(f"chat template of {self.source}: {_first_line(exc)}") from None
        return list(out) if tokenize else out

    def _named_template(self, name: str) -> str:
        templates = self.chat_template
        if not isinstance(templates, dict) or name not in templates:
            known = ", ".join(sorted(templates)) if isinstance(templates, dict) else "none: it has one template"
            raise ConfigError(f"{self.source}: no chat template named '{name}' (named templates: {known})")
        return templates[name]


def _generation_eos_ids(path: str) -> list[int]:
    """The eos ids an HF model directory's generation_config.json lists (Gemma 3: <eos> and <end_of_turn>)."""
    file = os.path.join(path, "generation_config.json")
    if not os.path.isfile(file):
        return []
    _check_json(file)
    with open(file, encoding="utf-8") as f:
        ids = json.load(f).get("eos_token_id")
    ids = [ids] if isinstance(ids, int) else ids or []
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise ConfigError(f"{file}: field 'eos_token_id' must be a token id or a list of them, got {ids!r}")
    return ids


def _check_json(file: str) -> None:
    if not os.path.isfile(file):
        return
    try:
        with open(file, encoding="utf-8") as f:
            json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{file}: not valid JSON ({_first_line(exc)})") from None


def _check_tokenizer_file(file: str) -> None:
    try:
        Tokenizer.from_file(file)
    except Exception as exc:  # the Rust loader raises plain Exceptions
        raise ConfigError(f"{file}: not a valid tokenizers file ({_first_line(exc)})") from None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
