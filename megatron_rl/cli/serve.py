"""`megatron-rl serve`: the native engine behind SGLang's native and OpenAI's /v1 HTTP APIs
(rollout/server.py, docs/serving.md)."""
from __future__ import annotations

import argparse
import gc
import os
import signal
import sys

from megatron_rl.config import ConfigError
from megatron_rl.models.pretrained import load_pretrained
from megatron_rl.rollout.config import NativeEngineConfig
from megatron_rl.rollout.native import NativeEngine
from megatron_rl.rollout.native.engine import return_freed_heap
from megatron_rl.rollout.openai_tools import PARSERS
from megatron_rl.rollout.server import RolloutServer, ServerLimits
from megatron_rl.weight_sync.shared_memory import reclaim_stale


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2-135m",
                        help="GGUF file, HF or Megatron checkpoint directory, or the alias smollm2-135m")
    parser.add_argument("--max-batch-size", type=int, default=32, help="KV-cache slots (sequences per step)")
    parser.add_argument("--max-seq-len", type=int, default=4096, help="prompt + response tokens per slot")
    parser.add_argument("--max-prefill-tokens", type=int, default=2048, help="prompt tokens per step")
    parser.add_argument("--device", default="auto", help="cpu, cuda[:N] or auto")
    parser.add_argument("--dtype", default="fp32", choices=["fp32", "bf16", "auto"])
    parser.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    parser.add_argument("--enable-return-routed-experts", dest="record_routing", action="store_true",
                        help="MoE models: record each token's experts, returned by /generate's return_routed_experts "
                             "(SGLang's flag)")


def build_engine(args: argparse.Namespace):
    # Huge pages for the large weight / KV buffers (~10% faster decoding on CPU); must be set before
    # torch's first large allocation, and only matters on Linux.
    os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

    config = NativeEngineConfig(max_batch_size=args.max_batch_size, max_seq_len=args.max_seq_len,
                                max_prefill_tokens=args.max_prefill_tokens, device=args.device,
                                dtype=args.dtype, num_threads=args.threads,
                                record_routing=getattr(args, "record_routing", False))
    return NativeEngine.from_pretrained(load_pretrained(args.model), config)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_engine_arguments(parser)
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: local only)")
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument("--api-key", default=os.environ.get("MEGATRON_RL_API_KEY"),
                        help="require 'Authorization: Bearer KEY' (default: $MEGATRON_RL_API_KEY)")
    parser.add_argument("--weight-version", type=int, default=0, help="initial weight version")
    parser.add_argument("--served-model-name", default=None,
                        help="the model id of /v1/models and OpenAI requests (default: the --model file name)")
    limits = ServerLimits()
    parser.add_argument("--max-request-mb", type=float, default=limits.max_body_bytes / 2**20,
                        help="largest JSON request body in MiB (checked before parsing)")
    parser.add_argument("--max-n", type=int, default=limits.max_n, help="most samples per request")
    parser.add_argument("--tool-call-parser", default="auto", choices=PARSERS,
                        help="how /v1/chat/completions reads the model's tool calls: auto (from the chat template), "
                             "a format, or none (tools rendered only with tool_choice none)")
    parser.add_argument("--max-queued-tokens", type=int, default=0,
                        help="most prompt + new tokens queued over all requests (0: 16 x slots x context)")


def run(args: argparse.Namespace) -> int:
    if not 0 <= args.port < 65536:
        raise ConfigError(f"--port must be in [0, 65535], got {args.port}")
    if args.max_request_mb <= 0 or args.max_n < 1 or args.max_queued_tokens < 0:
        raise ConfigError("--max-request-mb must be > 0, --max-n >= 1 and --max-queued-tokens >= 0")
    reclaim_stale()  # what killed runs left in /dev/shm: whatever starts next frees it
    limits = ServerLimits(max_body_bytes=int(args.max_request_mb * 2**20), max_n=args.max_n,
                          max_queued_tokens=args.max_queued_tokens)
    engine = build_engine(args)
    gc.collect()  # the loader's freed buffers (the checkpoint read before the engine copied it): ~0.4 GB
    return_freed_heap()
    if args.weight_version:
        engine.update_weights({}, args.weight_version)
    try:
        server = RolloutServer(engine, host=args.host, port=args.port, api_key=args.api_key, model_path=args.model,
                               model_name=args.served_model_name, limits=limits,
                               tool_call_parser=args.tool_call_parser)
    except OSError as exc:
        engine.close()
        raise ConfigError(f"cannot bind {args.host}:{args.port}: {exc.strerror}") from None
    if args.host not in ("127.0.0.1", "localhost", "::1") and not args.api_key:
        print(f"warning: serving on {args.host} without --api-key: anyone who can reach it can generate "
              "and replace the weights", file=sys.stderr)
    print(f"megatron-rl serve: {args.model} on {server.url} (weight version {engine.version})", flush=True)
    server.start()  # HTTP handlers only submit; this (main) thread runs the engine's steps

    def stop(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)
    try:
        engine.run_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.shutdown()
        engine.close()
    return 0
