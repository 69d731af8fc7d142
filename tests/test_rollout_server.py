"""`megatron-rl serve` over raw HTTP: SGLang-shaped responses, 400s with a message for bad requests
while the server keeps serving, API keys, safetensors-only weight updates; and the generate CLI."""
from __future__ import annotations

import base64
import json
import urllib.error
import urllib.request

import pytest
import torch
from safetensors.torch import save as save_safetensors

from megatron_rl.rollout.config import NativeEngineConfig
from megatron_rl.rollout.native import NativeEngine
from megatron_rl.rollout.server import RolloutServer, version_spans
from tests.helpers import prompt, tiny_state


@pytest.fixture(scope="module")
def server(tiny_arch):
    engine = NativeEngine(tiny_arch, tiny_state(tiny_arch), config=NativeEngineConfig(max_batch_size=4, max_seq_len=64),
                          eos_token_ids=[])
    srv = RolloutServer(engine, port=0).start()
    yield srv
    srv.shutdown()
    engine.close()


def call(url, path, body=None, *, raw=None, ctype="application/json", key=None, method=None):
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    req = urllib.request.Request(url + path, data=data, method=method or ("POST" if data is not None else "GET"))
    if data is not None:
        req.add_header("Content-Type", ctype)
    if key:
        req.add_header("Authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            text = resp.read()
            return resp.status, (json.loads(text) if "json" in resp.headers.get("Content-Type", "") else text.decode())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_generate_sglang_shape(server):
    status, out = call(server.url, "/generate", {"input_ids": prompt(0, 6), "return_logprob": True,
                                                 "sampling_params": {"max_new_tokens": 5, "temperature": 0}})
    assert status == 200 and server.url.startswith("http://127.0.0.1:")
    meta = out["meta_info"]
    assert len(out["output_ids"]) == 5 and meta["completion_tokens"] == 5 and meta["prompt_tokens"] == 6
    assert meta["finish_reason"] == {"type": "length", "length": 5}
    assert [t for _, t, _ in meta["output_token_logprobs"]] == out["output_ids"]
    assert meta["weight_version"] == 0 and meta["weight_versions"] == [{"version": 0, "start": 0, "end": 5}]
    status, outs = call(server.url, "/generate", {"input_ids": [prompt(1, 4), prompt(2, 5)], "rid": ["a", "b"],
                                                  "sampling_params": [{"max_new_tokens": 2}, {"max_new_tokens": 3, "n": 2}]})
    assert status == 200 and [o["meta_info"]["id"] for o in outs] == ["a", "b-0", "b-1"]
    assert "output_token_logprobs" not in outs[0]["meta_info"]


@pytest.mark.parametrize("body, message", [
    ({"input_ids": []}, "prompt_ids.*empty"),
    ({"input_ids": list(range(64))}, "prompt_ids.*context"),
    ({"input_ids": [1, 2], "sampling_params": {"temperature": -1}}, "temperature"),
    ({"input_ids": [1, 2], "sampling_params": {"top_p": 0}}, "top_p"),
    ({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": -1}}, "max_new_tokens"),
    ({"input_ids": [1, 2], "sampling_params": {"stop_token_ids": [None]}}, "stop_token_ids"),
    ({"input_ids": [1, 2], "sampling_params": {"n": 10**6}}, "sampling_params.n"),
    ({"input_ids": [1, 2], "sampling_params": {"spaces_between_special_tokens": False}}, "spaces_between"),
    ({"input_ids": [1, 2], "logprob_start_len": 5}, "logprob_start_len"),
    ({"input_ids": [1, 2], "lora_path": "x"}, "lora_path"),
    ({"input_ids": [1, 2], "sampling_params": {"frobnicate": 1}}, "frobnicate"),
    ({"input_ids": [[1, 2], []]}, "prompt_ids.*empty"),
    ({"input_ids": "1 2 3"}, "input_ids"),
    ({"text": "hello"}, "tokenizer"),
    ({}, "input_ids"),
    ([1, 2], "JSON object"),
])
def test_bad_requests_get_400_and_server_keeps_serving(server, body, message):
    status, out = call(server.url, "/generate", body)
    assert status == 400
    assert __import__("re").search(message, out["error"]["message"]), out
    status, ok = call(server.url, "/generate", {"input_ids": [3, 4, 5], "sampling_params": {"max_new_tokens": 2}})
    assert status == 200 and len(ok["output_ids"]) == 2


def test_invalid_json_and_unknown_paths(server):
    status, out = call(server.url, "/generate", raw=b"{not json")
    assert status == 400 and "JSON" in out["error"]["message"]
    assert call(server.url, "/nope")[0] == 404
    assert call(server.url, "/generate", method="GET")[0] == 405
    assert call(server.url, "/health")[0] == 200


def test_weight_updates_over_http(server, tiny_arch):
    body = {"input_ids": prompt(4, 6), "sampling_params": {"max_new_tokens": 6, "temperature": 0}}
    before = call(server.url, "/generate", body)[1]["output_ids"]
    new = tiny_state(tiny_arch, seed=5)
    status, out = call(server.url, "/update_weights_from_tensor?weight_version=4", raw=save_safetensors(new),
                       ctype="application/octet-stream")
    assert status == 200 and out["weight_version"] == 4
    after = call(server.url, "/generate", body)[1]
    assert after["output_ids"] != before and after["meta_info"]["weight_version"] == 4
    # SGLang's pickled payloads are refused; base64 safetensors in JSON are accepted
    status, out = call(server.url, "/update_weights_from_tensor", {"serialized_named_tensors": ["gASVAA=="]})
    assert status == 400 and "never unpickles" in out["error"]["message"]
    payload = base64.b64encode(save_safetensors(tiny_state(tiny_arch, seed=0))).decode()
    status, out = call(server.url, "/update_weights_from_tensor", {"serialized_named_tensors": [payload],
                                                                   "load_format": "safetensors", "weight_version": 5})
    assert status == 200 and call(server.url, "/generate", body)[1]["output_ids"] == before
    status, out = call(server.url, "/update_weights_from_tensor?weight_version=6",
                       raw=save_safetensors({"model.norm.weight": torch.zeros(3)}), ctype="application/octet-stream")
    assert status == 400 and "shape" in out["error"]["message"]
    assert call(server.url, "/get_model_info")[1]["weight_version"] == 5
    assert call(server.url, "/update_weight_version", {"new_version": "7"})[1]["new_version"] == 7
    assert call(server.url, "/flush_cache", method="POST")[0] == 200


def test_non_finite_weight_updates_are_refused(server, tiny_arch):
    body = {"input_ids": prompt(5, 6), "sampling_params": {"max_new_tokens": 4, "temperature": 0}}
    before = call(server.url, "/generate", body)[1]
    version = call(server.url, "/get_model_info")[1]["weight_version"]
    state = tiny_state(tiny_arch, seed=0)
    state["model.norm.weight"][3] = float("nan")
    state["lm_head.weight"][0, 0] = float("inf")
    status, out = call(server.url, "/update_weights_from_tensor?weight_version=99", raw=save_safetensors(state),
                       ctype="application/octet-stream")
    assert status == 400 and "non-finite" in out["error"]["message"]
    assert call(server.url, "/get_model_info")[1]["weight_version"] == version
    assert call(server.url, "/generate", body)[1]["output_ids"] == before["output_ids"]


def test_api_key(tiny_arch):
    engine = NativeEngine(tiny_arch, tiny_state(tiny_arch), config=NativeEngineConfig(max_batch_size=2, max_seq_len=32),
                          eos_token_ids=[])
    srv = RolloutServer(engine, port=0, api_key="s3cret").start()
    try:
        body = {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 1}}
        assert call(srv.url, "/generate", body)[0] == 401
        assert call(srv.url, "/generate", body, key="wrong")[0] == 401
        assert call(srv.url, "/generate", body, key="s3cret")[0] == 200
        assert call(srv.url, "/health")[0] == 200
    finally:
        srv.shutdown()
        engine.close()


def test_version_spans():
    assert version_spans([1, 1, 2, 2, 2]) == [{"version": 1, "start": 0, "end": 2}, {"version": 2, "start": 2, "end": 5}]


def test_generate_cli_reads_prompts(tmp_path):
    import argparse

    from megatron_rl.cli.generate import add_arguments, read_prompts
    from megatron_rl.config import ConfigError

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    file = tmp_path / "p.jsonl"
    file.write_text('{"prompt": "a"}\nplain line\n\n')
    assert read_prompts(parser.parse_args(["x", "--file", str(file)])) == ["x", "a", "plain line"]
    file.write_text('{"text": 1}\n')
    with pytest.raises(ConfigError, match="p.jsonl:1"):
        read_prompts(parser.parse_args(["--file", str(file)]))
    with pytest.raises(ConfigError, match="no prompts"):
        read_prompts(parser.parse_args([]))
