"""`megatron-rl bench vllm-sync`: a weight update of one model into one vLLM server (the CPU build here), through
vLLM's weight-transfer API (`transfer`, default gloo: rollout/vllm_transfer.py) against the reload from tmpfs
(safetensors written, then `reload_weights`), on the same server in one run, alternating round by round so both
see the same machine. `ratio` = reload time / transfer time (median of `repeats` rounds each, after one untimed
round of each). With `verify=true` a last transfer round reads the weights back (`/weight_checker`)."""
from __future__ import annotations

import contextlib
import logging
import os
import shutil
import statistics
import time

import torch

from megatron_rl.config import ConfigError
from megatron_rl.models.pretrained import load_pretrained
from megatron_rl.rollout.vllm_checksums import ParameterDigests
from megatron_rl.rollout.vllm_engine import (
    VLLMEngine,
    VLLMServer,
    check_plugin,
    device_server_args,
    launch_model_dir,
    vllm_python,
    with_output_layer,
)
from megatron_rl.rollout.vllm_transfer import weight_transfer_config
from megatron_rl.weight_sync.shared_memory import OWNED_DIR_PREFIX, shm_directory

log = logging.getLogger(__name__)


def bench_vllm_sync(options: dict) -> dict:
    known = {"model", "dtype", "repeats", "threads", "transfer", "verify"}
    if set(options) - known:
        raise ConfigError(f"bench vllm-sync: unknown option(s) {sorted(set(options) - known)} (known: {sorted(known)})")
    repeats = int(options.get("repeats", 5))
    threads = int(options.get("threads", 2))
    transfer = str(options.get("transfer", "gloo"))
    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16}
    if str(options.get("dtype", "fp32")) not in dtypes:
        raise ConfigError(f"bench vllm-sync: dtype={options['dtype']!r}: fp32 or bf16")
    dtype = dtypes[str(options.get("dtype", "fp32"))]
    pretrained = load_pretrained(str(options.get("model", "smollm2-135m")))
    state = {k: v.to(dtype) for k, v in pretrained.state.items()}
    python = vllm_python()
    check_plugin(python, transfer)
    model_dir = os.path.join(shm_directory(), f"{OWNED_DIR_PREFIX}{os.getpid()}-bench-vllm-sync")
    log_path = model_dir + ".log"
    tied = launch_model_dir(model_dir, pretrained.arch, state, pretrained.tokenizer)
    server = VLLMServer(model_dir, python=python, log_path=log_path,
                        env={"VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}", "VLLM_CPU_KVCACHE_SPACE": "1"},
                        args=["--dtype", str(dtype).removeprefix("torch."), "--enforce-eager", "--max-model-len", "512",
                              "--max-num-seqs", "8", *device_server_args(), *weight_transfer_config(transfer)])
    times: dict[str, list[float]] = {"reload": [], transfer: []}
    try:
        server.wait_ready(900)
        engines = {"reload": VLLMEngine(server.url, tied_embeddings=tied),
                   transfer: VLLMEngine(server.url, tied_embeddings=tied, weight_transfer=transfer)}
        version = 0
        for round_ in range(repeats + 1):
            for name, engine in engines.items():
                version += 1
                start = time.perf_counter()
                engine.update_weights(state, version)
                if round_:  # the first round of each is untimed (page-in, the transfer group's forming)
                    times[name].append(time.perf_counter() - start)
        nbytes = sum(t.numel() * t.element_size() for _, t in with_output_layer(state.items()))
        result = {f"{name}_s": round(statistics.median(values), 4) for name, values in times.items()}
        result.update({f"{name}_s_min": round(min(values), 4) for name, values in times.items()})
        result.update({f"{name}_s_max": round(max(values), 4) for name, values in times.items()})
        result.update({"ratio": round(statistics.median(times["reload"]) / statistics.median(times[transfer]), 3),
                       "bytes": nbytes, "transfer": transfer, "dtype": str(options.get("dtype", "fp32")),
                       "repeats": repeats})
        if options.get("verify", False):
            digests = ParameterDigests(dtype)
            list(digests.observe(with_output_layer(state.items())))
            start = time.perf_counter()
            result["readback_compared"] = engines[transfer].verify_readback(digests)["compared"]
            result["readback_s"] = round(time.perf_counter() - start, 4)
        for name, engine in engines.items():
            log.info(f"{name}: {nbytes / 1e6:.0f} MB in {result[name + '_s']:.3f} s median "
                     f"({result[name + '_s_min']:.3f}-{result[name + '_s_max']:.3f}) = "
                     f"{nbytes / result[name + '_s'] / 1e9:.2f} GB/s")
            engine.close()
        return result
    finally:
        server.stop()
        shutil.rmtree(model_dir, ignore_errors=True)
        with contextlib.suppress(OSError):
            os.unlink(log_path)
