"""`megatron-rl bench logprob`: fused log-prob + entropy vs log_softmax + gather on full fp32 logits.

Both variants run forward + backward (grads for hidden [N, H] and weight [V, H]) on the same inputs, one
after the other, each in its own fresh Python process (so neither inherits the other's heap).

Peak memory method: resident set size from /proc/self/status. After the inputs exist (hidden, weight,
targets, upstream grads, touched), the child resets the kernel's peak-RSS counter (`echo 5 >
/proc/self/clear_refs`) and records the RSS; the variant's peak is VmHWM - that baseline over all its
iterations. This counts every byte the operation makes resident (outputs, saved tensors, gradients
including the [V, H] weight gradient both variants produce, allocator slack), not just live tensors.
Time: median of `iters` timed iterations after one warm-up, `threads` intra-op threads.
"""
from __future__ import annotations

import json
import logging
import os
import statistics
import subprocess
import sys
import time

from megatron_rl.kernels.logprob import fused_logprobs_and_entropy

log = logging.getLogger(__name__)

_CHILD = "from megatron_rl.kernels.bench_logprob import _child; _child()"


def _status() -> dict[str, int]:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("VmRSS", "VmHWM")):
                key, value = line.split(":")
                out[key] = int(value.split()[0]) * 1024
    return out


def _child() -> None:
    import torch  # in the measured child only: the parent's memory stays out of the peak

    spec = json.loads(sys.argv[1])
    torch.set_num_threads(spec["threads"])
    torch.manual_seed(0)
    n, v, h = spec["n"], spec["v"], spec["h"]
    hidden = (torch.randn(n, h) * 0.5).requires_grad_()
    weight = (torch.randn(v, h) * 0.05).requires_grad_()
    targets = torch.randint(0, v, (n,))
    g = torch.randn(n)

    if spec["variant"] == "naive":
        def step():
            logits = hidden @ weight.T
            logp = torch.log_softmax(logits, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
            (logp * g).sum().backward()
            return logp
    else:
        def step():
            logp, ent = fused_logprobs_and_entropy(hidden, weight, targets, backend="torch",
                                                   chunk_size=spec["chunk"], vocab_chunk_size=spec["vchunk"])
            (logp * g).sum().backward()
            return logp

    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    base = _status()["VmRSS"]
    times, checksum = [], 0.0
    for i in range(spec["iters"] + 1):
        hidden.grad = weight.grad = None
        t0 = time.perf_counter()
        logp = step()
        dt = time.perf_counter() - t0
        if i:
            times.append(dt)
        checksum = float(logp.double().sum() + hidden.grad.double().sum() + weight.grad.double().sum())
    peak = _status()["VmHWM"] - base
    # The child's one output, read by _run in the parent (not a log line: it must stay unprefixed)
    sys.stdout.write(json.dumps({"time_s": statistics.median(times), "times_s": times, "peak_bytes": peak,
                                 "checksum": checksum}) + "\n")


def _run(spec: dict) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS=str(spec["threads"]))
    proc = subprocess.run([sys.executable, "-c", _CHILD, json.dumps(spec)], capture_output=True, text=True,
                          env=env, check=False)
    if proc.returncode:
        raise RuntimeError(f"bench child {spec['variant']} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def bench_logprob(options: dict) -> dict:
    """Options: n=8192 v=49152 h=576 iters=3 threads=2 chunk=512 vchunk=4096."""
    base = {"n": int(options.get("n", 8192)), "v": int(options.get("v", 49152)), "h": int(options.get("h", 576)),
            "iters": int(options.get("iters", 3)), "threads": int(options.get("threads", 2)),
            "chunk": int(options.get("chunk", 512)), "vchunk": int(options.get("vchunk", 4096))}
    log.info(f"logprob bench: N={base['n']} V={base['v']} H={base['h']} fp32, forward+backward, "
             f"{base['threads']} threads, median of {base['iters']} after 1 warm-up, each variant in a fresh process")
    log.info("fused computes log-probs and entropy (entropy not differentiated here); naive computes log-probs only")
    log.info("peak memory = peak RSS above the RSS with inputs allocated (kernel VmHWM reset via /proc/self/clear_refs)")
    res = {}
    for variant in ("naive", "fused"):
        res[variant] = _run({**base, "variant": variant})
        r = res[variant]
        log.info(f"  {variant:5s}: {r['time_s']:.3f} s  (runs {', '.join(f'{t:.2f}' for t in r['times_s'])})  "
                 f"peak +{r['peak_bytes'] / 2**20:.0f} MiB")
    naive, fused = res["naive"], res["fused"]
    rel = abs(naive["checksum"] - fused["checksum"]) / max(abs(naive["checksum"]), 1e-30)
    logits_mib = base["n"] * base["v"] * 4 / 2**20
    log.info(f"  full fp32 logits would be {logits_mib:.0f} MiB; checksum rel diff {rel:.1e}")
    return {
        "memory_ratio": round(fused["peak_bytes"] / naive["peak_bytes"], 4),
        "time_ratio": round(fused["time_s"] / naive["time_s"], 4),
        "ratio": round(naive["time_s"] / fused["time_s"], 4),
        "naive_s": round(naive["time_s"], 3), "fused_s": round(fused["time_s"], 3),
        "naive_peak_mib": round(naive["peak_bytes"] / 2**20, 1), "fused_peak_mib": round(fused["peak_bytes"] / 2**20, 1),
        "checksum_rel_diff": rel, "fused_computes_entropy": True,
        "memory_method": "peak RSS delta over inputs, fresh process per variant (VmHWM reset by clear_refs)",
        **{k: base[k] for k in ("n", "v", "h", "threads", "chunk", "vchunk")},
    }
