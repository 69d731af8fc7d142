"""RL algorithms as small pure functions: advantage estimators and policy losses (registered by name).

The loop calls, per global batch:

    adv = compute_advantages(rewards [N], group_ids, AdvantageConfig(...))   # sequence advantages
    batch.advantages = token_advantages(adv, batch.loss_mask)                # [B, S]
    normalizer = compute_normalizer(batch.loss_mask, loss_config)            # over the GLOBAL batch
    trainer.train_step(batch, make_loss_fn(loss_config, normalizer))
"""
from megatron_rl.algorithms.advantages import (
    ADVANTAGE_ESTIMATORS,
    AdvantageConfig,
    compute_advantages,
    grpo_advantages,
    group_index,
    reinforce_pp_advantages,
    rloo_advantages,
    token_advantages,
)
from megatron_rl.algorithms.losses import (
    LOSSES,
    LossConfig,
    aggregate,
    aipo_loss,
    compute_normalizer,
    get_loss,
    kl_penalty,
    make_loss_fn,
    pg_loss,
    policy_loss,
    ppo_clip_loss,
    register_loss,
    tis_loss,
)

__all__ = [
    "ADVANTAGE_ESTIMATORS", "AdvantageConfig", "compute_advantages", "grpo_advantages", "group_index",
    "reinforce_pp_advantages", "rloo_advantages", "token_advantages",
    "LOSSES", "LossConfig", "aggregate", "aipo_loss", "compute_normalizer", "get_loss", "kl_penalty",
    "make_loss_fn", "pg_loss", "policy_loss", "ppo_clip_loss", "register_loss", "tis_loss",
]
