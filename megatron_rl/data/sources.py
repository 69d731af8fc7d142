"""Prompt sources: JSONL / JSON / parquet files (one file, an HF dataset folder's split, or a glob) and
reasoning-gym generators, held-out splits, a resumable cursor.

    train, heldout = build_datasets(DataConfig())      # default: the quickstart chain_sum task
    stream = PromptStream(train, seed=1)               # deterministic shuffled order, epoch after epoch
    prompts = stream.next(8)                           # list[Prompt]
    state = stream.state_dict()                        # {'epoch', 'index', ...} for the checkpoint
    stream.load_state_dict(state)                      # resume exactly where it stopped

Every prompt is a typed `Prompt`: chat messages for the model, the question text, the reference
answer, metadata (for reasoning-gym, the task entry its scorer needs) and a stable id. A row's prompt is a
string or chat messages (OpenAI text content parts accepted); a conversation that ends with the
assistant's turn gives that turn as the reference answer, never as prompt text (`final_assistant_turn`).

Splits never overlap: both are de-duplicated by question text (whitespace-normalised) and every
training question that also appears in the held-out set is dropped from training. Measured: with
1-digit chain sums a naive training set contained 71 of 100 held-out questions.

The quickstart task (SmolLM2-135M-Instruct starts at ~22% greedy with the chat template's default
system prompt) is the default `SourceConfig`: reasoning-gym chain_sum, 2 terms of 1-2 digits, training
seed 1, held-out seed 987654. In YAML:

    data:
      train: {kind: reasoning_gym, task: chain_sum, size: 4000, seed: 1,
              task_config: {min_terms: 2, max_terms: 2, min_digits: 1, max_digits: 2}}
      heldout_size: 100
      heldout_seed: 987654
"""
from __future__ import annotations

import codecs
import glob
import json
import logging
import os
import random
import re
from typing import Any, Iterator, Sequence

from megatron_rl.config import path_kind
from megatron_rl.data.champ import load_champ
from megatron_rl.data.config import DataConfig, SourceConfig
from megatron_rl.data.prompts import (
    DataError,
    Prompt,
    PromptDataset,
    chat_messages,
    normalize_messages,
    normalize_question,
    split_final_assistant,
    stable_id,
)
from megatron_rl.data.reasoning_gym_tasks import create_task_dataset

logger = logging.getLogger(__name__)

# --- reading ----------------------------------------------------------------------------------------------

# Which files of an HF dataset folder belong to which split: the rules of the `datasets` library
# (data_files.py: a `data/{split}-NNNNN-of-NNNNN.*` shard name, else a split keyword as a folder name, else
# in the file name, delimited by one of NON_WORDS_CHARS; else every file is 'train').
SPLIT_KEYWORDS = {"train": ("train", "training"), "validation": ("validation", "valid", "dev", "val"),
                  "test": ("test", "testing", "eval", "evaluation")}
_SEP = r"[-._ 0-9]"
_SHARDED_SPLIT = re.compile(r"data/(\w+)-[0-9]{5}-of-[0-9]{5}[^/]*")
DATA_EXTENSIONS = (".parquet", ".jsonl", ".ndjson", ".json")
# JSON files `datasets` writes about a data set, not rows of it
_METADATA_FILES = {"dataset_info.json", "dataset_infos.json", "dataset_dict.json", "state.json"}


def _keyword_in(name: str, keyword: str, *, followed: bool) -> bool:
    tail = f"{_SEP}.*" if followed else f"({_SEP}.*)?"
    return re.fullmatch(f"(.*{_SEP})?{re.escape(keyword)}{tail}", name) is not None


def split_data_files(files: Sequence[str]) -> dict[str, list[str]]:
    """Split name -> the files (paths relative to the folder, '/'-separated) that belong to it."""
    sharded: dict[str, list[str]] = {}
    for f in files:
        if match := _SHARDED_SPLIT.fullmatch(f):
            sharded.setdefault(match.group(1), []).append(f)
    if sharded:
        return sharded
    for in_dir in (True, False):  # a keyword as a folder name wins over one in a file name
        found = {}
        for split, keywords in SPLIT_KEYWORDS.items():
            names = [f for f in files if any(_keyword_in(part, kw, followed=not in_dir) for kw in keywords
                                             for part in (f.split("/")[:-1] if in_dir else f.split("/")[-1:]))]
            if names:
                found[split] = names
        if found:
            return found
    return {"train": list(files)}


def _folder_files(folder: str, split: str) -> list[str]:
    files, arrow = [], False
    for root, dirs, names in os.walk(folder):
        dirs[:] = [d for d in dirs if not d.startswith((".", "__"))]  # hidden and special, as `datasets` skips
        for name in names:
            arrow = arrow or name.endswith(".arrow")
            if name.lower().endswith(DATA_EXTENSIONS) and not name.startswith((".", "__")) \
                    and name not in _METADATA_FILES:
                files.append(os.path.relpath(os.path.join(root, name), folder).replace(os.sep, "/"))
    if not files:
        hint = (" (its .arrow files are a `datasets` save_to_disk folder: write it out with "
                "Dataset.to_parquet or to_json)") if arrow else ""
        raise DataError(f"{folder}: no data files (.parquet, .jsonl, .json) in the folder{hint}")
    splits = split_data_files(sorted(files))
    canonical = next((name for name, keywords in SPLIT_KEYWORDS.items() if split in keywords), split)
    if canonical not in splits:
        raise DataError(f"{folder}: no split '{split}' (data split); the folder's splits: {', '.join(sorted(splits))}")
    return [os.path.join(folder, f) for f in sorted(splits[canonical])]


def source_files(cfg: SourceConfig) -> list[str]:
    """The files of a file source: the file, a glob's matches (sorted), or an HF dataset folder's split."""
    path = cfg.path
    assert path is not None
    if os.path.isdir(path):
        return _folder_files(path, cfg.split)
    if cfg.split != "train":  # a split picks files of a folder; a file or a glob has none to pick
        raise DataError(f"{path}: split={cfg.split!r} applies to a dataset folder, not to a file or a glob "
                        "(point path at the folder, or at the split's files)")
    if os.path.isfile(path):
        return [path]
    if any(ch in path for ch in "*?["):
        files = sorted(f for f in glob.glob(path, recursive=True) if os.path.isfile(f))
        if not files:
            raise DataError(f"data files not found: no file matches {path}")
        return files
    kind = path_kind(path)
    if kind == "missing":
        raise DataError(f"data file not found: {path}")
    raise DataError(f"data file {path} is {kind}, not a regular file")


def _get(row: dict, dotted: str) -> Any:
    value: Any = row
    for key in dotted.split("."):
        if not isinstance(value, dict) or key not in value:
            raise KeyError(dotted)
        value = value[key]
    return value


def _has(row: dict, dotted: str) -> bool:
    try:
        _get(row, dotted)
    except KeyError:
        return False
    return True


def _reference_answer(row: dict, cfg: SourceConfig, where: str, final_turn: str | None) -> str | None:
    if final_turn is not None and cfg.final_assistant_turn == "answer":
        if cfg.answer_field and _has(row, cfg.answer_field):
            raise DataError(f"{where}: two reference answers: field '{cfg.prompt_field}' ends with an assistant "
                            f"turn and the row has '{cfg.answer_field}' (answer_field); set answer_field=null to "
                            f"use the assistant turn, or final_assistant_turn=drop to use '{cfg.answer_field}'")
        return final_turn
    if not cfg.answer_field:
        return None
    try:
        answer = _get(row, cfg.answer_field)
    except KeyError:
        raise DataError(f"{where}: missing field '{cfg.answer_field}' (answer_field); "
                        f"fields present: {sorted(row)}") from None
    if answer is not None and not isinstance(answer, str):
        answer = json.dumps(answer) if isinstance(answer, (list, dict)) else str(answer)
    return answer


def _row_to_prompt(row: Any, cfg: SourceConfig, where: str, row_number: int, file: str) -> Prompt:
    if not isinstance(row, dict):
        raise DataError(f"{where}: a row must be a JSON object, got {type(row).__name__}")
    try:
        raw_prompt = _get(row, cfg.prompt_field)
    except KeyError:
        raise DataError(f"{where}: missing field '{cfg.prompt_field}' (prompt_field); "
                        f"fields present: {sorted(row)}") from None
    final_turn = None
    if isinstance(raw_prompt, (list, tuple)) and raw_prompt:
        conversation = normalize_messages(raw_prompt, where, cfg.prompt_field)
        raw_prompt, final_turn = split_final_assistant(conversation, cfg.final_assistant_turn, where,
                                                       cfg.prompt_field)
        if not raw_prompt:
            raise DataError(f"{where}: field '{cfg.prompt_field}' has no user message")
    answer = _reference_answer(row, cfg, where, final_turn)
    system = cfg.system_prompt
    if cfg.system_prompt_field:
        try:
            row_system = _get(row, cfg.system_prompt_field)
        except KeyError:
            row_system = None
        if row_system is not None:
            system = str(row_system)
    messages, question = chat_messages(raw_prompt, system, cfg.prompt_template, where, cfg.prompt_field)
    if cfg.id_field:
        try:
            prompt_id = str(_get(row, cfg.id_field))
        except KeyError:
            raise DataError(f"{where}: missing field '{cfg.id_field}' (id_field); "
                            f"fields present: {sorted(row)}") from None
    else:
        prompt_id = stable_id(cfg.name, question, answer)
    used = {cfg.prompt_field, cfg.answer_field, cfg.id_field, cfg.system_prompt_field}
    extra = {k: v for k, v in row.items() if k not in used}
    return Prompt(prompt_id=prompt_id, messages=messages, question=question, answer=answer,
                  metadata={"source": file, "row": row_number, "row_data": extra})


def _unicode_error(value: Any, where: str, field: str = "") -> DataError | None:
    """A DataError naming the first string (or key) of a JSON value holding a lone surrogate (`"\\ud800"`
    decodes to one): no tokenizer or UTF-8 file takes it."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as exc:
            return DataError(f"{where}: field '{field or '(row)'}' holds a lone surrogate "
                             f"(\\u{ord(value[exc.start]):04x} at character {exc.start}), which is not valid Unicode")
        return None
    if isinstance(value, dict):
        for key, item in value.items():
            name = f"{field}.{key}" if field else str(key)
            if error := _unicode_error(key, where, f"{name} (a key)") or _unicode_error(item, where, name):
                return error
    elif isinstance(value, list):
        for i, item in enumerate(value):
            if error := _unicode_error(item, where, f"{field}[{i}]"):
                return error
    return None


def _json_lines(path: str, max_row_bytes: int) -> Iterator[tuple[int, str, Any]]:
    with open(path, "rb") as f:
        for lineno, raw in enumerate(iter(lambda: f.readline(max_row_bytes + 1), b""), start=1):
            where = f"{path}:{lineno}"
            if len(raw) > max_row_bytes and not raw.endswith(b"\n"):
                while (rest := f.readline(1 << 20)) and not rest.endswith(b"\n"):
                    pass  # the rest of the row, read and dropped a MiB at a time
                yield lineno, where, DataError(f"{where}: row longer than {max_row_bytes:,} bytes "
                                               "(raise data.*.max_row_bytes to read it)")
                continue
            if lineno == 1 and raw.startswith(codecs.BOM_UTF8):
                raw = raw[len(codecs.BOM_UTF8):]  # a byte-order mark written by Windows editors: not data
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                yield lineno, where, DataError(f"{where}: not valid UTF-8 (byte 0x{raw[exc.start]:02x} at "
                                               f"byte {exc.start + 1} of the line)")
                continue
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                yield lineno, where, DataError(f"{where}: malformed JSON row ({exc.msg} at column {exc.colno})")
                continue
            yield lineno, where, _unicode_error(row, where) or row


def _json_array(path: str) -> Iterator[tuple[int, str, Any]]:
    try:
        with open(path, encoding="utf-8-sig") as f:
            rows = json.load(f)
    except UnicodeDecodeError as exc:
        raise DataError(f"{path}: not valid UTF-8 (byte {exc.start + 1} of the file)") from None
    except json.JSONDecodeError as exc:
        raise DataError(f"{path}:{exc.lineno}: malformed JSON ({exc.msg} at column {exc.colno})") from None
    for i, row in enumerate(rows):
        where = f"{path}: row {i}"
        yield i, where, _unicode_error(row, where) or row


def _parquet_rows(path: str) -> Iterator[tuple[int, str, Any]]:
    try:
        import pyarrow.parquet as pq  # optional (parquet extra): only for .parquet sources
    except ImportError:
        raise DataError(f"{path}: reading parquet needs pyarrow (pip install pyarrow)") from None
    try:
        rows = pq.read_table(path).to_pylist()
    except UnicodeDecodeError as exc:
        raise DataError(f"{path}: a string column is not valid UTF-8 ({exc.reason})") from None
    except Exception as exc:  # pyarrow raises several types for unreadable files
        raise DataError(f"{path}: cannot read parquet file: {exc}") from None
    for i, row in enumerate(rows):
        yield i, f"{path}: row {i}", row


def file_rows(path: str, kind: str = "jsonl", max_row_bytes: int = 16 << 20) -> Iterator[tuple[int, str, Any]]:
    """(line or row number, "file:line" for messages, the parsed row or the DataError that row raised) of a
    JSON-lines, JSON-array or Parquet file."""
    lower = path.lower()
    if lower.endswith(".parquet") or (kind == "parquet" and not lower.endswith(DATA_EXTENSIONS)):
        return _parquet_rows(path)
    if lower.endswith(".json"):
        with open(path, "rb") as f:
            head = f.read(4096).removeprefix(codecs.BOM_UTF8).lstrip()
        if head.startswith(b"["):
            return _json_array(path)
    return _json_lines(path, max_row_bytes)


def _read_rows(cfg: SourceConfig) -> Iterator[tuple[str, int, str, Any]]:
    """(file, row number, location text, row or DataError) for each row of the source's files."""
    for file in source_files(cfg):
        for number, where, row in file_rows(file, cfg.kind, cfg.max_row_bytes):
            yield file, number, where, row


def _dedup(prompts: Sequence[Prompt], exclude: set[str] = frozenset(), limit: int | None = None,
           ) -> tuple[list[Prompt], int, int]:
    """Keep the first prompt of each question, skip those in `exclude`; (kept, duplicates, excluded)."""
    seen: set[str] = set()
    kept, dup, excluded = [], 0, 0
    for p in prompts:
        key = normalize_question(p.question)
        if key in exclude:
            excluded += 1
            continue
        if key in seen:
            dup += 1
            continue
        seen.add(key)
        kept.append(p)
        if limit is not None and len(kept) >= limit:
            break
    return kept, dup, excluded


def load_file_source(cfg: SourceConfig) -> PromptDataset:
    """All rows of a JSONL / parquet source (file, folder or glob; or CHAMP) as prompts (not yet
    de-duplicated). With on_bad_row=skip, bad rows (undecodable or malformed lines included) are counted
    in the stats (`bad_rows_skipped`, with `first_bad_row`); `build_datasets` logs them."""
    if cfg.kind == "champ":
        return load_champ(cfg)
    prompts: list[Prompt] = []
    read = bad = 0
    first_error: DataError | None = None
    for file, number, where, row in _read_rows(cfg):
        read += 1
        try:
            if isinstance(row, Exception):
                raise row
            prompts.append(_row_to_prompt(row, cfg, where, number, file))
        except DataError as exc:
            if cfg.on_bad_row == "error":
                raise
            bad += 1
            first_error = first_error or exc
    if read == 0:
        raise DataError(f"{cfg.path}: no rows (the data is empty)")
    if not prompts:
        detail = f"; first error: {first_error}" if first_error else ""
        raise DataError(f"{cfg.path}: no usable rows ({read} read, {bad} bad){detail}")
    return PromptDataset(cfg.name, prompts, {"rows_read": read, "bad_rows_skipped": bad},
                         first_bad_row=None if first_error is None else str(first_error))


def reasoning_gym_prompt(task: str, task_config: dict[str, Any], entry: dict[str, Any],
                         cfg: SourceConfig) -> Prompt:
    messages, question = chat_messages(entry["question"], cfg.system_prompt, cfg.prompt_template,
                                   f"reasoning-gym {task}", "question")
    answer = None if entry.get("answer") is None else str(entry["answer"])
    return Prompt(prompt_id=stable_id(f"rg_{task}", question, answer), messages=messages, question=question,
                  answer=answer,
                  metadata={"reasoning_gym": {"task": task, "config": dict(task_config), "entry": entry}})


def generate_reasoning_gym(cfg: SourceConfig, *, size: int | None = None, seed: int | None = None,
                           unique: int | None = None, exclude: set[str] = frozenset()) -> PromptDataset:
    """Generate prompts from a reasoning-gym task. With `unique`, keep generating (up to 50x) until that
    many distinct questions not in `exclude` exist; otherwise generate `size` and de-duplicate."""
    if cfg.kind == "mixture":
        return _generate_mixture(cfg, seed=seed, unique=unique, exclude=exclude)
    size = cfg.size if size is None else size
    seed = cfg.seed if seed is None else seed
    budget = size if unique is None else max(size, 50 * unique)
    dataset = create_task_dataset(cfg.task, cfg.task_config, size=budget, seed=seed)
    prompts: list[Prompt] = []
    seen: set[str] = set()
    dup = excluded = read = 0
    for i in range(budget):
        if unique is not None and len(prompts) >= unique:
            break
        if unique is None and i >= size:
            break
        p = reasoning_gym_prompt(cfg.task, cfg.task_config, dataset[i], cfg)
        read += 1
        key = normalize_question(p.question)
        if key in exclude:
            excluded += 1
        elif key in seen:
            dup += 1
        else:
            seen.add(key)
            prompts.append(p)
    stats = {"rows_read": read, "duplicates_dropped": dup, "heldout_overlap_dropped": excluded}
    return PromptDataset(cfg.name, prompts, stats)


def _generate_mixture(cfg: SourceConfig, *, seed: int | None, unique: int | None,
                      exclude: set[str]) -> PromptDataset:
    """Each component generated on its own (with `seed` and an equal share of `unique` when given),
    interleaved round-robin and de-duplicated across components."""
    parts = []
    for i, component in enumerate(cfg.components):
        share = None if unique is None else unique // len(cfg.components) + (i < unique % len(cfg.components))
        parts.append(generate_reasoning_gym(component, seed=seed, unique=share, exclude=exclude).prompts)
    seen: set[str] = set()
    prompts, dup = [], 0
    for i in range(max(len(p) for p in parts)):
        for part in parts:
            if i < len(part):
                key = normalize_question(part[i].question)
                dup += key in seen
                if key not in seen:
                    seen.add(key)
                    prompts.append(part[i])
    return PromptDataset(cfg.name, prompts, {"rows_read": sum(map(len, parts)), "duplicates_dropped": dup})


def build_datasets(config: DataConfig) -> tuple[PromptDataset, PromptDataset]:
    """(train, heldout): each de-duplicated by question text, and no training question in heldout."""
    train_cfg = config.train
    if config.heldout is not None:
        if config.heldout.kind in ("reasoning_gym", "mixture"):
            heldout = generate_reasoning_gym(config.heldout, unique=config.heldout_size or None)
        else:
            raw = load_file_source(config.heldout)
            kept, dup, _ = _dedup(raw.prompts, limit=config.heldout_size or None)
            heldout = PromptDataset(raw.name, kept, {**raw.stats, "duplicates_dropped": dup},
                                    first_bad_row=raw.first_bad_row)
        exclude = heldout.questions()
        if train_cfg.kind in ("reasoning_gym", "mixture"):
            train = generate_reasoning_gym(train_cfg, exclude=exclude)
        else:
            raw = load_file_source(train_cfg)
            kept, dup, excl = _dedup(raw.prompts, exclude)
            train = PromptDataset(raw.name, kept,
                                  {**raw.stats, "duplicates_dropped": dup, "heldout_overlap_dropped": excl},
                                  first_bad_row=raw.first_bad_row)
    elif train_cfg.kind in ("reasoning_gym", "mixture"):
        if config.heldout_size:
            heldout = generate_reasoning_gym(train_cfg, seed=config.heldout_seed, unique=config.heldout_size)
            heldout.name = f"{train_cfg.name}_heldout"
        else:
            heldout = PromptDataset(f"{train_cfg.name}_heldout", [], {})
        train = generate_reasoning_gym(train_cfg, exclude=heldout.questions())
    else:
        raw = load_file_source(train_cfg)
        unique, dup, _ = _dedup(raw.prompts)
        order = list(range(len(unique)))
        random.Random(config.heldout_seed).shuffle(order)
        held_idx = set(order[:config.heldout_size])
        if config.heldout_size and len(unique) - len(held_idx) < 1:
            raise DataError(f"{train_cfg.path}: {len(unique)} distinct prompts cannot give "
                            f"heldout_size={config.heldout_size} and a training set")
        heldout = PromptDataset(f"{raw.name}_heldout", [unique[i] for i in sorted(held_idx)],
                                {"rows_read": len(held_idx)})
        train = PromptDataset(raw.name, [p for i, p in enumerate(unique) if i not in held_idx],
                              {**raw.stats, "duplicates_dropped": dup, "heldout_overlap_dropped": len(held_idx)},
                              first_bad_row=raw.first_bad_row)
    if not train.prompts:
        raise DataError(f"training source {train_cfg.name}: no prompts left after de-duplication "
                        f"against the held-out set")
    # logged once the data is accepted, so that a refused data set is one line (its error) and no more
    for source, dataset in ((train_cfg, train), (config.heldout, heldout)):
        if source is not None and dataset.stats.get("bad_rows_skipped"):
            logger.warning("%s: skipped %d bad rows of %d (on_bad_row=skip); first: %s", source.path or source.name,
                           dataset.stats["bad_rows_skipped"], dataset.stats["rows_read"], dataset.first_bad_row)
    return train, heldout


# --- the cursor ------------------------------------------------------------------------------------------

class PromptCursor:
    """A deterministic, resumable position (epoch, index) in per-epoch permutations of range(size).

    Epoch e's order is a permutation seeded by (seed, e) alone, so the order of any epoch can be
    recomputed after a restart; `state_dict` / `load_state_dict` save and restore the position, and
    every index is handed out exactly once per epoch.
    """

    def __init__(self, size: int, *, seed: int = 1, shuffle: bool = True):
        if size < 1:
            raise ValueError("PromptCursor needs a non-empty data set")
        self.size, self.seed, self.shuffle = size, seed, shuffle
        self.epoch = 0
        self.index = 0
        self._order_epoch = -1
        self._order: list[int] = []

    def order(self, epoch: int) -> list[int]:
        if epoch != self._order_epoch:
            order = list(range(self.size))
            if self.shuffle:
                random.Random(f"megatron_rl-cursor-{self.seed}-{epoch}").shuffle(order)
            self._order, self._order_epoch = order, epoch
        return self._order

    def take(self, count: int) -> list[int]:
        """The next `count` indices (crossing into the next epoch's permutation when one ends)."""
        out = []
        while len(out) < count:
            order = self.order(self.epoch)
            n = min(count - len(out), self.size - self.index)
            out.extend(order[self.index:self.index + n])
            self.index += n
            if self.index == self.size:
                self.epoch, self.index = self.epoch + 1, 0
        return out

    @property
    def consumed(self) -> int:
        """Indices handed out since the start of the run."""
        return self.epoch * self.size + self.index

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "index": self.index, "size": self.size, "seed": self.seed,
                "shuffle": self.shuffle}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key in ("size", "seed", "shuffle"):
            if key in state and state[key] != getattr(self, key):
                raise DataError(f"cannot resume the prompt cursor: saved {key}={state[key]!r} but the data "
                                f"set now has {key}={getattr(self, key)!r} (the data or its config changed)")
        epoch, index = int(state["epoch"]), int(state["index"])
        if epoch < 0 or not 0 <= index < self.size:
            raise DataError(f"cannot resume the prompt cursor: bad position epoch={epoch} index={index}")
        self.epoch, self.index = epoch, index


class PromptStream:
    """Training prompts in cursor order: `next(k)` returns the next k prompts; resumable."""

    def __init__(self, dataset: PromptDataset, *, seed: int = 1, shuffle: bool = True):
        self.dataset = dataset
        self.cursor = PromptCursor(len(dataset), seed=seed, shuffle=shuffle)

    @classmethod
    def from_config(cls, dataset: PromptDataset, config: DataConfig) -> "PromptStream":
        return cls(dataset, seed=config.shuffle_seed, shuffle=config.shuffle)

    def next(self, count: int) -> list[Prompt]:
        return [prompt for _, prompt in self.next_indexed(count)]

    def next_indexed(self, count: int) -> list[tuple[int, Prompt]]:
        """The next `count` prompts with their indices in the data set (what a checkpoint records)."""
        return [(i, self.dataset[i]) for i in self.cursor.take(count)]

    @property
    def epoch(self) -> int:
        return self.cursor.epoch

    def state_dict(self) -> dict[str, Any]:
        return {**self.cursor.state_dict(), "dataset": self.dataset.name}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.cursor.load_state_dict(state)
