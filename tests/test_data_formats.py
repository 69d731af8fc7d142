"""Data formats people bring: HF dataset folders and globs, OpenAI content-part messages, SFT-style
conversations that end with the assistant's answer; and the encodings that break naive readers (empty files,
undecodable bytes, a byte-order mark, lone surrogates). Catalogue: docs/bad_input.md."""
from __future__ import annotations

import json
import logging
import os

import pytest

from megatron_rl.config import ConfigError
from megatron_rl.data.sources import (
    DataConfig,
    DataError,
    SourceConfig,
    build_datasets,
    load_file_source,
    source_files,
    split_data_files,
)

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")


def write_jsonl(path, rows) -> str:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write((row if isinstance(row, str) else json.dumps(row)) + "\n")
    return str(path)


def write_parquet(path, rows) -> str:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), str(path))
    return str(path)


def rows(prefix: str, n: int) -> list[dict]:
    return [{"prompt": f"{prefix} question {i}", "answer": str(i)} for i in range(n)]


# --- HF dataset folders and globs -------------------------------------------------------------------------

def test_hub_parquet_layout_reads_every_shard_of_the_split(tmp_path):
    folder = tmp_path / "gsm8k"
    write_parquet(folder / "data" / "train-00000-of-00002.parquet", rows("a", 3))
    write_parquet(folder / "data" / "train-00001-of-00002.parquet", rows("b", 2))
    write_parquet(folder / "data" / "test-00000-of-00001.parquet", rows("t", 4))
    (folder / "README.md").write_text("---\nlicense: mit\n---\n")
    train = load_file_source(SourceConfig(kind="parquet", path=str(folder)))
    assert [p.question for p in train] == [f"a question {i}" for i in range(3)] + [f"b question {i}" for i in range(2)]
    assert train.name == "gsm8k" and train.stats == {"rows_read": 5, "bad_rows_skipped": 0}
    assert train[3].metadata["source"].endswith("train-00001-of-00002.parquet") and train[3].metadata["row"] == 0
    test = load_file_source(SourceConfig(kind="parquet", path=str(folder), split="test"))
    assert [p.answer for p in test] == ["0", "1", "2", "3"]
    with pytest.raises(DataError, match=r"gsm8k: no split 'validation' \(data split\); "
                                        r"the folder's splits: test, train"):
        load_file_source(SourceConfig(kind="parquet", path=str(folder), split="validation"))


def test_split_files_are_found_as_the_datasets_library_finds_them():
    # a split keyword delimited by non-word characters (-._ space digits), in a file name or a folder name
    assert split_data_files(["train.jsonl", "test.jsonl", "dev.jsonl"]) == \
        {"train": ["train.jsonl"], "validation": ["dev.jsonl"], "test": ["test.jsonl"]}
    assert split_data_files(["my_train-1.json", "my-eval.json", "trainer.json"]) == \
        {"train": ["my_train-1.json"], "test": ["my-eval.json"]}
    assert split_data_files(["training/a.parquet", "valid/b.parquet", "test2/c.parquet", "x.parquet"]) == \
        {"train": ["training/a.parquet"], "validation": ["valid/b.parquet"], "test": ["test2/c.parquet"]}
    # no keyword anywhere: all of it is train; "contest" and "trainer" are not keywords
    assert split_data_files(["contest.jsonl", "trainer.jsonl"]) == {"train": ["contest.jsonl", "trainer.jsonl"]}
    # the hub's sharded layout wins and may name any split
    assert split_data_files(["data/extra-00000-of-00001.parquet", "train.jsonl"]) == \
        {"extra": ["data/extra-00000-of-00001.parquet"]}


def test_jsonl_and_json_splits_and_synonyms(tmp_path):
    folder = tmp_path / "ds"
    write_jsonl(folder / "train.jsonl", rows("tr", 3))
    (folder / "validation.json").write_text(json.dumps(rows("va", 2)))  # one JSON array of rows
    write_jsonl(folder / "test.json", rows("te", 1))  # JSON lines under a .json name
    (folder / ".hidden.jsonl").write_text("not json\n")
    (folder / "dataset_info.json").write_text("{}")  # the library's metadata, not rows
    assert [p.question for p in load_file_source(SourceConfig(kind="jsonl", path=str(folder)))] == \
        [f"tr question {i}" for i in range(3)]
    dev = load_file_source(SourceConfig(kind="jsonl", path=str(folder), split="dev"))  # synonym of validation
    assert [p.question for p in dev] == ["va question 0", "va question 1"]
    assert dev[1].metadata == {"source": str(folder / "validation.json"), "row": 1, "row_data": {}}
    assert len(load_file_source(SourceConfig(kind="jsonl", path=str(folder), split="eval"))) == 1
    # a held-out source that is another split of the same folder
    train, heldout = build_datasets(DataConfig(train=SourceConfig(kind="jsonl", path=str(folder)),
                                               heldout=SourceConfig(kind="jsonl", path=str(folder), split="test")))
    assert len(train) == 3 and [p.question for p in heldout] == ["te question 0"]


def test_glob_reads_every_match_sorted_by_extension(tmp_path):
    write_jsonl(tmp_path / "shards" / "b.jsonl", rows("b", 2))
    write_parquet(tmp_path / "shards" / "a.parquet", rows("a", 1))
    write_jsonl(tmp_path / "shards" / "nested" / "c.jsonl", rows("c", 1))
    flat = load_file_source(SourceConfig(kind="jsonl", path=str(tmp_path / "shards" / "*")))
    assert [p.question for p in flat] == ["a question 0", "b question 0", "b question 1"]
    assert flat.name == "shards"
    deep = load_file_source(SourceConfig(kind="jsonl", path=str(tmp_path / "shards" / "**" / "*.jsonl")))
    assert [p.question for p in deep] == ["b question 0", "b question 1", "c question 0"]
    with pytest.raises(DataError, match=r"data files not found: no file matches .*shards/\*\.csv"):
        load_file_source(SourceConfig(kind="jsonl", path=str(tmp_path / "shards" / "*.csv")))
    with pytest.raises(DataError, match=r"split='test' applies to a dataset folder, not to a file or a glob"):
        load_file_source(SourceConfig(kind="jsonl", path=str(tmp_path / "shards" / "*"), split="test"))


def test_folder_without_data_files_is_named(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match=r"empty: no data files \(\.parquet, \.jsonl, \.json\) in the folder$"):
        load_file_source(SourceConfig(kind="jsonl", path=str(tmp_path / "empty")))
    arrow = tmp_path / "saved"
    arrow.mkdir()
    (arrow / "data-00000-of-00001.arrow").write_bytes(b"\x00")
    (arrow / "state.json").write_text("{}")
    with pytest.raises(DataError, match=r"saved: no data files .*save_to_disk folder"):
        load_file_source(SourceConfig(kind="jsonl", path=str(arrow)))
    assert source_files(SourceConfig(kind="jsonl", path=write_jsonl(tmp_path / "one.jsonl", rows("x", 1)))) == \
        [str(tmp_path / "one.jsonl")]


# --- OpenAI content parts ---------------------------------------------------------------------------------

def test_openai_text_parts_are_joined_as_vllm_joins_them(tmp_path):
    path = write_jsonl(tmp_path / "parts.jsonl", [
        {"prompt": [{"role": "system", "content": [{"type": "text", "text": "Be terse."}]},
                    {"role": "user", "content": [{"type": "text", "text": "What is"},
                                                 {"type": "text", "text": "2 + 2?"}]}], "answer": "4"},
    ])
    (p,) = load_file_source(SourceConfig(kind="jsonl", path=path))
    # vLLM's chat utils, text-only parts of a string-content template: "\n".join(texts)
    assert p.messages == [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "What is\n2 + 2?"}]
    assert p.question == "What is\n2 + 2?"


@pytest.mark.parametrize("content, message", [
    ([{"type": "text", "text": "look"}, {"type": "image_url", "image_url": {"url": "x.png"}}],
     r"p\.jsonl:2: field 'prompt\[0\]\.content' content part 1 is a part of type 'image_url'; only text parts"),
    ([{"type": "input_audio", "input_audio": {}}],
     r"p\.jsonl:2: field 'prompt\[0\]\.content' content part 0 .*'input_audio'"),
    ([{"type": "text", "text": 5}],
     r"p\.jsonl:2: field 'prompt\[0\]\.content' content part 0 of type 'text' has no string"),
    (["bare string"], r"p\.jsonl:2: field 'prompt\[0\]\.content' content part 0 is the part 'bare string'"),
    ([], r"p\.jsonl:2: field 'prompt\[0\]\.content' must be a string or a non-empty list of text parts, got \[\]"),
    (None, r"p\.jsonl:2: field 'prompt\[0\]\.content' must be a string or a non-empty list of text parts, got None"),
])
def test_non_text_parts_are_refused_naming_file_line_and_field(tmp_path, content, message):
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "fine", "answer": "1"},
                                              {"prompt": [{"role": "user", "content": content}], "answer": "1"}])
    with pytest.raises(DataError, match=message) as info:
        load_file_source(SourceConfig(kind="jsonl", path=path))
    assert "\n" not in str(info.value)
    skipped = load_file_source(SourceConfig(kind="jsonl", path=path, on_bad_row="skip"))
    assert len(skipped) == 1 and skipped.stats["bad_rows_skipped"] == 1


# --- conversations ending with the assistant's answer -----------------------------------------------------

CONVERSATION = [{"role": "system", "content": "You add numbers."}, {"role": "user", "content": "1+1?"},
                {"role": "assistant", "content": "2"}, {"role": "user", "content": "2+3?"},
                {"role": "assistant", "content": [{"type": "text", "text": "5"}]}]


def test_final_assistant_turn_is_the_reference_answer_never_prompt_text(tmp_path):
    path = write_jsonl(tmp_path / "sft.jsonl", [{"messages": CONVERSATION}])
    (p,) = load_file_source(SourceConfig(kind="jsonl", path=path, prompt_field="messages"))
    assert p.answer == "5" and p.question == "2+3?"
    assert p.messages == [dict(m) for m in CONVERSATION[:4]]  # earlier turns stay as context
    assert all(m["content"] != "5" for m in p.messages)


def test_final_assistant_turn_modes(tmp_path):
    both = write_jsonl(tmp_path / "both.jsonl", [{"messages": CONVERSATION, "answer": "five"}])
    with pytest.raises(DataError, match=r"both\.jsonl:1: two reference answers: field 'messages' ends with an "
                                        r"assistant turn and the row has 'answer' \(answer_field\); set "
                                        r"answer_field=null .* or final_assistant_turn=drop"):
        load_file_source(SourceConfig(kind="jsonl", path=both, prompt_field="messages"))
    (kept,) = load_file_source(SourceConfig(kind="jsonl", path=both, prompt_field="messages", answer_field=None))
    assert kept.answer == "5"
    (dropped,) = load_file_source(SourceConfig(kind="jsonl", path=both, prompt_field="messages",
                                               final_assistant_turn="drop"))
    assert dropped.answer == "five" and dropped.messages[-1] == {"role": "user", "content": "2+3?"}
    with pytest.raises(DataError, match=r"both\.jsonl:1: field 'messages' ends with an assistant turn "
                                        r"\(data\.\*\.final_assistant_turn=error\)"):
        load_file_source(SourceConfig(kind="jsonl", path=both, prompt_field="messages", final_assistant_turn="error"))
    only = write_jsonl(tmp_path / "only.jsonl", [{"messages": [{"role": "assistant", "content": "hi"}]}])
    with pytest.raises(DataError, match=r"only\.jsonl:1: field 'messages' has no user message"):
        load_file_source(SourceConfig(kind="jsonl", path=only, prompt_field="messages"))
    # a conversation ending with the user's turn is unchanged, its answer from answer_field
    open_ended = write_jsonl(tmp_path / "open.jsonl", [{"messages": CONVERSATION[:4], "answer": "5"}])
    (p,) = load_file_source(SourceConfig(kind="jsonl", path=open_ended, prompt_field="messages",
                                         final_assistant_turn="error"))
    assert p.answer == "5" and p.messages == CONVERSATION[:4]
    with pytest.raises(ConfigError, match="final_assistant_turn"):
        from megatron_rl.config import from_dict
        from_dict(SourceConfig, {"final_assistant_turn": "keep"})


# --- encodings and empty files (reliability, issue 23) ----------------------------------------------------

def test_empty_file_is_one_line(tmp_path):
    for name, text in (("empty.jsonl", ""), ("blank.jsonl", "\n  \n\n")):
        (tmp_path / name).write_text(text)
        with pytest.raises(DataError, match=rf"{name}: no rows \(the data is empty\)$"):
            load_file_source(SourceConfig(kind="jsonl", path=str(tmp_path / name), on_bad_row="skip"))


def test_undecodable_line_is_named_and_skip_counts_it(tmp_path, caplog):
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(b'{"prompt": "ok", "answer": "1"}\n{"prompt": "caf\xe9", "answer": "2"}\n'
                     b'{"prompt": "fine", "answer": "3"}\n')
    with pytest.raises(DataError, match=r"latin1\.jsonl:2: not valid UTF-8 \(byte 0xe9 at byte 16 of the line\)"):
        load_file_source(SourceConfig(kind="jsonl", path=str(path)))
    ds = load_file_source(SourceConfig(kind="jsonl", path=str(path), on_bad_row="skip"))
    assert [p.question for p in ds] == ["ok", "fine"] and ds.stats == {"rows_read": 3, "bad_rows_skipped": 1}
    with caplog.at_level(logging.WARNING, logger="megatron_rl.data.sources"):
        train, _ = build_datasets(DataConfig(train=SourceConfig(kind="jsonl", path=str(path), on_bad_row="skip"),
                                             heldout_size=0))
    assert train.stats["bad_rows_skipped"] == 1 and len(train) == 2
    (line,) = caplog.messages  # one line, once the data set is accepted
    assert line == (f"{path}: skipped 1 bad rows of 3 (on_bad_row=skip); first: "
                    f"{path}:2: not valid UTF-8 (byte 0xe9 at byte 16 of the line)")


def test_leading_byte_order_mark_is_not_data_but_a_later_one_is_named(tmp_path):
    path = tmp_path / "bom.jsonl"
    path.write_bytes(b'\xef\xbb\xbf{"prompt": "first", "answer": "1"}\n{"prompt": "second", "answer": "2"}\n')
    assert [p.question for p in load_file_source(SourceConfig(kind="jsonl", path=str(path)))] == ["first", "second"]
    array = tmp_path / "bom.json"
    array.write_bytes(b'\xef\xbb\xbf[{"prompt": "first", "answer": "1"}]')
    assert [p.question for p in load_file_source(SourceConfig(kind="jsonl", path=str(array)))] == ["first"]
    middle = tmp_path / "mid.jsonl"
    middle.write_bytes(b'{"prompt": "first", "answer": "1"}\n\xef\xbb\xbf{"prompt": "second", "answer": "2"}\n')
    with pytest.raises(DataError, match=r"mid\.jsonl:2: malformed JSON row \(Unexpected UTF-8 BOM"):
        load_file_source(SourceConfig(kind="jsonl", path=str(middle)))


def test_lone_surrogate_is_named_with_its_field(tmp_path):
    path = write_jsonl(tmp_path / "sur.jsonl", ['{"prompt": "fine", "answer": "1"}',
                                               '{"prompt": "bad \\ud800 text", "answer": "2"}',
                                               '{"prompt": "ok", "answer": "3", "meta": {"tags": ["x", "\\udfff"]}}'])
    with pytest.raises(DataError, match=r"sur\.jsonl:2: field 'prompt' holds a lone surrogate \(\\ud800 at "
                                        r"character 4\), which is not valid Unicode"):
        load_file_source(SourceConfig(kind="jsonl", path=path))
    ds = load_file_source(SourceConfig(kind="jsonl", path=path, on_bad_row="skip"))
    assert [p.question for p in ds] == ["fine"] and ds.stats["bad_rows_skipped"] == 2
    with pytest.raises(DataError, match=r"sur\.jsonl:3: field 'meta\.tags\[1\]' holds a lone surrogate"):
        load_file_source(SourceConfig(kind="jsonl", path=write_jsonl(tmp_path / "sur.jsonl", [
            '{"prompt": "ok", "answer": "3"}', "",
            '{"prompt": "ok", "answer": "3", "meta": {"tags": ["x", "\\udfff"]}}'])))


def test_bad_data_through_the_cli_is_one_line_and_exit_2(tmp_path, capsys):
    """The whole path a user takes: `megatron-rl eval` with an undecodable data file (DataError is a
    ConfigError: the CLI prints one line and exits 2)."""
    from megatron_rl.checkpoints_tools.convert import save_hf
    from megatron_rl.cli import main
    from megatron_rl.models.arch import preset
    from tests.helpers import tiny_state

    assert issubclass(DataError, ConfigError)
    model = str(tmp_path / "model")
    save_hf(model, preset("tiny"), tiny_state(preset("tiny")), None)
    data = tmp_path / "bad.jsonl"
    data.write_bytes(b'{"prompt": "ok", "answer": "1"}\n\xff\xfe{"prompt": "x"}\n')
    code = main(["eval", f"model.path={model}", "data.train.kind=jsonl", f"data.train.path={data}",
                 "data.heldout_size=1"])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    assert err.strip().splitlines()[-1] == \
        f"megatron-rl eval: error: {data}:2: not valid UTF-8 (byte 0xff at byte 1 of the line)"
