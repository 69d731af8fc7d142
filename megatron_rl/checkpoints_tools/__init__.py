"""Checkpoint conversion tools: GGUF / HF safetensors <-> Megatron layout at any TP/PP (`megatron-rl convert`).

Installed as `megatron_rl.checkpoints_tools`. Reading every model format at run time is `megatron_rl/models/`.
"""
