"""Weight sync from a Megatron trainer at TP=2 x PP=2 to an engine at TP=1: after every sync the
engine's weights equal the trainer's. Two channels: the shared-memory arena of an engine process (every
tensor checksummed on both sides) and bucketed assembly on rank 0 for an engine held there."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from megatron_rl.placement.launch import run_distributed
from tests.helpers import near_uniform_state
from tests.test_trainer_parallel import _data


def _sync_worker(rank, world_size, arch, state, batch, tp=2, pp=2, ep=1, delta=False, dtype="fp32", lr=1e-2,
                 versions=(1, 2)):
    import torch.distributed as dist

    from megatron_rl.placement.generator_process import GeneratorProcess
    from megatron_rl.rollout.config import NativeEngineConfig
    from megatron_rl.rollout.native import NativeEngine
    from megatron_rl.trainer.config import ParallelConfig, TrainerConfig
    from megatron_rl.trainer.trainer import MegatronTrainer
    from megatron_rl.weight_sync.channel import (
        InProcessWeightChannel,
        SharedMemoryWeightChannel,
    )

    torch.set_num_threads(1)
    parallel = ParallelConfig(tensor_parallel=tp, pipeline_parallel=pp, expert_parallel=ep)
    trainer = MegatronTrainer(arch, TrainerConfig(parallel=parallel, micro_batch_size=2, lr=lr, vocab_divisible_by=1),
                              hf_state=state)
    generator = engine = None
    state = trainer.gather_hf_state(dst=0)  # the engine's names (MoE: transformers' in-memory form -> published)
    engine_config = NativeEngineConfig(max_batch_size=2, dtype=dtype)
    if rank == 0:
        generator = GeneratorProcess(arch, state, config=engine_config, verify_weights=True)
        engine = NativeEngine(arch, state, config=engine_config)
    try:
        channel = SharedMemoryWeightChannel(trainer, generator, delta=delta)
        # buckets far smaller than the model: many reduce rounds, tensors split across ranks in each
        buckets = InProcessWeightChannel(trainer, engine, bucket_bytes=16 << 10, delta=delta)
        normalizer = batch.loss_mask.sum()
        mismatches, sent = [], []
        for version in versions:
            trainer.train_step(batch, lambda lp, mb, ent: (-(lp * mb.loss_mask).sum() / normalizer, {}))
            shared = channel.push(version)  # verify mode: the engine's checksums must equal the shared buffer's
            bucketed = buckets.push(version)
            sent.append((shared.get("weight_sync/sent_fraction"), bucketed.get("weight_sync/sent_fraction"),
                         {k.split("/")[1].removesuffix("_tensors"): v for k, v in bucketed.items() if k.endswith("_tensors")}))
            # what a full sync leaves in the engine: the trainer's weights in the engine's dtype
            expected = {n: t.to(torch.bfloat16 if dtype == "bf16" else torch.float32) for n, t in (trainer.gather_hf_state(dst=0) or {}).items()}
            if rank == 0:
                views = channel.arena_views[1 - generator.staging_index]  # the arena the engine adopted
                assert set(views) == set(expected), sorted(set(views) ^ set(expected))
                mismatches.append([n for n in expected if not torch.equal(views[n], expected[n])])
                held = engine.named_weights(expected)  # (an MoE engine also answers to transformers' fused names)
                assert set(held) == set(expected) and engine.version == version
                mismatches[-1] += [f"bucketed {n}" for n in expected if not torch.equal(held[n], expected[n])]
                assert generator.version == version
                assert generator.health()["process_alive"]
        dist.barrier()
        return (mismatches, sent) if delta else mismatches if rank == 0 else None
    finally:
        if generator is not None:
            generator.close()
            engine.close()


def test_tp2_pp2_trainer_to_tp1_engine_equal_after_every_sync(tiny_arch):
    state = near_uniform_state(tiny_arch)
    mismatches = run_distributed(_sync_worker, 4, tiny_arch, state, _data(tiny_arch))[0]
    assert mismatches == [[], []]


def test_delta_syncs_leave_the_engines_equal_to_full_syncs_and_send_less(tiny_arch):
    """Delta sync (rollout.weight_sync: delta) at TP=2 into a bf16 engine: after every step the generator
    process's arena and the engine on rank 0 hold the bits a full sync would give; the first sync sends
    everything, the later ones only the changed elements (a small learning rate moves few bf16 values)."""
    state = near_uniform_state(tiny_arch)
    mismatches, sent = run_distributed(_sync_worker, 2, tiny_arch, state, _data(tiny_arch), 2, 1, 1, True, "bf16",
                                       1e-3, (1, 2, 3, 4))[0]
    assert mismatches == [[], [], [], []]
    assert sent[0][0] == 1.0 and sent[1][0] == 1.0  # each of the two arenas is written whole once
    assert sent[0][1] == 1.0 and sent[0][2]["whole"] > 0 and sent[0][2]["sparse"] + sent[0][2]["mask"] == 0
    for shared, bucketed, tensors in sent[2:]:
        assert 0 < shared < 1 and 0 < bucketed < 1, sent
    assert sum(t["sparse"] + t["mask"] for _, _, t in sent[1:]) > 0, sent


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe", "qwen2_moe"])
def test_ep2_trainer_to_engine_carries_every_ranks_experts(family):
    """Expert parallelism: each EP rank holds half of every layer's experts (and data-parallel rank 1 is
    EP rank 1), so both channels must take experts from every EP rank, dense tensors (Qwen2-MoE's shared
    expert included) once."""
    from tests import moe_helpers

    _, arch, state, _ = moe_helpers.build(family)
    mismatches = run_distributed(_sync_worker, 2, arch, state, _data(arch, rows=4), 1, 1, 2)[0]
    assert mismatches == [[], []]


@pytest.mark.slow  # ~1 min per family on 2 cores (a 2-rank trainer and a generator process)
@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_tp2_trainer_to_engine_carries_qkv_biases_and_qk_norms(tiny_arch, family):
    """Qwen2's q/k/v biases (Megatron's fused linear_qkv.bias, split by query group) and Qwen3's q/k norm
    weights (replicated; head_dim 24 apart from hidden / heads) reach the engine exactly, trained."""
    extra = {"qwen2": dict(attention_bias=True), "qwen3": dict(qk_norm=True, head_dim=24)}[family]
    arch = dataclasses.replace(tiny_arch, num_layers=2, family=family, **extra)
    state = near_uniform_state(arch)
    generator = torch.Generator().manual_seed(7)
    for i in range(arch.num_layers):
        p = f"model.layers.{i}.self_attn."
        if arch.attention_bias:
            state.update({p + "q_proj.bias": 0.1 * torch.randn(arch.q_size, generator=generator),
                          p + "k_proj.bias": 0.1 * torch.randn(arch.kv_size, generator=generator),
                          p + "v_proj.bias": 0.1 * torch.randn(arch.kv_size, generator=generator)})
        if arch.qk_norm:
            state.update({p + n: 1.0 + 0.1 * torch.randn(arch.head_dim, generator=generator)
                          for n in ("q_norm.weight", "k_norm.weight")})
    mismatches = run_distributed(_sync_worker, 2, arch, state, _data(arch), 2, 1)[0]
    assert mismatches == [[], []]
