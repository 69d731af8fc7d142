"""The chat-template families of the tests (tests/fixtures/chat_templates/README.md): each published template
paired with SmolLM2's real byte-level BPE vocabulary plus the family's control tokens, written as an HF
tokenizer directory by transformers' own `save_pretrained`."""
from __future__ import annotations

import dataclasses
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, processors
from transformers import PreTrainedTokenizerFast

FIXTURES = Path(__file__).parent / "fixtures" / "chat_templates"
SHIPPED = Path(__file__).parent.parent / "examples" / "chat_templates"  # templates the project ships (README there)
LLAMA3_TOKENS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
                 "<|eom_id|>", "<|python_tag|>"]
# SmolLM2's vocabulary already has <|im_start|>, <|im_end|> and <|endoftext|> as special tokens.
QWEN_PLAIN_TOKENS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"]
GEMMA3_TOKENS = ["<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>", "<start_of_image>"]
# GPT-OSS's harmony format (SmolLM2's vocabulary has <|endoftext|> already)
HARMONY_TOKENS = ["<|startoftext|>", "<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>",
                  "<|return|>", "<|call|>"]
MISTRAL_TOKENS = ["<s>", "</s>", "[INST]", "[/INST]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]", "[TOOL_CALLS]",
                  "[TOOL_RESULTS]", "[/TOOL_RESULTS]"]


@dataclasses.dataclass(frozen=True)
class Family:
    template_file: str | None  # None: SmolLM2's template, from the GGUF
    eos: str
    bos: str | None = None
    pad: str | None = None
    special: tuple[str, ...] = ()
    plain: tuple[str, ...] = ()  # added but not special, as Qwen's own tokenizer has them

    @property
    def template(self) -> str:
        folder = FIXTURES if (FIXTURES / self.template_file).exists() else SHIPPED
        return (folder / self.template_file).read_text(encoding="utf-8")


FAMILIES = {
    "llama-3.1": Family("meta-llama-Llama-3.1-8B-Instruct.jinja", eos="<|eot_id|>", bos="<|begin_of_text|>",
                        special=tuple(LLAMA3_TOKENS)),
    "llama-3.2": Family("meta-llama-Llama-3.2-3B-Instruct.jinja", eos="<|eot_id|>", bos="<|begin_of_text|>",
                        special=tuple(LLAMA3_TOKENS)),
    "qwen2.5": Family("Qwen-Qwen2.5-7B-Instruct.jinja", eos="<|im_end|>", pad="<|endoftext|>",
                      plain=tuple(QWEN_PLAIN_TOKENS[:2])),
    "qwen3": Family("Qwen-Qwen3-0.6B.jinja", eos="<|im_end|>", pad="<|endoftext|>", plain=tuple(QWEN_PLAIN_TOKENS)),
    "mistral-v0.3": Family("mistralai-Mistral-7B-Instruct-v0.3.jinja", eos="</s>", bos="<s>",
                           special=tuple(MISTRAL_TOKENS)),
    "gemma-3": Family("google-gemma-3-it.jinja", eos="<eos>", bos="<bos>", pad="<pad>", special=tuple(GEMMA3_TOKENS)),
    "gpt-oss": Family("openai-gpt-oss-120b.jinja", eos="<|return|>", pad="<|endoftext|>", special=tuple(HARMONY_TOKENS)),
    "smollm2": Family(None, eos="<|im_end|>", bos="<|im_start|>", pad="<|im_end|>"),
}


def save_family_tokenizer(path: Path, family: Family, vocabulary: str) -> PreTrainedTokenizerFast:
    """The family's tokenizer on `vocabulary` (a `tokenizers` JSON string), saved by transformers at `path`."""
    tk = Tokenizer.from_str(vocabulary)
    tk.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in family.special])
    tk.add_tokens([AddedToken(t, special=False, normalized=False) for t in family.plain])
    if family.bos:  # as Llama 3's and Mistral's own tokenizers: plain encoding prepends BOS
        bos = (family.bos, tk.token_to_id(family.bos))
        tk.post_processor = processors.TemplateProcessing(single=f"{family.bos} $A", pair=f"{family.bos} $A $B",
                                                          special_tokens=[bos])
    hf = PreTrainedTokenizerFast(tokenizer_object=tk, bos_token=family.bos, eos_token=family.eos,
                                 pad_token=family.pad, chat_template=family.template,
                                 clean_up_tokenization_spaces=False)
    hf.save_pretrained(path)
    return hf
