"""megatron_rl: asynchronous RL post-training of LLMs on native PyTorch (after Meta's LlamaRL)."""
__version__ = "0.1.0"
