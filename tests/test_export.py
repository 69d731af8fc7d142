"""`convert --to hf` writes what transformers' `save_pretrained` writes: config.json with the tensors' dtype,
generation_config.json, safetensors sharded above a size cap with model.safetensors.index.json; the export
loads with AutoModelForCausalLM / AutoTokenizer without a warning and greedy-generates what our engine does.

transformers runs in a fresh subprocess (LOADER below): some of its warnings are emitted once per process, so
only a fresh one shows whether loading our export warns."""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors import safe_open

from megatron_rl.checkpoints_tools.convert import convert, parse_shard_size
from megatron_rl.cli import main as cli_main
from megatron_rl.config import ConfigError
from megatron_rl.models.arch import preset
from megatron_rl.models.pretrained import SAFE_WEIGHTS_INDEX, load_pretrained
from megatron_rl.rollout.config import NativeEngineConfig
from megatron_rl.rollout.engine import GenerateRequest, SamplingParams
from megatron_rl.rollout.native import NativeEngine
from tests.helpers import prompt, tiny_state

transformers = pytest.importorskip("transformers")

# Loads each job's model and tokenizer with transformers, recording every warning (transformers' logging and
# Python's) while loading and while generating; prints one JSON line.
LOADER = r"""
import hashlib, json, logging, sys, warnings
import torch, transformers
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

class Record(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages = []
    def emit(self, record):
        self.messages.append(f"{record.name}: {record.getMessage()}")

transformers.utils.logging.disable_progress_bar()
results = []
for job in json.loads(sys.argv[1]):
    handler = Record()
    logging.getLogger("transformers").addHandler(handler)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = AutoModelForCausalLM.from_pretrained(job["path"]).eval()
        tokenizer = AutoTokenizer.from_pretrained(job["path"])
    load = handler.messages + [f"{w.category.__name__}: {w.message}" for w in caught]
    handler.messages = []
    greedy = []
    with warnings.catch_warnings(record=True) as caught, torch.inference_mode():
        warnings.simplefilter("always")
        for ids in job["prompts"]:
            x = torch.tensor([ids])
            out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=job["new_tokens"],
                                 do_sample=False)
            greedy.append(out[0, len(ids):].tolist())
        logits = model(torch.tensor([job["prompts"][0]])).logits.float().numpy().tobytes()
    generate = handler.messages + [f"{w.category.__name__}: {w.message}" for w in caught]
    logging.getLogger("transformers").removeHandler(handler)
    derived = GenerationConfig.from_model_config(model.config).to_diff_dict()
    saved = model.generation_config.to_diff_dict()
    for config in (derived, saved):
        config.pop("transformers_version", None)
    results.append({"load_warnings": load, "generate_warnings": generate, "greedy": greedy,
                    "dtype": str(model.dtype), "logits_sha": hashlib.sha256(logits).hexdigest(),
                    "generation_config": saved, "generation_config_from_model_config": derived,
                    "tokenizer_ids": tokenizer.encode("Hello world, 1234!", add_special_tokens=False)})
print(json.dumps(results))
"""
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
NEW_TOKENS = 24


def _byte_level_tokenizer():
    """A byte-level BPE with no merges (every byte one token) and three special tokens."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    byte_chars = list(pre_tokenizers.ByteLevel.alphabet())
    vocab = {ch: i for i, ch in enumerate(sorted(byte_chars))}
    tk = Tokenizer(models.BPE(vocab=vocab, merges=[], fuse_unk=False))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tk.decoder = decoders.ByteLevel()
    tk.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in SPECIALS])
    return tk


@pytest.fixture(scope="module")
def hf_source(tmp_path_factory):
    """A tiny random Llama with tied embeddings saved by transformers itself (the source a user converts):
    weights spread enough that greedy decoding has no near-ties."""
    tk = _byte_level_tokenizer()
    arch = dataclasses.replace(preset("tiny"), vocab_size=tk.get_vocab_size(), tie_word_embeddings=True)
    config = transformers.LlamaConfig(
        vocab_size=arch.vocab_size, hidden_size=arch.hidden_size, intermediate_size=arch.ffn_hidden_size,
        num_hidden_layers=arch.num_layers, num_attention_heads=arch.num_attention_heads,
        num_key_value_heads=arch.num_query_groups, max_position_embeddings=arch.max_position_embeddings,
        rope_theta=arch.rope_theta, rms_norm_eps=arch.norm_eps, tie_word_embeddings=True,
        bos_token_id=tk.token_to_id(SPECIALS[0]), eos_token_id=tk.token_to_id(SPECIALS[2]),
        pad_token_id=tk.token_to_id(SPECIALS[0]))
    model = transformers.LlamaForCausalLM(config)
    missing, unexpected = model.load_state_dict(tiny_state(arch, seed=3), strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    path = str(tmp_path_factory.mktemp("export") / "source")
    model.save_pretrained(path)
    transformers.PreTrainedTokenizerFast(tokenizer_object=tk, bos_token=SPECIALS[0], eos_token=SPECIALS[2],
                                         pad_token=SPECIALS[0]).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def exports(hf_source, tmp_path_factory):
    """The source converted three ways: as is, sharded at 60KB, cast to bf16."""
    root = tmp_path_factory.mktemp("exports")
    out = {"plain": str(root / "plain"), "sharded": str(root / "sharded"), "bf16": str(root / "bf16")}
    convert(hf_source, out["plain"], to="hf")
    convert(hf_source, out["sharded"], to="hf", max_shard_size="60KB")
    convert(hf_source, out["bf16"], to="hf", dtype="bf16")
    return out


def _engine_greedy(path: str, prompts: list[list[int]]) -> list[list[int]]:
    model = load_pretrained(path)
    with NativeEngine.from_pretrained(model, NativeEngineConfig(max_batch_size=4, max_seq_len=256)) as engine:
        outs = engine.generate([GenerateRequest(f"p{i}", ids, SamplingParams(temperature=0.0,
                                                                             max_new_tokens=NEW_TOKENS))
                                for i, ids in enumerate(prompts)])
    return [o.output_ids for o in outs]


def _hf_load(jobs: list[dict]) -> list[dict]:
    """Run LOADER on `jobs` in a fresh interpreter; its JSON result per job."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "warning"}
    result = subprocess.run([sys.executable, "-c", LOADER, json.dumps(jobs)], capture_output=True, text=True,
                            env=env, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def _safetensors_keys(path: str) -> dict[str, list[str]]:
    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    keys = {}
    for name in files:
        with safe_open(os.path.join(path, name), "pt") as f:
            assert f.metadata() == {"format": "pt"}
            keys[name] = list(f.keys())
    return keys


def test_export_loads_in_transformers_without_warnings_and_generates_what_our_engine_does(hf_source, exports):
    prompts = [prompt(i, 5 + 3 * i, vocab=256) for i in range(3)]
    jobs = [{"path": hf_source, "prompts": prompts, "new_tokens": NEW_TOKENS}]
    jobs += [{"path": exports[k], "prompts": prompts, "new_tokens": NEW_TOKENS} for k in ("plain", "sharded", "bf16")]
    source, plain, sharded, bf16 = _hf_load(jobs)
    for result in (plain, sharded, bf16):
        assert result["load_warnings"] == [], result["load_warnings"]
        assert result["generate_warnings"] == [], result["generate_warnings"]
        # generation_config.json is what transformers derives from the exported config.json
        assert result["generation_config"] == result["generation_config_from_model_config"]
    assert plain["dtype"] == sharded["dtype"] == "torch.float32" and bf16["dtype"] == "torch.bfloat16"
    # fp32 exports hold the source's exact weights: transformers computes the same logits bit for bit
    assert plain["logits_sha"] == sharded["logits_sha"] == source["logits_sha"]
    assert plain["tokenizer_ids"] == source["tokenizer_ids"]
    engine = _engine_greedy(exports["plain"], prompts)
    assert engine == plain["greedy"] == sharded["greedy"] == source["greedy"]
    assert _engine_greedy(exports["bf16"], prompts) == bf16["greedy"]


def test_export_files_follow_save_pretrained(hf_source, exports):
    plain = exports["plain"]
    with open(os.path.join(plain, "config.json"), encoding="utf-8") as f:
        config = json.load(f)
    assert config["dtype"] == "float32" and config["torch_dtype"] == "float32"
    with open(os.path.join(exports["bf16"], "config.json"), encoding="utf-8") as f:
        assert json.load(f)["dtype"] == "bfloat16"
    with open(os.path.join(plain, "generation_config.json"), encoding="utf-8") as f:
        generation = json.load(f)
    with open(os.path.join(hf_source, "generation_config.json"), encoding="utf-8") as f:
        reference = json.load(f)  # what save_pretrained wrote for the source
    reference.pop("transformers_version")
    assert generation == reference
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        assert generation[key] == config[key]
    # unsharded below the cap, lm_head left out when tied (as save_pretrained)
    keys = _safetensors_keys(plain)
    assert list(keys) == ["model.safetensors"] and "lm_head.weight" not in keys["model.safetensors"]
    assert not os.path.exists(os.path.join(plain, SAFE_WEIGHTS_INDEX))
    for name in keys["model.safetensors"]:
        with safe_open(os.path.join(exports["bf16"], "model.safetensors"), "pt") as f:
            assert f.get_tensor(name).dtype == torch.bfloat16


def test_sharded_export_has_a_valid_index_and_our_loader_reads_it(exports, tmp_path):
    sharded = exports["sharded"]
    keys = _safetensors_keys(sharded)
    n = len(keys)
    assert n >= 3 and sorted(keys) == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    with open(os.path.join(sharded, SAFE_WEIGHTS_INDEX), encoding="utf-8") as f:
        index = json.load(f)
    weight_map = index["weight_map"]
    assert weight_map == {k: name for name, names in keys.items() for k in names}
    state = load_pretrained(sharded).state
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in state.values())
    assert index["metadata"]["total_parameters"] == sum(t.numel() for t in state.values())
    cap = parse_shard_size("60KB")
    for name in keys:  # every shard under the cap unless it holds one tensor bigger than the cap
        assert os.path.getsize(os.path.join(sharded, name)) <= cap + 4096 or len(keys[name]) == 1
    plain = load_pretrained(exports["plain"]).state
    assert state.keys() == plain.keys() and all(torch.equal(state[k], plain[k]) for k in state)
    # a shard the index lists is missing: a clear error naming it
    broken = tmp_path / "broken"
    os.makedirs(broken)
    for name in os.listdir(sharded):
        if name != f"model-00002-of-{n:05d}.safetensors":
            os.link(os.path.join(sharded, name), broken / name)
    with pytest.raises(ConfigError, match=rf"model.safetensors.index.json: shard 'model-00002-of-{n:05d}"
                                          r"\.safetensors' listed in 'weight_map' is missing"):
        load_pretrained(str(broken))
    # the index maps a tensor that its shard does not hold
    os.link(os.path.join(sharded, f"model-00002-of-{n:05d}.safetensors"),
            broken / f"model-00002-of-{n:05d}.safetensors")
    os.remove(broken / SAFE_WEIGHTS_INDEX)
    (broken / SAFE_WEIGHTS_INDEX).write_text(json.dumps(
        {**index, "weight_map": {**weight_map, "model.extra.weight": f"model-00001-of-{n:05d}.safetensors"}}))
    with pytest.raises(ConfigError, match=rf"index.json: tensor 'model.extra.weight' is not in its shard "
                                          rf"'model-00001-of-{n:05d}.safetensors' \(1 missing\)"):
        load_pretrained(str(broken))


def test_cli_max_shard_size_flag(hf_source, tmp_path, capsys):
    out = tmp_path / "cli"
    assert cli_main(["convert", hf_source, str(out), "--to", "hf", "--max-shard-size", "100KB"]) == 0
    assert os.path.isfile(out / SAFE_WEIGHTS_INDEX)
    assert cli_main(["convert", hf_source, str(tmp_path / "bad"), "--to", "hf", "--max-shard-size", "5 parsecs"]) == 2
    err = capsys.readouterr().err
    assert "megatron-rl convert: error: --max-shard-size '5 parsecs' is not a size" in err
    assert "Traceback" not in err and not (tmp_path / "bad").exists()
    assert parse_shard_size("5GB") == 5 * 10**9 and parse_shard_size("1.5MB") == 1_500_000
    assert parse_shard_size(1234) == 1234


@pytest.mark.slow
def test_smollm2_export_loads_without_warnings_and_generates_what_our_engine_does(smollm2, tmp_path):
    out = str(tmp_path / "smollm2-hf")
    convert("smollm2-135m", out, to="hf", max_shard_size="200MB")  # fp32 (GGUF dequantized): 3 shards
    tok = smollm2.tokenizer
    prompts = [tok.encode(text) for text in ("The capital of France is", "def reverse(s):")]
    (result,) = _hf_load([{"path": out, "prompts": prompts, "new_tokens": NEW_TOKENS}])
    assert result["load_warnings"] == [] and result["generate_warnings"] == []
    assert result["dtype"] == "torch.float32" and len(_safetensors_keys(out)) == 3
    assert result["tokenizer_ids"] == tok.encode("Hello world, 1234!")
    assert _engine_greedy(out, prompts) == result["greedy"]
