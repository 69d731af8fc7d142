"""FP8 block quantization for fp8 inference engines (CPU, torch's float8 dtypes) and the log-prob gap it
opens between trainer and engine; TE FP8 training where TE and a GPU exist."""
from __future__ import annotations

import pytest
import torch

from megatron_rl.weight_sync.fp8 import (
    FP8_DTYPE,
    dequantize_blockwise,
    fake_quantize_state,
    quantize_blockwise,
    quantize_state,
)


def _reference_quantize(weight, block):
    """Tile by tile with Python loops: the independent reference."""
    rows, cols = weight.shape
    nb_r, nb_c = -(-rows // block), -(-cols // block)
    q = torch.empty(rows, cols, dtype=FP8_DTYPE)
    scales = torch.empty(nb_r, nb_c)
    for i in range(nb_r):
        for j in range(nb_c):
            tile = weight[i * block:(i + 1) * block, j * block:(j + 1) * block].float()
            amax = tile.abs().max().item()
            scale = amax / 448.0 if amax > 0 else 1.0
            scales[i, j] = scale
            q[i * block:(i + 1) * block, j * block:(j + 1) * block] = (tile / scale).to(FP8_DTYPE)
    return q, scales


@pytest.mark.parametrize("shape, block", [((256, 384), 128), ((200, 130), 64), ((7, 5), 4)])
def test_blockwise_quantization_matches_tile_by_tile_reference(shape, block):
    torch.manual_seed(0)
    weight = torch.randn(*shape) * torch.logspace(-2, 1, shape[1])  # columns of very different magnitudes
    weight[0, 0] = 50.0  # an outlier coarsens only its own tile
    q, scale_inv = quantize_blockwise(weight, block)
    ref_q, ref_scales = _reference_quantize(weight, block)
    assert q.dtype == FP8_DTYPE and q.shape == weight.shape
    assert scale_inv.shape == (-(-shape[0] // block), -(-shape[1] // block))
    torch.testing.assert_close(scale_inv, ref_scales, rtol=1e-6, atol=0)
    assert torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8))
    restored = dequantize_blockwise(q, scale_inv, block)
    # e4m3 keeps 3 mantissa bits: relative rounding error <= 2^-4 for normal values; subnormals are
    # bounded by half the smallest subnormal step (2^-10) times the tile's scale.
    scale_full = scale_inv.repeat_interleave(block, 0).repeat_interleave(block, 1)[:shape[0], :shape[1]]
    bound = torch.maximum(weight.abs() * 2.0 ** -4, scale_full * 2.0 ** -10)
    assert ((restored - weight).abs() <= bound + 1e-12).all()
    # quantizing the dequantized weights is exact: the engine's weights are a fixed point
    q2, s2 = quantize_blockwise(restored, block)
    assert torch.equal(q2.view(torch.uint8), q.view(torch.uint8)) and torch.allclose(s2, scale_inv)


def test_zero_tile_and_state_naming():
    weight = torch.zeros(4, 8)
    weight[:, 4:] = 1.0
    q, scale_inv = quantize_blockwise(weight, 4)
    assert torch.equal(scale_inv, torch.tensor([[1.0, 1.0 / 448.0]]))
    assert torch.equal(dequantize_blockwise(q, scale_inv, 4), weight)
    state = {"model.layers.0.self_attn.q_proj.weight": torch.randn(8, 8), "model.norm.weight": torch.ones(8),
             "model.embed_tokens.weight": torch.randn(16, 8)}
    out = quantize_state(state, block=4)
    assert out["model.layers.0.self_attn.q_proj.weight"].dtype == FP8_DTYPE
    assert out["model.layers.0.self_attn.q_proj.weight_scale_inv"].shape == (2, 2)
    assert out["model.norm.weight"] is state["model.norm.weight"]
    assert out["model.embed_tokens.weight"] is state["model.embed_tokens.weight"]


def test_fp8_engine_weights_open_a_small_logprob_gap(tiny_arch):
    """Behaviour log-probs of an engine on fp8-rounded weights vs the trainer's log-probs of the same tokens
    (the two sides of train/logprob_mismatch): a real, small gap; with the exact weights it is ~0."""
    from megatron_rl.rollout.config import NativeEngineConfig
    from megatron_rl.rollout.engine import GenerateRequest, SamplingParams
    from megatron_rl.rollout.native import NativeEngine
    from megatron_rl.trainer.config import TrainerConfig
    from megatron_rl.trainer.trainer import MegatronTrainer
    from megatron_rl.types import TrainBatch
    from megatron_rl.weight_sync.fp8 import quantization_error
    from tests.helpers import prompt, tiny_state

    state = tiny_state(tiny_arch, seed=3)
    trainer = MegatronTrainer(tiny_arch, TrainerConfig(micro_batch_size=1, vocab_divisible_by=1), hf_state=state)
    config = NativeEngineConfig(max_batch_size=8, max_seq_len=64, prepack_weights=False)
    requests = [GenerateRequest(request_id=f"r{i}", prompt_ids=prompt(i, 6, tiny_arch.vocab_size),
                                sampling=SamplingParams(max_new_tokens=12, temperature=1.0, seed=i))
                for i in range(4)]
    gaps = {}
    for name, weights in (("exact", state), ("fp8", fake_quantize_state(state, block=32))):
        with NativeEngine(tiny_arch, weights, config=config) as engine:
            completions = engine.generate(requests)
        diffs = []
        for c in completions:
            tokens = torch.tensor([c.prompt_ids + c.output_ids])
            train_lp = trainer.compute_logprobs(TrainBatch(tokens=tokens, loss_mask=torch.ones_like(tokens, dtype=torch.float)))
            diffs.append((train_lp[0, len(c.prompt_ids):] - torch.tensor(c.output_logprobs)).abs())
        gaps[name] = torch.cat(diffs).mean().item()
    assert gaps["exact"] < 1e-4, gaps
    assert 1e-3 < gaps["fp8"] < 0.3, gaps  # 0.15 here: random weights with spread logits are sensitive
    assert 0.005 < quantization_error(state, block=32)["weight_sync/fp8_rel_error"] < 0.05


@pytest.mark.gpu
def test_te_fp8_trainer_step_runs(tiny_arch):
    """TE FP8 (delayed scaling) trainer step on a GPU: finite loss, close to the bf16 step's."""
    pytest.importorskip("transformer_engine")
    from megatron_rl.models.arch import ModelArch
    from megatron_rl.trainer.config import TrainerConfig
    from megatron_rl.trainer.trainer import MegatronTrainer
    from megatron_rl.types import TrainBatch
    from tests.helpers import near_uniform_state

    arch = ModelArch(vocab_size=256, num_layers=2, hidden_size=128, ffn_hidden_size=256, num_attention_heads=4,
                     num_query_groups=2, max_position_embeddings=256)  # TE FP8 GEMMs need dims % 16 == 0
    batch = TrainBatch(tokens=torch.randint(0, 256, (16, 65)), loss_mask=torch.ones(16, 65))
    losses = {}
    for recipe in ("none", "delayed", "tensorwise"):
        trainer = MegatronTrainer(arch, TrainerConfig(precision="bf16", layer_spec="te", fp8=recipe, micro_batch_size=16),
                                  hf_state=near_uniform_state(arch))
        losses[recipe] = trainer.train_step(batch, lambda lp, mb, e: (-(lp * mb.loss_mask).sum() / mb.loss_mask.sum(), {}))["train/loss"]
    assert all(torch.isfinite(torch.tensor(v)) for v in losses.values())
    assert abs(losses["delayed"] - losses["none"]) < 0.05 and abs(losses["tensorwise"] - losses["none"]) < 0.05


def test_loop_with_fp8_generator_reports_the_logprob_gap(tmp_path, tiny_chat_model):
    """cluster.generator.precision=fp8: every weight sync quantizes; the loop's train/logprob_mismatch
    shows the gap (it is < 1e-4 with identical weights, tests/test_loop.py)."""
    import json
    import os

    from megatron_rl.controller.loop import train
    from tests.test_loop import _config

    run_dir = str(tmp_path / "run")
    train(_config(tiny_chat_model, run_dir, "steps=2", "cluster.generator.precision=fp8",
                  "cluster.generator.fp8_block_size=32", "checkpoint.every_steps=0", "checkpoint.save_at_end=false",
                  "eval.before_training=false", "eval.after_training=false"))
    records = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    mismatches = [r["train/logprob_mismatch"] for r in records if "train/logprob_mismatch" in r]
    assert len(mismatches) == 2 and all(1e-4 < m < 0.5 for m in mismatches), mismatches


def test_fp8_training_needs_transformer_engine_on_cpu(tiny_arch):
    from megatron_rl.trainer.config import TrainerConfig
    from megatron_rl.trainer.model import transformer_engine_available
    from megatron_rl.trainer.trainer import MegatronTrainer

    if transformer_engine_available():
        pytest.skip("TE with CUDA present: the GPU test covers FP8 training")
    with pytest.raises(ValueError, match="trainer.fp8='delayed' needs Transformer Engine layers"):
        MegatronTrainer(tiny_arch, TrainerConfig(fp8="delayed"))


def test_fp8_checkpoint_for_engines(tmp_path, tiny_arch):
    """The engines' starting checkpoint: projections in block fp8 + scale_inv, SGLang's quantization_config,
    everything else as it was; dequantized weights within e4m3's rounding of the originals."""
    import json

    from safetensors.torch import load_file

    from megatron_rl.checkpoints_tools.convert import save_hf
    from megatron_rl.weight_sync.fp8 import write_fp8_checkpoint
    from tests.helpers import tiny_state

    state = {k: v.to(torch.bfloat16) for k, v in tiny_state(tiny_arch, seed=2).items()}
    save_hf(str(tmp_path / "hf"), tiny_arch, state, None)
    out = write_fp8_checkpoint(str(tmp_path / "hf"), str(tmp_path / "fp8"), block=32)
    config = json.load(open(tmp_path / "fp8" / "config.json"))
    assert config["quantization_config"] == {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                                             "weight_block_size": [32, 32]}
    saved = load_file(f"{out}/model.safetensors")
    index = json.load(open(tmp_path / "fp8" / "model.safetensors.index.json"))["weight_map"]
    assert set(index) == set(saved)
    name = "model.layers.1.mlp.down_proj.weight"
    assert saved[name].dtype == FP8_DTYPE and saved[name + "_scale_inv"].dtype == torch.float32
    restored = dequantize_blockwise(saved[name], saved[name + "_scale_inv"], 32)
    assert ((restored - state[name].float()).abs() <= state[name].float().abs() * 2 ** -4 + 1e-3).all()
    assert torch.equal(saved["model.norm.weight"], state["model.norm.weight"])
