"""Our SGLang client, weight sync and launch line against SGLang 0.5.23's contract.

The contract (tests/fixtures/sglang_0.5.23_contract.json) is extracted from the sglang 0.5.23 wheel by
scripts/extract_sglang_contract.py: request structs, the /generate schema, the routes, and the
launch_server flags. Two kinds of test:
- every request body and launch flag we produce, validated against it (no server);
- our weight sync and control calls against tests/sglang_standin.py, a stand-in server that enforces
  0.5.23's weight-update rules (begin/end sessions, the writer lock, flush refused while requests run).
Where sglang itself is installed (the gpu extra), the fixture is checked against the real library.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request

import pytest
import torch

from megatron_rl.cli.launch_env import sglang_server_args
from megatron_rl.rollout.client import HTTPEngine, SGLangServer, encode_routed_experts
from megatron_rl.rollout.engine import GenerateRequest, RequestError, SamplingParams
from megatron_rl.trainer.parallel import free_port
from megatron_rl.weight_sync.distributed import BroadcastWeightSender
from tests.sglang_standin import CONTRACT, _check_body, check_sampling_params

ROUTES = CONTRACT["routes"]


# --- the fixture against the installed library (GPU environments) --------------------------------
def test_fixture_matches_installed_sglang():
    server_args = pytest.importorskip("sglang.srt.server_args")
    import argparse

    import sglang

    assert sglang.__version__ == CONTRACT["sglang_version"]
    parser = argparse.ArgumentParser()
    server_args.ServerArgs.add_cli_args(parser)
    flags = {o for a in parser._actions for o in a.option_strings if o.startswith("--")}
    assert flags == set(CONTRACT["server_flags"])


# --- every request body we send, validated against the contract ----------------------------------
class _Recorder:
    """Stands in for the HTTP transport: records (method, path, body) and answers as SGLang would."""

    def __init__(self):
        self.sent: list[tuple[str, str, object]] = []

    def __call__(self, method, path, body=None, *, raw=None, content_type="application/json"):
        self.sent.append((method, path.split("?")[0], body))
        if path == "/model_info":
            return 200, {"weight_version": "default", "model_path": "m"}
        if path == "/generate":
            n = len(body["input_ids"]) if body["input_ids"] and isinstance(body["input_ids"][0], list) else 1
            samples = sum(p.get("n", 1) for p in body["sampling_params"]) if n > 1 or isinstance(
                body["sampling_params"], list) else body["sampling_params"].get("n", 1)
            meta = {"id": "r", "finish_reason": {"type": "length"}, "weight_version": "default",
                    "output_token_logprobs": [[-0.5, 1, None]]}
            if body.get("return_routed_experts"):  # prompt + 1 output - 1 positions, 2 layers x top-2
                prompt = body["input_ids"][0] if isinstance(body["input_ids"][0], list) else body["input_ids"]
                meta["routed_experts"] = encode_routed_experts(torch.zeros(len(prompt), 2, 2, dtype=torch.int32))
            return 200, [{"output_ids": [1], "meta_info": meta}] * samples
        return 200, {"success": True, "message": "ok"}


def _violations(sent) -> list[str]:
    problems = []
    for method, path, body in sent:
        route = ROUTES.get(path)
        if route is None:
            problems.append(f"{path}: no such route in SGLang {CONTRACT['sglang_version']}")
            continue
        if route["deprecated"]:
            problems.append(f"{path}: deprecated in SGLang {CONTRACT['sglang_version']}")
        if method not in route["methods"]:
            problems.append(f"{path}: {method} not among {route['methods']}")
        if path == "/generate":  # pre-checked as api_types' GenerateRequest, then parsed as GenerateReqInput
            unknown = set(body) - set(CONTRACT["requests"]["GenerateReqInput"]["fields"])
            if unknown:
                problems.append(f"/generate: fields SGLang ignores {sorted(unknown)}")
            known = CONTRACT["generate"]["GenerateRequest"]["fields"]
            lists = [k for k, v in body.items() if isinstance(v, list) and k in known and not known[k]["list"]]
            if lists:
                problems.append(f"/generate: {lists} take one value, not a list")
            error = check_sampling_params(body.get("sampling_params"))
            if error:
                problems.append(f"/generate: {error}")
        elif route["body"] in CONTRACT["requests"]:
            error = _check_body(route["body"], body if body is not None else {})
            if error:
                problems.append(f"{path}: {error}")
            unknown = set(body or {}) - set(CONTRACT["requests"][route["body"]]["fields"])
            if unknown:  # SGLang ignores them silently: a field we think we send, it never reads
                problems.append(f"{path}: fields {route['body']} does not have {sorted(unknown)}")
    return problems


@pytest.fixture
def recorded(monkeypatch):
    recorder = _Recorder()
    monkeypatch.setattr(HTTPEngine, "request", lambda self, *a, **k: recorder(*a, **k))
    return recorder


def test_generation_and_control_bodies_match_contract(recorded):
    engine = HTTPEngine("http://sglang")
    sampling = SamplingParams(max_new_tokens=4, top_k=0, seed=3, stop=["</a>"], n=2)  # top_k 0: whole vocabulary
    engine.generate([GenerateRequest(request_id="r0", prompt_ids=[1, 2], sampling=sampling),
                     GenerateRequest(request_id="r1", prompt_ids=[3], sampling=SamplingParams(top_k=5))])
    engine.abort(["r0-0", "r0-1"])
    engine.abort("r1")
    engine.abort()
    engine.pause()
    engine.resume()
    engine.flush_cache()
    health = engine.health()
    assert engine.version == 0  # a server launched from the checkpoint reports "default": our version 0
    assert health["ok"] is True and health["version"] == 0
    assert _violations(recorded.sent) == []
    aborts = [b for _, p, b in recorded.sent if p == "/abort_request"]
    assert {"rid": "r0-0"} in aborts and {"rid": "r1"} in aborts and {"abort_all": True} in aborts
    generate = next(b for _, p, b in recorded.sent if p == "/generate")
    assert [p["top_k"] for p in generate["sampling_params"]] == [-1, 5]
    assert "return_routed_experts" not in generate


def test_routing_record_request_matches_contract(recorded):
    """An MoE run's engines ask for routing records: a field /generate's handler reads (GenerateReqInput),
    one scalar for the whole batch, and the launch flag that turns the capture on."""
    HTTPEngine("http://sglang", routing=(2, 2)).generate(
        [GenerateRequest(request_id="r0", prompt_ids=[1, 2], sampling=SamplingParams(max_new_tokens=1))])
    assert _violations(recorded.sent) == []
    generate = next(b for _, p, b in recorded.sent if p == "/generate")
    assert generate["return_routed_experts"] is True
    fields = CONTRACT["requests"]["GenerateReqInput"]["fields"]
    assert fields["return_routed_experts"]["type"] == "bool" and not fields["return_routed_experts"]["list"]
    assert "--enable-return-routed-experts" in sglang_server_args(1, "bf16", 8, True, record_routing=True)
    assert "--enable-return-routed-experts" not in sglang_server_args(1, "bf16", 8, True)


def test_weight_update_bodies_match_contract(recorded):
    server = SGLangServer("http://sglang")
    server.init_weights_update_group("127.0.0.1", 1234, 1, 2, "weight_update_group", "nccl")
    server.pause("in_place")
    server.begin_weight_update()
    server.update_weights_from_distributed(["a"], ["bfloat16"], [[2, 2]], None, "weight_update_group", False)
    server.update_weights_from_distributed(["b"], ["bfloat16"], [[2]], 3, "weight_update_group", True)
    server.end_weight_update()
    server.resume()
    assert _violations(recorded.sent) == []
    paths = [p for _, p, _ in recorded.sent]
    assert paths.index("/begin_weight_update") < paths.index("/update_weights_from_distributed") \
        < paths.index("/end_weight_update")


def test_lora_bodies_and_flags_match_contract(recorded):
    """Adapter sync (`rollout.weight_sync: adapters`): /load_lora_adapter and /unload_lora_adapter bodies are
    0.5.23's LoadLoRAAdapterReqInput / UnloadLoRAAdapterReqInput, /generate names the adapter in lora_path (one per
    request of the batch), and the servers are launched with LoRA on for the trainer's rank and projections."""
    engine = HTTPEngine("http://sglang")
    engine.load_adapter("/runs/r/adapters/v1", 1)
    engine.generate([GenerateRequest(request_id="r0", prompt_ids=[1, 2], sampling=SamplingParams(max_new_tokens=1)),
                     GenerateRequest(request_id="r1", prompt_ids=[3], sampling=SamplingParams(max_new_tokens=1))])
    engine.load_adapter("/runs/r/adapters/v2", 2)
    engine._pool.shutdown(wait=True)  # the previous adapter's unload runs in the background
    assert _violations(recorded.sent) == []
    loads = [b for _, p, b in recorded.sent if p == "/load_lora_adapter"]
    assert loads == [{"lora_name": "policy-v1", "lora_path": "/runs/r/adapters/v1"},
                     {"lora_name": "policy-v2", "lora_path": "/runs/r/adapters/v2"}]
    assert [b for _, p, b in recorded.sent if p == "/unload_lora_adapter"] == [{"lora_name": "policy-v1"}]
    generate = next(b for _, p, b in recorded.sent if p == "/generate")
    assert generate["lora_path"] == ["policy-v1", "policy-v1"]
    fields = CONTRACT["requests"]["GenerateReqInput"]["fields"]
    assert fields["lora_path"]["list"] and CONTRACT["generate"]["GenerateRequest"]["fields"]["lora_path"]["list"]
    args = sglang_server_args(1, "bf16", 8, True, lora=(8, ["linear_qkv", "linear_proj"]))
    assert set(a for a in args if a.startswith("--")) <= set(CONTRACT["server_flags"])
    modules = args[args.index("--lora-target-modules") + 1:args.index("--weight-version")]
    assert "--enable-lora" in args and args[args.index("--max-lora-rank") + 1] == "8"
    assert modules == ["k_proj", "o_proj", "q_proj", "v_proj"]


def test_launch_flags_are_sglang_0_5_23_flags():
    args = sglang_server_args(8, "fp8", 256, False, mem_fraction_static=0.82, deterministic=True, record_routing=True)
    flags = [a for a in args if a.startswith("--")]
    assert set(flags) <= set(CONTRACT["server_flags"]), sorted(set(flags) - set(CONTRACT["server_flags"]))
    assert args[args.index("--tp-size") + 1] == "8" and args[args.index("--max-running-requests") + 1] == "256"
    assert args[args.index("--mem-fraction-static") + 1] == "0.82"
    assert "--enable-deterministic-inference" in args and "--disable-cuda-graph" in args
    assert args[args.index("--quantization") + 1] == "fp8"
    assert args[args.index("--weight-version") + 1] == "0"


# --- weight sync against the stand-in server -----------------------------------------------------
@pytest.fixture
def standin():
    yield from _standin()


@pytest.fixture
def standin_lora():
    yield from _standin("--enable-lora")


def _standin(*flags):
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "tests.sglang_standin", "--port", str(port), *flags],
                            cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))), env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            urllib.request.urlopen(url + "/health", timeout=1)
            break
        except OSError:
            if time.monotonic() > deadline or proc.poll() is not None:
                proc.kill()
                raise RuntimeError("the SGLang stand-in did not start")
            time.sleep(0.2)
    yield url
    proc.kill()
    proc.wait()


def _state(url: str) -> dict:
    with urllib.request.urlopen(url + "/standin/state") as resp:
        return json.loads(resp.read())


def _model(url: str, named: dict) -> None:
    req = urllib.request.Request(url + "/standin/model", data=json.dumps({"names": list(named)}).encode(),
                                 method="POST", headers={"Content-Type": "application/json"})
    urllib.request.urlopen(req).read()


def _weights(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"layer{i}.weight": torch.randn(64, 64, generator=g) for i in range(6)}


def _submit_long(engine: HTTPEngine, url: str, count: int = 3, tokens: int = 1500):
    futures = engine.submit([GenerateRequest(request_id=f"q{i}", prompt_ids=[1, 2, 3],
                                             sampling=SamplingParams(max_new_tokens=tokens)) for i in range(count)])
    deadline = time.monotonic() + 30
    while len(_state(url)["steps"]) < 2 * count:  # generation has started
        assert time.monotonic() < deadline
        time.sleep(0.02)
    return futures


def _sender(url: str) -> BroadcastWeightSender:
    return BroadcastWeightSender([SGLangServer(url)], [1], master_address="127.0.0.1", master_port=free_port(),
                                 backend="gloo", bucket_bytes=40 << 10)  # 6 tensors of 16 KiB: 3 buckets


def _check_one_model_per_label(state: dict) -> None:
    assert state["steps"] and all(step["consistent"] for step in state["steps"]), \
        "a decode step ran on half-updated weights"
    assert state["label_moves"] and all(move["consistent"] for move in state["label_moves"]), \
        "the weight version moved before every tensor of that version had arrived"
    assert not state["session"] and state["deprecated_calls"] == []


def test_in_flight_sync_updates_running_requests_between_two_decode_steps(standin):
    weights = _weights(1)
    _model(standin, weights)
    engine = HTTPEngine(standin)
    futures = _submit_long(engine, standin)
    sender = _sender(standin)
    stats = sender.push(weights.items(), version=1)
    sender.close()
    completions = engine.wait(futures, timeout=60)
    state = _state(standin)
    _check_one_model_per_label(state)
    assert stats["weight_sync/buckets"] == 3 and state["version"] == "1"
    # in flight: the requests running across the sync hold tokens of both versions, none aborted
    assert all(c.finish_reason == "length" and set(c.weight_versions) == {0, 1} for c in completions)
    assert state["checksum"] == {k: pytest.approx(float(v.double().sum())) for k, v in weights.items()}
    engine.close()


def test_pause_mode_sync_flushes_the_cache(standin):
    weights = _weights(2)
    _model(standin, weights)
    engine = HTTPEngine(standin)
    futures = _submit_long(engine, standin)
    engine.pause()  # controller/loop.py's pause mode: pause, push, flush, resume
    sender = _sender(standin)
    sender.push(weights.items(), version=4)
    assert engine.flush_cache() is True
    engine.resume()
    sender.close()
    completions = engine.wait(futures, timeout=60)
    state = _state(standin)
    _check_one_model_per_label(state)
    assert state["version"] == "4" and all(c.finish_reason == "length" for c in completions)
    assert any("flush=True" in e for e in state["events"]) and not any(e.startswith("400") for e in state["events"])
    engine.close()


def test_abort_by_request_id_and_health(standin):
    engine = HTTPEngine(standin)
    assert engine.version == 0 and engine.health()["ok"] is True
    futures = _submit_long(engine, standin, count=2, tokens=5000)
    engine.abort(["q0"])
    first = futures[0].result(timeout=30)
    assert first.finish_reason == "abort" and not futures[1].done()
    engine.abort()
    assert futures[1].result(timeout=30).finish_reason == "abort"
    assert _state(standin)["deprecated_calls"] == []
    engine.close()


# --- the in-process engine's calls into sglang.Engine's tokenizer manager ------------------------
class _FakeIO:
    """io_struct's request types as far as we build them: each refuses a field 0.5.23 does not have."""

    def __getattr__(self, name):
        fields = CONTRACT["requests"][name]["fields"]

        def make(**kwargs):
            unknown = set(kwargs) - set(fields)
            assert not unknown, f"{name} has no field(s) {sorted(unknown)}"
            return (name, kwargs)
        return make


class _FakeTokenizerManager:
    def __init__(self):
        self.calls = []

    def __getattr__(self, method):
        async def call(obj=None, request=None):
            self.calls.append((method, obj))
            return (True, "ok")
        return call


def _in_process_engine(monkeypatch):
    import asyncio
    import threading

    from megatron_rl.rollout import sglang_engine

    engine = object.__new__(sglang_engine.SGLangEngine)
    engine._tm = _FakeTokenizerManager()
    engine._loop = asyncio.new_event_loop()
    threading.Thread(target=engine._loop.run_forever, daemon=True).start()
    engine._engine = type("E", (), {"_serialize_tensors_per_rank": staticmethod(lambda named, _: [b"x"])})()
    engine._version, engine._paused = 0, None
    monkeypatch.setattr(sglang_engine.SGLangEngine, "_io", staticmethod(lambda: _FakeIO()))
    return engine


def test_in_process_engine_updates_inside_a_session_paused_in_place(monkeypatch):
    engine = _in_process_engine(monkeypatch)
    engine.update_weights({"w": torch.zeros(2)}, version=3)
    calls = [(m, o[0] if o else None) for m, o in engine._tm.calls]
    assert calls == [("pause_generation", "PauseGenerationReqInput"),
                     ("begin_weight_update", "BeginWeightUpdateReqInput"),
                     ("update_weights_from_tensor", "UpdateWeightsFromTensorReqInput"),
                     ("end_weight_update", "EndWeightUpdateReqInput"),
                     ("continue_generation", "ContinueGenerationReqInput")]
    assert engine._tm.calls[0][1][1] == {"mode": "in_place"}
    update = engine._tm.calls[2][1][1]
    assert update["flush_cache"] is False and update["weight_version"] == "3" and engine.version == 3
    # the controller's pause mode: retract first (running requests freed), then the update flushes
    engine._tm.calls.clear()
    engine.pause()
    engine.update_weights({"w": torch.zeros(2)}, version=4)
    engine.resume()
    methods = [m for m, _ in engine._tm.calls]
    assert methods == ["pause_generation", "begin_weight_update", "update_weights_from_tensor", "end_weight_update",
                       "continue_generation"]
    assert engine._tm.calls[0][1][1] == {"mode": "retract"} and engine._tm.calls[2][1][1]["flush_cache"] is True
    engine._loop.call_soon_threadsafe(engine._loop.stop)


def test_colocated_engine_memory_fraction_from_the_plan():
    from types import SimpleNamespace

    from megatron_rl.config import ConfigError
    from megatron_rl.rollout.sglang_engine import colocated_engine_kwargs

    gib = 2 ** 30
    plan = SimpleNamespace(hardware=SimpleNamespace(hbm_bytes=80 * gib), pp=2, usable_bytes=72 * gib,
                           engine_memory={"kv_cache": 10 * gib},
                           trainer_memory={"weights": 4 * gib, "gradients": 4 * gib, "optimizer": 16 * gib})
    kwargs = colocated_engine_kwargs(plan, deterministic=True)
    # its own weights sharded by TP only (4 GiB x PP 2) + 10 GiB of KV cache = 18 / 80 of the GPU
    assert kwargs == {"mem_fraction_static": 0.23, "enable_memory_saver": True,
                      "enable_deterministic_inference": True}
    for key in ("mem_fraction_static", "enable_memory_saver", "enable_deterministic_inference"):
        assert "--" + key.replace("_", "-") in CONTRACT["server_flags"]  # sglang.Engine takes ServerArgs fields
    plan.engine_memory["kv_cache"] = 50 * gib
    with pytest.raises(ConfigError, match="a colocated engine needs"):
        colocated_engine_kwargs(plan, deterministic=False)
    # MoE: the engine holds every expert (the trainer's share x PP x EP), the trainer keeps its expert state
    moe = SimpleNamespace(hardware=plan.hardware, pp=2, ep=4, usable_bytes=72 * gib, engine_memory={"kv_cache": 10 * gib},
                          trainer_memory={"weights": 1 * gib, "gradients": 1 * gib, "optimizer": 4 * gib,
                                          "expert_weights": 2 * gib, "expert_gradients": 2 * gib,
                                          "expert_optimizer": 8 * gib, "activations": 30 * gib})
    # 1 x 2 dense + 2 x 2 x 4 experts + 10 KV = 28 GiB of 80
    assert colocated_engine_kwargs(moe, deterministic=False)["mem_fraction_static"] == 0.35
    moe.engine_memory["kv_cache"] = 40 * gib  # 18 resident + 58 engine > 72 usable (activations are freed)
    with pytest.raises(ConfigError, match="a colocated engine needs 58.0 GiB next to the trainer's 18.0 GiB"):
        colocated_engine_kwargs(moe, deterministic=False)


def test_gpu_extra_pins_what_sglang_pins():
    import re

    setup = open(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "setup.py")).read()
    gpu = re.search(r'"gpu": \[(.*?)\]', setup).group(1)
    pins = dict(re.findall(r'"([\w\-\[\],]+?)(?:\[[^\]]*\])?==([\w.]+)"', gpu))
    assert pins["sglang"] == CONTRACT["sglang_version"]
    assert f"torch=={pins['torch']}" in CONTRACT["pins"]  # the torch sglang 0.5.23 requires, not another


# --- process groups: CPU tensors never go over an NCCL-only group ---------------------------------
def test_shared_memory_channel_collectives_use_a_gloo_group(monkeypatch):
    from megatron_rl.weight_sync import channel

    made = []
    monkeypatch.setattr(channel.dist, "get_backend", lambda group=None: "nccl")
    monkeypatch.setattr(channel.dist, "new_group",
                        lambda ranks=None, backend=None: made.append(backend) or "gloo-group")
    assert channel.cpu_tensor_group() == "gloo-group" and made == ["gloo"]
    monkeypatch.setattr(channel.dist, "get_backend", lambda group=None: "cpu:gloo,cuda:nccl")
    assert channel.cpu_tensor_group("world") == "world" and made == ["gloo"]


# --- LoRA adapters into SGLang servers ------------------------------------------------------------
def _lora_trainer():
    from megatron_rl.models.arch import preset
    from tests.helpers import tiny_state
    from tests.test_lora import _trainer

    arch = preset("tiny")
    return _trainer(arch, tiny_state(arch))


def test_adapter_sync_loads_peft_directories_into_sglang(standin_lora, tmp_path):
    """A LoRA trainer's adapters reach an SGLang server as PEFT directories through /load_lora_adapter: what the
    server loaded is the trainer's adapters (read back by peft's format reader), new requests run on the newest
    adapter and are tagged with its version, a request in flight finishes on the adapter it started with, which is
    then unloaded, and only the newest directory is kept."""
    from megatron_rl.models.lora_layout import read_peft_adapter
    from megatron_rl.rollout.pool import EnginePool
    from megatron_rl.weight_sync.channel import AdapterWeightChannel
    from tests.test_lora import ALPHA, RANK, TARGETS

    trainer = _lora_trainer()
    pool = EnginePool([HTTPEngine(standin_lora)])
    channel = AdapterWeightChannel(trainer, pool, directory=str(tmp_path / "adapters"))
    metrics = channel.push(1)
    v1 = tmp_path / "adapters" / "v1"
    sent = read_peft_adapter(str(v1), rank=RANK, alpha=ALPHA, targets=TARGETS)
    expected = trainer.gather_peft_state()
    assert sent.keys() == expected.keys() and all(torch.equal(sent[k], expected[k]) for k in sent)
    assert metrics["weight_sync/sent_bytes"] == sum(t.numel() * t.element_size() for t in expected.values())
    assert _state(standin_lora)["adapters"]["policy-v1"]["path"] == str(v1)

    long = pool.submit([GenerateRequest(request_id="long", prompt_ids=[1, 2], sampling=SamplingParams(max_new_tokens=400))])
    deadline = time.monotonic() + 30
    while not _state(standin_lora)["steps"]:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    with torch.no_grad():  # version 2 differs from version 1
        for name, param in trainer.gpt.named_parameters():
            if "lora_B" in name:
                param.add_(0.5)
    channel.push(2)
    short = pool.generate([GenerateRequest(request_id="short", prompt_ids=[3], sampling=SamplingParams(max_new_tokens=4))])
    first = pool.wait(long)
    assert short[0].weight_versions == [2] * 4 and first[0].weight_versions == [1] * 400
    deadline = time.monotonic() + 30
    while "unloaded policy-v1" not in _state(standin_lora)["events"]:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    state = _state(standin_lora)
    used = {entry["rid"]: entry["adapter"] for entry in state["adapter_log"]}
    assert used == {"long": "policy-v1", "short": "policy-v2"} and list(state["adapters"]) == ["policy-v2"]
    assert sorted(p.name for p in (tmp_path / "adapters").iterdir()) == ["v2"]
    v2 = read_peft_adapter(str(tmp_path / "adapters" / "v2"), rank=RANK, alpha=ALPHA, targets=TARGETS)
    assert not torch.equal(v2[next(k for k in v2 if "lora_B" in k)], sent[next(k for k in sent if "lora_B" in k)])
    pool.close()


def test_adapter_sync_to_a_server_without_lora_names_the_flag(standin, tmp_path):
    from megatron_rl.rollout.pool import EnginePool
    from megatron_rl.weight_sync.channel import AdapterWeightChannel

    channel = AdapterWeightChannel(_lora_trainer(), EnginePool([HTTPEngine(standin)]), directory=str(tmp_path))
    with pytest.raises(RequestError, match="--enable-lora"):
        channel.push(1)

