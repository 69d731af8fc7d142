"""Rollout engines behind one interface (`engine.RolloutEngine`): the native PyTorch engine (`native/`),
the SGLang adapter (`sglang_engine.py`, imports sglang only when constructed), the HTTP client of
`megatron-rl serve` and SGLang servers (`client.py`), replicas behind one engine (`pool.py`), the HTTP
server (`server.py`), and the configuration of all of it (`config.py`, importable without torch)."""
