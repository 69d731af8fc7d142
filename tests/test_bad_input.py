"""Bad input gets one clear error naming the problem (file, field, value), not a traceback."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from megatron_rl.checkpoints_tools.megatron_layout import MegatronLayout, check_parallel_layout
from megatron_rl.checkpoints_tools.pretrained import load_pretrained
from megatron_rl.config import ConfigError
from megatron_rl.models import ModelArch, preset


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
    with pytest.raises(ConfigError, match="config.json: missing field 'num_hidden_layers'"):
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
