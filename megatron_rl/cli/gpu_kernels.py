"""GPU timing of the Triton kernels against their torch references (for a lent GPU; < 2 minutes on an H200).

    python -m megatron_rl.cli.gpu_kernels [--out results.json] [--quick]

1. Copy bandwidth of the device: `dst.copy_(src)` of 1 GiB, counted as bytes read + written.
2. Resharding: 4 layers of Llama-3-70B shapes (+ its 128256-row embedding and head), bf16, Megatron TP=8 ->
   engine TP=4, every engine rank; Triton segment-copy vs the torch reference (`copy_` per segment), both
   checked bit-exact; bandwidth = 2 x bytes written / time. Bucket packing (`pack_tensors`, 512 MiB buckets).
3. Fused log-prob + entropy, N=8192, V=128256 (padded 128384), H=4096, bf16: forward + backward of the
   Triton path vs the chunked torch path vs naive full-logits log_softmax + gather (fp32 logits); peak
   memory (torch.cuda.max_memory_allocated above the inputs) and time. The Triton elementwise kernels
   alone on one fp32 logits tile: bandwidth = bytes they read (+ write) / time.
Every figure is printed with the copy bandwidth for scale; the last line is one JSON object.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import time

import torch

from megatron_rl.kernels.logprob import fused_logprobs_and_entropy
from megatron_rl.models.arch import preset
from megatron_rl.models.megatron_layout import MegatronLayout, hf_to_megatron
from megatron_rl.weight_sync import reshard as R


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def _time(fn, reps=5, warmup=2, device="cuda") -> float:
    """Median seconds of fn() over reps (CUDA events on a GPU; perf_counter for the CPU smoke test)."""
    for _ in range(warmup):
        fn()
    _sync(device)
    times = []
    for _ in range(reps):
        if torch.device(device).type == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def copy_bandwidth(nbytes: int = 1 << 30, device="cuda") -> float:
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    t = _time(lambda: dst.copy_(src), reps=10, device=device)
    del src, dst
    return 2 * nbytes / t


def bench_reshard(copy_bw: float, arch, tp=8, engine_tp=4, device="cuda") -> dict:
    layers = arch.num_layers
    h, f, q, kv, v = arch.hidden_size, arch.ffn_hidden_size, arch.q_size, arch.kv_size, arch.vocab_size
    rnd = lambda *s: torch.randn(*s, device=device).to(torch.bfloat16)  # noqa: E731
    hf = {"model.embed_tokens.weight": rnd(v, h), "lm_head.weight": rnd(v, h), "model.norm.weight": rnd(h)}
    for i in range(layers):
        p = f"model.layers.{i}."
        hf.update({p + "self_attn.q_proj.weight": rnd(q, h), p + "self_attn.k_proj.weight": rnd(kv, h),
                   p + "self_attn.v_proj.weight": rnd(kv, h), p + "self_attn.o_proj.weight": rnd(h, q),
                   p + "mlp.gate_proj.weight": rnd(f, h), p + "mlp.up_proj.weight": rnd(f, h),
                   p + "mlp.down_proj.weight": rnd(h, f), p + "input_layernorm.weight": rnd(h),
                   p + "post_attention_layernorm.weight": rnd(h)})
    layout = MegatronLayout(arch, tp=tp)
    shards = hf_to_megatron(hf, layout)
    del hf
    engine = R.EngineLayout(arch, tp=engine_tp)
    plan = R.build_reshard_plan(layout, engine)
    outs = {be: [R.execute_plan(plan, e, shards, backend=be) for e in range(engine.tp)] for be in ("torch", "triton")}
    exact = all(torch.equal(outs["torch"][e][k], outs["triton"][e][k]) for e in range(engine.tp) for k in outs["torch"][e])
    nbytes = sum(t.numel() * t.element_size() for out in outs["torch"] for t in out.values())
    outs = outs["torch"]
    res = {"reshard_bytes": nbytes, "reshard_bit_exact": exact,
           "reshard_segments": sum(len(c.segments) for cs in plan.copies for c in cs),
           "reshard_launches": sum(len(cs) for cs in plan.copies)}
    for be in ("torch", "triton"):
        t = _time(lambda: [R.execute_plan(plan, e, shards, backend=be) for e in range(engine.tp)], reps=3, warmup=1,
                  device=device)
        res[f"reshard_{be}_s"] = t
        res[f"reshard_{be}_GBps"] = 2 * nbytes / t / 1e9
        print(f"reshard {be:6s}: {t * 1e3:8.2f} ms  {2 * nbytes / t / 1e9:7.1f} GB/s  "
              f"({2 * nbytes / t / copy_bw:.0%} of copy bandwidth)", flush=True)
    named = [(f"{e}/{k}", t) for e, out in enumerate(outs) for k, t in out.items()]
    t = _time(lambda: R.pack_tensors(named, 512 << 20), reps=3, warmup=1, device=device)
    res.update(pack_s=t, pack_GBps=2 * nbytes / t / 1e9)
    print(f"bucket pack   : {t * 1e3:8.2f} ms  {2 * nbytes / t / 1e9:7.1f} GB/s  "
          f"({2 * nbytes / t / copy_bw:.0%} of copy bandwidth)", flush=True)
    return res


def bench_logprob(copy_bw: float, n: int, v: int, h: int, device="cuda", rows=2048) -> dict:
    from megatron_rl.kernels import triton_logprob as T  # optional Triton, on a GPU only

    cuda = torch.device(device).type == "cuda"

    torch.manual_seed(0)
    padded = -(-v // 128) * 128
    hidden = (torch.randn(n, h, device=device) * 0.5).bfloat16().requires_grad_()
    weight = (torch.randn(padded, h, device=device) * 0.02).bfloat16().requires_grad_()
    targets = torch.randint(0, v, (n,), device=device)
    g = torch.randn(n, device=device)

    def naive():
        logits = (hidden @ weight[:v].T).float()
        lp = torch.log_softmax(logits, -1).gather(-1, targets[:, None]).squeeze(-1)
        (lp * g).sum().backward()
        return lp

    def fused(backend):
        def run():
            lp, ent = fused_logprobs_and_entropy(hidden, weight, targets, vocab_size=v, backend=backend,
                                                 **({"chunk_size": 2048, "vocab_chunk_size": 32768}
                                                    if backend == "torch" and cuda else {}))
            (lp * g + 0.01 * ent).sum().backward()
            return lp
        return run

    res, lps = {}, {}
    for name, fn in (("naive", naive), ("torch", fused("torch")), ("triton", fused("triton"))):
        hidden.grad = weight.grad = None
        _sync(device)
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated() if cuda else 0
        lps[name] = fn().detach()
        _sync(device)
        peak = torch.cuda.max_memory_allocated() - base if cuda else 0

        def step(fn=fn):
            hidden.grad = weight.grad = None
            fn()
        t = _time(step, reps=3, warmup=1, device=device)
        res[f"logprob_{name}_s"], res[f"logprob_{name}_peak_GiB"] = t, peak / 2**30
        print(f"logprob {name:6s}: {t * 1e3:8.2f} ms fwd+bwd  peak +{peak / 2**30:6.2f} GiB", flush=True)
    res["logprob_triton_vs_naive_maxdiff"] = (lps["triton"] - lps["naive"]).abs().max().item()
    res["logprob_triton_vs_torch_maxdiff"] = (lps["triton"] - lps["torch"]).abs().max().item()
    print(f"max |logp triton - naive| {res['logprob_triton_vs_naive_maxdiff']:.2e}, "
          f"|triton - torch| {res['logprob_triton_vs_torch_maxdiff']:.2e}")

    # The Triton elementwise kernels alone on one fp32 logits tile.
    rows = min(rows, n)
    z = torch.randn(rows, v, device=device)
    tgt = targets[:rows].contiguous()
    stats = [torch.empty(rows, device=device) for _ in range(4)]
    block = T._block_v(v)
    t_stats = _time(lambda: T._stats_kernel[(rows,)](z, z.stride(0), tgt, *stats, v, 1.0, BLOCK_V=block),
                    device=device)
    lz, ent, g1 = stats[0] + 12.0, stats[1].abs(), g[:rows].contiguous()
    t_grad = _time(lambda: T._grad_kernel[(rows,)](z, z.stride(0), tgt, lz, ent, g1, g1, v, 1.0,
                                                   HAS_G2=True, BLOCK_V=block), device=device)
    zbytes = rows * v * 4
    t_ref = _time(lambda: torch.logsumexp(z, dim=1), device=device)  # torch's single-pass reduction, for scale
    for name, t, nbytes in (("stats kernel", t_stats, zbytes), ("grad kernel", t_grad, 2 * zbytes),
                            ("torch.logsumexp", t_ref, zbytes)):
        print(f"{name:15s}: {t * 1e6:8.1f} us  {nbytes / t / 1e9:7.1f} GB/s  ({nbytes / t / copy_bw:.0%} of copy)")
    res.update(stats_kernel_GBps=zbytes / t_stats / 1e9, grad_kernel_GBps=2 * zbytes / t_grad / 1e9,
               torch_logsumexp_GBps=zbytes / t_ref / 1e9)
    return res


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="also write the JSON result here")
    parser.add_argument("--quick", action="store_true", help="1 layer and N=2048 (smoke run)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("gpu_bench needs a CUDA GPU")
    torch.backends.cuda.matmul.allow_tf32 = False
    bw = copy_bandwidth()
    print(f"device {torch.cuda.get_device_name()}: copy bandwidth {bw / 1e9:.1f} GB/s (read + write)", flush=True)
    result = {"device": torch.cuda.get_device_name(), "copy_GBps": bw / 1e9}

    base = preset("llama3-70b")
    result.update(bench_reshard(bw, dataclasses.replace(base, num_layers=1 if args.quick else 4)))
    torch.cuda.empty_cache()
    result.update(bench_logprob(bw, 2048 if args.quick else 8192, 128256, 4096))
    line = json.dumps({"gpu_bench": "kernels", **result})
    if args.out:
        with open(args.out, "w") as f:
            f.write(line + "\n")
    print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
