"""Config tree: YAML + dotted overrides, typed conversion, errors that name the field, file and line."""
from __future__ import annotations

import dataclasses

import pytest

from megatron_rl.config import ConfigError, describe, field_docs, from_dict, load_yaml
from megatron_rl.run_config import RunConfig


def _write(tmp_path, text):
    path = tmp_path / "recipe.yaml"
    path.write_text(text)
    return str(path)


def test_yaml_and_overrides(tmp_path):
    path = _write(tmp_path, "trainer:\n  lr: 1e-5\n  parallel:\n    tensor_parallel: 2\nrun_dir: out\n")
    config = load_yaml(RunConfig, path, ["trainer.lr=3e-6", "trainer.parallel.pipeline_parallel=2", "seed=7"])
    assert config.trainer.lr == 3e-6  # override wins; "1e-5" without a dot is still read as a number
    assert config.trainer.parallel.tensor_parallel == 2
    assert config.trainer.parallel.pipeline_parallel == 2
    assert config.seed == 7 and config.run_dir == "out"


def test_unknown_key_suggests_closest_with_file_and_line(tmp_path):
    path = _write(tmp_path, "trainer:\n  lr: 1e-5\n  micro_bach_size: 4\n")
    with pytest.raises(ConfigError) as info:
        load_yaml(RunConfig, path)
    message = str(info.value)
    assert f"{path}:3" in message and "trainer.micro_bach_size" in message
    assert "did you mean 'trainer.micro_batch_size'" in message


def test_override_typo_names_the_override():
    with pytest.raises(ConfigError, match=r"command-line override 'trainer\.lrr'.*did you mean 'trainer\.lr'"):
        load_yaml(RunConfig, None, ["trainer.lrr=1e-6"])


def test_wrong_type_and_invalid_value_name_the_field(tmp_path):
    path = _write(tmp_path, "trainer:\n  micro_batch_size: four\n")
    with pytest.raises(ConfigError, match=r"recipe\.yaml:2: field 'trainer\.micro_batch_size' must be an integer"):
        load_yaml(RunConfig, path)
    path = _write(tmp_path, "trainer:\n  parallel:\n    tensor_parallel: 0\n")
    with pytest.raises(ConfigError, match=r"recipe\.yaml:3: field 'trainer\.parallel\.tensor_parallel': must be >= 1"):
        load_yaml(RunConfig, path)
    with pytest.raises(ConfigError, match=r"not one of \['auto', 'fp32', 'bf16'\].*did you mean 'bf16'"):
        load_yaml(RunConfig, None, ["trainer.precision=bf61"])


def test_invalid_yaml_reports_line(tmp_path):
    path = _write(tmp_path, "trainer:\n  lr: [1e-5\n")
    with pytest.raises(ConfigError, match=r"recipe\.yaml:\d+: invalid YAML"):
        load_yaml(RunConfig, path)


def test_a_yaml_alias_bomb_is_refused_before_it_is_walked(tmp_path):
    """Nine levels of nine aliases stand for 9**9 values in a dozen lines; an ordinary anchor still works."""
    levels = ["    l0: &l0 [x, x, x, x, x, x, x, x, x]"]
    levels += [f"    l{k}: &l{k} [{', '.join([f'*l{k - 1}'] * 9)}]" for k in range(1, 9)]
    path = _write(tmp_path, "reward:\n  kwargs:\n" + "\n".join(levels) + "\n")
    with pytest.raises(ConfigError, match=r"recipe\.yaml: the YAML's aliases expand to more than 100,000 values"):
        load_yaml(RunConfig, path)
    with pytest.raises(ConfigError, match="command-line override reward.kwargs: the YAML's aliases expand"):
        load_yaml(RunConfig, _write(tmp_path, "steps: 2\n"), ["reward.kwargs={" + ", ".join(
            line.strip().replace(": ", ": ", 1) for line in levels) + "}"])
    shared = _write(tmp_path, "reward:\n  kwargs:\n    a: &a {n: 1}\n    b: *a\n")
    assert load_yaml(RunConfig, shared).reward.kwargs == {"a": {"n": 1}, "b": {"n": 1}}


def test_missing_file():
    with pytest.raises(ConfigError, match="config file not found: /nonexistent.yaml"):
        load_yaml(RunConfig, "/nonexistent.yaml")


def _all_config_classes(cls, seen=None):
    seen = seen if seen is not None else set()
    seen.add(cls)
    for f in dataclasses.fields(cls):
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        if dataclasses.is_dataclass(default) and type(default) not in seen:
            _all_config_classes(type(default), seen)
    return seen


def test_every_field_is_documented():
    for cls in _all_config_classes(RunConfig):
        docs = field_docs(cls)
        undocumented = [f.name for f in dataclasses.fields(cls) if not docs.get(f.name)]
        assert not undocumented, f"{cls.__name__} fields without a docstring: {undocumented}"
    assert any("trainer.parallel.tensor_parallel: int = 1" in line for line in describe(RunConfig))


def test_from_dict_round_trip():
    config = load_yaml(RunConfig, None, ["trainer.lr=2e-6"])
    assert from_dict(RunConfig, dataclasses.asdict(config)) == config


def test_config_tree_imports_and_validates_without_torch():
    """The whole config tree (`megatron-rl config`, recipe validation, the planner's input) is read without
    importing torch, Megatron or numpy: every section lives in a torch-free module."""
    import subprocess
    import sys

    code = ("import sys; from megatron_rl.run_config import RunConfig; RunConfig(); "
            "print(sorted(m for m in ('torch', 'megatron', 'numpy', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
