"""The data section (`data:`): training prompt sources and the held-out split, importable without torch."""
from __future__ import annotations

import dataclasses
import os
from typing import Any, Literal

from megatron_rl.config import RECIPE_PATH_FIELD, require


@dataclasses.dataclass(kw_only=True)
class SourceConfig:
    """Where prompts come from: a reasoning-gym generator or a JSONL / parquet file."""

    kind: Literal["reasoning_gym", "jsonl", "parquet", "mixture", "champ"] = "reasoning_gym"
    """reasoning_gym: a seeded procedural generator; jsonl / parquet: a file at `path`; mixture: the
    reasoning_gym sources listed in `components`, interleaved (e.g. tasks of different difficulty);
    champ: the CHAMP competition-math set (reference = worked solution; data/champ.py)."""
    path: str | None = dataclasses.field(default=None, metadata={RECIPE_PATH_FIELD: True})
    """jsonl / parquet: a file, a folder laid out as an HF dataset (`data/train-00000-of-00002.parquet`,
    `train.jsonl` + `test.jsonl`, `train/*.json`, ...: every .parquet / .jsonl / .json file of `split`,
    found as the `datasets` library finds split files), or a glob (`shards/*.parquet`: every
    matching file, sorted). Files are read by extension (.parquet, .jsonl, .json: JSON lines or one JSON
    array of rows), a file of another name as `kind` says. champ: optional (default: the file in the
    champ-dataset package)."""
    split: str = "train"
    """jsonl / parquet folder: the split to read ('train', 'validation', 'test' or a name used in
    `data/{split}-NNNNN-of-NNNNN.*` files; their synonyms such as 'dev' and 'eval' count). A folder with no
    split in its file names is all 'train'."""
    prompt_field: str = "prompt"
    """jsonl / parquet: field with the prompt, a string (the user message) or a list of chat messages
    ({'role', 'content'}; content a string or OpenAI text parts [{'type': 'text', 'text': ...}], joined
    with newlines as vLLM joins them). Dotted paths reach nested fields ('extra.question')."""
    final_assistant_turn: Literal["answer", "drop", "error"] = "answer"
    """jsonl / parquet, a prompt of chat messages that ends with an assistant turn (an SFT-style
    `messages` row): that turn is never prompt text. answer: it is the row's reference answer (a row that
    also has `answer_field` is refused as ambiguous); drop: it is left out and `answer_field` gives the
    answer; error: such a row is refused."""
    answer_field: str | None = "answer"
    """jsonl / parquet: field with the reference answer (None: no answers)."""
    id_field: str | None = None
    """jsonl / parquet: field with a stable prompt id (None: hash of question and answer)."""
    system_prompt: str | None = None
    """System message put before every prompt (None: none, so the chat template's default applies)."""
    system_prompt_field: str | None = None
    """jsonl / parquet: per-row system prompt field (overrides system_prompt when present in a row)."""
    prompt_template: str = "{question}"
    """Format string for the user message; `{question}` is the prompt text (e.g. add answer-format
    instructions: "{question}\\nPut the final answer in \\\\boxed{{}}.")."""
    max_row_bytes: int = 16 << 20
    """jsonl: the longest row read (bytes); a longer one is a bad row (`on_bad_row`), named by file and line,
    and is never held in memory whole."""
    on_bad_row: Literal["error", "skip"] = "error"
    """A malformed row (bad JSON, missing field, wrong type): error names the file and line; skip
    counts it in the data set's stats and goes on."""
    task: str = "chain_sum"
    """reasoning_gym: the task name (chain_sum, basic_arithmetic, countdown, ...)."""
    task_config: dict[str, Any] = dataclasses.field(
        default_factory=lambda: {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2})
    """reasoning_gym: the generator's own config options (difficulty), without size and seed."""
    size: int = 4000
    """reasoning_gym: how many questions to generate (before de-duplication)."""
    seed: int = 1
    """reasoning_gym: generator seed."""
    components: list["SourceConfig"] = dataclasses.field(default_factory=list)
    """mixture: the reasoning_gym sources to mix, each with its own task, task_config, size and seed
    (a held-out set takes an equal share of heldout_size from each)."""

    def __post_init__(self) -> None:
        require(self.max_row_bytes >= 1024, "max_row_bytes", "must be >= 1024")
        if self.kind == "mixture":
            require(bool(self.components), "components", "a mixture source needs at least one component")
            require(all(c.kind == "reasoning_gym" for c in self.components), "components",
                    "mixture components must be reasoning_gym sources")
        if self.path:
            self.path = os.path.expanduser(self.path)
        if self.kind in ("jsonl", "parquet"):
            require(bool(self.path), "path", f"a {self.kind} source needs a path")
        require(self.size >= 1, "size", "must be >= 1")
        require("{question}" in self.prompt_template, "prompt_template", "must contain {question}")
        require(bool(self.prompt_field), "prompt_field", "must not be empty")
        require(bool(self.split), "split", "must not be empty")

    @property
    def name(self) -> str:
        if self.kind == "reasoning_gym":
            return f"rg_{self.task}"
        if self.kind == "mixture":
            return "rg_mixture"
        if self.kind == "champ":
            return "champ"
        path = (self.path or "data").rstrip("/\\") or "data"
        if any(ch in path for ch in "*?["):  # a glob: named for the folder it searches
            path = os.path.dirname(path.split("*")[0].split("?")[0].split("[")[0]) or "data"
        return os.path.splitext(os.path.basename(path))[0]


@dataclasses.dataclass(kw_only=True)
class DataConfig:
    """Training prompts, the held-out evaluation set, and the order prompts are drawn in."""

    train: SourceConfig = dataclasses.field(default_factory=SourceConfig)
    """The training source (default: the quickstart reasoning-gym chain_sum task)."""
    heldout: SourceConfig | None = None
    """A separate held-out source. None: for reasoning_gym, the same task generated with heldout_seed;
    for files, heldout_size rows carved out of the training file (seeded by heldout_seed)."""
    heldout_size: int = 100
    """Number of held-out questions (0: no held-out set; with an explicit `heldout` source, its cap)."""
    heldout_seed: int = 987654
    """Seed of the held-out generator (reasoning_gym) or of the carve-out (files)."""
    shuffle: bool = True
    """Draw training prompts in a new seeded permutation every epoch (False: file order)."""
    shuffle_seed: int = 1
    """Seed of the per-epoch permutations."""

    def __post_init__(self) -> None:
        require(self.heldout_size >= 0, "heldout_size", "must be >= 0")

    def files(self) -> tuple[str, ...]:
        """The data files this config reads (a run directory that holds them never moves them)."""
        return tuple(source.path for source in (self.train, self.heldout) if source is not None and source.path)
