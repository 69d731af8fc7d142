"""Sparse upcycling: a dense decoder turned into a mixture-of-experts model of the same attention (docs/moe.md).

Recipe (`upcycle`, `megatron-rl convert SOURCE OUT --to hf --upcycle-experts E --upcycle-top-k K`):
- Architecture: a Llama / Mistral model (SmolLM2 included) becomes a Mixtral-family model, a Qwen3 model a
  Qwen3-MoE one (top-k weights renormalized); attention, norms, embeddings and RoPE are kept as they are.
- Experts: every expert of layer i is a copy of layer i's dense MLP (gate, up, down).
- Router: W_r ~ N(0, router_std^2), default std 0.02 (the usual initializer range of both families). Small
  random logits spread the tokens over all experts (a zero router would tie every expert and send every
  token to experts 0..k-1, leaving the others untrained) while keeping the routing probabilities soft.
- Output at init: with identical experts and renormalized top-k weights a layer computes
  sum_k w_k * MLP(x) = MLP(x), so the upcycled model computes the dense model's function (up to float
  rounding of the weighted sum) whatever the router says.
- Symmetry breaking: experts diverge in training because each receives a different subset of the tokens.
  The router itself gets no gradient from the language-modelling loss while the experts are identical
  (its weights only scale one shared output by sum_k w_k = 1), only from the load-balancing loss; so
  `expert_noise` (default 0) can perturb each expert's weights multiplicatively, W * (1 + noise * N(0, 1)),
  which gives the router a gradient from the first step at the cost of leaving the dense function by a
  relative ~noise. 0 keeps the exact dense function at init.
"""
from __future__ import annotations

import dataclasses

import torch

from megatron_rl.config import ConfigError, require
from megatron_rl.models.arch import ModelArch
from megatron_rl.models.families import get_family, hf_expert_names, hf_router_name

# dense family -> the MoE family whose attention is the same
UPCYCLE_FAMILY = {"llama": "mixtral", "mistral": "mixtral", "qwen3": "qwen3_moe"}


@dataclasses.dataclass(frozen=True, kw_only=True)
class UpcycleRecipe:
    """How a dense model is upcycled (module docstring)."""

    num_experts: int = 4
    """Experts per layer, each a copy of the layer's dense MLP."""
    top_k: int = 2
    """Experts each token is routed to."""
    router_std: float = 0.02
    """Standard deviation of the random router weights."""
    expert_noise: float = 0.0
    """Relative multiplicative noise on each expert's copy (0: identical experts, the dense function)."""
    seed: int = 0
    """Seed of the router weights and the expert noise."""

    def __post_init__(self) -> None:
        require(self.num_experts >= 2, "upcycle.num_experts", f"must be >= 2, got {self.num_experts}")
        require(1 <= self.top_k <= self.num_experts, "upcycle.top_k",
                f"must be in 1..num_experts={self.num_experts}, got {self.top_k}")
        require(self.router_std >= 0, "upcycle.router_std", f"must be >= 0, got {self.router_std}")
        require(self.expert_noise >= 0, "upcycle.expert_noise", f"must be >= 0, got {self.expert_noise}")


def upcycle_arch(arch: ModelArch, recipe: UpcycleRecipe) -> ModelArch:
    """The MoE architecture of an upcycled `arch` (same attention; experts of the dense MLP's width)."""
    if arch.is_moe:
        raise ConfigError(f"upcycling needs a dense model; this {arch.family} model already has "
                          f"{arch.num_experts} experts", field="num_experts")
    family = UPCYCLE_FAMILY.get(arch.family)
    if family is None:
        raise ConfigError(f"upcycling a {arch.family} model is not supported (supported: "
                          f"{', '.join(UPCYCLE_FAMILY)}: no MoE family has its attention)", field="family")
    return dataclasses.replace(arch, family=family, num_experts=recipe.num_experts, moe_top_k=recipe.top_k,
                               moe_ffn_hidden_size=arch.ffn_hidden_size, moe_norm_topk_prob=True)


def upcycle_state(arch: ModelArch, state: dict[str, torch.Tensor],
                  recipe: UpcycleRecipe) -> tuple[ModelArch, dict[str, torch.Tensor]]:
    """(MoE arch, HF-named MoE state with the published per-expert names) of the dense `state`."""
    moe_arch = upcycle_arch(arch, recipe)
    family = get_family(moe_arch.family)
    g = torch.Generator().manual_seed(recipe.seed)
    out = {}
    mlp_names = {f"model.layers.{i}.mlp.{p}_proj.weight"
                 for i in range(arch.num_layers) for p in ("gate", "up", "down")}
    for name, tensor in state.items():
        if name not in mlp_names:
            out[name] = tensor
    for layer in range(arch.num_layers):
        dense = [state.get(f"model.layers.{layer}.mlp.{p}_proj.weight") for p in ("gate", "up", "down")]
        if any(t is None for t in dense):
            raise ConfigError(f"upcycling: the dense model has no MLP weights for layer {layer} "
                              f"('model.layers.{layer}.mlp.gate_proj.weight')")
        router = torch.randn((recipe.num_experts, arch.hidden_size), generator=g) * recipe.router_std
        out[hf_router_name(family, layer)] = router.to(dense[0].dtype)
        for expert in range(recipe.num_experts):
            for name, weight in zip(hf_expert_names(family, layer, expert), dense):
                copy = weight.clone()  # own storage: safetensors refuses tensors that share memory
                if recipe.expert_noise:
                    noise = torch.randn(weight.shape, generator=g) * recipe.expert_noise
                    copy = (copy.float() * (1.0 + noise)).to(weight.dtype)
                out[name] = copy
    return moe_arch, out
