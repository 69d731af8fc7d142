"""`megatron-rl parity`: the model-family parity matrix against transformers (fp32, CPU, tiny random models).

Every row is a tiny model built from the family's transformers config class with random weights (no hub).
Columns: max |logit difference| of the Megatron trainer against transformers at TP=1, TP=2 (and PP=2 for
one family), the HF -> Megatron (TP=2, PP=2) -> HF round trip through `convert` (max |difference| of the
reloaded tensors and of transformers' logits on the export: 0 means bit-exact), and the native engine's
greedy 64 tokens (identical or not) and max |log-prob difference|. Rows marked "long" run one sequence of
LONG_POSITIONS tokens, one per rope-scaling type (trainer at TP=1, engine on a prompt of that length).
docs/models.md describes the families.
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
import tempfile
from typing import Any

import torch

from megatron_rl.checkpoints_tools.convert import convert
from megatron_rl.config import ConfigError
from megatron_rl.models import families
from megatron_rl.models.arch import ModelArch
from megatron_rl.models.pretrained import load_pretrained
from megatron_rl.placement.launch import run_distributed
from megatron_rl.rollout.native.parity import engine_parity
from megatron_rl.types import TrainBatch

TOLERANCE = 1e-4
LONG_POSITIONS = 4096
_BASE = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6, max_position_embeddings=128,
             tie_word_embeddings=False)
_LONG = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
             num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6, tie_word_embeddings=False)


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    config_class: str
    fields: dict[str, Any]
    long: bool = False
    pipeline: bool = False
    """Also run at PP=2 (one family is enough: the layer split is family-independent)."""


def _rope(rope_type: str, theta: float, **extra) -> dict[str, Any]:
    return {"rope_parameters": {"rope_type": rope_type, "rope_theta": theta, **extra}}


CASES: tuple[Case, ...] = (
    Case("llama3.1 (llama3 rope)", "LlamaConfig", {**_BASE, **_rope(
        "llama3", 500000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=64)}, pipeline=True),
    Case("llama (linear rope)", "LlamaConfig", {**_BASE, **_rope("linear", 10000.0, factor=4.0)}),
    Case("llama (dynamic rope)", "LlamaConfig", {**_BASE, "max_position_embeddings": 64,
                                                 **_rope("dynamic", 10000.0, factor=2.0)}),
    Case("llama (yarn rope)", "LlamaConfig", {**_BASE, **_rope("yarn", 10000.0, factor=4.0,
                                                               original_max_position_embeddings=32)}),
    Case("mistral", "MistralConfig", {**_BASE, "sliding_window": None, **_rope("default", 1000000.0)}),
    Case("qwen2", "Qwen2Config", {**_BASE, **_rope("default", 1000000.0)}),
    Case("mistral (16-token window)", "MistralConfig", {**_BASE, "sliding_window": 16, **_rope("default", 1000000.0)}),
    Case("qwen2 (16-token window on layer 1)", "Qwen2Config", {
        **_BASE, "use_sliding_window": True, "sliding_window": 16, "max_window_layers": 1,
        **_rope("default", 1000000.0)}),
    Case("qwen3", "Qwen3Config", {**_BASE, "head_dim": 32, **_rope("default", 1000000.0)}),
    Case("mixtral (8 experts, top-2)", "MixtralConfig", {**_BASE, "num_local_experts": 8, "num_experts_per_tok": 2,
                                                         "sliding_window": None, **_rope("default", 1000000.0)}),
    Case("qwen3_moe (top-3 of 8, not renormalized)", "Qwen3MoeConfig", {
        **_BASE, "head_dim": 32, "moe_intermediate_size": 32, "num_experts": 8, "num_experts_per_tok": 3,
        "norm_topk_prob": False, **_rope("default", 1000000.0)}),
    Case("qwen2_moe (top-4 of 8, gated shared expert)", "Qwen2MoeConfig", {
        **_BASE, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 64, "num_experts": 8,
        "num_experts_per_tok": 4, "norm_topk_prob": False, **_rope("default", 1000000.0)}),
    Case("glm4_moe (sigmoid top-4 of 8 in 2 of 4 groups, dense layer 0, half rotary)", "Glm4MoeConfig", {
        **_BASE, "moe_intermediate_size": 32, "n_routed_experts": 8, "num_experts_per_tok": 4, "n_group": 4,
        "topk_group": 2, "routed_scaling_factor": 2.5, "n_shared_experts": 1, "first_k_dense_replace": 1,
        "norm_topk_prob": True, "attention_bias": True, "use_qk_norm": True,
        **_rope("default", 1000000.0, partial_rotary_factor=0.5)}),
    Case("deepseek_v3 (multi-latent attention: q latent 24, kv latent 16; glm4_moe's router and layout)",
         "DeepseekV3Config", {**_BASE, "head_dim": 8, "num_key_value_heads": 4, "moe_intermediate_size": 32,
                              "n_routed_experts": 8, "num_experts_per_tok": 4, "n_group": 4, "topk_group": 2,
                              "routed_scaling_factor": 2.5, "n_shared_experts": 1, "first_k_dense_replace": 1,
                              "norm_topk_prob": True, "q_lora_rank": 24, "kv_lora_rank": 16, "qk_nope_head_dim": 12,
                              "qk_rope_head_dim": 8, "v_head_dim": 12, **_rope("default", 10000.0)}),
    Case("deepseek_v3 (yarn rope with mscale_all_dim, as DeepSeek-V3 ships)", "DeepseekV3Config", {
        **_BASE, "head_dim": 8, "num_key_value_heads": 4, "moe_intermediate_size": 32, "n_routed_experts": 8,
        "num_experts_per_tok": 2, "n_group": 1, "topk_group": 1, "n_shared_experts": 1, "first_k_dense_replace": 1,
        "q_lora_rank": None, "kv_lora_rank": 16, "qk_nope_head_dim": 12, "qk_rope_head_dim": 8, "v_head_dim": 12,
        **_rope("yarn", 10000.0, factor=4.0, original_max_position_embeddings=32, beta_fast=32.0, beta_slow=1.0,
                mscale=1.0, mscale_all_dim=1.0)}),
    Case("gemma3_text (16-token window on 5 of 6 layers, local RoPE base, linear rope on global)",
         "Gemma3TextConfig", {**_BASE, "num_hidden_layers": 6, "sliding_window": 16, "query_pre_attn_scalar": 24,
                              "tie_word_embeddings": True, "rope_parameters": {
                                  "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1000000.0},
                                  "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}},
         pipeline=True),  # (the scaled embedding lives on the first stage only)
    Case("gemma2 (16-token window on layers 0 and 2, soft-capped attention 5 and logits 3)", "Gemma2Config", {
        **_BASE, "num_hidden_layers": 4, "sliding_window": 16, "query_pre_attn_scalar": 24, "tie_word_embeddings": True,
        "attn_logit_softcapping": 5.0, "final_logit_softcapping": 3.0, **_rope("default", 10000.0)}),
    Case("gpt_oss (16-token window on layer 0, sinks, biases, top-2 of 4 clamped-SwiGLU experts, yarn rope)",
         "GptOssConfig", {**_BASE, "intermediate_size": 32, "num_local_experts": 4, "num_experts_per_tok": 2,
                          "sliding_window": 16, "swiglu_limit": 2.0, "rope_parameters": {
                              "rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
                              "truncate": False, "original_max_position_embeddings": 32, "rope_theta": 150000.0}}),
    Case("smollm2-like", "LlamaConfig", {**_BASE, "tie_word_embeddings": True, "num_key_value_heads": 2,
                                         **_rope("default", 100000.0)}),
    Case("long: llama3 rope", "LlamaConfig", {**_LONG, "max_position_embeddings": 8192, **_rope(
        "llama3", 500000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=1024)}, long=True),
    Case("long: linear rope", "LlamaConfig", {**_LONG, "max_position_embeddings": 8192,
                                              **_rope("linear", 10000.0, factor=4.0)}, long=True),
    Case("long: dynamic rope", "LlamaConfig", {**_LONG, "max_position_embeddings": 2 * LONG_POSITIONS,
                                               **_rope("dynamic", 10000.0, factor=4.0)}, long=True),
    Case("long: yarn rope", "LlamaConfig", {**_LONG, "max_position_embeddings": 8192, **_rope(
        "yarn", 10000.0, factor=8.0, original_max_position_embeddings=1024)}, long=True),
)


def hf_model(case: Case, seed: int = 0):
    """A transformers model of `case` with random weights large enough to make logits informative."""
    import transformers  # the reference implementation; a dev dependency of the parity check only

    config = getattr(transformers, case.config_class)(**case.fields, attn_implementation="eager")
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    zero_centred = config.model_type.startswith("gemma")  # Gemma's norms scale by 1 + weight
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_((0.0 if zero_centred else 1.0) + 0.2 * torch.randn_like(param))
            elif name.endswith(".bias"):
                param.copy_(0.5 * torch.randn_like(param))
            else:
                param.copy_(torch.randn_like(param) / math.sqrt(param.shape[-1]))
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # zero at init; random, it changes which experts win
                buffer.copy_(0.1 * torch.randn_like(buffer))
    return model


def case_model(case: Case, seed: int = 0) -> tuple[Any, ModelArch, dict[str, torch.Tensor]]:
    """(transformers model, our ModelArch read from its config through the registry, HF-named state)."""
    model = hf_model(case, seed)
    arch = families.from_hf_config(model.config.to_dict(), where=f"{case.config_class}({case.name})")
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return model, arch, state


def case_tokens(case: Case, arch: ModelArch, seed: int = 0) -> torch.Tensor:
    """Token rows (B, S): 1 x (LONG_POSITIONS + 1) for long cases, else 2 x 49."""
    rows, length = (1, LONG_POSITIONS + 1) if case.long else (2, 49)
    return torch.randint(0, arch.vocab_size, (rows, length), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def reference_logits(model, tokens: torch.Tensor) -> torch.Tensor:
    """transformers' logits for tokens[:, :-1] (what the trainer's compute_logits predicts)."""
    return model(tokens[:, :-1]).logits.float()


def trainer_logits(arch: ModelArch, state: dict[str, torch.Tensor], tokens: torch.Tensor, *, tp: int = 1,
                   pp: int = 1, ep: int = 1, pg_collection=None) -> torch.Tensor:
    from megatron_rl.trainer.config import (  # torch + megatron: trainer only
        ParallelConfig,
        TrainerConfig,
    )
    from megatron_rl.trainer.trainer import MegatronTrainer

    config = TrainerConfig(parallel=ParallelConfig(tensor_parallel=tp, pipeline_parallel=pp, expert_parallel=ep),
                           micro_batch_size=tokens.shape[0], vocab_divisible_by=1)
    trainer = MegatronTrainer(arch, config, pg_collection=pg_collection, hf_state=state, frozen=True)
    return trainer.compute_logits(TrainBatch(tokens=tokens, loss_mask=torch.zeros(tokens.shape)))


def _parallel_worker(rank, world_size, jobs):
    """On each of 2 gloo ranks: the trainer's logits for every (arch, state, tokens, tp, pp) job."""
    torch.set_num_threads(1)
    results = [trainer_logits(arch, state, tokens, tp=tp, pp=pp) for arch, state, tokens, tp, pp in jobs]
    return results if rank == 0 else None


def convert_round_trip(model, arch: ModelArch, tokens: torch.Tensor, workdir: str) -> float:
    """HF dir (save_pretrained) -> Megatron TP=2 x PP=2 (or what divides) -> HF dir, reloaded both by us and by
    transformers: the max |difference| of the tensors and of transformers' logits (0.0 = bit-exact)."""
    import transformers  # the reference loader, see hf_model

    source, megatron_dir, back_dir = (os.path.join(workdir, d) for d in ("hf", "megatron", "back"))
    model.save_pretrained(source)
    tp = 2 if arch.num_query_groups % 2 == 0 else 1
    pp = 2 if arch.num_layers % 2 == 0 else 1
    convert(source, megatron_dir, to="megatron", tp=tp, pp=pp)
    convert(megatron_dir, back_dir, to="hf")
    # our reader's view of both directories (MoE experts: transformers 5 fuses them in memory, the files
    # keep the published per-expert names); transformers' logits on the export are the independent check
    original = load_pretrained(source).state
    back = load_pretrained(back_dir)
    if back.arch != arch or set(back.state) != set(original):
        return math.inf
    worst = 0.0
    for name, tensor in back.state.items():
        worst = max(worst, (tensor - original[name]).abs().max().item())
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(back_dir, dtype=torch.float32,
                                                                 attn_implementation="eager").eval()
    if type(reloaded) is not type(model):
        return math.inf
    with torch.no_grad():
        worst = max(worst, (reloaded(tokens[:, :-1]).logits - model(tokens[:, :-1]).logits).abs().max().item())
    return worst


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item() if a.shape == b.shape else math.inf


def parity_matrix(cases=CASES, *, engine: bool = True, parallel: bool = True, round_trip: bool = True,
                  log=print) -> list[dict[str, Any]]:
    """One dict per case: the measured columns (None where not run for that case)."""
    rows, jobs, job_of = [], [], {}
    built = []
    for case in cases:
        model, arch, state = case_model(case)
        tokens = case_tokens(case, arch)
        expected = reference_logits(model, tokens)
        row: dict[str, Any] = {"case": case.name, "family": arch.family, "tp1": None, "tp2": None, "pp2": None,
                               "convert": None, "engine_greedy": None, "engine_logprob": None}
        row["tp1"] = _max_diff(trainer_logits(arch, state, tokens), expected)
        if parallel and not case.long:
            job_of[(case.name, "tp2")] = len(jobs)
            jobs.append((arch, state, tokens, 2, 1))
            if case.pipeline:
                job_of[(case.name, "pp2")] = len(jobs)
                jobs.append((arch, state, tokens, 1, 2))
        if round_trip and not case.long:
            with tempfile.TemporaryDirectory() as workdir:
                row["convert"] = convert_round_trip(model, arch, tokens, workdir)
        if engine:
            prompts = [tokens[0, :LONG_POSITIONS].tolist()] if case.long else None
            equal, worst = engine_parity(model, arch, state, prompts=prompts, max_new_tokens=16 if case.long else 64)
            row["engine_greedy"], row["engine_logprob"] = equal, worst
        rows.append(row)
        built.append(expected)
        log(f"  {case.name}: done")
    if jobs:
        results = run_distributed(_parallel_worker, 2, jobs)[0]
        for (name, column), index in job_of.items():
            i = next(k for k, r in enumerate(rows) if r["case"] == name)
            rows[i][column] = _max_diff(results[index], built[i])
    return rows


def format_table(rows: list[dict[str, Any]]) -> str:
    def cell(value) -> str:
        if value is None:
            return "-"
        if isinstance(value, bool):
            return "identical" if value else "DIFFERENT"
        return f"{value:.1e}" if value else "0"

    header = ("case", "family", "trainer TP=1", "trainer TP=2", "trainer PP=2", "convert round trip",
              "engine greedy", "engine log-prob")
    keys = ("case", "family", "tp1", "tp2", "pp2", "convert", "engine_greedy", "engine_logprob")
    table = [header] + [tuple(r[k] if k in ("case", "family") else cell(r[k]) for k in keys) for r in rows]
    widths = [max(len(line[i]) for line in table) for i in range(len(header))]
    return "\n".join("  ".join(v.ljust(w) for v, w in zip(line, widths)) for line in table)


def failures(rows: list[dict[str, Any]]) -> list[str]:
    bad = []
    for r in rows:
        for key in ("tp1", "tp2", "pp2", "engine_logprob"):
            if r[key] is not None and not r[key] <= TOLERANCE:
                bad.append(f"{r['case']}: {key} {r[key]:.2e} > {TOLERANCE}")
        if r["convert"] is not None and r["convert"] != 0.0:
            bad.append(f"{r['case']}: convert round trip is not bit-exact ({r['convert']:.2e})")
        if r["engine_greedy"] is False:
            bad.append(f"{r['case']}: engine greedy tokens differ from transformers")
    return bad


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--only", action="append", default=None, help="run only cases whose name contains this")
    parser.add_argument("--no-engine", action="store_true", help="skip the native engine columns")
    parser.add_argument("--no-parallel", action="store_true", help="skip TP=2 / PP=2 (2 gloo processes)")
    parser.add_argument("--no-long", action="store_true", help=f"skip the {LONG_POSITIONS}-position rows")


def run(args: argparse.Namespace) -> int:
    cases = [c for c in CASES if (not args.only or any(o in c.name for o in args.only))
             and not (args.no_long and c.long)]
    if not cases:
        names = ", ".join(c.name for c in CASES)
        raise ConfigError(f"--only {args.only} matches no case (cases: {names})")
    # progress on stderr, so stdout is the table alone
    rows = parity_matrix(cases, engine=not args.no_engine, parallel=not args.no_parallel,
                         log=lambda line: print(line, file=sys.stderr, flush=True))
    print(format_table(rows))
    bad = failures(rows)
    for line in bad:
        print("FAIL " + line)
    print(f"tolerance {TOLERANCE:g} on logits / log-probs (fp32); round trip must be bit-exact: "
          f"{'all pass' if not bad else f'{len(bad)} failure(s)'}")
    return 1 if bad else 0
