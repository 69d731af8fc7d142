"""`megatron-rl bench serve`: the same requests through `megatron-rl serve`'s OpenAI API (a server
process, `batch` concurrent HTTP clients) and through the engine called directly (this process), one
after the other with the same engine settings. Greedy, eos ignored, so both generate exactly
`requests x max_new_tokens` tokens; ratio = HTTP throughput / direct throughput (target >= 0.9).

Also reported: HTTP latency percentiles, whether the outputs are the same tokens, the server's idle
and peak resident memory, and how fast a 20 MB body is refused.

Options (key=value): model=smollm2-135m batch=32 requests=64 max_new_tokens=32 threads=2 max_seq_len=512.
"""
from __future__ import annotations

import concurrent.futures
import json
import logging
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from typing import Any

import torch

from megatron_rl.config import ConfigError
from megatron_rl.models.pretrained import load_pretrained
from megatron_rl.rollout.bench_generate import PROMPTS
from megatron_rl.rollout.config import NativeEngineConfig
from megatron_rl.rollout.engine import GenerateRequest, SamplingParams
from megatron_rl.rollout.native import NativeEngine

log = logging.getLogger(__name__)

_OPTIONS = {"model", "batch", "requests", "max_new_tokens", "threads", "max_seq_len"}


def bench_serve(options: dict[str, Any]) -> dict[str, Any]:
    unknown = sorted(set(options) - _OPTIONS)
    if unknown:
        raise ConfigError(f"bench serve: unknown option {unknown[0]!r} (known: {', '.join(sorted(_OPTIONS))})")
    model = str(options.get("model", "smollm2-135m"))
    batch = int(options.get("batch", 32))
    count = int(options.get("requests", 64))
    new_tokens = int(options.get("max_new_tokens", 32))
    threads = int(options.get("threads", 2))
    max_seq_len = int(options.get("max_seq_len", 512))
    pretrained = load_pretrained(model)
    tokenizer = pretrained.tokenizer
    prompts = [tokenizer.encode_chat([{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}]) for i in range(count)]
    total_tokens = count * new_tokens

    # --- the engine called directly ---------------------------------------------------------------
    torch.set_num_threads(threads)
    config = NativeEngineConfig(max_batch_size=batch, max_seq_len=max_seq_len, num_threads=threads)
    engine = NativeEngine.from_pretrained(pretrained, config)
    sampling = SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    requests = [GenerateRequest(f"r{i}", p, sampling) for i, p in enumerate(prompts)]
    engine.generate(requests[:batch])  # warm-up: KV cache, packed weights
    start = time.perf_counter()
    direct = engine.generate(requests)
    direct_s = time.perf_counter() - start
    engine.close()
    del engine, pretrained
    log.info(f"direct: {count} requests x {new_tokens} tokens in {direct_s:.2f} s "
             f"({total_tokens / direct_s:.1f} tok/s)")

    # --- the same requests over HTTP -----------------------------------------------------------------
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    command = [sys.executable, "-m", "megatron_rl.cli", "serve", "--model", model, "--port", str(port),
               "--max-batch-size", str(batch), "--max-seq-len", str(max_seq_len), "--threads", str(threads),
               "--served-model-name", "bench"]
    server = subprocess.Popen(command, stdout=subprocess.DEVNULL, env={**os.environ, "OMP_NUM_THREADS": str(threads)})
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, server)
        body = {"model": "bench", "max_tokens": new_tokens, "temperature": 0, "ignore_eos": True,
                "return_token_ids": True}
        for k in range(0, batch, 8):
            post_json(url + "/v1/completions", {**body, "prompt": prompts[k:k + 8]})
        idle_rss = rss_kb(server.pid, "VmRSS")

        def one(i: int) -> tuple[list[int], float]:
            begin = time.perf_counter()
            out = post_json(url + "/v1/completions", {**body, "prompt": prompts[i]})[1]
            return out["choices"][0]["token_ids"], time.perf_counter() - begin

        start = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(batch) as pool:
            results = list(pool.map(one, range(count)))
        http_s = time.perf_counter() - start
        peak_rss = rss_kb(server.pid, "VmHWM")
        latencies = sorted(latency for _, latency in results)
        same = sum(ids == c.output_ids for (ids, _), c in zip(results, direct))
        big = b'{"model": "bench", "prompt": "' + b"x" * (20 << 20) + b'"}'
        begin = time.perf_counter()
        refused, _ = post_json(url + "/v1/completions", big)
        refuse_s = time.perf_counter() - begin
    finally:
        server.terminate()
        server.wait(timeout=60)
    log.info(f"http:   {count} requests x {new_tokens} tokens in {http_s:.2f} s ({total_tokens / http_s:.1f} tok/s), "
             f"latency p50 {latencies[len(latencies) // 2]:.2f} s p95 {latencies[int(0.95 * (len(latencies) - 1))]:.2f} s")
    log.info(f"server memory: idle {idle_rss / 1024:.0f} MB, peak {peak_rss / 1024:.0f} MB; 20 MB body -> "
             f"{refused} in {refuse_s * 1000:.0f} ms; same tokens as direct: {same}/{count}")
    return {"ratio": round(direct_s / http_s, 4), "http_tok_s": round(total_tokens / http_s, 1),
            "direct_tok_s": round(total_tokens / direct_s, 1), "batch": batch, "requests": count,
            "max_new_tokens": new_tokens, "latency_p50_s": round(latencies[len(latencies) // 2], 3),
            "latency_p95_s": round(latencies[int(0.95 * (len(latencies) - 1))], 3),
            "same_tokens": same, "server_idle_rss_mb": round(idle_rss / 1024), "server_peak_rss_mb": round(peak_rss / 1024),
            "refuse_20mb_status": refused, "refuse_20mb_ms": round(refuse_s * 1000, 1)}


def wait_healthy(url: str, server: subprocess.Popen, timeout: float = 600) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if server.poll() is not None:
            raise RuntimeError(f"bench serve: the server exited with code {server.returncode}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=5) as resp:
                if resp.status == 200:
                    return
        except OSError:  # not listening yet (URLError and HTTPError are OSErrors)
            pass
        time.sleep(0.2)
    raise RuntimeError(f"bench serve: the server did not become healthy within {timeout} s")


def post_json(url: str, body: Any) -> tuple[int, Any]:
    """(status, JSON answer) of a POST; raises on any status but 200 and 413."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=600) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        if exc.code != 413:
            raise
        return exc.code, json.loads(exc.read())


def rss_kb(pid: int, field: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0
