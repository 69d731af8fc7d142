"""Adapter-only weight sync (`rollout.weight_sync: adapters`): the native engine applies LoRA adapters beside its base
weights (rollout/native/lora.py).

Against peft on transformers (fp32, a tiny Qwen2 with q/k/v biases): greedy tokens identical and log-probs within
1e-5 for PEFT's own random adapters (a separate A per projection: the block-diagonal path), for adapters on some
projections only (zero blocks for the others), and for a trainer's adapters synced through the channel (one A per
fused linear), which also equal what the merged-weights sync gives the engine. Tolerance: the same fp32 maths in
another order (the low-rank path beside the base instead of merged weights), ~1e-6 over two layers."""
from __future__ import annotations

import copy
import json
import os

import pytest
import torch

from megatron_rl.cli import parity
from megatron_rl.config import ConfigError
from megatron_rl.controller.loop import train
from megatron_rl.rollout.config import NativeEngineConfig
from megatron_rl.rollout.engine import GenerateRequest, SamplingParams
from megatron_rl.rollout.native import NativeEngine
from megatron_rl.rollout.native.parity import default_prompts, hf_greedy
from tests.test_lora import ALPHA, RANK, _batch, _loss, _trainer
from tests.test_reliability import _config

peft = pytest.importorskip("peft")

CASE = next(c for c in parity.CASES if c.name == "qwen2")
TOL = 1e-5
NEW_TOKENS = 24


@pytest.fixture(scope="module")
def qwen2():
    return parity.case_model(CASE)


def _engine_outputs(arch, state, adapters=None, scaling=ALPHA / RANK):
    prompts = default_prompts(arch)
    config = NativeEngineConfig(max_batch_size=len(prompts), max_seq_len=max(map(len, prompts)) + NEW_TOKENS,
                                dtype="fp32", device="cpu")
    greedy = SamplingParams(temperature=0.0, max_new_tokens=NEW_TOKENS, ignore_eos=True)
    with NativeEngine(arch, state, config=config, eos_token_ids=[]) as engine:
        if adapters is not None:
            held = engine.update_adapters(adapters, scaling=scaling, version=1)
            assert engine.version == 1 and held > 0
            base = engine.named_weights()
            assert all(torch.equal(base[n], state[n]) for n in base if n in state)  # the base stays as it was
        outs = engine.generate([GenerateRequest(f"p{i}", p, greedy) for i, p in enumerate(prompts)])
    return prompts, outs


def _worst_against(hf_model, prompts, outs) -> float:
    worst = 0.0
    for prompt, out in zip(prompts, outs):
        hf_ids, logits = hf_greedy(hf_model, prompt, NEW_TOKENS)
        assert out.output_ids == hf_ids
        ref = torch.log_softmax(logits, -1).gather(1, torch.tensor(hf_ids)[:, None])[:, 0]
        worst = max(worst, (ref - torch.tensor(out.output_logprobs)).abs().max().item())
    return worst


@pytest.mark.parametrize("targets", [["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
                                     ["q_proj", "v_proj", "down_proj"]])
def test_peft_adapters_in_the_engine_equal_peft(qwen2, targets):
    model, arch, state = qwen2
    config = peft.LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=targets, init_lora_weights=False)
    torch.manual_seed(3)
    lora_model = peft.get_peft_model(copy.deepcopy(model), config).eval()
    adapters = {k: v.detach().clone() for k, v in peft.get_peft_model_state_dict(lora_model).items()}
    assert adapters and all(".lora_" in k for k in adapters)
    prompts, outs = _engine_outputs(arch, state, adapters)
    assert _worst_against(lora_model, prompts, outs) <= TOL
    _, plain = _engine_outputs(arch, state)
    assert [o.output_ids for o in plain] != [o.output_ids for o in outs]  # the adapters change the policy


def test_trainer_adapters_synced_alone_equal_the_merged_sync(qwen2):
    from megatron_rl.weight_sync.channel import AdapterWeightChannel

    model, arch, state = qwen2
    trainer = _trainer(arch, state)
    batch = _batch(arch.vocab_size)
    trainer.train_step(batch, _loss(batch))  # B moves off zero
    prompts = default_prompts(arch)
    config = NativeEngineConfig(max_batch_size=len(prompts), max_seq_len=max(map(len, prompts)) + NEW_TOKENS,
                                dtype="fp32", device="cpu")
    greedy = SamplingParams(temperature=0.0, max_new_tokens=NEW_TOKENS, ignore_eos=True)
    requests = [GenerateRequest(f"p{i}", p, greedy) for i, p in enumerate(prompts)]
    with NativeEngine(arch, state, config=config, eos_token_ids=[]) as engine:
        metrics = AdapterWeightChannel(trainer, engine).push(version=1)
        synced = engine.generate(requests)
    with NativeEngine(arch, trainer.export_hf_state(), config=config, eos_token_ids=[]) as engine:
        merged = engine.generate(requests)
    assert [o.output_ids for o in synced] == [o.output_ids for o in merged]
    worst = max((torch.tensor(a.output_logprobs) - torch.tensor(b.output_logprobs)).abs().max().item()
                for a, b in zip(synced, merged))
    assert worst <= TOL
    full_bytes = 4 * arch.num_parameters()
    adapter_bytes = 4 * sum(v.numel() for v in trainer.checkpoint_state().values())
    # PEFT's names repeat a fused linear's A once per projection (q/k/v, gate/up): at most 3x the trained A's;
    # rank 4 of width 64 is ~1/16 of each matrix here (of SmolLM2's 576 at rank 8, ~1/36)
    assert adapter_bytes <= metrics["weight_sync/sent_bytes"] <= 3 * adapter_bytes
    assert metrics["weight_sync/sent_bytes"] < full_bytes / 4


def test_bad_adapters_are_refused_by_name(qwen2):
    _, arch, state = qwen2
    config = NativeEngineConfig(max_batch_size=1, max_seq_len=32, dtype="fp32", device="cpu")
    a = torch.zeros(RANK, arch.hidden_size)
    with NativeEngine(arch, state, config=config, eos_token_ids=[]) as engine:
        with pytest.raises(ConfigError, match="q_proj.*lora_B"):
            engine.update_adapters({"model.layers.0.self_attn.q_proj.lora_A.weight": a}, scaling=2.0)
        with pytest.raises(ConfigError, match="does not fit|do not fit"):
            engine.update_adapters({"model.layers.0.self_attn.q_proj.lora_A.weight": a,
                                    "model.layers.0.self_attn.q_proj.lora_B.weight": torch.zeros(3, RANK)},
                                   scaling=2.0)
        with pytest.raises(ConfigError, match="layer 9"):
            engine.update_adapters({"model.layers.9.mlp.down_proj.lora_A.weight": a}, scaling=2.0)
        with pytest.raises(ConfigError, match="not a LoRA factor"):
            engine.update_adapters({"model.embed_tokens.weight": a}, scaling=2.0)
        assert engine.version == 0 and engine.model.adapters is None  # nothing applied


def test_a_run_synced_by_adapters_trains_like_one_synced_merged(tmp_path, tiny_chat_model):
    """Two short LoRA runs from the same seed, one sending merged weights, one only the adapters: the same
    rollouts to within the low-rank path's rounding, so the same rewards, and syncs of a few percent of the bytes."""
    runs = {}
    for mode in ("full", "adapters"):
        run_dir = str(tmp_path / mode)
        train(_config(tiny_chat_model, run_dir, "steps=2", "trainer.lr=1e-3", "trainer.lora.rank=4",
                      f"rollout.weight_sync={mode}"))
        runs[mode] = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    full, adapters = runs["full"], runs["adapters"]
    assert [m["rollout/reward_mean"] for m in full] == [m["rollout/reward_mean"] for m in adapters]
    sent = [(f["weight_sync/sent_bytes"], a["weight_sync/sent_bytes"]) for f, a in zip(full, adapters)]
    assert len(sent) == 2 and all(0 < a < 0.2 * f for f, a in sent), sent


@pytest.mark.parametrize("extra", [[], ["trainer.lora.rank=4", "rollout.placement=disaggregated"],
                                   ["trainer.lora.rank=4", "cluster.generator.backend=vllm"],
                                   ["trainer.lora.rank=4", "cluster.generator.backend=sglang",
                                    "cluster.generator.precision=fp8"]])
def test_adapter_sync_without_lora_or_an_engine_that_loads_adapters_is_refused(tmp_path, tiny_chat_model, extra):
    with pytest.raises(ConfigError, match="rollout.weight_sync"):
        _config(tiny_chat_model, str(tmp_path), "rollout.weight_sync=adapters", *extra)


def test_adapter_sync_reaches_sglang_servers_not_an_in_process_sglang_engine(tmp_path, tiny_chat_model, tiny_arch):
    """SGLang servers take adapters (tests/test_sglang_contract.py); an in-process SGLang engine is refused by name
    before SGLang is imported."""
    from types import SimpleNamespace

    from megatron_rl.placement.generators import make_engine

    config = _config(tiny_chat_model, str(tmp_path), "rollout.weight_sync=adapters", "trainer.lora.rank=4",
                     "cluster.generator.backend=sglang")
    with pytest.raises(ConfigError, match="cluster.generator.urls"):
        make_engine(config, SimpleNamespace(arch=tiny_arch))


@pytest.mark.parametrize("mode", ["full", "adapters"])
def test_imported_adapters_reach_the_engine_before_the_first_rollout(tmp_path, tiny_chat_model, mode):
    """`trainer.lora.init_from`: the engine is built from the base model, so the imported adapters must reach it
    before step 1 generates; otherwise step 1's rollouts come from the base, not the policy being trained, and the
    engine's log-probs of them differ from the trainer's by the adapters' whole effect."""
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny_chat_model, dtype=torch.float32)
    torch.manual_seed(0)
    adapted = peft.get_peft_model(base, peft.LoraConfig(
        r=4, lora_alpha=8.0, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        init_lora_weights=False))  # random A and B: adapters that change the model
    with torch.no_grad():  # Megatron's fused q/k/v and gate/up each take one A
        for layer in adapted.base_model.model.model.layers:
            for shared, others in ((layer.self_attn.q_proj, (layer.self_attn.k_proj, layer.self_attn.v_proj)),
                                   (layer.mlp.gate_proj, (layer.mlp.up_proj,))):
                for other in others:
                    other.lora_A["default"].weight.copy_(shared.lora_A["default"].weight)
    adapter_dir = tmp_path / "imported"
    adapted.save_pretrained(adapter_dir)
    run_dir = str(tmp_path / "run")
    train(_config(tiny_chat_model, run_dir, "steps=1", "trainer.lora.rank=4", "trainer.lora.alpha=8.0",
                  f"trainer.lora.init_from={adapter_dir}", f"rollout.weight_sync={mode}"))
    first = json.loads(open(os.path.join(run_dir, "metrics.jsonl")).readline())
    assert first["train/logprob_mismatch"] < 1e-4, first["train/logprob_mismatch"]
