"""Bad input gets one clear error naming the problem (file, field, value), not a traceback."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from megatron_rl.config import ConfigError
from megatron_rl.models.arch import ModelArch, preset
from megatron_rl.models.megatron_layout import MegatronLayout, check_parallel_layout
from megatron_rl.models.pretrained import load_pretrained


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "megatron_rl.cli", *args], capture_output=True, text=True, timeout=300)


def test_missing_model_file(tmp_path):
    with pytest.raises(ConfigError, match="model path not found: .*nope.gguf"):
        load_pretrained(str(tmp_path / "nope.gguf"))


def test_corrupt_gguf(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\x03\x00\x00\x00" + b"\xff" * 64)
    with pytest.raises(ConfigError, match="bad.gguf: not a readable GGUF file"):
        load_pretrained(str(bad))


def test_truncated_safetensors(tmp_path, tiny_chat_model):
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(tiny_chat_model, broken)
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    with pytest.raises(ConfigError, match="model.safetensors: corrupt or unreadable safetensors file"):
        load_pretrained(str(broken))


def test_unknown_architecture(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "mamba", "architectures": ["MambaForCausalLM"],
                                                      "vocab_size": 10}))
    with pytest.raises(ConfigError, match=r"unsupported architecture \['MambaForCausalLM'\]"):
        load_pretrained(str(tmp_path))


def test_missing_config_field(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": 10}))
    with pytest.raises(ConfigError, match="config.json: field 'num_hidden_layers': missing: it sets the shape of the weights"):
        load_pretrained(str(tmp_path))


def test_tp_that_does_not_divide_the_heads(smollm2):
    with pytest.raises(ConfigError, match=r"tensor_parallel=2 does not divide the model's 3 key/value heads"):
        MegatronLayout(smollm2.arch, tp=2)
    with pytest.raises(ConfigError, match=r"pipeline_parallel=4 does not divide the model's 30 layers"):
        check_parallel_layout(smollm2.arch, 1, 4)


def test_inconsistent_arch():
    with pytest.raises(ConfigError, match=r"field 'num_query_groups': 4 must divide num_attention_heads=6"):
        ModelArch(vocab_size=10, num_layers=1, hidden_size=12, ffn_hidden_size=8, num_attention_heads=6,
                  num_query_groups=4)
    with pytest.raises(ConfigError, match="unknown model preset 'tinny'; did you mean 'tiny'"):
        preset("tinny")


def test_cli_errors_are_one_line_without_traceback(tmp_path):
    result = _cli("convert", str(tmp_path / "missing.gguf"), str(tmp_path / "out"), "--to", "megatron")
    assert result.returncode == 2
    assert "megatron-rl convert: error: model path not found" in result.stderr
    assert "Traceback" not in result.stderr
    recipe = tmp_path / "r.yaml"
    recipe.write_text("trainer:\n  lerning_rate: 1e-6\n")
    result = _cli("config", str(recipe))
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "r.yaml:2: unknown key 'trainer.lerning_rate'" in result.stderr
    result = _cli("convert", "smollm2-135m", str(tmp_path / "out"), "--to", "megatron", "--tp", "2")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "tensor_parallel=2 does not divide the model's 3 key/value heads" in result.stderr
    assert not (tmp_path / "out").exists()  # nothing half-written
    # Megatron's uneven pipeline split: SmolLM2's 30 layers over PP 4 as 7 + 2 x 8 + 6 is fine; 9 + ... is not
    result = _cli("convert", "smollm2-135m", str(tmp_path / "out"), "--to", "megatron", "--pp", "4",
                  "--first-stage-layers", "9", "--last-stage-layers", "6")
    assert result.returncode == 2 and "Traceback" not in result.stderr and not (tmp_path / "out").exists()
    assert "leave 15 of the model's 30 layers for the other 2 stages" in result.stderr


# --- data rows (catalogue: docs/bad_input.md) -------------------------------------------------------------

def _jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


@pytest.mark.parametrize("row, message", [
    ({"prompt": "", "answer": "1"}, r"d\.jsonl:2: field 'prompt' is empty"),
    ({"prompt": "   \n", "answer": "1"}, r"d\.jsonl:2: field 'prompt' is empty"),
    ({"prompt": [], "answer": "1"}, r"d\.jsonl:2: field 'prompt' must be a non-empty string or list of chat messages"),
    ({"prompt": [{"role": "system", "content": "be nice"}], "answer": "1"}, r"d\.jsonl:2: field 'prompt' has no user message"),
    ({"prompt": [{"role": "user"}], "answer": "1"}, r"d\.jsonl:2: field 'prompt' must be a string or a list of .*messages"),
    (["a", "list"], r"d\.jsonl:2: a row must be a JSON object, got list"),
    ({"prompt": "hi", "answer": "1", "extra": {"q": 1}}, None),
])
def test_bad_jsonl_rows_name_file_line_and_field(tmp_path, row, message):
    from megatron_rl.data.config import SourceConfig
    from megatron_rl.data.prompts import DataError
    from megatron_rl.data.sources import load_file_source

    path = _jsonl(tmp_path / "d.jsonl", [{"prompt": "fine", "answer": "2"}, row])
    if message is None:
        assert len(load_file_source(SourceConfig(kind="jsonl", path=path))) == 2
        return
    with pytest.raises(DataError, match=message):
        load_file_source(SourceConfig(kind="jsonl", path=path))
    skipped = load_file_source(SourceConfig(kind="jsonl", path=path, on_bad_row="skip"))
    assert len(skipped) == 1 and skipped.stats["bad_rows_skipped"] == 1


def test_bad_parquet_rows_and_files(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    from megatron_rl.data.config import SourceConfig
    from megatron_rl.data.prompts import DataError
    from megatron_rl.data.sources import load_file_source

    path = str(tmp_path / "d.parquet")
    pq.write_table(pa.table({"prompt": ["1+1?", None, "3+3?"], "answer": ["2", "4", "6"]}), path)
    with pytest.raises(DataError, match=r"d\.parquet: row 1: field 'prompt' must be a non-empty string .* got NoneType"):
        load_file_source(SourceConfig(kind="parquet", path=path))
    assert load_file_source(SourceConfig(kind="parquet", path=path, on_bad_row="skip")).stats == \
        {"rows_read": 3, "bad_rows_skipped": 1}
    with pytest.raises(DataError, match=r"d\.parquet: row 0: missing field 'question' \(prompt_field\)"):
        load_file_source(SourceConfig(kind="parquet", path=path, prompt_field="question"))
    broken = tmp_path / "broken.parquet"
    broken.write_bytes(open(path, "rb").read()[:40])
    with pytest.raises(DataError, match=r"broken\.parquet: cannot read parquet file"):
        load_file_source(SourceConfig(kind="parquet", path=str(broken)))


class _StubTokenizer:
    """Token count = characters of the user message (prompt lengths under the test's control)."""

    def encode_chat(self, messages):
        return [1] * len(messages[-1]["content"])

    def decode(self, ids):
        return ""


class _StubEngine:
    def __init__(self):
        self.submitted = []

    def submit(self, requests):
        from concurrent.futures import Future

        from megatron_rl.types import Completion

        futures = []
        for request in requests:
            self.submitted.append(request)
            for sample_id in request.sample_ids():
                future = Future()
                future.set_result(Completion(sample_id, list(request.prompt_ids), [2], [-1.0], [0], "stop",
                                             request.group_id))
                futures.append(future)
        return futures

    def wait(self, futures, timeout=None):
        return [f.result() for f in futures]


def test_prompt_longer_than_the_context_is_named_or_skipped_and_counted(tmp_path):
    from megatron_rl.controller.episodes import SingleTurnSampling
    from megatron_rl.controller.producer import RolloutProducer
    from megatron_rl.data.config import DataConfig, SourceConfig
    from megatron_rl.data.prompts import DataError
    from megatron_rl.data.sources import PromptStream, build_datasets
    from megatron_rl.rewards.registry import Reward
    from megatron_rl.rewards.config import RewardConfig
    from megatron_rl.rollout.config import RolloutConfig

    path = _jsonl(tmp_path / "p.jsonl", [{"prompt": "short", "answer": "1"}, {"prompt": "x" * 50, "answer": "2"},
                                         {"prompt": "tiny", "answer": "3"}, {"prompt": "ok", "answer": "4"}])
    data = DataConfig(train=SourceConfig(kind="jsonl", path=path), heldout_size=0, shuffle=False)
    train_set, _ = build_datasets(data)

    def producer(mode):
        config = RolloutConfig(prompts_per_step=2, samples_per_prompt=1, on_overlong_prompt=mode)
        episodes = SingleTurnSampling(_StubEngine(), _StubTokenizer(), Reward(RewardConfig(name="exact_match")), config)
        return RolloutProducer(episodes, _StubTokenizer(), PromptStream.from_config(train_set, data), config, seed=0,
                               max_prompt_tokens=20)

    with pytest.raises(DataError, match=r"p\.jsonl: row 2: prompt '[^']+' has 50 tokens after the chat template, "
                                        r"more than the 20 .*engine.max_seq_len.*on_overlong_prompt=skip"):
        producer("error").next_groups(0)
    skipping = producer("skip")
    groups = skipping.next_groups(0)
    assert [g.prompt.question for g in groups] == ["short", "tiny"]  # the next prompt takes the slot
    assert skipping.last_skipped == [train_set[1].prompt_id]
    assert [g.prompt.question for g in skipping.next_groups(1)] == ["ok", "short"]
    assert skipping.last_skipped == []


def test_rollout_buffer_of_changed_data_is_refused(tmp_path):
    from megatron_rl.controller.episodes import SingleTurnSampling
    from megatron_rl.controller.producer import RolloutProducer
    from megatron_rl.data.config import DataConfig, SourceConfig
    from megatron_rl.data.prompts import DataError
    from megatron_rl.data.sources import PromptStream, build_datasets
    from megatron_rl.rewards.registry import Reward
    from megatron_rl.rewards.config import RewardConfig
    from megatron_rl.rollout.config import RolloutConfig

    def producer(rows):
        data = DataConfig(train=SourceConfig(kind="jsonl", path=_jsonl(tmp_path / "b.jsonl", rows)), heldout_size=0)
        train_set, _ = build_datasets(data)
        config = RolloutConfig(prompts_per_step=1, samples_per_prompt=2, max_staleness=1)
        episodes = SingleTurnSampling(_StubEngine(), _StubTokenizer(), Reward(RewardConfig(name="exact_match")), config)
        return RolloutProducer(episodes, _StubTokenizer(), PromptStream.from_config(train_set, data), config, seed=0)

    rows = [{"prompt": f"q{i}", "answer": str(i)} for i in range(4)]
    first = producer(rows)
    first.next_groups(0)
    tensors, metadata = first.state_dict()
    assert len(metadata["groups"]) == 1
    restored = producer(rows)
    restored.load_state_dict(tensors, metadata)
    assert restored.pending_prompt_ids() == first.pending_prompt_ids()
    rows[metadata["groups"][0]["index"]]["prompt"] = "edited"
    with pytest.raises(DataError, match=r"checkpoint rollout buffer: prompt '[^']+' .*is not in the training data"):
        producer(rows).load_state_dict(tensors, metadata)


def test_checkpoint_from_another_parallel_layout(tmp_path):
    import types

    from megatron_rl.checkpoint.config import CheckpointConfig
    from megatron_rl.checkpoint.manager import CheckpointError, CheckpointManager

    (tmp_path / "ck" / "model" / "mp_rank_00_000").mkdir(parents=True)
    trainer = types.SimpleNamespace(tp_rank=1, pp_rank=0)
    with pytest.raises(CheckpointError, match=r"no model shard for tp=1 pp=0 \(was the checkpoint written with "
                                              r"another parallel layout\?\)"):
        CheckpointManager(str(tmp_path), CheckpointConfig()).load(str(tmp_path / "ck"), trainer)


def test_model_without_tokenizer(tmp_path, tiny_chat_model):
    import shutil

    from megatron_rl.controller.loop import build_controller
    from megatron_rl.models.config import ModelConfig
    from megatron_rl.run_config import RunConfig

    bare = tmp_path / "bare"
    shutil.copytree(tiny_chat_model, bare)
    (bare / "tokenizer.json").unlink()
    with pytest.raises(ConfigError, match=r"bare: the model has no tokenizer \(tokenizer.json\)"):
        build_controller(RunConfig(model=ModelConfig(path=str(bare)), run_dir=str(tmp_path / "run")))


def test_new_reliability_config_fields_are_validated(tmp_path):
    from megatron_rl.config import load_yaml
    from megatron_rl.run_config import RunConfig

    with pytest.raises(ConfigError, match=r"command-line override 'trainer.max_nonfinite_steps_in_a_row': .*must be >= 1"):
        load_yaml(RunConfig, None, ["trainer.max_nonfinite_steps_in_a_row=0"])
    with pytest.raises(ConfigError, match=r"'rollout.on_overlong_prompt' = 'drop' is not one of \['error', 'skip'\]"):
        load_yaml(RunConfig, None, ["rollout.on_overlong_prompt=drop"])
    with pytest.raises(ConfigError, match=r"'rollout.deterministic' must be true or false, got 'yes please'"):
        load_yaml(RunConfig, None, ["rollout.deterministic=yes please"])


def test_http_server_binds_loopback_by_default(tiny_arch):
    from megatron_rl.rollout.config import NativeEngineConfig
    from megatron_rl.rollout.native import NativeEngine
    from megatron_rl.rollout.server import RolloutServer
    from tests.helpers import tiny_state

    engine = NativeEngine(tiny_arch, tiny_state(tiny_arch), config=NativeEngineConfig(max_batch_size=1, max_seq_len=16))
    try:
        server = RolloutServer(engine, port=0)
        assert server.address[0] == "127.0.0.1"
        server.shutdown()
    finally:
        engine.close()


def test_every_row_of_the_bad_input_catalogue_names_existing_tests():
    import ast
    import os
    import re

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    rows = [line for line in open(os.path.join(root, "docs", "bad_input.md")) if line.startswith("| ")
            and not line.startswith(("| Input", "| Fault", "|---"))]
    assert len(rows) >= 30
    defined: dict[str, set[str]] = {}
    for row in rows:
        named = re.findall(r"`(tests/\w+\.py)::(\w+)`", row.rsplit("|", 2)[1])
        assert named, f"catalogue row without a test: {row.strip()}"
        for file, test in named:
            if file not in defined:
                tree = ast.parse(open(os.path.join(root, file)).read())
                defined[file] = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
            assert test in defined[file], f"{file}::{test} (named in docs/bad_input.md) does not exist"
