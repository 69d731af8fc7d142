"""Checkpoint conversion: GGUF / HF safetensors <-> Megatron layout at any TP/PP.

Installed as `megatron_rl.checkpoints_tools`. Entry point: `megatron-rl convert`.
"""
from megatron_rl.checkpoints_tools.pretrained import Pretrained, load_pretrained

__all__ = ["Pretrained", "load_pretrained"]
