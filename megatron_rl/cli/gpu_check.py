"""One-GPU check of the cluster path's parts against the device's own measured peaks.

    python -m megatron_rl.cli.gpu_check [--out FILE] [--smoke]      (scripts/gpu_check.sh runs it)

1. Peaks, measured here: copy bandwidth (`dst.copy_(src)`, bytes read + written), dense BF16 matmul
   TFLOP/s, and FP8 matmul TFLOP/s through torch._scaled_mm where the GPU and torch support it.
2. Trainer step (MegatronTrainer, a ~1.2B Llama, 8 x 2048 tokens): BF16, and FP8 (delayed scaling) where
   Transformer Engine is installed. MFU = model flops (6 N per token + 12 L q s for attention, the
   dense-attention convention) / time / measured BF16 peak; tokens/s.
3. Engine decode (NativeEngine, BF16, 64 sequences x 128 new tokens): tokens/s, and the bandwidth a decode
   step streams (weight bytes / step time) against the copy bandwidth.
4. Weight sync trainer -> engine on the device (export HF views, engine load): GB/s against copy bandwidth.
5. Fused log-prob kernel (cli/gpu_kernels.py `bench_logprob`, N=8192, V=128256, H=4096): Triton vs
   chunked torch vs naive, time and peak memory.
6. SGLang smoke test, where a GPU and sglang exist: `sglang.launch_server` on a tiny model saved as HF,
   one greedy generation, one weight sync (begin / update_weights_from_distributed / end, NCCL with a
   second GPU for the server, else gloo; the
   client and sender the cluster path uses), the weight version and a checksum of two tensors read back
   with /get_weights_by_name, and a generation under the new version.
The FP8 trainer step uses rows of uneven lengths padded by FP8_TOKEN_MULTIPLE (controller/batching.py),
the shapes RL batches have. The last line is one JSON object, written (and saved to --out) even when a
section fails; `failed_sections` names them. `--smoke` shrinks every shape (it runs on CPU too, skipping
the Triton kernel, FP8 and SGLang) so the script's plumbing is tested without a GPU.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
import urllib.request

import torch

from megatron_rl.checkpoints_tools.convert import save_hf
from megatron_rl.cli.gpu_kernels import _sync, _time, bench_logprob, copy_bandwidth
from megatron_rl.cli.launch_env import sglang_server_args
from megatron_rl.controller.batching import FP8_TOKEN_MULTIPLE
from megatron_rl.models.arch import ModelArch
from megatron_rl.rollout.config import NativeEngineConfig
from megatron_rl.rollout.engine import GenerateRequest, SamplingParams
from megatron_rl.rollout.client import HTTPEngine, SGLangServer
from megatron_rl.rollout.native import NativeEngine
from megatron_rl.rollout.sglang_engine import sglang_available
from megatron_rl.trainer.config import TrainerConfig
from megatron_rl.trainer.model import transformer_engine_available
from megatron_rl.trainer.parallel import free_port
from megatron_rl.trainer.trainer import MegatronTrainer
from megatron_rl.types import TrainBatch
from megatron_rl.weight_sync.distributed import BroadcastWeightSender


@dataclasses.dataclass(frozen=True)
class Shapes:
    arch: ModelArch
    train_rows: int
    train_seq: int          # tokens per row fed to the model (rows hold train_seq + 1 tokens)
    micro_batch: int
    engine_batch: int
    prompt_len: int
    new_tokens: int
    matmul_n: int
    copy_bytes: int


def shapes(smoke: bool) -> Shapes:
    if smoke:
        arch = ModelArch(vocab_size=512, num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4,
                         num_query_groups=2, max_position_embeddings=256)
        return Shapes(arch, 4, 32, 2, 4, 8, 8, 256, 1 << 22)
    arch = ModelArch(vocab_size=32768, num_layers=16, hidden_size=2048, ffn_hidden_size=8192, num_attention_heads=16,
                     num_query_groups=8, max_position_embeddings=4096)
    return Shapes(arch, 8, 2048, 2, 64, 128, 128, 8192, 1 << 30)


def matmul_tflops(n: int, device: str, dtype=torch.bfloat16) -> float:
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    t = _time(lambda: a @ b, reps=10, warmup=3, device=device)
    return 2 * n ** 3 / t / 1e12


def fp8_matmul_tflops(n: int) -> float | None:
    """torch._scaled_mm with per-tensor scales (Hopper and newer); None where unsupported."""
    if not hasattr(torch, "_scaled_mm"):
        return None
    try:
        a = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn)
        b = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn).t()  # column-major second operand
        one = torch.tensor(1.0, device="cuda")
        fn = lambda: torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)  # noqa: E731
        fn()
        return 2 * n ** 3 / _time(fn, reps=10, warmup=3) / 1e12
    except (RuntimeError, TypeError) as exc:
        print(f"fp8 matmul unavailable: {exc}")
        return None


def model_flops_per_token(arch: ModelArch, seq: int) -> float:
    return 6 * arch.num_parameters() + 12 * arch.num_layers * arch.q_size * seq


def trainer_step(s: Shapes, device: str, fp8: str, steps: int = 3) -> tuple[dict, object]:
    config = TrainerConfig(precision="bf16" if device == "cuda" else "fp32", micro_batch_size=s.micro_batch,
                           fp8=fp8, layer_spec="auto", lr=1e-6)
    trainer = MegatronTrainer(s.arch, config)
    tokens = torch.randint(0, s.arch.vocab_size, (s.train_rows, s.train_seq + 1))
    loss_mask = torch.ones(tokens.shape)
    token_multiple = 1
    if fp8 != "none":  # RL rows end anywhere: uneven lengths, aligned by padding as the controller does
        for r in range(s.train_rows):
            loss_mask[r, s.train_seq + 1 - (2 * r + 3):] = 0.0
        token_multiple = FP8_TOKEN_MULTIPLE
    batch = TrainBatch(tokens=tokens, loss_mask=loss_mask, token_multiple=token_multiple).token_aligned()

    def loss_fn(logprobs, mb, entropy):
        return -(logprobs * mb.loss_mask.to(logprobs.device)).sum() / batch.loss_mask.sum(), {}

    trainer.train_step(batch, loss_fn)  # warm-up: optimizer states, TE fp8 metadata, kernels
    _sync(device)
    start = time.perf_counter()
    losses = [trainer.train_step(batch, loss_fn)["train/loss"] for _ in range(steps)]
    _sync(device)
    step_s = (time.perf_counter() - start) / steps
    n_tokens = s.train_rows * s.train_seq
    return {"step_s": step_s, "tokens_per_s": n_tokens / step_s, "loss": losses[-1],
            "flops_per_step": model_flops_per_token(s.arch, s.train_seq) * n_tokens}, trainer


def engine_decode(s: Shapes, device: str, state) -> tuple[dict, object]:
    engine = NativeEngine(s.arch, state, config=NativeEngineConfig(
        max_batch_size=s.engine_batch, max_seq_len=s.prompt_len + s.new_tokens + 8, device=device, dtype="auto",
        prepack_weights=False, max_prefill_tokens=s.engine_batch * s.prompt_len))
    requests = [GenerateRequest(request_id=f"r{i}", prompt_ids=torch.randint(0, s.arch.vocab_size, (s.prompt_len,)).tolist(),
                                sampling=SamplingParams(max_new_tokens=s.new_tokens, temperature=1.0, seed=i))
                for i in range(s.engine_batch)]
    engine.generate(requests[:2])  # warm-up
    _sync(device)
    start = time.perf_counter()
    completions = engine.generate(requests)
    _sync(device)
    elapsed = time.perf_counter() - start
    generated = sum(len(c.output_ids) for c in completions)
    steps = max(len(c.output_ids) for c in completions)
    weight_bytes = sum(t.numel() * t.element_size() for t in engine.named_weights().values())
    step_s = elapsed / max(steps, 1)
    return {"tokens_per_s": generated / elapsed, "decode_step_s": step_s,
            "weight_stream_GBps": weight_bytes / step_s / 1e9, "weight_bytes": weight_bytes}, engine


def weight_sync(trainer, engine, device: str) -> dict:
    state = trainer.export_hf_state()
    engine.update_weights(state, 1)  # warm-up
    _sync(device)
    start = time.perf_counter()
    engine.update_weights(state, 2)
    _sync(device)
    elapsed = time.perf_counter() - start
    nbytes = sum(t.numel() * t.element_size() for t in engine.named_weights().values())
    return {"sync_s": elapsed, "sync_GBps": nbytes / elapsed / 1e9, "bytes": nbytes}


def sglang_smoke(s: Shapes, state_v0: dict, state_v1: dict, timeout: float = 600.0) -> dict:
    """SGLang server start, generate, one weight sync over NCCL, checksum (see the module docstring)."""
    workdir = tempfile.mkdtemp(prefix="gpu_check_sglang_")
    port = free_port()
    save_hf(os.path.join(workdir, "model"), s.arch, {k: v.cpu() for k, v in state_v0.items()}, None)
    flags = sglang_server_args(1, "bf16", 16, False, mem_fraction_static=0.3)
    cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", os.path.join(workdir, "model"),
           "--host", "127.0.0.1", "--port", str(port), "--skip-tokenizer-init", "--dtype", "bfloat16", *flags]
    # NCCL refuses two ranks on one GPU: with a second GPU the server takes it and the sync is NCCL, as on
    # a cluster; on one GPU the group runs over gloo (the protocol is the same, the transport slower).
    two_gpus = torch.cuda.device_count() > 1
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="1") if two_gpus else dict(os.environ)
    backend = "nccl" if two_gpus else "gloo"
    log = open(os.path.join(workdir, "server.log"), "w")
    start = time.perf_counter()
    server = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        while True:
            try:
                urllib.request.urlopen(url + "/health", timeout=5)
                break
            except OSError:
                if server.poll() is not None or time.perf_counter() - start > timeout:
                    raise RuntimeError(f"sglang.launch_server did not come up (log: {log.name})") from None
                time.sleep(2)
        startup_s = time.perf_counter() - start
        engine = HTTPEngine(url, timeout=timeout)
        request = GenerateRequest(request_id="smoke", prompt_ids=list(range(1, 9)),
                                  sampling=SamplingParams(max_new_tokens=16, temperature=0.0))
        before = engine.generate([request])[0]
        sender = BroadcastWeightSender([SGLangServer(url, timeout=timeout)], [1], master_address="127.0.0.1",
                                       master_port=free_port(), backend=backend)
        sync_start = time.perf_counter()
        sender.push(((k, v.to(torch.bfloat16)) for k, v in state_v1.items()), version=1)
        sync_s = time.perf_counter() - sync_start
        after = engine.generate([request])[0]
        checksum = {}
        for name in ("model.embed_tokens.weight", "lm_head.weight"):
            if name not in state_v1:
                continue
            _, served = engine.request("POST", "/get_weights_by_name", {"name": name, "truncate_size": 64})
            sent = state_v1[name].to(torch.bfloat16).float().flatten()[:len(torch.tensor(served).flatten())]
            checksum[name] = float((torch.tensor(served).flatten().float() - sent.cpu()).abs().max())
        sender.close()
        version = engine.version
        engine.close()
        return {"startup_s": startup_s, "sync_s": sync_s, "sync_backend": backend, "version_after_sync": version,
                "versions_before": sorted(set(before.weight_versions)),
                "versions_after": sorted(set(after.weight_versions)),
                "tokens_changed": before.output_ids != after.output_ids, "max_abs_diff_read_back": checksum,
                "ok": version == 1 and set(after.weight_versions) == {1} and all(v == 0.0 for v in checksum.values())}
    finally:
        server.terminate()
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
        log.close()
        shutil.rmtree(workdir, ignore_errors=True)


def _emit(result: dict, out: str | None) -> None:
    result["failed_sections"] = [k for k, v in result.items() if isinstance(v, dict) and "error" in v]
    line = json.dumps({"gpu_check": True, **result}, default=str)
    if out:
        with open(out, "w") as f:
            f.write(line + "\n")
    print(line, flush=True)


def _section(result: dict, name: str, fn):
    """Run one part; a failure is printed and recorded under `name` and the check goes on to the next
    part (one GPU session should report everything that works, not stop at the first failure)."""
    try:
        return fn()
    except Exception as exc:  # noqa: BLE001 - reported, and counted in the JSON
        traceback.print_exc()
        result[name] = {"error": f"{type(exc).__name__}: {exc}"}
        return None


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="also write the JSON line here")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes (runs on CPU too)")
    args = parser.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and not args.smoke:
        raise SystemExit("gpu_check needs a CUDA GPU (or --smoke for a tiny CPU run of the same steps)")

    s = shapes(args.smoke)
    torch.manual_seed(0)
    result: dict = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "smoke": args.smoke}
    try:
        _run(args, device, s, result)
    except Exception as exc:  # noqa: BLE001 - the JSON is still written: a session reports what it measured
        traceback.print_exc()
        result["main"] = {"error": f"{type(exc).__name__}: {exc}"}
    finally:
        _emit(result, args.out)
    return 1 if result["failed_sections"] else 0


def _run(args, device: str, s: Shapes, result: dict) -> None:
    copy_bw = copy_bandwidth(s.copy_bytes, device=device)
    bf16_peak = matmul_tflops(s.matmul_n, device, torch.bfloat16 if device == "cuda" else torch.float32)
    fp8_peak = fp8_matmul_tflops(s.matmul_n) if device == "cuda" else None
    result.update(copy_GBps=copy_bw / 1e9, matmul_bf16_TFLOPs=bf16_peak, matmul_fp8_TFLOPs=fp8_peak)
    print(f"[peaks] copy {copy_bw / 1e9:.0f} GB/s, bf16 matmul {bf16_peak:.0f} TFLOP/s"
          + (f", fp8 matmul {fp8_peak:.0f} TFLOP/s" if fp8_peak else ""), flush=True)

    recipes = ["none"] + (["delayed"] if device == "cuda" and transformer_engine_available() else [])
    trainer = None
    for recipe in recipes:
        key = f"train_{'bf16' if recipe == 'none' else 'fp8_' + recipe}"
        out = _section(result, key, lambda recipe=recipe: trainer_step(s, device, recipe))
        if out is None:
            continue
        stats, trainer_r = out
        stats["mfu"] = stats.pop("flops_per_step") / stats["step_s"] / (bf16_peak * 1e12)
        result[key] = stats
        print(f"[train {recipe if recipe != 'none' else 'bf16'}] {stats['step_s']:.3f} s/step, "
              f"{stats['tokens_per_s']:.0f} tok/s, MFU {stats['mfu']:.1%} of measured bf16 peak, loss {stats['loss']:.3f}",
              flush=True)
        if recipe == "none":
            trainer = trainer_r
        else:
            del trainer_r
    if len(recipes) == 1:
        print("[train fp8] skipped: Transformer Engine with CUDA is not available")
    if trainer is None:
        return

    if device == "cuda" and sglang_available():
        state_v0 = trainer.export_hf_state()
        state_v1 = {k: v * 0.5 for k, v in state_v0.items()}
        smoke = _section(result, "sglang", lambda: sglang_smoke(s, state_v0, state_v1))
        if smoke is not None:
            result["sglang"] = smoke
            print(f"[sglang] up in {smoke['startup_s']:.0f} s, weight sync {smoke['sync_s'] * 1e3:.0f} ms, "
                  f"version {smoke['version_after_sync']}, read-back diff {smoke['max_abs_diff_read_back']}",
                  flush=True)
    else:
        print("[sglang] skipped: needs a CUDA GPU and the sglang package (gpu extra)")
    decoded = _section(result, "decode", lambda: engine_decode(s, device, trainer.export_hf_state()))
    if decoded is not None:
        engine_stats, engine = decoded
        engine_stats["weight_stream_frac_of_copy"] = engine_stats["weight_stream_GBps"] * 1e9 / copy_bw
        result["decode"] = engine_stats
        print(f"[decode] {engine_stats['tokens_per_s']:.0f} tok/s at batch {s.engine_batch}, "
              f"{engine_stats['decode_step_s'] * 1e3:.2f} ms/step, weights streamed at "
              f"{engine_stats['weight_stream_GBps']:.0f} GB/s ({engine_stats['weight_stream_frac_of_copy']:.0%} of copy)",
              flush=True)
        sync = _section(result, "weight_sync", lambda: weight_sync(trainer, engine, device))
        if sync is not None:
            sync["frac_of_copy"] = sync["sync_GBps"] * 1e9 / copy_bw
            result["weight_sync"] = sync
            print(f"[weight sync] {sync['bytes'] / 2**30:.2f} GiB in {sync['sync_s'] * 1e3:.1f} ms = "
                  f"{sync['sync_GBps']:.0f} GB/s ({sync['frac_of_copy']:.0%} of copy)", flush=True)
        engine.close()
        del engine
    del trainer
    if device == "cuda":
        torch.cuda.empty_cache()

        stats = _section(result, "logprob", lambda: bench_logprob(copy_bw, 2048 if args.smoke else 8192, 128256, 4096,
                                                                 device=device))
        if stats is not None:
            result["logprob"] = stats
    else:
        print("[logprob] skipped on CPU (the Triton kernel needs a GPU; tests cover it with the interpreter)")


if __name__ == "__main__":
    raise SystemExit(main())
