"""megatron_rl: asynchronous RL post-training of LLMs on native PyTorch (after Meta's LlamaRL).

The top-level folders `kernels/` and `checkpoints_tools/` are installed under the `megatron_rl`
namespace (`megatron_rl.kernels`, `megatron_rl.checkpoints_tools`): the bare name `kernels` is taken
on PyPI.
"""
from setuptools import find_packages, setup

library_packages = find_packages(include=["megatron_rl", "megatron_rl.*"])

setup(
    name="megatron-rl",
    version="0.1.0",
    description="Asynchronous RL post-training for LLMs: Megatron-core trainers, native and SGLang rollout engines",
    python_requires=">=3.10",
    packages=library_packages + ["megatron_rl.kernels", "megatron_rl.checkpoints_tools"],
    package_data={"megatron_rl.sim": ["hardware.yaml"]},
    package_dir={
        "megatron_rl.kernels": "kernels",
        "megatron_rl.checkpoints_tools": "checkpoints_tools",
    },
    install_requires=[
        # A range, not a pin: GPU users bring their own CUDA build. CPU installs pin torch==2.13.0
        # explicitly (README, .ci/run) because a bare requirement pulls a multi-GB CUDA wheel.
        "torch>=2.4,<3",
        "megatron-core>=0.13,<0.20",
        "numpy",
        "gguf>=0.10",
        "tokenizers>=0.19",
        "safetensors>=0.4",
        "jinja2>=3.1",
        "pyyaml>=6",
        "wandb>=0.17",
        "tqdm>=4.60",
        "matplotlib>=3.7",
        "sympy>=1.12",
        "math-verify>=0.7",
        # reasoning-gym (task generators + scorers) is installed with --no-deps by scripts/setup_cpu.sh:
        # its declared dependencies are puzzle libraries the tasks we use never import.
    ],
    extras_require={
        # Never list "apex": the PyPI package of that name is an unrelated web toolkit.
        "gpu": ["transformer-engine[pytorch]", "sglang", "triton"],
        # triton in dev: its kernels are tested on CPU through the interpreter (TRITON_INTERPRET=1).
        "dev": ["pytest>=8", "import-linter>=2.1", "transformers>=4.45", "accelerate>=0.30", "pyarrow>=14",
                "triton>=3.0; platform_system == 'Linux'"],
        "parquet": ["pyarrow>=14"],
    },
    entry_points={"console_scripts": ["megatron-rl=megatron_rl.cli:main"]},
)
