"""megatron_rl: asynchronous RL post-training of LLMs on native PyTorch (after Meta's LlamaRL).

Everything imports under the one name `megatron_rl`; the kernels live in `megatron_rl/kernels/`, never in
a top-level `kernels/` folder: that name is Hugging Face's `kernels` package, which transformers imports.
"""
from setuptools import find_packages, setup

setup(
    name="megatron-rl",
    version="0.1.0",
    description="Asynchronous RL post-training for LLMs: Megatron-core trainers, native and SGLang rollout engines",
    python_requires=">=3.10",
    packages=find_packages(include=["megatron_rl", "megatron_rl.*"]),
    package_data={"megatron_rl.sim": ["hardware.yaml"], "megatron_rl.kernels": ["cpu_decode.c", "cpu_decode_body.h"]},
    install_requires=[
        # A range, not a pin: GPU users bring their own CUDA build. CPU installs pin torch==2.13.0
        # explicitly (README, .ci/run) because a bare requirement pulls a multi-GB CUDA wheel.
        "torch>=2.4,<3",
        "megatron-core>=0.13,<0.20",
        "numpy",
        "gguf>=0.10",
        "tokenizers>=0.19",
        "safetensors>=0.4",
        # `convert --to hf` shards safetensors as save_pretrained does (split_torch_state_dict_into_shards)
        "huggingface_hub>=0.23",
        # Tokenization and chat templates go through transformers (AutoTokenizer, apply_chat_template), as
        # in vLLM and SGLang. 4.52: the first to read named templates from additional_chat_templates/ (as
        # save_pretrained writes them today); checked with 4.51.3 (misses them) and 4.52.4.
        "transformers>=4.52",
        # transformers renders chat templates with jinja2 but lists it only as an extra.
        "jinja2>=3.1",
        "pyyaml>=6",
        "wandb>=0.17",
        "tqdm>=4.60",
        "matplotlib>=3.7",
        "sympy>=1.12",
        "math-verify>=0.7",
        # `megatron-rl serve`: the SGLang-native and OpenAI-compatible HTTP API (rollout/server.py).
        "fastapi>=0.110,<1",
        "uvicorn>=0.29,<1",
        # reasoning-gym (task generators + scorers) is installed with --no-deps by scripts/setup_cpu.sh:
        # its declared dependencies are puzzle libraries the tasks we use never import.
    ],
    extras_require={
        # Never list "apex": the PyPI package of that name is an unrelated web toolkit.
        # Pinned to resolve together, wheels only (docs/gpu.md; scripts/setup_gpu.sh installs torch first):
        # sglang 0.5.23 pins torch 2.14.1 (and transformers 5.19.0, tokenizers 0.23.2) and its CUDA 13 kernels;
        # torch 2.14.1 pins triton ~3.8.0; Transformer Engine's CUDA 13 core is a wheel.
        "gpu": ["sglang==0.5.23", "torch==2.14.1", "triton~=3.8.0", "transformer-engine[core-cu13]==2.20.2"],
        # Transformer Engine's torch extension exists only as a source archive that compiles against the
        # installed torch (nvcc, CUDA and cuDNN headers, minutes to build): opt-in, never in the GPU check's path.
        "te-torch": ["transformer-engine[pytorch]==2.20.2"],
        # triton in dev: its kernels are tested on CPU through the interpreter (TRITON_INTERPRET=1).
        "dev": ["pytest>=8", "import-linter>=2.1", "accelerate>=0.30", "pyarrow>=14",
                "triton>=3.0; platform_system == 'Linux'",
                # the official OpenAI client (and its HTTP library) against `megatron-rl serve`
                "openai>=1.40,<4", "httpx>=0.27",
                # lm-eval's local-completions / local-chat-completions / sglang-generate against the server
                "lm-eval[api]>=0.4.13,<0.5",
                # property-based fuzzing of configs and data through the CLI (tests/test_fuzz_inputs.py)
                "hypothesis>=6.100",
                # the reference of the LoRA tests (tests/test_lora.py): adapters loaded onto transformers models
                "peft>=0.17",
                # OpenEnv environments in process (agent.environment: openenv:...; tests/test_agent_environments.py)
                "openenv>=0.10,<0.11"],
        # Environment libraries (docs/environments.md). They cannot share one environment (verifiers pins
        # mcp==2.0.0, OpenEnv's fastmcp mcp<2): verifiers usually runs in its own, scripts/setup_verifiers.sh.
        "openenv": ["openenv>=0.10,<0.11"],
        "verifiers": ["verifiers>=0.4,<0.5"],
        "parquet": ["pyarrow>=14"],
    },
    entry_points={"console_scripts": ["megatron-rl=megatron_rl.cli:main"]},
)
