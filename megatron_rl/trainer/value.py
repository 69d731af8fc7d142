"""PCL's value model V(x): a Megatron GPTModel whose final hidden state at the last prompt token goes
through a scalar head, trained by regression on the policy's own rollouts (Gao, Kim, Sun et al. 2025,
arXiv 2510.01135; loss in `megatron_rl.algorithms.pcl.value_loss`).

    value = ValueTrainer(arch, ValueModelConfig(), hf_state=policy_state, pg_collection=policy.pg)
    v = value.predict([prompt_ids, ...])                    # [N] predicted mean reward, one forward pass
    metrics = value.update([prompt_ids, ...], targets)      # one optimizer step on (V - target)^2

It is a `MegatronTrainer` (same model building, DDP, optimizer, schedules, TP/PP) whose network is the
GPTModel plus a scalar `value_head` (`ValueHead`) on the last pipeline stage. Head choice: a sigmoid,
so V lies in (0, 1) like the 0/1 (or partial-credit) rewards it predicts; `head: linear` for unbounded
rewards. The head starts at weight 0 and bias 0 (every prompt predicted 0.5, the target difficulty)
and has its own learning rate: with Adam, a 1e-5 step on one bias moves the prediction by ~1e-5, far
too slow to follow a policy that changes every step.

Why V learned slowly with a plain Linear head on the raw state (measured: explained variance -0.5..0
over a 12-step run, candidates' V within +-0.03 of each other while realised rewards spread 0..1):
the state after the last prompt token is that of the chat template's closing tokens, the same for
every prompt, so its prompt-independent part dwarfs the prompt-dependent part (SmolLM2-135M, 10
layers, arithmetic prompts: the mean state's norm is 13x a prompt's mean deviation from it, mean
pairwise cosine 0.993). A zero-initialised head moved
by Adam (every coordinate ~lr per step) then mostly moves the shared component, i.e. all predictions
together, and learns the per-prompt differences that selection needs only after many steps. Fixes,
each optional in `ValueModelConfig` (paper: a regression head, details unspecified):
- `standardize_features`: the head reads (h - mean) / std with running per-feature statistics of
  the states it is trained on (BatchNorm's running statistics, no affine), so its weights see only
  what distinguishes prompts, at unit scale, and one Adam step moves V(x) by a useful amount;
- `mean_reward_prior`: the head's logit is offset by logit(mean target of the batch it was last
  trained on) (linear head: that mean), a fixed, not learned, baseline; the learned part is the
  per-prompt residual. A learned bias at Adam's rate (~head_lr per step in logit space) takes
  hundreds of steps to follow a mean reward moving from 0.1 to 0.6 as the policy learns.

Its checkpoints (`shard_state` / `load_shard`) are the backbone's Megatron shards plus `value_head.*`
on the last stage; `load_hf_state` loads a backbone (policy or pretrained weights) and keeps the head.

Prompt batches reuse `TrainBatch`: row b is the prompt's tokens followed by one pad token, and
loss_mask[b, P_b] = 1 marks the position after the prompt; the value is read from the hidden state
that predicts that position, i.e. the state after the last prompt token (the model's input is
tokens[:, :-1], so the extra pad keeps the last prompt token inside it).
"""
from __future__ import annotations

import dataclasses
import math

import torch
from megatron.core.optimizer import get_standard_config_overrides
from megatron.core.optimizer.optimizer_config import ParamKey
from megatron.core.optimizer_param_scheduler import ParamGroupOverride

from megatron_rl.algorithms.losses import clipped_value_loss
from megatron_rl.algorithms.pcl import value_loss
from megatron_rl.models.arch import ModelArch
from megatron_rl.models.megatron_layout import hf_to_megatron
from megatron_rl.models.pretrained import load_pretrained
from megatron_rl.trainer import cpu_compat
from megatron_rl.trainer.config import CriticConfig, ValueModelConfig
from megatron_rl.trainer.trainer import MegatronTrainer
from megatron_rl.types import TrainBatch


def truncate_layers(arch: ModelArch, state: dict[str, torch.Tensor], num_layers: int,
                    ) -> tuple[ModelArch, dict[str, torch.Tensor]]:
    """The first `num_layers` blocks of an HF-named Llama state (embeddings and final norm kept)."""
    if num_layers == 0 or num_layers == arch.num_layers:
        return arch, state
    if num_layers > arch.num_layers:
        raise ValueError(f"value.num_layers={num_layers} exceeds the model's {arch.num_layers} layers")
    kept = {}
    for name, tensor in state.items():
        if name.startswith("model.layers."):
            if int(name.split(".")[2]) >= num_layers:
                continue
        kept[name] = tensor
    return dataclasses.replace(arch, num_layers=num_layers), kept


class ValueHead(torch.nn.Module):
    """The scalar head: logit = weight . standardise(h) + bias + prior (module docstring).

    Parameters `weight` [1, H] and `bias` [1] (as a Linear's, zero-initialised). Its `statistics`
    (`feature_mean`, `feature_var` [H] and `feature_count`: running statistics of the states the head
    was trained on, merged exactly with Chan et al.'s parallel variance; `prior`: the baseline logit)
    are float64 CPU tensors outside the module's buffers, so bf16 casts (Float16Module) and the
    optimizer's master weights leave them alone; `ValueTrainer.shard_state` saves them with the head.
    Statistics are folded in by `observe_features` only, never while predicting, so V(x) does not
    depend on which other prompts are scored with x."""

    STATISTICS = ("feature_mean", "feature_var", "feature_count", "prior")

    def __init__(self, hidden_size: int, dtype: torch.dtype, *, standardize: bool, bias: bool = True):
        super().__init__()
        self.standardize = standardize
        self.weight = torch.nn.Parameter(torch.zeros(1, hidden_size, dtype=dtype))
        # no bias: a Bradley-Terry head (transformers' `score` layer has none; a pairwise loss cannot train one)
        self.bias = torch.nn.Parameter(torch.zeros(1, dtype=dtype)) if bias else None
        self.statistics = {"feature_mean": torch.zeros(hidden_size, dtype=torch.float64),
                           "feature_var": torch.ones(hidden_size, dtype=torch.float64),
                           "feature_count": torch.zeros((), dtype=torch.float64),
                           "prior": torch.zeros((), dtype=torch.float64)}

    @torch.no_grad()
    def observe_features(self, states: torch.Tensor) -> None:
        """Merge a batch of states [b, H] into the running mean and (population) variance."""
        if not self.standardize or states.shape[0] == 0:
            return
        stats = self.statistics
        states = states.detach().to("cpu", torch.float64)
        count, previous = float(states.shape[0]), float(stats["feature_count"])
        total = previous + count
        batch_mean, batch_var = states.mean(0), states.var(0, unbiased=False)
        delta = batch_mean - stats["feature_mean"]
        if previous == 0:
            stats["feature_mean"].copy_(batch_mean)
            stats["feature_var"].copy_(batch_var)
        else:
            stats["feature_var"].copy_((stats["feature_var"] * previous + batch_var * count
                                        + delta.pow(2) * previous * count / total) / total)
            stats["feature_mean"].add_(delta * count / total)
        stats["feature_count"].fill_(total)

    def forward(self, states: torch.Tensor) -> torch.Tensor:
        """[b] float32 logits of states [b, H]."""
        stats = self.statistics
        states = states.to(self.weight.dtype)
        if self.standardize and float(stats["feature_count"]) > 0:
            mean = stats["feature_mean"].to(states.device, torch.float32)
            std = (stats["feature_var"] + STANDARDIZE_EPS).sqrt().to(states.device, torch.float32)
            states = ((states.float() - mean) / std).to(self.weight.dtype)
        logit = states @ self.weight.t()
        if self.bias is not None:
            logit = logit + self.bias
        logit = logit.squeeze(-1).float()
        return logit + float(stats["prior"])


STANDARDIZE_EPS = 1e-5
"""Added to the running variance before the square root (a feature constant over the batches seen)."""


class ValueNetwork(torch.nn.Module):
    """GPTModel (returning final hidden states) plus the scalar `value_head` on the last stage."""

    def __init__(self, gpt, hidden_size: int, with_head: bool, standardize: bool = False, bias: bool = True):
        super().__init__()
        self.gpt = gpt
        self.config = gpt.config
        self.model_type = gpt.model_type  # Megatron's schedules read these from the wrapped module
        self.value_head = None
        if with_head:
            self.value_head = ValueHead(hidden_size, gpt.config.params_dtype, standardize=standardize, bias=bias)

    def set_input_tensor(self, input_tensor) -> None:
        self.gpt.set_input_tensor(input_tensor)

    def forward(self, input_ids, position_ids, attention_mask, **kwargs):
        return self.gpt(input_ids, position_ids, attention_mask, **kwargs)


class ValueTrainer(MegatronTrainer):
    """V(x) on the policy trainer's ranks: `predict` prompts, `update` on observed mean rewards."""

    def __init__(self, arch: ModelArch, config: ValueModelConfig, *, hf_state: dict[str, torch.Tensor],
                 pg_collection=None):
        self.value_config = config
        arch, hf_state = truncate_layers(arch, hf_state, config.num_layers)
        super().__init__(arch, config.trainer, pg_collection=pg_collection, hf_state=hf_state)

    def _network(self, gpt):
        self.network = ValueNetwork(gpt, self.arch.hidden_size, with_head=self.is_last_stage,
                                    standardize=self.value_config.standardize_features)
        return self.network

    def _param_group_overrides(self, opt_config):
        head_lr, backbone_lr = self.value_config.head_lr, self.config.lr
        overrides = dict(get_standard_config_overrides(config=opt_config) or {})
        if head_lr == backbone_lr:
            return overrides or None  # one schedule for all: the head joins the backbone's groups
        # The scheduler reads max_lr/min_lr. lr_mult (the head's rate as a multiple of the backbone's)
        # changes no rate in Megatron; it is part of the key that matches saved param groups to the
        # optimizer's on checkpoint load, where groups differing only in max_lr would be confused.
        overrides[ParamKey(name="*value_head*")] = ParamGroupOverride(
            max_lr=head_lr, min_lr=head_lr, lr_mult=head_lr / backbone_lr if backbone_lr > 0 else math.inf)
        return overrides

    # --- batches ----------------------------------------------------------------------------------
    def prompt_batch(self, prompts: list[list[int]], targets: torch.Tensor | None = None,
                     pad_token_id: int = 0) -> TrainBatch:
        """Prompts -> TrainBatch (module docstring); `targets` go to advantages[b, P_b]. Rows are padded
        to a multiple of the micro-batch size with zero-mask rows (they never enter the loss)."""
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("the value model needs non-empty prompts")
        micro = self.config.micro_batch_size
        rows = -(-len(prompts) // micro) * micro
        width = max(len(p) for p in prompts) + 1
        tokens = torch.full((rows, width), pad_token_id, dtype=torch.long)
        mask = torch.zeros(rows, width)
        values = torch.zeros(rows, width)
        for b, ids in enumerate(prompts):
            tokens[b, :len(ids)] = torch.tensor(ids)
            mask[b, len(ids)] = 1.0
            if targets is not None:
                values[b, len(ids)] = float(targets[b])
        return TrainBatch(tokens=tokens, loss_mask=mask, advantages=values if targets is not None else None)

    def _states(self, hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """[b, H] each row's state after its prompt (hidden[b, P_b - 1], P_b the marked position)."""
        position = (mask.to(hidden.device).argmax(dim=-1) - 1).clamp(min=0)
        return hidden[torch.arange(hidden.shape[0], device=hidden.device), position]

    def _values(self, states: torch.Tensor) -> torch.Tensor:
        """[b] V of states [b, H]."""
        logit = self.network.value_head(states)
        return torch.sigmoid(logit) if self.value_config.head == "sigmoid" else logit

    def _set_prior(self, targets: torch.Tensor) -> None:
        """The head's baseline logit from the mean of the targets it is about to be trained on
        (`mean_reward_prior`): logit of the mean, clipped to [PRIOR_CLIP, 1 - PRIOR_CLIP], for a sigmoid
        head (all-0 or all-1 targets would give an infinite logit), the mean itself for a linear one."""
        if not self.value_config.mean_reward_prior or self.network.value_head is None:
            return
        mean = float(targets.mean())
        if self.value_config.head == "sigmoid":
            mean = min(max(mean, PRIOR_CLIP), 1 - PRIOR_CLIP)
            mean = math.log(mean / (1 - mean))
        self.network.value_head.statistics["prior"].fill_(mean)

    # --- weights: the backbone plus the head ------------------------------------------------------
    def shard_state(self) -> dict[str, torch.Tensor]:
        """This rank's Megatron-named backbone weights plus, on the last stage, `value_head.weight`,
        `value_head.bias` and the head's statistics `value_head.feature_mean` ... (`ValueHead`): what a
        checkpoint of the value model must hold."""
        state = super().shard_state()
        head = self.network.value_head
        if head is not None:
            state.update({f"{HEAD}.{k}": v for k, v in head.state_dict().items()})
            state.update({f"{HEAD}.{k}": v.clone() for k, v in head.statistics.items()})
        return state

    def load_shard(self, shard: dict[str, torch.Tensor]) -> None:
        """Inverse of `shard_state`: the head is required on the last stage (a checkpoint without it is
        not a value model's)."""
        head = {k[len(HEAD) + 1:]: v for k, v in shard.items() if k.startswith(HEAD + ".")}
        if (self.network.value_head is not None) != bool(head):
            raise ValueError(f"value model weights (tp={self.tp_rank}, pp={self.pp_rank}): "
                             + ("the scalar head is missing" if not head else "a scalar head on a non-last stage"))
        if head:
            statistics = {k: head.pop(k) for k in ValueHead.STATISTICS if k in head}
            missing = [k for k in ValueHead.STATISTICS if k not in statistics]
            if missing:
                raise ValueError(f"value model weights (tp={self.tp_rank}, pp={self.pp_rank}): the scalar head's "
                                 f"statistics {missing} are missing (a checkpoint of an older value model?)")
            with torch.no_grad():
                self.network.value_head.load_state_dict(head)
                for k, v in statistics.items():
                    self.network.value_head.statistics[k].copy_(v.to(torch.float64))
        super().load_shard({k: v for k, v in shard.items() if not k.startswith(HEAD + ".")})

    def load_hf_state(self, hf_state: dict[str, torch.Tensor]) -> None:
        """HF-named backbone weights (a policy's or a pretrained model's); the head is left as it is."""
        stage = hf_to_megatron(hf_state, self.layout)[self.pp_rank]
        super().load_shard(stage[self.layout.shard_index(self.tp_rank, self.ep_rank)])

    # --- executor operations ----------------------------------------------------------------------
    @torch.no_grad()
    def predict(self, prompts: list[list[int]], pad_token_id: int = 0) -> torch.Tensor:
        """[N] float32 V(x) of each prompt (CPU, on every rank of this replica), one forward pass.

        Prompts are ordered by length and each micro-batch is cut after its longest prompt, so padding
        costs little (prompts of a mixture differ in length by up to ~2x); V does not depend on the
        order or the padding (the state after each prompt's last token is read)."""
        order = _by_length(prompts)
        batch = self.prompt_batch([prompts[i] for i in order], pad_token_id=pad_token_id)

        def on_hidden(hidden, tokens, mb):
            return hidden.new_zeros(()), {"values": self._values(self._states(hidden, mb.loss_mask))}

        with cpu_compat.redirect_cuda_to_cpu():
            result = self._forward_only(batch, on_hidden, "values", trim=True)
            values = self._broadcast_from_last_stage(result, (batch.batch_size,), torch.float32)[:len(prompts)]
        return values[_inverse(order)]

    def update(self, prompts: list[list[int]], targets: torch.Tensor, pad_token_id: int = 0) -> dict[str, float]:
        """`updates_per_step` optimizer steps of sum_i (V(x_i) - target_i)^2 / N over these prompts
        (ordered by length and trimmed per micro-batch, like `predict`; the loss is a sum over prompts,
        so the order does not change it). Before the first step the head's prior is set from the
        targets' mean and, in the first step's forward pass, the prompts' states are folded into the
        feature statistics (each batch once, however many steps). Metrics: value/loss (of the first
        step, i.e. of the predictions before this update, with the new prior and statistics),
        value/loss_after (of the last step, before its own update), value/grad_norm, value/update_time."""
        order = _by_length(prompts)
        targets = torch.as_tensor(targets, dtype=torch.float32)
        batch = self.prompt_batch([prompts[i] for i in order], targets[order], pad_token_id=pad_token_id)
        count = len(prompts)
        self._set_prior(targets)
        fold = [True]

        def head_loss(hidden, tokens, mb):
            rows = (mb.loss_mask.sum(-1) > 0).to(hidden.device)  # padding rows filling a micro-batch carry no target
            states = self._states(hidden, mb.loss_mask)[rows]
            if fold[0]:
                self.network.value_head.observe_features(states)
            predicted = self._values(states)
            target = (mb.advantages * mb.loss_mask).sum(-1).to(hidden.device)[rows]
            return value_loss(predicted, target, normalizer=count), {}

        steps: list[dict[str, float]] = []
        for _ in range(self.value_config.updates_per_step):
            steps.append(self.train_step_on_hidden(batch, head_loss, trim=True))
            fold[0] = False
        return {"value/loss": steps[0]["train/loss"], "value/loss_after": steps[-1]["train/loss"],
                "value/grad_norm": steps[-1]["train/grad_norm"],
                "value/update_time": sum(m["perf/train_step_time"] for m in steps)}


PRIOR_CLIP = 0.02
"""The mean target is clipped to [PRIOR_CLIP, 1 - PRIOR_CLIP] before its logit (sigmoid head)."""

HEAD = "value_head"
"""Name prefix of the scalar head's tensors in `ValueTrainer.shard_state` (and its checkpoints)."""


def _by_length(prompts: list[list[int]]) -> list[int]:
    """Prompt indices, shortest first (stable: equal lengths keep their order)."""
    return sorted(range(len(prompts)), key=lambda i: len(prompts[i]))


def _inverse(order: list[int]) -> torch.Tensor:
    inverse = torch.empty(len(order), dtype=torch.long)
    inverse[torch.tensor(order, dtype=torch.long)] = torch.arange(len(order))
    return inverse


# --- PPO's critic: V(s_t) at every token ---------------------------------------------------------------

class CriticTrainer(ValueTrainer):
    """PPO's token-level critic on the policy's ranks: the same backbone and scalar head as the value
    model above (a linear head, no feature statistics, no prior), read at every position instead of after
    the prompt. V[b, t] is the value of the state before token t of row b, i.e. of hidden[b, t - 1], which
    is token-aligned with the trainer's log-probs (entry t predicts token t; column 0 has no value).

        critic = CriticTrainer(arch, CriticConfig(), hf_state=policy_state, pg_collection=policy.pg)
        values = critic.token_values(batch)                           # [B, S], every rank of the replica
        metrics = critic.update(share)                                # share.values, .returns: [B, S]
    """

    def __init__(self, arch: ModelArch, config: CriticConfig, *, hf_state: dict[str, torch.Tensor],
                 pg_collection=None):
        self.critic_config = config
        super().__init__(arch, ValueModelConfig(init_from=config.init_from, head="linear", head_lr=config.head_lr,
                                                updates_per_step=config.updates_per_step,
                                                standardize_features=False, mean_reward_prior=False,
                                                trainer=config.trainer),
                         hf_state=hf_state, pg_collection=pg_collection)

    def _token_values(self, hidden: torch.Tensor) -> torch.Tensor:
        """[b, S] float32 values from hidden states [b, S-1, H] (column 0: no state before it, 0)."""
        values = self._values(hidden)
        return torch.cat([values.new_zeros(values.shape[0], 1), values], dim=1)

    @torch.no_grad()
    def token_values(self, batch: TrainBatch) -> torch.Tensor:
        """[B, S] float32 V of the state before each token (0 in column 0), on every rank of this replica."""
        def on_hidden(hidden, tokens, mb):
            return hidden.new_zeros(()), {"values": self._token_values(hidden)}

        with cpu_compat.redirect_cuda_to_cpu():
            result = self._forward_only(batch, on_hidden, "values")
            return self._broadcast_from_last_stage(result, (batch.batch_size, batch.seq_length), torch.float32)

    def update(self, batch: TrainBatch, normalizer: float) -> dict[str, float]:
        """`updates_per_step` optimizer steps of the clipped value loss (algorithms/losses.py:
        clipped_value_loss) on this data-parallel rank's rows: `batch.returns` are the targets,
        `batch.values` the values the step's advantages came from (the clip's centre), `batch.loss_mask`
        the token steps; `normalizer` the global count of loss tokens. Metrics under critic/."""
        if batch.values is None or batch.returns is None:
            raise ValueError("the critic's update needs the batch's values and returns")

        def head_loss(hidden, tokens, mb):
            values = self._token_values(hidden)
            return clipped_value_loss(values, mb.values.to(values.device), mb.returns.to(values.device),
                                      mb.loss_mask.to(values.device), self.critic_config.value_clip, normalizer)

        steps = [self.train_step_on_hidden(batch, head_loss, trim=True)
                 for _ in range(self.critic_config.updates_per_step)]
        first, last = steps[0], steps[-1]
        return {"critic/value_loss": first["train/value_loss"], "critic/value_clip_frac": first["train/value_clip_frac"],
                "critic/value_loss_after": last["train/value_loss"], "critic/grad_norm": last["train/grad_norm"],
                "critic/update_skipped": last["train/update_skipped"],
                "critic/update_time": sum(m["perf/train_step_time"] for m in steps)}


def initial_weights(init_from: str, policy_arch: ModelArch, policy_state: dict[str, torch.Tensor], field: str,
                    ) -> tuple[ModelArch, dict[str, torch.Tensor]]:
    """A value model's starting backbone: the policy's own (`init_from: policy`) or a model path's, whose
    vocabulary must be the policy's (the value model reads the policy's tokens)."""
    if init_from == "policy":
        return policy_arch, policy_state
    source = load_pretrained(init_from)
    if source.arch.vocab_size != policy_arch.vocab_size:
        raise ValueError(f"{field}={init_from!r}: vocabulary {source.arch.vocab_size} differs from the policy's "
                         f"{policy_arch.vocab_size} (the value model reads the policy's tokens)")
    return source.arch, source.state
