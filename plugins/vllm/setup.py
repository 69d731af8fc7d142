"""megatron-rl-vllm: megatron_rl's plugin for vLLM, installed into vLLM's own environment (docs/vllm.md).

scripts/setup_vllm_cpu.sh installs it there; on a cluster: `pip install --no-deps ./plugins/vllm` with vLLM's
Python. It needs only what vLLM already has (torch, vllm); megatron_rl itself is never imported there.
"""
from setuptools import setup

setup(
    name="megatron-rl-vllm",
    version="0.1.0",
    description="megatron_rl's vLLM plugin: the gloo weight-transfer backend (trainer -> vLLM workers over TCP)",
    python_requires=">=3.10",
    packages=["megatron_rl_vllm"],
    entry_points={"vllm.general_plugins": ["megatron_rl = megatron_rl_vllm:register"]},
)
