"""`python -m megatron_rl.cli ...` (what torchrun / srun launch): the `megatron-rl` command."""
import sys

from megatron_rl.cli import main

sys.exit(main())
