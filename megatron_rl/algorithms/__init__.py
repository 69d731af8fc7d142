"""RL algorithms as small pure functions, each citing its paper (derivations: docs/algorithms.md).

    adv = advantages.compute_advantages(rewards [N], group_ids, AdvantageConfig(...))   # sequence advantages
    batch.advantages = advantages.token_advantages(adv, batch.loss_mask)               # [B, S]
    normalizer = losses.compute_normalizer(batch.loss_mask, loss_config)               # over the GLOBAL batch
    trainer.train_step(batch, losses.make_loss_fn(loss_config, normalizer))

`advantages.py` (GRPO, RLOO, REINFORCE++), `losses.py` (PG, PPO-clip, AIPO, TIS; KL and entropy terms),
`jepo.py` (the JEPO bound), `pcl.py` (PCL's selection and value targets), `waltz.py` (WaltzRL's rewards);
their configuration in `config.py` (importable without torch).
"""
