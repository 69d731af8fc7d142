"""The sections of `gpu_check` (cli/gpu_check.py runs each in a process of its own, under its budget).

    python -m megatron_rl.cli.gpu_sections NAME --facts FILE --out FILE --budget-s S [--smoke]

Each section measures one part of the cluster path on this device and writes one JSON object to --out:
its numbers, `{"skipped": why}` where it does not apply here (no sglang, no usable Transformer Engine, no
GPU for a GPU-only kernel), and its failure is the process's exit status with the traceback on stderr.
`--facts` is the `env` section's output (the device's measured peaks), which later sections read.
"""
from __future__ import annotations

import argparse
import base64
import dataclasses
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from importlib import metadata

import torch

from megatron_rl.checkpoints_tools.convert import save_hf
from megatron_rl.cli.gpu_kernels import _sync, _time, bench_logprob, copy_bandwidth
from megatron_rl.cli.launch_env import sglang_server_args
from megatron_rl.controller.batching import FP8_TOKEN_MULTIPLE
from megatron_rl.models.arch import ModelArch
from megatron_rl.models.families import to_hf_config
from megatron_rl.rollout.client import HTTPEngine, SGLangServer
from megatron_rl.rollout.config import NativeEngineConfig
from megatron_rl.rollout.engine import GenerateRequest, SamplingParams
from megatron_rl.rollout.native import NativeEngine
from megatron_rl.rollout.sglang_engine import sglang_available
from megatron_rl.rollout.vllm_transfer import VLLMWeightTransfer, ipc_handles
from megatron_rl.trainer.config import TrainerConfig
from megatron_rl.trainer.model import transformer_engine_problem
from megatron_rl.trainer.parallel import free_port
from megatron_rl.trainer.trainer import MegatronTrainer
from megatron_rl.types import TrainBatch
from megatron_rl.weight_sync.distributed import BroadcastWeightSender

PACKAGES = ("torch", "triton", "transformers", "megatron-core", "sglang", "transformer-engine",
            "transformer-engine-torch", "nvidia-cuda-runtime-cu13", "nvidia-nccl-cu13")


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
    return Shapes(arch, 8, 2048, 2, 32, 128, 128, 8192, 1 << 30)


def _device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def _dtype(device: str) -> torch.dtype:
    return torch.bfloat16 if device == "cuda" else torch.float32


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


# --- sections ----------------------------------------------------------------------------------------------
def section_env(s: Shapes, facts: dict, budget_s: float) -> dict:
    """What this machine is (GPU, driver, CUDA, torch, free memory, package versions) and its measured
    peaks: copy bandwidth, dense bf16 and fp8 matmul."""
    device = _device()
    versions = {}
    for name in PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    env = {"device": device, "python": platform.python_version(), "torch": torch.__version__,
           "cuda_runtime": torch.version.cuda, "packages": versions}
    if device == "cuda":
        free, total = torch.cuda.mem_get_info()
        env.update(gpu=torch.cuda.get_device_name(), capability=list(torch.cuda.get_device_capability()),
                   gpus=torch.cuda.device_count(), memory_free_GiB=free / 2**30, memory_total_GiB=total / 2**30)
        if shutil.which("nvidia-smi"):
            query = subprocess.run(["nvidia-smi", "--query-gpu=driver_version,clocks.max.sm,power.limit",
                                    "--format=csv,noheader"], capture_output=True, text=True, timeout=30)
            env["nvidia_smi"] = query.stdout.strip().splitlines()[:1]
    copy_bw = copy_bandwidth(s.copy_bytes, device=device)
    env["copy_GBps"] = copy_bw / 1e9
    env["matmul_bf16_TFLOPs"] = matmul_tflops(s.matmul_n, device, _dtype(device))
    env["matmul_fp8_TFLOPs"] = fp8_matmul_tflops(s.matmul_n) if device == "cuda" else None
    print(f"[env] {env.get('gpu', 'cpu')}, torch {torch.__version__} (CUDA {torch.version.cuda}), copy "
          f"{env['copy_GBps']:.0f} GB/s, bf16 matmul {env['matmul_bf16_TFLOPs']:.0f} TFLOP/s", flush=True)
    return env


def _hf_model(arch: ModelArch):
    """The family's own transformers model for `arch`, randomly initialised (no hub, no file)."""
    import transformers  # the baseline and the reference model, never our code path

    config = transformers.AutoConfig.for_model(**{k: v for k, v in to_hf_config(arch).items()
                                                  if k not in ("architectures", "torch_dtype")})
    return transformers.AutoModelForCausalLM.from_config(config)


def _requests(s: Shapes, count: int, seed: int = 0) -> list[GenerateRequest]:
    generator = torch.Generator().manual_seed(seed)
    return [GenerateRequest(request_id=f"r{i}",
                            prompt_ids=torch.randint(0, s.arch.vocab_size, (s.prompt_len,), generator=generator).tolist(),
                            sampling=SamplingParams(max_new_tokens=s.new_tokens, temperature=1.0, seed=i))
            for i in range(count)]


def section_decode(s: Shapes, facts: dict, budget_s: float) -> dict:
    """The native engine's decode (bf16, batch `engine_batch`, every sequence `new_tokens` long) against
    HF `generate` of the same random model in the same dtype, and the bandwidth a decode step streams."""
    device = _device()
    hf = _hf_model(s.arch).to(device=device, dtype=_dtype(device)).eval()
    requests = _requests(s, s.engine_batch)
    prompts = torch.tensor([r.prompt_ids for r in requests], device=device)

    def hf_generate():
        with torch.no_grad():
            return hf.generate(prompts, attention_mask=torch.ones_like(prompts), do_sample=True,
                               max_new_tokens=s.new_tokens, min_new_tokens=s.new_tokens, pad_token_id=0)
    hf_generate()  # warm-up
    _sync(device)
    start = time.perf_counter()
    hf_generate()
    _sync(device)
    hf_s = time.perf_counter() - start
    state = {k: v.detach() for k, v in hf.state_dict().items()}
    del hf
    engine = NativeEngine(s.arch, state, config=NativeEngineConfig(
        max_batch_size=s.engine_batch, max_seq_len=s.prompt_len + s.new_tokens + 8, device=device, dtype="auto",
        prepack_weights=False, max_prefill_tokens=s.engine_batch * s.prompt_len))
    try:
        engine.generate(_requests(s, s.engine_batch, seed=1))  # warm-up, the same shapes
        _sync(device)
        start = time.perf_counter()
        completions = engine.generate(requests)
        _sync(device)
        ours_s = time.perf_counter() - start
        weight_bytes = sum(t.numel() * t.element_size() for t in engine.named_weights().values())
    finally:
        engine.close()
    generated = sum(len(c.output_ids) for c in completions)
    steps = max(len(c.output_ids) for c in completions)
    step_s = ours_s / max(steps, 1)
    result = {"batch": s.engine_batch, "new_tokens": s.new_tokens, "tokens_per_s": generated / ours_s,
              "hf_tokens_per_s": s.engine_batch * s.new_tokens / hf_s, "decode_step_s": step_s,
              "weight_stream_GBps": weight_bytes / step_s / 1e9, "weight_bytes": weight_bytes}
    result["ratio_vs_hf"] = result["tokens_per_s"] / result["hf_tokens_per_s"]
    if facts.get("copy_GBps"):
        result["weight_stream_frac_of_copy"] = result["weight_stream_GBps"] / facts["copy_GBps"]
    print(f"[decode] {result['tokens_per_s']:.0f} tok/s at batch {s.engine_batch} "
          f"({result['ratio_vs_hf']:.2f}x HF generate's {result['hf_tokens_per_s']:.0f})", flush=True)
    return result


def trainer_step(s: Shapes, device: str, fp8: str, layer_spec: str, steps: int = 3) -> tuple[dict, MegatronTrainer]:
    config = TrainerConfig(precision="bf16" if device == "cuda" else "fp32", micro_batch_size=s.micro_batch,
                           fp8=fp8, layer_spec=layer_spec, lr=1e-6)
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


def _with_mfu(stats: dict, facts: dict) -> dict:
    flops = stats.pop("flops_per_step")
    peak = facts.get("matmul_bf16_TFLOPs")
    stats["mfu"] = flops / stats["step_s"] / (peak * 1e12) if peak else None
    return stats


def section_train_bf16(s: Shapes, facts: dict, budget_s: float) -> dict:
    """A Megatron trainer step in bf16 on megatron-core's local layers (no Transformer Engine)."""
    stats, _ = trainer_step(s, _device(), "none", "local")
    stats = _with_mfu(stats, facts)
    print(f"[train bf16] {stats['step_s']:.3f} s/step, {stats['tokens_per_s']:.0f} tok/s, MFU "
          f"{stats['mfu'] or 0:.1%}", flush=True)
    return stats


def section_logprob(s: Shapes, facts: dict, budget_s: float) -> dict:
    """The fused Triton log-prob kernel against chunked and naive torch: time and peak memory."""
    if _device() != "cuda":
        return {"skipped": "the Triton kernel needs a GPU (tests cover it on CPU through the interpreter)"}
    smoke = s.arch.vocab_size < 1024
    return bench_logprob(facts.get("copy_GBps", 1.0) * 1e9, 2048 if smoke else 8192, 128256, 4096, device="cuda")


def section_weight_sync(s: Shapes, facts: dict, budget_s: float) -> dict:
    """Trainer -> engine on this device: export the HF views, load them into the engine (the path a
    colocated run takes; NCCL between processes needs a second GPU); then the trainer's side of vLLM's NCCL
    and CUDA-IPC weight transfers (`vllm_nccl_sender`, `vllm_ipc_handles`)."""
    device = _device()
    _, trainer = trainer_step(s, device, "none", "local", steps=1)
    state = trainer.export_hf_state()
    engine = NativeEngine(s.arch, state, config=NativeEngineConfig(
        max_batch_size=s.engine_batch, max_seq_len=s.prompt_len + s.new_tokens + 8, device=device, dtype="auto",
        prepack_weights=False))
    try:
        engine.update_weights(state, 1)  # warm-up
        _sync(device)
        start = time.perf_counter()
        engine.update_weights(trainer.export_hf_state(), 2)
        _sync(device)
        elapsed = time.perf_counter() - start
        nbytes = sum(t.numel() * t.element_size() for t in engine.named_weights().values())
    finally:
        engine.close()
    result = {"transport": "in-process", "sync_s": elapsed, "sync_GBps": nbytes / elapsed / 1e9, "bytes": nbytes}
    if facts.get("copy_GBps"):
        result["frac_of_copy"] = result["sync_GBps"] / facts["copy_GBps"]
    print(f"[weight sync] {nbytes / 2**30:.2f} GiB in {elapsed * 1e3:.1f} ms = {result['sync_GBps']:.0f} GB/s", flush=True)
    if device == "cuda":
        result["vllm_nccl"] = vllm_nccl_sender(trainer.export_hf_state())
        result["vllm_ipc"] = vllm_ipc_handles(trainer.export_hf_state())
        if not (result["vllm_nccl"]["ok"] and result["vllm_ipc"]["ok"]):
            raise RuntimeError(f"vLLM weight transfer, trainer side: {result}")
    return result


def vllm_nccl_sender(state: dict[str, torch.Tensor]) -> dict:
    """The trainer's side of vLLM's NCCL weight transfer (rollout/vllm_transfer.py) on this device: the
    torch.cuda.nccl calls it makes (unique id, a communicator from it, the warm-up all-reduce, one broadcast per
    tensor) in a group of one (NCCL refuses two ranks on one GPU, and vLLM is not installed here), with the
    control-plane calls a vLLM server would get recorded and checked in order."""
    calls: list[tuple[str, object]] = []
    transfer = VLLMWeightTransfer(lambda path, body: calls.append((path, body)), backend="nccl", workers=0)
    start = time.perf_counter()
    sent = transfer.send(iter(state.items()), version=7)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    paths = [path for path, _ in calls]
    init = calls[0][1]["init_info"]
    ok = (paths == ["/init_weight_transfer_engine", "/start_weight_update", "/update_weights", "/finish_weight_update"]
          and len(base64.b64decode(init["nccl_unique_id_b64"])) == 128 and init["world_size"] == 1
          and calls[2][1]["update_info"]["names"] == list(state) and calls[3][1] == {"weight_version": "7"}
          and sent["tensors"] == len(state))
    transfer.close()
    result = {"calls": paths, "tensors": sent["tensors"], "bytes": sent["bytes"], "send_s": seconds, "ok": ok}
    print(f"[weight sync] vLLM NCCL sender: {int(sent['tensors'])} tensors, {sent['bytes'] / 1e6:.0f} MB through "
          f"torch.cuda.nccl in {seconds:.3f} s; control calls {paths}", flush=True)
    return result


_MAP_IPC_HANDLES = """
import base64, json, pickle, sys, torch
from torch.multiprocessing.reductions import rebuild_cuda_tensor
device = int(sys.argv[1])
uuid = str(torch.cuda.get_device_properties(device).uuid)
sums = []
for handle in pickle.loads(base64.b64decode(sys.stdin.read())):
    args = list(handle[uuid])
    args[6] = device  # as vLLM's IPC backend does: the receiver's own device index
    sums.append(float(rebuild_cuda_tensor(*args).double().sum()))
print(json.dumps(sums))
"""


def vllm_ipc_handles(state: dict[str, torch.Tensor]) -> dict:
    """The CUDA-IPC handles vLLM's IPC weight transfer gets from us (rollout/vllm_transfer.py `ipc_handles`),
    mapped in another process on this GPU as vLLM's worker maps them, and the tensors there equal ours."""
    names = list(state)[:4]
    tensors = [state[name].detach().to("cuda").contiguous() for name in names]
    torch.cuda.synchronize()
    done = subprocess.run([sys.executable, "-c", _MAP_IPC_HANDLES, str(torch.cuda.current_device())],
                          input=ipc_handles(tensors), capture_output=True, text=True, timeout=120)
    if done.returncode != 0:
        return {"ok": False, "error": done.stderr[-1500:]}
    theirs = json.loads(done.stdout.splitlines()[-1])
    ours = [float(t.double().sum()) for t in tensors]
    print(f"[weight sync] vLLM IPC handles: {len(names)} tensors mapped in another process, sums equal: "
          f"{theirs == ours}", flush=True)
    return {"tensors": names, "ok": theirs == ours, "sums": ours, "mapped_sums": theirs}


def section_sglang(s: Shapes, facts: dict, budget_s: float) -> dict:
    """SGLang server start, generate, one weight sync through our sender, version check and read-back."""
    if _device() != "cuda" or not sglang_available():
        return {"skipped": "needs a CUDA GPU and the sglang package (the gpu extra)"}
    deadline = time.monotonic() + budget_s - 15  # leave time to stop the server and write the result
    arch = s.arch
    state_v0 = {k: v.detach().to(torch.bfloat16) for k, v in _hf_model(arch).state_dict().items()}
    state_v1 = {k: v * 0.5 for k, v in state_v0.items()}
    workdir = tempfile.mkdtemp(prefix="gpu_check_sglang_")
    port = free_port()
    save_hf(os.path.join(workdir, "model"), arch, {k: v.float() for k, v in state_v0.items()}, None)
    flags = sglang_server_args(1, "bf16", 16, False, mem_fraction_static=0.5)
    cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", os.path.join(workdir, "model"),
           "--host", "127.0.0.1", "--port", str(port), "--skip-tokenizer-init", "--dtype", "bfloat16", *flags]
    # NCCL refuses two ranks on one GPU: with a second GPU the server takes it and the sync is NCCL, as on
    # a cluster; on one GPU the group runs over gloo (the protocol is the same, the transport slower).
    two_gpus = torch.cuda.device_count() > 1
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="1") if two_gpus else dict(os.environ)
    backend = "nccl" if two_gpus else "gloo"
    log = open(os.path.join(workdir, "server.log"), "w")
    start = time.perf_counter()
    server = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        while True:
            try:
                urllib.request.urlopen(url + "/health", timeout=5)
                break
            except OSError:
                if server.poll() is not None or time.monotonic() > deadline:
                    with open(log.name) as f:
                        tail = f.read()[-2000:]
                    raise RuntimeError(f"sglang.launch_server did not come up; its log ends:\n{tail}") from None
                time.sleep(2)
        startup_s = time.perf_counter() - start
        timeout = max(deadline - time.monotonic(), 5)
        engine = HTTPEngine(url, timeout=timeout)
        request = GenerateRequest(request_id="smoke", prompt_ids=list(range(1, 9)),
                                  sampling=SamplingParams(max_new_tokens=16, temperature=0.0))
        before = engine.generate([request])[0]
        sender = BroadcastWeightSender([SGLangServer(url, timeout=timeout)], [1], master_address="127.0.0.1",
                                       master_port=free_port(), backend=backend)
        sync_start = time.perf_counter()
        sender.push(iter(state_v1.items()), version=1)
        sync_s = time.perf_counter() - sync_start
        after = engine.generate([request])[0]
        checksum = {}
        for name in ("model.embed_tokens.weight", "lm_head.weight"):
            if name not in state_v1:
                continue
            _, served = engine.request("POST", "/get_weights_by_name", {"name": name, "truncate_size": 64})
            served = torch.tensor(served).flatten().float()
            checksum[name] = float((served - state_v1[name].float().flatten()[:len(served)].cpu()).abs().max())
        sender.close()
        version = engine.version
        engine.close()
        ok = version == 1 and set(after.weight_versions) == {1} and all(v == 0.0 for v in checksum.values())
        result = {"startup_s": startup_s, "sync_s": sync_s, "sync_backend": backend, "version_after_sync": version,
                  "versions_before": sorted(set(before.weight_versions)),
                  "versions_after": sorted(set(after.weight_versions)),
                  "tokens_changed": before.output_ids != after.output_ids, "max_abs_diff_read_back": checksum, "ok": ok}
        print(f"[sglang] up in {startup_s:.0f} s, weight sync {sync_s * 1e3:.0f} ms, version {version}", flush=True)
        if not ok:
            raise RuntimeError(f"the weight update did not take: {json.dumps(result)}")
        return result
    finally:
        server.terminate()
        try:
            server.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, 9)
            server.wait()
        log.close()
        shutil.rmtree(workdir, ignore_errors=True)


def section_te_fp8(s: Shapes, facts: dict, budget_s: float) -> dict:
    """A trainer step through Transformer Engine's layers in FP8 (delayed scaling), rows of uneven lengths
    padded as RL batches are; where TE's torch extension imports and passes its one-layer FP8 self-test."""
    problem = transformer_engine_problem()
    if problem:
        return {"skipped": f"Transformer Engine is not usable here: {problem}"}
    stats, _ = trainer_step(s, "cuda", "delayed", "te")
    stats = _with_mfu(stats, facts)
    print(f"[train fp8] {stats['step_s']:.3f} s/step, {stats['tokens_per_s']:.0f} tok/s", flush=True)
    return stats


def section_packing(s: Shapes, facts: dict, budget_s: float) -> dict:
    """Sequence packing on the device: log-probs of rows of uneven lengths packed into one THD row (Transformer
    Engine's variable-length attention where TE is usable, else the local layers) against the padded rows,
    and one packed training step's time against the padded one's."""
    device = _device()
    layer_spec = "te" if transformer_engine_problem() is None else "local"
    g = torch.Generator().manual_seed(0)
    lengths = [s.train_seq + 1 - (s.train_seq * r) // (2 * s.train_rows) for r in range(s.train_rows)]
    tokens = torch.randint(0, s.arch.vocab_size, (s.train_rows, s.train_seq + 1), generator=g)
    loss_mask = torch.zeros(tokens.shape)
    for r, n in enumerate(lengths):
        loss_mask[r, n // 4:n] = 1.0
    batch = TrainBatch(tokens=tokens, loss_mask=loss_mask)
    result: dict = {"layer_spec": layer_spec, "device": device, "real_tokens": int(loss_mask.sum())}
    logprobs = {}
    for name, packing in (("padded", {}), ("packed", {"sequence_packing": True})):
        config = TrainerConfig(precision="bf16" if device == "cuda" else "fp32", micro_batch_size=s.micro_batch,
                               layer_spec=layer_spec, lr=0.0, seed=0, **packing)
        trainer = MegatronTrainer(s.arch, config)
        logprobs[name] = trainer.compute_logprobs(batch).float() * loss_mask

        def loss_fn(lp, mb, entropy):
            return -(lp * mb.loss_mask.to(lp.device)).sum() / loss_mask.sum(), {}

        trainer.train_step(batch, loss_fn)  # warm-up
        _sync(device)
        start = time.perf_counter()
        trainer.train_step(batch, loss_fn)
        _sync(device)
        result[f"{name}_step_s"] = time.perf_counter() - start
    result["max_logprob_diff"] = float((logprobs["packed"] - logprobs["padded"]).abs().max())
    result["max_abs_logprob"] = float(logprobs["padded"].abs().max())
    print(f"[packing] {layer_spec} layers: packed vs padded log-probs differ by at most {result['max_logprob_diff']:.3g} "
          f"(|log-prob| up to {result['max_abs_logprob']:.1f}); step {result['packed_step_s']:.3f} s packed, "
          f"{result['padded_step_s']:.3f} s padded", flush=True)
    return result


SECTIONS = {"env": section_env, "decode": section_decode, "train_bf16": section_train_bf16,
            "logprob": section_logprob, "weight_sync": section_weight_sync, "sglang": section_sglang,
            "te_fp8": section_te_fp8, "packing": section_packing}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("section", choices=list(SECTIONS))
    parser.add_argument("--facts", help="the env section's JSON")
    parser.add_argument("--out", required=True)
    parser.add_argument("--budget-s", type=float, default=600.0)
    parser.add_argument("--smoke", action="store_true", help="tiny shapes (runs on CPU too)")
    args = parser.parse_args(argv)
    facts = {}
    if args.facts and os.path.exists(args.facts):
        with open(args.facts) as f:
            facts = json.load(f)
    torch.manual_seed(0)
    result = SECTIONS[args.section](shapes(args.smoke), facts, args.budget_s)
    with open(args.out, "w") as f:
        json.dump(result, f, default=str)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
