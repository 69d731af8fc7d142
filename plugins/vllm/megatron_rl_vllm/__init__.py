"""megatron_rl's plugin for vLLM (loaded by vLLM in every one of its processes through the
`vllm.general_plugins` entry point): registers the `gloo` weight-transfer backend, so that
`--weight-transfer-config '{"backend": "gloo"}'` gives vLLM's own weight-transfer API
(`/init_weight_transfer_engine`, `/start_weight_update`, `/update_weights`, `/finish_weight_update`) a
transport on machines without NCCL (CPU builds). The trainer's side is megatron_rl/rollout/vllm_transfer.py.
"""

BACKEND = "gloo"


def register() -> None:
    """vLLM's plugin hook; vLLM may call it more than once in a process."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    try:
        WeightTransferEngineFactory.register_engine(BACKEND, "megatron_rl_vllm.gloo_transfer",
                                                    "GlooWeightTransferEngine")
    except ValueError:  # registered by an earlier call in this process
        pass
