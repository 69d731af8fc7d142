"""Where the generator executor runs, as the config places it: in this process (native engine, or
in-process SGLang), in a generator process on this host's cores (`rollout.placement: disaggregated`),
on the launch's own generator ranks (`cluster.generator.launch_ranks`), or on SGLang servers
(`cluster.generator.urls`). `make_engine` returns one object behind the `RolloutEngine` protocol
whichever it is."""
from __future__ import annotations

import os
import shutil
import socket

import torch

from megatron_rl import ranks
from megatron_rl.config import ConfigError
from megatron_rl.models.families import get_family
from megatron_rl.placement.core_share import CoreShare
from megatron_rl.placement.generator_process import GeneratorProcess
from megatron_rl.placement.generator_ranks import generator_rank_pool, rollout_engine_config
from megatron_rl.rollout.native import NativeEngine
from megatron_rl.rollout.pool import EnginePool
from megatron_rl.rollout.sglang_engine import SGLangEngine
from megatron_rl.rollout.vllm_engine import (
    VLLMEngine,
    VLLMServer,
    check_plugin,
    device_server_args,
    launch_model_dir,
    resolve_weight_transfer,
    vllm_python,
)
from megatron_rl.rollout.vllm_transfer import weight_transfer_config
from megatron_rl.weight_sync.channel import make_weight_channel
from megatron_rl.weight_sync.fp8 import generator_weights
from megatron_rl.weight_sync.shared_memory import OWNED_DIR_PREFIX, shm_directory


def engine_context(config, arch) -> int:
    """Tokens (prompt + response) one engine sequence holds: engine.max_seq_len capped by the model."""
    return min(config.engine.max_seq_len or arch.max_position_embeddings, arch.max_position_embeddings)


def make_engine(config, model, *, single_policy: bool = True, sglang_kwargs: dict | None = None,
                vllm_memory_fraction: float | None = None):
    """The generator executor for the configured placement (see RolloutConfig.placement). A run of several
    policies (`single_policy=False`) keeps the fixed core split: their generator processes would each
    lend and take back the same cores. `sglang_kwargs`: more `sglang.Engine` arguments for an in-process
    SGLang engine (its planned memory fraction); `vllm_memory_fraction`: the GPU share of vLLM servers launched
    beside the trainer (colocated on a GPU), which then sleep while it trains."""
    rollout = config.rollout
    generator = config.cluster.generator
    engine_config = rollout_engine_config(config)
    arch = model.arch
    routing = (arch.num_layers, arch.moe_top_k) if engine_config.record_routing and arch.is_moe else None
    if get_family(arch.family).gpt_oss and (generator.backend in ("vllm", "sglang") or generator.urls):
        raise ConfigError(f"cluster.generator.backend: {generator.backend}: GPT-OSS weight updates to vLLM and SGLang "
                          "are not mapped (ours carry per-expert tensors, the published checkpoints stacked ones); "
                          "GPT-OSS rolls out on the native engine", field="cluster.generator.backend")
    if generator.launch_ranks:  # generator ranks of this launch (placement/generator_ranks.py)
        return generator_rank_pool(config)
    if generator.backend == "vllm":
        return vllm_engines(config, model, colocated_memory_fraction=vllm_memory_fraction)
    if generator.urls:  # a generator group of SGLang servers (examples/slurm_common.sh starts them)
        return EnginePool.for_sglang_servers(generator.urls, engine_tp=generator.engine_tp,
                                             master_address=socket.getfqdn(), master_port=generator.weight_update_group_port,
                                             precision=generator.precision, fp8_block_size=generator.fp8_block_size,
                                             routing=routing, **pool_options(generator))
    if generator.backend == "sglang":  # one in-process SGLang engine on this machine's GPUs
        if rollout.weight_sync == "adapters":
            raise ConfigError("rollout.weight_sync: adapters reaches SGLang servers through their LoRA endpoints "
                              "(cluster.generator.urls), not an in-process SGLang engine (use rollout.weight_sync "
                              "full)", field="rollout.weight_sync")
        return SGLangEngine(config.model.path, tp_size=generator.engine_tp, routing=routing, **(sglang_kwargs or {}),
                            **({"quantization": "fp8"} if generator.precision == "fp8" else {}))
    if rollout.placement == "disaggregated":
        torch.set_num_threads(rollout.trainer_threads)
        # Lending makes the thread count, and so floating-point summation order, depend on timing.
        lend = rollout.lend_idle_cores and not rollout.deterministic and single_policy and ranks.world_size() == 1
        cores = CoreShare(trainer_threads=rollout.trainer_threads, generator_threads=rollout.generator_threads) if lend else None
        return GeneratorProcess(model.arch, generator_weights(model.state, config.cluster.generator), tokenizer=model.tokenizer, config=engine_config,
                                threads=rollout.generator_threads, verify_weights=rollout.verify_weight_sync,
                                core_share=cores)
    return NativeEngine(model.arch, generator_weights(model.state, config.cluster.generator), tokenizer=model.tokenizer,
                        config=engine_config)


VLLM_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "auto": "auto"}


def vllm_engines(config, model, *, colocated_memory_fraction: float | None = None):
    """backend vllm: clients of the servers in `cluster.generator.urls`, or `num_engines` servers launched here
    from the run's initial weights (written once to tmpfs; logs in RUN_DIR/vllm_<i>.log), as one engine.
    `colocated_memory_fraction` (servers beside the trainer on its GPUs): each server takes that share of the
    GPU (`--gpu-memory-utilization`) and runs with sleep mode, so it frees its memory while the trainer steps."""
    generator = config.cluster.generator
    tied = bool(model.arch.tie_word_embeddings)
    transfer = resolve_weight_transfer(generator.vllm_weight_transfer, colocated=colocated_memory_fraction is not None)
    workers = generator.engine_tp if torch.cuda.is_available() else 1  # a CPU server runs one worker
    if transfer == "ipc" and workers > 1:
        raise ConfigError(f"cluster.generator.vllm_weight_transfer: ipc hands each tensor from trainer rank 0's GPU to a "
                          f"worker on that GPU; servers of {workers} workers (cluster.generator.engine_tp) span other "
                          "GPUs: use reload, or engine_tp 1", field="cluster.generator.vllm_weight_transfer")
    if config.rollout.verify_weight_sync and workers > 1:
        raise ConfigError(f"rollout.verify_weight_sync: vLLM servers of {workers} workers hold shards of each parameter, "
                          "which the read-back does not compare (rollout/vllm_checksums.py); it checks servers of one "
                          "worker (cluster.generator.engine_tp 1)", field="rollout.verify_weight_sync")
    readback = dict(verify_weights=config.rollout.verify_weight_sync,
                    weight_dtype={"fp32": torch.float32, "bf16": torch.bfloat16}.get(config.engine.dtype))
    if generator.urls:
        if tied:  # the servers were launched from a tied checkpoint: a reload would leave their output layer stale
            raise ConfigError("cluster.generator.urls: the model ties its output layer to its embedding, which vLLM's "
                              "in-place weight reload leaves on the launch weights; let the run launch its vLLM "
                              "servers (no urls: docs/vllm.md)",
                              field="cluster.generator.urls")
        # the servers' workers reach trainer rank 0 at the launch's MASTER_ADDR (gloo; NCCL finds its own way)
        address = os.environ.get("MASTER_ADDR") or socket.getfqdn()
        engines = [VLLMEngine(url, weight_transfer=transfer, transfer_workers=workers, transfer_address=address,
                              **readback) for url in generator.urls]
    else:
        python = vllm_python(generator.vllm_python)
        check_plugin(python, transfer)
        model_dir = os.path.join(shm_directory(), f"{OWNED_DIR_PREFIX}{os.getpid()}-vllm-model")
        tied = launch_model_dir(model_dir, model.arch, model.state, model.tokenizer)
        args = ["--dtype", VLLM_DTYPES[config.engine.dtype], "--max-model-len", str(engine_context(config, model.arch)),
                "--max-num-seqs", str(config.engine.max_batch_size), "--seed", str(config.seed),
                "--tensor-parallel-size", str(workers),
                *(["--quantization", "fp8"] if generator.precision == "fp8" else []), *device_server_args(),
                *([] if transfer == "reload" else weight_transfer_config(transfer)),
                *([] if colocated_memory_fraction is None else
                  ["--enable-sleep-mode", "--gpu-memory-utilization", f"{colocated_memory_fraction:g}"]),
                *generator.vllm_args]
        threads = config.engine.num_threads or os.cpu_count() or 1
        env = {"VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}", "VLLM_CPU_KVCACHE_SPACE": f"{generator.vllm_kv_cache_gib:g}",
               # ipc's handles are pickled; the server is this run's own, on loopback
               **({"VLLM_ALLOW_INSECURE_SERIALIZATION": "1"} if transfer == "ipc" else {})}
        servers = [VLLMServer(model_dir, python=python, args=args, env=env, ready_timeout=generator.ready_timeout_s,
                              log_path=os.path.join(config.run_dir, f"vllm_{i}.log")) for i in range(generator.num_engines)]
        try:
            for server in servers:
                server.wait_ready(generator.ready_timeout_s)
        except BaseException:
            for server in servers:
                server.stop()
            shutil.rmtree(model_dir, ignore_errors=True)
            raise
        engines = [VLLMEngine(server.url, server=server, tied_embeddings=tied, launch_dir=model_dir,
                              weight_transfer=transfer, transfer_workers=workers,
                              sleep_mode=colocated_memory_fraction is not None, **readback) for server in servers]
    # a pool even of one: a launched engine that dies is restarted, and its groups wait for it
    return EnginePool(engines, **pool_options(generator))


def pool_options(generator) -> dict:
    """EnginePool's fault-tolerance settings from `cluster.generator`."""
    return dict(dead_engine_timeout_s=generator.dead_engine_timeout_s,
                hung_engine_timeout_s=generator.hung_engine_timeout_s)


def policy_weight_channel(config, trainer, engine):
    """The weight channel from `trainer` to the generator `engine` (weight_sync/channel.py): engines that
    run fp8 weights without fp8 GEMMs get them rounded through block-wise fp8 on every sync."""
    generator = config.cluster.generator
    fp8_engine = generator.precision == "fp8" and generator.backend == "native"  # SGLang and vLLM quantize themselves
    return make_weight_channel(trainer, engine, transform=(
        (lambda state: generator_weights(state, generator)) if fp8_engine else None),
        delta=config.rollout.weight_sync == "delta", adapters=config.rollout.weight_sync == "adapters",
        adapter_directory=os.path.join(config.run_dir, "adapters"))
