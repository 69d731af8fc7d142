"""Prompt sources: files, reasoning-gym generators, non-overlapping splits, the resumable cursor."""
from __future__ import annotations

import json
import sys

import pytest

from megatron_rl.config import ConfigError, from_dict
from megatron_rl.data.sources import (
    DataConfig,
    DataError,
    PromptCursor,
    PromptStream,
    SourceConfig,
    build_datasets,
    load_file_source,
    normalize_question,
)


def write_jsonl(path, rows):
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(row if isinstance(row, str) else json.dumps(row))
            f.write("\n")
    return str(path)


# --- files ---------------------------------------------------------------------------------------------

def test_jsonl_fields_system_prompt_and_messages(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [
        {"problem": "What is 2+2?", "solution": 4, "uid": "a1", "level": 3},
        "",  # blank lines are ignored
        {"problem": [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "3+3?"}],
         "solution": "6", "uid": "a2"},
        {"problem": "Nested?", "solution": "yes", "uid": "a3", "sys": "Row system."},
    ])
    cfg = SourceConfig(kind="jsonl", path=path, prompt_field="problem", answer_field="solution", id_field="uid",
                       system_prompt="You are a calculator.", system_prompt_field="sys",
                       prompt_template="{question}\nAnswer with a number.")
    ds = load_file_source(cfg)
    assert [p.prompt_id for p in ds] == ["a1", "a2", "a3"]
    first = ds[0]
    assert first.answer == "4" and first.question == "What is 2+2?"
    assert first.messages == [{"role": "system", "content": "You are a calculator."},
                              {"role": "user", "content": "What is 2+2?\nAnswer with a number."}]
    assert first.metadata["row"] == 1 and first.metadata["row_data"] == {"level": 3}
    assert ds[1].messages[0] == {"role": "system", "content": "Be terse."} and ds[1].question == "3+3?"
    assert ds[2].messages[0]["content"] == "Row system."


def test_dotted_field_and_hash_ids_are_stable(tmp_path):
    rows = [{"x": {"q": f"question {i}", "a": str(i)}} for i in range(4)]
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    cfg = SourceConfig(kind="jsonl", path=path, prompt_field="x.q", answer_field="x.a")
    ids = [p.prompt_id for p in load_file_source(cfg)]
    assert ids == [p.prompt_id for p in load_file_source(cfg)] and len(set(ids)) == 4
    assert ids[0].startswith("d-")


def test_malformed_jsonl_row_names_file_and_line(tmp_path):
    path = write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "a", "answer": "1"}, "", '{"prompt": "b", "answ',
                                                 {"prompt": "c", "answer": "3"}])
    with pytest.raises(DataError, match=r"bad\.jsonl:3: malformed JSON row"):
        load_file_source(SourceConfig(kind="jsonl", path=path))
    ds = load_file_source(SourceConfig(kind="jsonl", path=path, on_bad_row="skip"))
    assert [p.question for p in ds] == ["a", "c"]
    assert ds.stats == {"rows_read": 3, "bad_rows_skipped": 1}


def test_an_overlong_row_is_named_and_never_read_whole(tmp_path):
    """A row past max_row_bytes is a bad row named by file and line; the reader holds at most the bound plus
    a MiB of it (so a 1 GB line cannot exhaust memory), and the rows after it are read as usual."""
    long_row = json.dumps({"prompt": "x" * (3 << 20), "answer": "1"})
    path = write_jsonl(tmp_path / "long.jsonl", [{"prompt": "a", "answer": "1"}, long_row,
                                                  {"prompt": "c", "answer": "3"}])
    with pytest.raises(DataError, match=r"long\.jsonl:2: row longer than 4,096 bytes \(raise data\.\*\.max_row_bytes"):
        load_file_source(SourceConfig(kind="jsonl", path=path, max_row_bytes=4096))
    ds = load_file_source(SourceConfig(kind="jsonl", path=path, max_row_bytes=4096, on_bad_row="skip"))
    assert [p.question for p in ds] == ["a", "c"] and ds.stats["bad_rows_skipped"] == 1
    assert len(load_file_source(SourceConfig(kind="jsonl", path=path))) == 3  # the default bound: 16 MiB


def test_missing_field_names_the_field(tmp_path):
    path = write_jsonl(tmp_path / "m.jsonl", [{"prompt": "a", "answer": "1"}, {"question": "b", "answer": "2"}])
    with pytest.raises(DataError, match=r"m\.jsonl:2: missing field 'prompt'.*fields present: \['answer', 'question'\]"):
        load_file_source(SourceConfig(kind="jsonl", path=path))
    with pytest.raises(DataError, match=r"m\.jsonl:1: missing field 'solution' \(answer_field\)"):
        load_file_source(SourceConfig(kind="jsonl", path=path, answer_field="solution"))
    assert len(load_file_source(SourceConfig(kind="jsonl", path=path, on_bad_row="skip"))) == 1
    # every row bad: an error, not an empty data set
    with pytest.raises(DataError, match="no usable rows.*missing field 'problem'"):
        load_file_source(SourceConfig(kind="jsonl", path=path, prompt_field="problem", on_bad_row="skip"))
    path2 = write_jsonl(tmp_path / "t.jsonl", [{"prompt": 5, "answer": "1"}, ["not", "an", "object"]])
    with pytest.raises(DataError, match=r"t\.jsonl:1: field 'prompt' must be"):
        load_file_source(SourceConfig(kind="jsonl", path=path2))
    with pytest.raises(DataError, match="not found"):
        load_file_source(SourceConfig(kind="jsonl", path=str(tmp_path / "none.jsonl")))


def test_parquet_source(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    path = str(tmp_path / "d.parquet")
    pq.write_table(pa.table({"question": ["1+1?", "2+2?", "1+1?"], "answer": ["2", "4", "2"]}), path)
    ds = load_file_source(SourceConfig(kind="parquet", path=path, prompt_field="question"))
    assert [p.answer for p in ds] == ["2", "4", "2"] and ds[1].metadata["row"] == 1
    with pytest.raises(DataError, match=r"d\.parquet: row 0: missing field 'prompt'"):
        load_file_source(SourceConfig(kind="parquet", path=path))


def test_file_splits_never_overlap(tmp_path):
    rows = [{"prompt": f"q{i % 30}", "answer": str(i % 30)} for i in range(60)]  # every question twice
    rows.append({"prompt": "  q1 \n", "answer": "1"})  # whitespace variant is a duplicate too
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    train, heldout = build_datasets(DataConfig(train=SourceConfig(kind="jsonl", path=path), heldout_size=10))
    assert len(heldout) == 10 and len(train) == 20
    assert not train.questions() & heldout.questions()
    assert train.stats["duplicates_dropped"] == 31
    again_train, again_heldout = build_datasets(
        DataConfig(train=SourceConfig(kind="jsonl", path=path), heldout_size=10))
    assert [p.prompt_id for p in again_heldout] == [p.prompt_id for p in heldout]
    # an explicit held-out file: its questions are removed from training
    held_path = write_jsonl(tmp_path / "h.jsonl", [{"prompt": "q3", "answer": "3"}, {"prompt": "new", "answer": "0"}])
    train, heldout = build_datasets(DataConfig(train=SourceConfig(kind="jsonl", path=path),
                                               heldout=SourceConfig(kind="jsonl", path=held_path)))
    assert len(heldout) == 2 and len(train) == 29 and "q3" not in train.questions()
    assert train.stats["heldout_overlap_dropped"] == 2


# --- reasoning-gym ----------------------------------------------------------------------------------------

def test_reasoning_gym_default_is_the_quickstart_task_and_splits_are_disjoint():
    cfg = DataConfig()
    assert cfg.train.task == "chain_sum" and cfg.train.task_config["max_digits"] == 2
    train, heldout = build_datasets(cfg)
    assert len(heldout) == 100
    # 1-digit sums repeat: a naive split shares most held-out questions with training; none may leak into training
    assert train.stats["heldout_overlap_dropped"] > 0
    assert not train.questions() & heldout.questions()
    assert len(train.questions()) == len(train)
    p = heldout[0]
    assert p.messages == [{"role": "user", "content": p.question}]
    meta = p.metadata["reasoning_gym"]
    assert meta["task"] == "chain_sum" and meta["entry"]["answer"] == p.answer
    # deterministic: the same config gives the same prompts and ids
    train2, heldout2 = build_datasets(DataConfig())
    assert [q.prompt_id for q in heldout2] == [q.prompt_id for q in heldout]
    assert [q.question for q in train2][:50] == [q.question for q in train][:50]


@pytest.mark.parametrize("task,options", [
    ("basic_arithmetic", {"min_terms": 2, "max_terms": 3, "min_digits": 1, "max_digits": 2}),
    ("countdown", {"min_numbers": 3, "max_numbers": 4}),
    ("chain_sum", {"min_terms": 3, "max_terms": 4, "min_digits": 2, "max_digits": 3}),
])
def test_reasoning_gym_tasks_and_difficulty(task, options):
    cfg = DataConfig(train=SourceConfig(task=task, task_config=options, size=20, seed=3,
                                        system_prompt="Think, then answer."), heldout_size=5)
    train, heldout = build_datasets(cfg)
    assert len(heldout) == 5 and len(train) > 5
    assert train[0].messages[0] == {"role": "system", "content": "Think, then answer."}
    assert train[0].metadata["reasoning_gym"]["config"] == options
    # only the needed generator modules were imported, not the whole package
    assert "reasoning_gym.algorithmic" not in sys.modules and "cellpylib" not in sys.modules


def test_reasoning_gym_errors():
    with pytest.raises(ValueError, match="unknown reasoning-gym task 'chain_summ'.*chain_sum"):
        build_datasets(DataConfig(train=SourceConfig(task="chain_summ")))
    with pytest.raises(ValueError, match="bad generator option.*min_terms"):
        build_datasets(DataConfig(train=SourceConfig(task_config={"num_terms": 2})))


def test_data_config_from_yaml_data():
    cfg = from_dict(DataConfig, {"train": {"kind": "reasoning_gym", "task": "countdown", "size": 10,
                                           "task_config": {"min_numbers": 3}}, "heldout_size": 4})
    assert cfg.train.task == "countdown" and cfg.heldout is None
    with pytest.raises(ConfigError, match="train.path"):
        from_dict(DataConfig, {"train": {"kind": "jsonl"}})
    with pytest.raises(ConfigError, match="heldout_size"):
        DataConfig(heldout_size=-1)


# --- cursor ----------------------------------------------------------------------------------------------

def test_cursor_epochs_are_permutations_and_deterministic():
    a, b = PromptCursor(10, seed=7), PromptCursor(10, seed=7)
    first = a.take(25)
    assert first == b.take(25)
    assert sorted(first[:10]) == list(range(10)) and sorted(first[10:20]) == list(range(10))
    assert first[:10] != first[10:20]  # a new permutation each epoch
    assert (a.epoch, a.index, a.consumed) == (2, 5, 25)
    assert PromptCursor(10, seed=8).take(10) != first[:10]
    assert PromptCursor(5, shuffle=False).take(7) == [0, 1, 2, 3, 4, 0, 1]


def test_cursor_resume_continues_exactly():
    train, _ = build_datasets(DataConfig(train=SourceConfig(size=50), heldout_size=5))
    full = PromptStream(train, seed=3)
    uninterrupted = [p.prompt_id for _ in range(12) for p in full.next(7)]
    run = PromptStream(train, seed=3)
    got = [p.prompt_id for _ in range(5) for p in run.next(7)]
    state = json.loads(json.dumps(run.state_dict()))  # what a checkpoint stores
    resumed = PromptStream(train, seed=3)
    resumed.load_state_dict(state)
    got += [p.prompt_id for _ in range(7) for p in resumed.next(7)]
    assert got == uninterrupted
    with pytest.raises(DataError, match="seed"):
        PromptStream(train, seed=4).load_state_dict(state)
    with pytest.raises(DataError, match="size"):
        PromptCursor(len(train) + 1, seed=3).load_state_dict(state)


def test_normalize_question():
    assert normalize_question("  What is\n 2 +  2?  ") == "What is 2 + 2?"
