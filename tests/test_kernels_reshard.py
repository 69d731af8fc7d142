"""Resharding Megatron TP/PP shards into engine TP shards: bit-exact against slicing the HF tensors that
the reference converter (`megatron_to_hf`) produces; bucket packing round trips."""
from __future__ import annotations

import pytest
import torch

from megatron_rl.kernels import triton_reshard
from megatron_rl.models.arch import ModelArch
from megatron_rl.models.megatron_layout import (
    MegatronLayout,
    hf_to_megatron,
    megatron_to_hf,
)
from megatron_rl.placement.launch import run_distributed
from megatron_rl.weight_sync import reshard as R

needs_triton = pytest.mark.skipif(not triton_reshard.AVAILABLE, reason="triton not importable")


def _arch(heads=8, groups=4, vocab=250, tied=False, layers=2, hidden=32, ffn=48, family="llama", head_dim=4):
    return ModelArch(vocab_size=vocab, num_layers=layers, hidden_size=hidden, ffn_hidden_size=ffn,
                     num_attention_heads=heads, num_query_groups=groups, head_dim=head_dim,
                     tie_word_embeddings=tied, max_position_embeddings=64, family=family,
                     attention_bias=family == "qwen2", qk_norm=family == "qwen3")


def _random_hf(arch: ModelArch, dtype=torch.float32, seed=0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    h, f, q, kv = arch.hidden_size, arch.ffn_hidden_size, arch.q_size, arch.kv_size
    rnd = lambda *s: torch.randn(*s, generator=g).to(dtype)  # noqa: E731
    state = {"model.embed_tokens.weight": rnd(arch.vocab_size, h), "model.norm.weight": rnd(h)}
    if not arch.tie_word_embeddings:
        state["lm_head.weight"] = rnd(arch.vocab_size, h)
    for i in range(arch.num_layers):
        p = f"model.layers.{i}."
        state.update({p + "self_attn.q_proj.weight": rnd(q, h), p + "self_attn.k_proj.weight": rnd(kv, h),
                      p + "self_attn.v_proj.weight": rnd(kv, h), p + "self_attn.o_proj.weight": rnd(h, q),
                      p + "mlp.gate_proj.weight": rnd(f, h), p + "mlp.up_proj.weight": rnd(f, h),
                      p + "mlp.down_proj.weight": rnd(h, f), p + "input_layernorm.weight": rnd(h),
                      p + "post_attention_layernorm.weight": rnd(h)})
        if arch.attention_bias:
            state.update({p + "self_attn.q_proj.bias": rnd(q), p + "self_attn.k_proj.bias": rnd(kv),
                          p + "self_attn.v_proj.bias": rnd(kv)})
        if arch.qk_norm:
            state.update({p + "self_attn.q_norm.weight": rnd(arch.head_dim), p + "self_attn.k_norm.weight": rnd(arch.head_dim)})
    return state


def _expected(hf: dict[str, torch.Tensor], engine: R.EngineLayout, rank: int) -> dict[str, torch.Tensor]:
    """The engine loader's view, written out directly from the vLLM/SGLang sharding rules."""
    a, E = engine.arch, engine.tp
    hd = a.head_dim
    out = {}
    per = -(-(-(-a.vocab_size // 64) * 64) // E)
    for name, t in hf.items():
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            out[name] = t[rank * per:(rank + 1) * per]
        elif name.endswith(("q_proj.weight", "q_proj.bias")):
            n = a.num_attention_heads // E * hd
            out[name] = t[rank * n:(rank + 1) * n]
        elif t.dim() == 1 and not name.endswith(("k_proj.bias", "v_proj.bias")):
            out[name] = t  # every norm, the q/k head norms included
        elif name.endswith(("k_proj.weight", "v_proj.weight", "k_proj.bias", "v_proj.bias")):
            kv = a.num_query_groups
            head0, count = (rank * (kv // E), kv // E) if E <= kv else (rank // (E // kv), 1)
            out[name] = t[head0 * hd:(head0 + count) * hd]
        elif name.endswith(("gate_proj.weight", "up_proj.weight")):
            n = a.ffn_hidden_size // E
            out[name] = t[rank * n:(rank + 1) * n]
        elif name.endswith("o_proj.weight"):
            n = a.q_size // E
            out[name] = t[:, rank * n:(rank + 1) * n]
        elif name.endswith("down_proj.weight"):
            n = a.ffn_hidden_size // E
            out[name] = t[:, rank * n:(rank + 1) * n]
        else:
            raise AssertionError(name)
    return out


def _check(arch, tp, pp, engine_tp, backend="torch", dtype=torch.float32, stages=(None, None)):
    hf_in = _random_hf(arch, dtype)
    layout = MegatronLayout(arch, tp=tp, pp=pp, first_stage_layers=stages[0], last_stage_layers=stages[1])
    shards = hf_to_megatron(hf_in, layout)
    hf = megatron_to_hf(shards, layout)  # the reference converter
    engine = R.EngineLayout(arch, tp=engine_tp)
    plan = R.build_reshard_plan(layout, engine)
    for rank in range(engine_tp):
        sources = {key: shards[key[0]][key[1]] for key in plan.sources(rank)}  # only what the plan asks for
        got = R.execute_plan(plan, rank, sources, backend=backend)
        want = _expected(hf, engine, rank)
        assert set(got) == set(want)
        for name, t in want.items():
            assert got[name].dtype == t.dtype and got[name].shape == t.shape, name
            assert torch.equal(got[name], t), f"engine rank {rank}: {name}"
    return plan


@pytest.mark.parametrize("tp,pp,engine_tp", [(2, 1, 1), (4, 1, 2), (2, 2, 4), (1, 1, 8), (4, 2, 1)])
def test_reshard_bit_exact_vs_converter(tp, pp, engine_tp):
    # 8 heads / 4 kv heads: engine TP=8 replicates kv heads; vocab 250 is padded on both sides.
    _check(_arch(), tp, pp, engine_tp)


@pytest.mark.parametrize("tp,pp,engine_tp", [(2, 1, 1), (2, 2, 4), (4, 1, 2), (1, 1, 8)])
@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_reshard_bit_exact_qkv_bias_and_qk_norm(family, tp, pp, engine_tp):
    # qwen2: q/k/v biases split like their rows (kv heads replicated at engine TP=8); qwen3: per-head
    # q/k norm weights replicated, head_dim 6 independent of hidden / heads (32 / 8)
    plan = _check(_arch(family=family, head_dim=6 if family == "qwen3" else 4), tp, pp, engine_tp)
    names = set(plan.shapes[0])
    extra = {"qwen2": {"self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"},
             "qwen3": {"self_attn.q_norm.weight", "self_attn.k_norm.weight"}}[family]
    assert {f"model.layers.1.{n}" for n in extra} <= names


def test_reshard_from_an_uneven_pipeline_split():
    # Megatron's uneven split: 5 layers as 1 + 2 + 2 and 2 + 3 (the sync reads each layer from its own stage)
    _check(_arch(layers=5), 2, 3, 2, stages=(1, None))
    _check(_arch(layers=5, tied=True), 1, 2, 4, stages=(None, 3))


def test_reshard_tied_bf16_and_mha():
    _check(_arch(tied=True), 2, 2, 2, dtype=torch.bfloat16)
    _check(_arch(heads=4, groups=4), 4, 1, 2)


def test_plan_sources_and_senders():
    plan = _check(_arch(), 4, 1, 2)
    assert plan.sources(0) == [(0, 0), (0, 1)] and plan.sources(1) == [(0, 1), (0, 2), (0, 3)]  # vocab rows 128..249 live on 1
    sends = plan.copies_from(0, 1)
    assert list(sends) == [0, 1]
    # fused QKV: one q segment per query group; Megatron TP=2 holds 2 groups of 2 heads (hd 4) per rank,
    # each group's rows are [q (8 rows); k (4); v (4)]
    plan = _check(_arch(), 2, 1, 1)
    q = [c for c in plan.copies[0] if c.dst == "model.layers.0.self_attn.q_proj.weight"]
    assert [(c.src[1], c.segments) for c in q] == [
        (0, [(0, 0, 0, 0, 8, 32), (16, 0, 8, 0, 8, 32)]), (1, [(0, 0, 16, 0, 8, 32), (16, 0, 24, 0, 8, 32)])]


def test_engine_layout_validation():
    from megatron_rl.config import ConfigError

    with pytest.raises(ConfigError, match="num_attention_heads"):
        R.EngineLayout(_arch(), tp=3)
    with pytest.raises(ConfigError, match="Megatron shard"):
        layout = MegatronLayout(_arch(), tp=2)
        plan = R.build_reshard_plan(layout, R.EngineLayout(_arch(), tp=1))
        R.execute_plan(plan, 0, {(0, 0): {}})


def _triton_worker(rank, world_size):
    arch = _arch(heads=4, groups=2, vocab=70, hidden=16, ffn=16, layers=1)
    _check(arch, 2, 1, 1, backend="triton")
    _check(arch, 2, 1, 4, backend="triton", dtype=torch.bfloat16)
    _check(_arch(heads=4, groups=2, vocab=70, hidden=16, ffn=16, layers=1, family="qwen2"), 2, 1, 4, backend="triton")
    _check(_arch(heads=4, groups=2, vocab=70, hidden=16, ffn=16, layers=1, family="qwen3"), 2, 1, 1, backend="triton")
    return True


@needs_triton
def test_reshard_triton_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # Triton's interpreter in a fresh process (CPU tensors)
    assert run_distributed(_triton_worker, 1) == [True]


@pytest.mark.gpu
def test_reshard_triton_gpu():
    arch = _arch(heads=16, groups=8, vocab=1000, hidden=256, ffn=512, layers=2)
    hf = {k: v.cuda() for k, v in _random_hf(arch, torch.bfloat16).items()}
    layout = MegatronLayout(arch, tp=8)
    shards = hf_to_megatron(hf, layout)
    plan = R.build_reshard_plan(layout, R.EngineLayout(arch, tp=2))
    for rank in range(2):
        a = R.execute_plan(plan, rank, shards, backend="triton")
        b = R.execute_plan(plan, rank, shards, backend="torch")
        assert all(torch.equal(a[k], b[k]) for k in b)


# ------------------------------------------------------------------------------------------------ buckets
def test_bucket_pack_unpack_roundtrip():
    g = torch.Generator().manual_seed(1)
    named = {f"t{i}": torch.randn(3 + i, 5, generator=g) for i in range(10)}
    named.update({f"b{i}": torch.randn(7, i + 1, generator=g).bfloat16() for i in range(5)})
    named["big"] = torch.randn(400, 10, generator=g)          # larger than a bucket: alone
    named["noncontig"] = torch.randn(6, 9, generator=g).T      # packed from a strided source
    named["scalar"] = torch.tensor(3.5)
    buckets = R.pack_tensors(named, bucket_bytes=1024, align_bytes=64)
    for b in buckets:
        assert b.buffer.dtype == b.layout.dtype and b.buffer.dim() == 1
        assert len(b.layout.entries) == 1 or b.layout.nbytes <= 1024
        for e in b.layout.entries:
            assert (e.offset * b.buffer.element_size()) % 64 == 0
    assert {b.layout.dtype for b in buckets} == {torch.float32, torch.bfloat16}
    out = R.unpack_buckets(buckets)
    assert list(out) != [] and set(out) == set(named)
    for name, t in named.items():
        assert out[name].dtype == t.dtype and torch.equal(out[name], t), name
        # views into the bucket: no copy on unpack
        owner = next(b for b in buckets if any(e.name == name for e in b.layout.entries))
        assert out[name].untyped_storage().data_ptr() == owner.buffer.untyped_storage().data_ptr()
    # a receiver rebuilds views from the layout alone (what travels as metadata)
    received = R.allocate_buckets([b.layout for b in buckets])
    for src, dst in zip(buckets, received):
        dst.buffer.copy_(src.buffer)
    assert all(torch.equal(R.unpack_buckets(received)[k], named[k]) for k in named)


def test_reshard_to_buckets():
    arch = _arch()
    layout = MegatronLayout(arch, tp=2)
    shards = hf_to_megatron(_random_hf(arch), layout)
    plan = R.build_reshard_plan(layout, R.EngineLayout(arch, tp=2))
    for rank in range(2):
        buckets = R.reshard_to_buckets(plan, rank, shards, bucket_bytes=4096)
        assert len(buckets) > 1
        want = R.execute_plan(plan, rank, shards, backend="torch")
        got = R.unpack_buckets(buckets)
        assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)


def _gpu_bench_smoke_worker(rank, world_size):
    from megatron_rl.cli import gpu_kernels as gpu_bench

    bw = gpu_bench.copy_bandwidth(1 << 20, device="cpu")
    res = gpu_bench.bench_reshard(bw, _arch(heads=8, groups=8, vocab=300, hidden=32, ffn=64, layers=1), device="cpu")
    res.update(gpu_bench.bench_logprob(bw, n=16, v=200, h=8, device="cpu", rows=4))
    return res


@needs_triton
def test_gpu_bench_script_smoke_on_cpu(monkeypatch):
    """The GPU script's code paths at toy shapes on CPU (Triton interpreted), so it runs when a GPU is lent."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    res = run_distributed(_gpu_bench_smoke_worker, 1)[0]
    assert res["reshard_bit_exact"] and res["logprob_triton_vs_naive_maxdiff"] < 1e-3
