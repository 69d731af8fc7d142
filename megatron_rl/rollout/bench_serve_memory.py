"""`megatron-rl bench serve-memory`: the resident memory of a `megatron-rl serve` process under a load spike
and after it. One server (`slots` KV-cache slots of `context` tokens, fp32), then:
1. idle, after one request: the baseline;
2. the first full batch of `slots` chat requests of one token, then a second one: time and growth of each
   (the first pays for committing the cache's pages);
3. `clients` concurrent chat clients with no max_tokens (an OpenAI client's default: the rest of the
   context), each answer ended by the `stop` strings (the first sentence: keeps the run short on a CPU;
   the engine must still plan for the whole context): peak memory;
4. `idle_s` seconds idle: what the server still holds.
ratio = idle memory after the spike / the baseline (1.0: everything given back).

Options (key=value): model=smollm2-135m slots=64 context=4096 clients=256 idle_s=60 threads=2 stop=.|\\n (strings
separated by |).
"""
from __future__ import annotations

import concurrent.futures
import logging
import os
import socket
import subprocess
import sys
import time
from typing import Any

from megatron_rl.config import ConfigError
from megatron_rl.rollout.bench_generate import PROMPTS
from megatron_rl.rollout.bench_serve import post_json, rss_kb, wait_healthy

log = logging.getLogger(__name__)

_OPTIONS = {"model", "slots", "context", "clients", "idle_s", "threads", "stop"}


def bench_serve_memory(options: dict[str, Any]) -> dict[str, Any]:
    unknown = sorted(set(options) - _OPTIONS)
    if unknown:
        raise ConfigError(f"bench serve-memory: unknown option {unknown[0]!r} (known: {', '.join(sorted(_OPTIONS))})")
    model = str(options.get("model", "smollm2-135m"))
    slots, context = int(options.get("slots", 64)), int(options.get("context", 4096))
    clients, idle_s = int(options.get("clients", 256)), float(options.get("idle_s", 60))
    threads = int(options.get("threads", 2))
    stops = str(options.get("stop", ".|\\n")).encode().decode("unicode_escape").split("|")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    command = [sys.executable, "-m", "megatron_rl.cli", "serve", "--model", model, "--port", str(port),
               "--max-batch-size", str(slots), "--max-seq-len", str(context), "--threads", str(threads),
               "--served-model-name", "bench", "--max-n", "1"]
    server = subprocess.Popen(command, stdout=subprocess.DEVNULL, env={**os.environ, "OMP_NUM_THREADS": str(threads)})
    url = f"http://127.0.0.1:{port}/v1/chat/completions"

    def chat(i: int, **fields: Any) -> None:
        post_json(url, {"model": "bench", "messages": [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}],
                    "temperature": 0, **fields})

    def together(count: int, **fields: Any) -> float:
        begin = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(count) as pool:
            list(pool.map(lambda i: chat(i, **fields), range(count)))
        return time.perf_counter() - begin

    rss = (lambda: rss_kb(server.pid, "VmRSS") / 1024)
    try:
        wait_healthy(url.rsplit("/v1", 1)[0], server)
        chat(0, max_tokens=1)
        baseline = rss()
        first_s = together(slots, max_tokens=1)
        after_first = rss()
        second_s = together(slots, max_tokens=1)
        after_second = rss()
        spike_s = together(clients, stop=stops)
        peak = rss_kb(server.pid, "VmHWM") / 1024
        after_spike = rss()
        time.sleep(idle_s)
        idle = rss()
    finally:
        server.terminate()
        server.wait(timeout=60)
    log.info(f"baseline {baseline:.0f} MB; first batch of {slots}: {first_s:.2f} s, +{after_first - baseline:.0f} MB; "
             f"second: {second_s:.2f} s, +{after_second - after_first:.0f} MB")
    log.info(f"{clients} clients: {spike_s:.1f} s, peak {peak:.0f} MB, {after_spike:.0f} MB at the end, "
             f"{idle:.0f} MB after {idle_s:g} s idle")
    return {"ratio": round(idle / baseline, 3), "baseline_mb": round(baseline), "first_batch_s": round(first_s, 2),
            "first_batch_mb": round(after_first - baseline), "second_batch_s": round(second_s, 2),
            "second_batch_mb": round(after_second - after_first), "clients": clients, "spike_s": round(spike_s, 1),
            "peak_mb": round(peak), "after_spike_mb": round(after_spike), "idle_s": idle_s, "idle_mb": round(idle),
            "slots": slots, "context": context}
