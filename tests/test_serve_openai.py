"""`megatron-rl serve` through the official `openai` client (and raw HTTP where the client cannot go):
OpenAI's /v1 completions and chat, streaming, n, stop, seeds, log-probs, the token-id extension, OpenAI
error objects, abuse bounds, and the SGLang-native fidelity fields. References: the engine called
directly (same weights), transformers (its chat template and its forward pass), the openai client."""
from __future__ import annotations

import concurrent.futures
import json
import socket
import time

import httpx
import pytest
import torch
from megatron_rl.checkpoints_tools.convert import save_hf

from megatron_rl.models.arch import ModelArch
from megatron_rl.rollout.config import NativeEngineConfig
from megatron_rl.rollout.engine import GenerateRequest, SamplingParams
from megatron_rl.rollout.native import NativeEngine
from megatron_rl.rollout.server import RolloutServer, ServerLimits
from tests.helpers import tiny_state

openai = pytest.importorskip("openai")

MODEL = "tiny-chat"
MAX_BODY = 1 << 20
MAX_N = 8


@pytest.fixture(scope="module")
def chat_model(smollm2, tmp_path_factory):
    """A tiny random Llama with SmolLM2's tokenizer (real text and chat template), spread logits (greedy
    has no near-ties), also saved as an HF directory for transformers."""
    arch = ModelArch(vocab_size=smollm2.arch.vocab_size, num_layers=2, hidden_size=64, ffn_hidden_size=128,
                     num_attention_heads=4, num_query_groups=2, rope_theta=10000.0, tie_word_embeddings=False,
                     max_position_embeddings=256)
    state = tiny_state(arch, seed=3)
    path = str(tmp_path_factory.mktemp("serve") / "hf")
    save_hf(path, arch, state, smollm2.tokenizer)
    return arch, state, smollm2.tokenizer, path


def _engine(chat_model, slots: int) -> NativeEngine:
    arch, state, tokenizer, _ = chat_model
    return NativeEngine(arch, state, tokenizer=tokenizer, config=NativeEngineConfig(max_batch_size=slots, max_seq_len=128))


@pytest.fixture(scope="module")
def served(chat_model):
    engine = _engine(chat_model, 8)
    server = RolloutServer(engine, port=0, model_name=MODEL, limits=ServerLimits(max_body_bytes=MAX_BODY, max_n=MAX_N))
    server.start()
    yield server
    server.shutdown()
    engine.close()


@pytest.fixture(scope="module")
def reference(chat_model):
    """The same weights in a separate engine, called directly."""
    engine = _engine(chat_model, 4)
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def direct(engine, prompt_ids, **sampling):
    return engine.generate([GenerateRequest("ref", list(prompt_ids), SamplingParams(**sampling))])


def test_models_and_greedy_completion_equal_the_engine(client, reference, chat_model):
    tokenizer = chat_model[2]
    assert [m.id for m in client.models.list().data] == [MODEL]
    prompt = "The quick brown fox"
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0,
                                    extra_body={"return_token_ids": True})
    (ref,) = direct(reference, tokenizer.encode(prompt), max_new_tokens=12, temperature=0)
    choice = out.choices[0]
    assert choice.token_ids == ref.output_ids and choice.prompt_token_ids == tokenizer.encode(prompt)
    assert choice.finish_reason == ref.finish_reason
    kept = ref.output_ids[:-1] if ref.finish_reason == "stop" else ref.output_ids
    assert choice.text == tokenizer.decode(kept)
    assert choice.token_logprobs == pytest.approx(ref.output_logprobs, abs=1e-4)
    assert choice.weight_versions == [{"version": 0, "start": 0, "end": len(ref.output_ids)}]
    assert out.usage.prompt_tokens == len(choice.prompt_token_ids)
    assert out.usage.completion_tokens == len(ref.output_ids)
    # token-id prompts and a list of prompts give the same, one choice per prompt
    ids = tokenizer.encode(prompt)
    batch = client.completions.create(model=MODEL, prompt=[ids, tokenizer.encode("Hello")], max_tokens=12, temperature=0)
    assert batch.choices[0].text == choice.text and len(batch.choices) == 2
    (ref2,) = direct(reference, tokenizer.encode("Hello"), max_new_tokens=12, temperature=0)
    assert batch.choices[1].text == tokenizer.decode(ref2.output_ids)


def test_chat_uses_the_models_template(client, reference, chat_model):
    transformers = pytest.importorskip("transformers")
    path = chat_model[3]
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a colour."}]
    expected_prompt = transformers.AutoTokenizer.from_pretrained(path).apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    out = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0,
                                         extra_body={"return_token_ids": True})
    assert out.prompt_token_ids == list(expected_prompt)
    (ref,) = direct(reference, expected_prompt, max_new_tokens=10, temperature=0)
    assert out.choices[0].token_ids == ref.output_ids
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == chat_model[2].decode(ref.output_ids)
    assert out.usage.total_tokens == len(expected_prompt) + len(ref.output_ids)
    # template arguments reach the template as transformers passes them; tools only where the template
    # renders them (tests/test_serve_tools.py), else a 400 naming them
    expected_prompt = transformers.AutoTokenizer.from_pretrained(path).apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False, mood="calm")
    out = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1,
                                         extra_body={"return_token_ids": True, "chat_template_kwargs": {"mood": "calm"}})
    assert out.prompt_token_ids == list(expected_prompt)
    tools = [{"type": "function", "function": {"name": "get_colour", "description": "Pick a colour.",
                                               "parameters": {"type": "object", "properties": {}}}}]
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1, tools=tools)
    assert refused.value.body["param"] == "tools"


def test_streaming_equals_the_full_response(client):
    full = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=16, temperature=0)
    pieces = list(client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=16, temperature=0,
                                            stream=True))
    assert "".join(p.choices[0].text for p in pieces) == full.choices[0].text
    assert pieces[-1].choices[0].finish_reason == full.choices[0].finish_reason
    messages = [{"role": "user", "content": "Say something."}]
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0)
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == chat.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == chat.usage.completion_tokens
    # n > 1 streams interleave their choices by index
    args = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 10, "n": 3, "seed": 5}
    whole = client.completions.create(**args)
    texts = ["", "", ""]
    for piece in client.completions.create(**args, stream=True):
        for choice in piece.choices:
            texts[choice.index] += choice.text
    assert texts == [c.text for c in whole.choices]


def test_raw_stream_ends_with_done(served):
    body = {"model": MODEL, "prompt": "abc", "max_tokens": 4, "stream": True}
    with httpx.stream("POST", served.url + "/v1/completions", json=body, timeout=60) as resp:
        lines = [line for line in resp.iter_lines() if line]
    assert resp.status_code == 200 and lines[-1] == "data: [DONE]"
    assert all(line.startswith("data: ") for line in lines)


def test_n_and_seed_reproducible_and_equal_the_engine(client, reference, chat_model):
    tokenizer = chat_model[2]
    args = {"model": MODEL, "prompt": "Write a word:", "max_tokens": 8, "temperature": 1.0, "n": 3, "seed": 1234,
            "extra_body": {"return_token_ids": True, "ignore_eos": True}}
    first, second = client.completions.create(**args), client.completions.create(**args)
    ids = [c.token_ids for c in first.choices]
    assert len(ids) == 3 and ids == [c.token_ids for c in second.choices]
    assert len({tuple(i) for i in ids}) > 1  # samples of one request differ
    refs = direct(reference, tokenizer.encode("Write a word:"), max_new_tokens=8, n=3, seed=1234, ignore_eos=True)
    assert ids == [r.output_ids for r in refs]
    other = client.completions.create(**{**args, "seed": 99})
    assert [c.token_ids for c in other.choices] != ids


def test_stop_string_trims_and_reports_stop(client, chat_model):
    base = client.completions.create(model=MODEL, prompt="Numbers:", max_tokens=24, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    stop = base[len(base) // 2:len(base) // 2 + 3]
    assert stop.strip(), base
    out = client.completions.create(model=MODEL, prompt="Numbers:", max_tokens=24, temperature=0, stop=[stop],
                                    extra_body={"ignore_eos": True})
    assert out.choices[0].finish_reason == "stop"
    assert out.choices[0].text == base[:base.find(stop)]
    streamed = "".join(p.choices[0].text for p in client.completions.create(
        model=MODEL, prompt="Numbers:", max_tokens=24, temperature=0, stop=[stop], stream=True,
        extra_body={"ignore_eos": True}))
    assert streamed == out.choices[0].text


def test_logprobs_and_echo_match_transformers(client, chat_model):
    transformers = pytest.importorskip("transformers")
    tokenizer, path = chat_model[2], chat_model[3]
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompt = "Paris is the capital of"
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=5, temperature=0, logprobs=3, echo=True,
                                    extra_body={"return_token_ids": True, "ignore_eos": True})
    choice = out.choices[0]
    ids = choice.prompt_token_ids + choice.token_ids
    with torch.no_grad():
        reference = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)
    expected = [None] + [reference[i - 1, ids[i]].item() for i in range(1, len(ids))]
    lp = choice.logprobs
    assert lp.token_logprobs[0] is None
    assert lp.token_logprobs[1:] == pytest.approx(expected[1:], abs=2e-4)
    assert lp.tokens[:len(choice.prompt_token_ids)] == [tokenizer.token_text(t) for t in choice.prompt_token_ids]
    assert len(set(lp.tokens[len(choice.prompt_token_ids):])) == len(set(choice.token_ids))
    assert choice.text.startswith(prompt)
    for i in range(len(choice.prompt_token_ids), len(ids)):  # greedy: the chosen token is the top one
        top = lp.top_logprobs[i]
        assert 1 <= len(top) <= 4 and max(top.values()) == pytest.approx(lp.token_logprobs[i], abs=2e-4)
        best = reference[i - 1].topk(3)
        assert sorted(top.values(), reverse=True)[:3] == pytest.approx(best.values.tolist(), abs=2e-4)
    # max_tokens 0 scores the prompt only (lm-eval's log-likelihood requests)
    scored = client.completions.create(model=MODEL, prompt=prompt, max_tokens=0, logprobs=1, echo=True)
    assert scored.choices[0].logprobs.token_logprobs == pytest.approx(lp.token_logprobs[:len(choice.prompt_token_ids)],
                                                                      abs=1e-5)
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                                          temperature=0, logprobs=True, top_logprobs=2,
                                          extra_body={"return_token_ids": True, "ignore_eos": True})
    content = chat.choices[0].logprobs.content
    assert [c.logprob for c in content] == pytest.approx(chat.choices[0].token_logprobs, abs=1e-6)
    assert all(len(c.top_logprobs) == 2 and c.top_logprobs[0].logprob == pytest.approx(c.logprob, abs=2e-4)
               for c in content)


def test_a_stop_token_keeps_its_logprob_for_lm_eval(client, chat_model):
    """lm-eval's log-likelihood request (echo, logprobs=1, max_tokens=1) where the model's next token is a
    stop token: the response still holds one entry per prompt token plus the generated one, so lm-eval's own
    parser (which drops the last entry) scores the whole continuation, equal to transformers'. Also in
    chat, the stop token's log-prob is reported."""
    transformers = pytest.importorskip("transformers")
    completions = pytest.importorskip("lm_eval.models.openai_completions")
    tokenizer, path = chat_model[2], chat_model[3]
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    context, continuation = tokenizer.encode("The capital of France is"), tokenizer.encode(" Paris")
    ids = context + continuation
    with torch.no_grad():
        reference = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)
    following = int(reference[-1].argmax())  # what the model says next: made a stop token below
    body = {"model": MODEL, "prompt": ids, "temperature": 0, "max_tokens": 1, "logprobs": 1, "echo": True,
            "seed": 1234}
    stopped = client.completions.create(**body, extra_body={"stop_token_ids": [following], "return_token_ids": True})
    choice = stopped.choices[0]
    assert choice.finish_reason == "stop" and choice.token_ids == [following]
    assert len(choice.logprobs.token_logprobs) == len(ids) + 1
    assert choice.logprobs.token_logprobs[-1] == pytest.approx(reference[-1, following].item(), abs=2e-4)
    (score, greedy), = completions.LocalCompletionsAPI.parse_logprobs(stopped.model_dump(), ctxlens=[len(context)])
    expected = sum(reference[i - 1, ids[i]].item() for i in range(len(context), len(ids)))
    assert score == pytest.approx(expected, abs=1e-4)
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                                          temperature=0, logprobs=True, extra_body={"return_token_ids": True})
    first = chat.choices[0].token_ids[0]
    ended = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                                           temperature=0, logprobs=True,
                                           extra_body={"return_token_ids": True, "stop_token_ids": [first]})
    assert ended.choices[0].message.content == "" and ended.choices[0].token_ids == [first]
    assert [c.logprob for c in ended.choices[0].logprobs.content] == pytest.approx(ended.choices[0].token_logprobs)


def test_tiny_temperatures_sample_greedily(client):
    """A temperature below GREEDY_BELOW_TEMPERATURE is greedy: 1e-300 is 0 in float32, and dividing the
    logits by it gave NaN probabilities (garbage text); just above the floor the text is still greedy."""
    from megatron_rl.rollout.engine import GREEDY_BELOW_TEMPERATURE

    def tokens(temperature):
        out = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=8,
                                        temperature=temperature, seed=5,
                                        extra_body={"return_token_ids": True, "ignore_eos": True})
        return out.choices[0].token_ids
    greedy = tokens(0)
    assert tokens(1e-300) == greedy and tokens(GREEDY_BELOW_TEMPERATURE / 2) == greedy
    assert tokens(GREEDY_BELOW_TEMPERATURE * 2) == greedy  # the spread logits of this model: one-hot already


@pytest.mark.parametrize("path, body, field", [
    ("/v1/completions", '{"model": "tiny-chat", "prompt": "a \\ud800 b"}', "prompt"),
    ("/v1/chat/completions", '{"model": "tiny-chat", "messages": [{"role": "user", "content": "\\udfff"}]}',
     "messages[0].content"),
    ("/tokenize", '{"prompt": ["ok", "\\ud83d"]}', "prompt[1]"),
    ("/v1/completions", '{"model": "tiny-chat", "prompt": "x", "\\ud800": 1}', "\\ud800"),
])
def test_lone_surrogates_are_a_400_naming_the_field(served, path, body, field, caplog):
    """JSON may carry a lone surrogate escape; no tokenizer can encode it: a 400 naming the field, no 500 and
    no traceback in the server's log."""
    import urllib.error
    import urllib.request

    request = urllib.request.Request(served.url + path, data=body.encode(), headers={"Content-Type": "application/json"})
    with caplog.at_level("INFO"), pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=30)
    assert refused.value.code == 400
    error = json.loads(refused.value.read())["error"]
    assert error["param"] == field and "surrogate" in error["message"]
    assert "Traceback" not in caplog.text


def test_a_client_leaving_mid_body_is_one_log_line(served, caplog):
    import socket
    import time

    host, port = served.address
    with caplog.at_level("INFO"):
        with socket.create_connection((host, port), timeout=10) as conn:
            conn.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 1000\r\n\r\n{\"model\": ")
        time.sleep(1.0)
    assert "left while sending its body" in caplog.text
    assert "Traceback" not in caplog.text and "error serving" not in caplog.text


@pytest.mark.parametrize("kwargs, error, status, param", [
    ({"model": "gpt-4"}, "NotFoundError", 404, "model"),
    ({"max_tokens": 10**9}, "BadRequestError", 400, "max_tokens"),
    ({"temperature": -0.5}, "BadRequestError", 400, "temperature"),
    ({"top_p": 1.5}, "BadRequestError", 400, "top_p"),
    ({"n": MAX_N + 1}, "BadRequestError", 400, "n"),
    ({"presence_penalty": 0.5}, "BadRequestError", 400, "presence_penalty"),
    ({"extra_body": {"stop_token_ids": [None]}}, "BadRequestError", 400, "stop_token_ids"),
    ({"extra_body": {"guided_json": {}}}, "BadRequestError", 400, "guided_json"),
])
def test_bad_requests_get_openai_errors_and_the_next_request_works(client, kwargs, error, status, param):
    args = {"model": MODEL, "prompt": "hi", "max_tokens": 2, **kwargs}
    with pytest.raises(getattr(openai, error)) as info:
        client.completions.create(**args)
    assert info.value.status_code == status
    body = info.value.body
    assert body["param"] == param and body["message"] and body["type"]
    assert len(client.completions.create(model=MODEL, prompt="hi", max_tokens=2).choices) == 1


def test_malformed_json_and_oversized_body(served, client):
    resp = httpx.post(served.url + "/v1/chat/completions", content=b"{not json",
                      headers={"Content-Type": "application/json"}, timeout=30)
    assert resp.status_code == 400 and "JSON" in resp.json()["error"]["message"]
    for path in ("/v1/completions", "/generate"):
        big = json.dumps({"model": MODEL, "prompt": "x" * (2 * MAX_BODY), "text": "x"}).encode()
        resp = httpx.post(served.url + path, content=big, headers={"Content-Type": "application/json"}, timeout=30)
        assert resp.status_code == 413 and resp.json()["error"]["type"] == "invalid_request_error"
    assert client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "ok"}],
                                          max_tokens=2).choices[0].message.content is not None


def test_missing_api_key(chat_model):
    engine = _engine(chat_model, 2)
    server = RolloutServer(engine, port=0, api_key="s3cret", model_name=MODEL).start()
    try:
        anonymous = openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            anonymous.models.list()
        authorised = openai.OpenAI(base_url=server.url + "/v1", api_key="s3cret", max_retries=0)
        assert authorised.completions.create(model=MODEL, prompt="a", max_tokens=1).choices
    finally:
        server.shutdown()
        engine.close()


def _idle(engine, deadline_s: float = 60.0) -> bool:
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        health = engine.health()
        if health["running"] == 0 and health["waiting"] == 0:
            return True
        time.sleep(0.05)
    return False


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"model": MODEL, "prompt": "go", "max_tokens": 100, "ignore_eos": True}),
    ("/v1/completions", {"model": MODEL, "prompt": "go", "max_tokens": 100, "ignore_eos": True, "stream": True}),
    ("/generate", {"text": "go", "sampling_params": {"max_new_tokens": 10**9, "ignore_eos": True}}),
])
def test_a_disconnected_client_is_aborted(served, path, body):
    served.engine.pause()  # the request queues and stays: only the abort can end it
    try:
        payload = json.dumps(body).encode()
        host, port = served.address
        with socket.create_connection((host, port)) as sock:
            sock.sendall(b"POST " + path.encode() + b" HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: " + str(len(payload)).encode() + b"\r\n\r\n" + payload)
            end = time.monotonic() + 30
            while served.engine.health()["waiting"] == 0 and time.monotonic() < end:
                time.sleep(0.02)
            assert served.engine.health()["waiting"] == 1
            aborted = served.engine.health().get("aborted", 0)
        # the client is gone: its request leaves the queue while the engine is still paused
        assert _idle(served.engine)
        assert served.engine.health().get("aborted", 0) == aborted + 1
    finally:
        served.engine.resume()


def test_queued_tokens_are_capped(chat_model):
    engine = _engine(chat_model, 2)
    server = RolloutServer(engine, port=0, model_name=MODEL, limits=ServerLimits(max_queued_tokens=200)).start()
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
        with pytest.raises(openai.BadRequestError, match="more than the server ever queues"):
            client.completions.create(model=MODEL, prompt="a", max_tokens=100, n=3)
        engine.pause()
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            first = pool.submit(client.completions.create, model=MODEL, prompt="a", max_tokens=100)
            end = time.monotonic() + 30
            while engine.health()["waiting"] == 0 and time.monotonic() < end:
                time.sleep(0.02)
            with pytest.raises(openai.RateLimitError):
                client.completions.create(model=MODEL, prompt="b", max_tokens=100)
            engine.resume()
            assert len(first.result(timeout=60).choices) == 1
    finally:
        engine.resume()
        server.shutdown()
        engine.close()


# --- SGLang-native fidelity -------------------------------------------------------------------------
def test_native_stop_trimming_and_matched(served):
    url = served.url
    base = httpx.post(url + "/generate", json={"text": "Numbers:", "sampling_params": {
        "max_new_tokens": 24, "temperature": 0, "ignore_eos": True}}, timeout=60).json()
    stop = base["text"][len(base["text"]) // 2:][:3]
    sp = {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True, "stop": [stop]}
    trimmed = httpx.post(url + "/generate", json={"text": "Numbers:", "sampling_params": sp}, timeout=60).json()
    kept = httpx.post(url + "/generate", json={"text": "Numbers:", "sampling_params": {**sp, "no_stop_trim": True}},
                      timeout=60).json()
    assert trimmed["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert trimmed["text"] == base["text"][:base["text"].find(stop)]
    assert kept["text"].startswith(trimmed["text"] + stop)
    stop_id = base["output_ids"][2]
    by_token = httpx.post(url + "/generate", json={"text": "Numbers:", "sampling_params": {
        "max_new_tokens": 8, "temperature": 0, "ignore_eos": True, "stop_token_ids": [stop_id]}}, timeout=60).json()
    assert by_token["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_id}
    assert by_token["output_ids"][-1] == stop_id
    assert by_token["text"] == served.tokenizer.decode(by_token["output_ids"][:-1])


def test_native_logprobs_tokenize_and_server_info(served, chat_model):
    url = served.url
    tokenizer = chat_model[2]
    ids = httpx.post(url + "/tokenize", json={"prompt": "Hello world"}, timeout=30).json()["tokens"]
    assert ids == tokenizer.encode("Hello world")
    assert httpx.post(url + "/detokenize", json={"tokens": ids}, timeout=30).json()["text"] == "Hello world"
    out = httpx.post(url + "/generate", json={"input_ids": ids, "return_logprob": True, "logprob_start_len": 0,
                                              "top_logprobs_num": 2, "return_text_in_logprobs": True,
                                              "sampling_params": {"max_new_tokens": 3, "temperature": 0}},
                     timeout=60).json()
    meta = out["meta_info"]
    assert [t for _, t, _ in meta["input_token_logprobs"]] == ids and meta["input_token_logprobs"][0][0] is None
    assert all(isinstance(lp, float) for lp, _, _ in meta["input_token_logprobs"][1:])
    assert [len(top) for top in meta["output_top_logprobs"]] == [2] * len(out["output_ids"])
    assert [top[0][1] for top in meta["output_top_logprobs"]] == out["output_ids"]  # greedy: the top token
    assert meta["output_token_logprobs"][0][2] == tokenizer.token_text(out["output_ids"][0])
    zero = httpx.post(url + "/generate", json={"input_ids": ids, "return_logprob": True, "logprob_start_len": 0,
                                               "sampling_params": {"max_new_tokens": 0}}, timeout=60).json()
    assert zero["output_ids"] == []
    scores = zero["meta_info"]["input_token_logprobs"]
    assert [t for _, t, _ in scores] == ids and scores[0][0] is None
    assert [lp for lp, _, _ in scores[1:]] == pytest.approx([lp for lp, _, _ in meta["input_token_logprobs"][1:]],
                                                            abs=1e-4)
    info = httpx.get(url + "/get_server_info", timeout=30).json()
    assert info["context_length"] == 128 and info["max_n"] == MAX_N and info["engine"]["ok"]
    assert "engine" not in httpx.get(url + "/get_model_info", timeout=30).json()


def test_native_streaming(served):
    body = {"text": "Once", "sampling_params": {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}}
    full = httpx.post(served.url + "/generate", json=body, timeout=60).json()
    with httpx.stream("POST", served.url + "/generate", json={**body, "stream": True}, timeout=60) as resp:
        lines = [line for line in resp.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line[6:]) for line in lines[:-1]]
    assert chunks[-1]["text"] == full["text"] and chunks[-1]["output_ids"] == full["output_ids"]
    assert [len(c["output_ids"]) for c in chunks[:-1]] == list(range(1, len(chunks)))
    assert all(full["text"].startswith(c["text"]) for c in chunks)


@pytest.mark.slow
def test_256_concurrent_clients_all_complete(served, chat_model):
    tokenizer = chat_model[2]
    words = ["the", "cat", "sat", "on", "a", "mat", "while", "rain", "fell", "over", "hills", "and", "rivers"]

    def one(i: int) -> int:
        prompt = " ".join(words[: 1 + i % len(words)])
        with httpx.Client(timeout=600) as http:
            resp = http.post(served.url + "/v1/completions", json={"model": MODEL, "prompt": prompt,
                                                                    "max_tokens": 1 + i % 8, "temperature": 0})
        resp.raise_for_status()
        return len(tokenizer.encode(resp.json()["choices"][0]["text"]))

    with concurrent.futures.ThreadPoolExecutor(256) as pool:
        results = list(pool.map(one, range(256)))
    assert len(results) == 256


@pytest.mark.slow
def test_smollm2_chat_end_to_end(smollm2):
    """The real SmolLM2-135M-Instruct: a chat answer through the openai client equals the engine's own."""
    engine = NativeEngine.from_pretrained(smollm2, NativeEngineConfig(max_batch_size=2, max_seq_len=512))
    server = RolloutServer(engine, port=0, model_path="smollm2-135m").start()
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=600)
        messages = [{"role": "user", "content": "What is the capital of France?"}]
        out = client.chat.completions.create(model="smollm2-135m", messages=messages, max_tokens=24, temperature=0)
        (ref,) = direct(engine, smollm2.tokenizer.encode_chat(messages), max_new_tokens=24, temperature=0)
        text = out.choices[0].message.content
        assert text == smollm2.tokenizer.decode(ref.output_ids) and "Paris" in text
    finally:
        server.shutdown()
        engine.close()


def test_serve_cli_refuses_bad_limits():
    import argparse

    from megatron_rl.cli import serve
    from megatron_rl.config import ConfigError

    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    with pytest.raises(ConfigError, match="max-n"):
        serve.run(parser.parse_args(["--max-n", "0"]))


# --- lm-eval against the server, scored like transformers ---------------------------------------------
_LL_TASK = """task: serve_loglikelihood
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
"""
_GEN_TASK = """task: serve_generate
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{question}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["\\n\\n"]
  max_gen_toks: 12
  do_sample: false
  temperature: 0
metric_list:
  - metric: exact_match
"""
_QUESTIONS = ["The capital of France is", "Two plus two equals", "The colour of the sky is", "Water freezes at",
              "The opposite of hot is", "A week has seven"] + [f"Fact number {i} says that" for i in range(26)]


def _lm_eval(tmp_path, model: str, model_args: dict, task: str, chat: bool):
    lm_eval = pytest.importorskip("lm_eval")
    from lm_eval.tasks import TaskManager

    out = lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=[task], log_samples=True,
                                  task_manager=TaskManager(include_path=str(tmp_path)), apply_chat_template=chat,
                                  random_seed=0, numpy_random_seed=0, torch_random_seed=0, fewshot_random_seed=0)
    return out["results"][task], out["samples"][task]


def _write_tasks(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps({"question": q, "choices": [" Paris", " four", " blue", " zero degrees"],
                                        "answer": i % 4}) + "\n" for i, q in enumerate(_QUESTIONS)))
    (tmp_path / "ll.yaml").write_text(_LL_TASK.format(data=data))
    (tmp_path / "gen.yaml").write_text(_GEN_TASK.format(data=data))


def _loglikelihoods(samples) -> list[list[float]]:
    return [[r[0][0] for r in s["resps"]] for s in samples]


@pytest.mark.slow
def test_lm_eval_through_the_server_scores_like_transformers(served, chat_model, tmp_path, monkeypatch):
    """lm-eval's local-completions (log-likelihood, token ids with echo) and local-chat-completions
    (generate-until through the chat template) against the server give the same per-request results
    and scores as lm-eval's own transformers model on the same weights."""
    _write_tasks(tmp_path, monkeypatch)
    path = chat_model[3]
    hf_args = {"pretrained": path, "dtype": "float32", "device": "cpu", "batch_size": 1}
    api = {"model": MODEL, "tokenizer": path, "num_concurrent": 1, "max_retries": 1, "max_length": 128}

    for chat in (False, True):  # plain, and the context rendered with the chat template
        ours, our_samples = _lm_eval(tmp_path, "local-completions", {
            **api, "base_url": served.url + "/v1/completions", "tokenizer_backend": "huggingface"},
            "serve_loglikelihood", chat=chat)
        theirs, their_samples = _lm_eval(tmp_path, "hf", hf_args, "serve_loglikelihood", chat=chat)
        assert len(our_samples) == len(_QUESTIONS)
        # fp32 on both sides, a few tokens a choice: rounding is ~1e-6; 1e-4 is the bound
        for a, b in zip(_loglikelihoods(our_samples), _loglikelihoods(their_samples), strict=True):
            assert a == pytest.approx(b, abs=1e-4)
        assert ours["acc,none"] == theirs["acc,none"]
        print(f"lm-eval loglikelihood (chat={chat}): local-completions acc {ours['acc,none']}, hf {theirs['acc,none']}")

    ours, our_samples = _lm_eval(tmp_path, "local-chat-completions", {
        **api, "base_url": served.url + "/v1/chat/completions", "tokenizer_backend": None}, "serve_generate", chat=True)
    theirs, their_samples = _lm_eval(tmp_path, "hf", hf_args, "serve_generate", chat=True)
    assert [s["filtered_resps"] for s in our_samples] == [s["filtered_resps"] for s in their_samples]
    assert any(s["filtered_resps"][0] for s in our_samples)  # non-empty generations were compared
    assert ours["exact_match,none"] == theirs["exact_match,none"]


@pytest.mark.slow
def test_lm_eval_sglang_generate_against_the_native_api(served, chat_model, tmp_path, monkeypatch):
    """lm-eval's own `sglang-generate` model on /generate: log-likelihoods (read from
    input_token_logprobs) and generate-until answers (stop strings trimmed) equal transformers'."""
    _write_tasks(tmp_path, monkeypatch)
    path = chat_model[3]
    hf_args = {"pretrained": path, "dtype": "float32", "device": "cpu", "batch_size": 1}
    api = {"model": MODEL, "tokenizer": path, "num_concurrent": 1, "max_retries": 1, "max_length": 128,
           "base_url": served.url + "/generate", "tokenizer_backend": "huggingface"}
    ours, our_samples = _lm_eval(tmp_path, "sglang-generate", api, "serve_loglikelihood", chat=False)
    theirs, their_samples = _lm_eval(tmp_path, "hf", hf_args, "serve_loglikelihood", chat=False)
    for a, b in zip(_loglikelihoods(our_samples), _loglikelihoods(their_samples), strict=True):
        assert a == pytest.approx(b, abs=1e-3)
    assert ours["acc,none"] == theirs["acc,none"]
    ours, our_samples = _lm_eval(tmp_path, "sglang-generate", api, "serve_generate", chat=False)
    theirs, their_samples = _lm_eval(tmp_path, "hf", hf_args, "serve_generate", chat=False)
    assert [s["filtered_resps"] for s in our_samples] == [s["filtered_resps"] for s in their_samples]
    assert any(s["filtered_resps"][0] for s in our_samples)
    assert ours["exact_match,none"] == theirs["exact_match,none"]


def test_one_clients_backlog_does_not_starve_another(chat_model):
    """Client A queues 60 requests, then client B sends one: B is admitted at the next freed place
    (round robin across clients), so it is answered after at most a couple of turns of A's requests,
    not after A's whole backlog."""
    import threading
    import time
    import urllib.request
    from concurrent.futures import ThreadPoolExecutor

    engine = _engine(chat_model, 2)
    server = RolloutServer(engine, port=0, model_name=MODEL, limits=ServerLimits(max_body_bytes=MAX_BODY))
    server.start()
    finished: list[tuple[str, float]] = []
    lock = threading.Lock()

    def ask(user: str, i: int) -> None:
        body = json.dumps({"model": MODEL, "prompt": f"Count {i}:", "max_tokens": 12, "temperature": 0,
                           "user": user, "ignore_eos": True}).encode()
        request = urllib.request.Request(server.url + "/v1/completions", data=body,
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=300) as response:
            assert response.status == 200
        with lock:
            finished.append((user, time.monotonic()))
    try:
        capacity = server.bridge.admission.capacity
        with ThreadPoolExecutor(64) as pool:
            backlog = [pool.submit(ask, "A", i) for i in range(60)]
            deadline = time.monotonic() + 60
            while len(server.bridge.admission.waiting.get("user:A", ())) < 40 and time.monotonic() < deadline:
                time.sleep(0.02)
            assert len(server.bridge.admission.waiting.get("user:A", ())) >= 40  # A's backlog is waiting
            sent = time.monotonic()
            pool.submit(ask, "B", 0).result(timeout=300)
            answered = time.monotonic()
            for f in backlog:
                f.result(timeout=300)
        a_before_b = sum(1 for user, t in finished if user == "A" and sent <= t <= answered)
        assert a_before_b <= 2 * capacity, (a_before_b, capacity)
        assert [user for user, _ in finished].count("A") == 60
        assert server.bridge.admission.running == 0 and not server.bridge.admission.waiting
    finally:
        server.shutdown()
        engine.close()


def test_fair_admission_in_turns_and_given_up_turns_free_their_place():
    """The admission alone: a full server queues; places go to clients in turn (B's one request before A's
    second); a request given up while waiting never holds a place, and the next one is admitted at once."""
    import asyncio

    from megatron_rl.rollout.serving import FairAdmission

    async def scenario():
        admission = FairAdmission(capacity=1)
        order = []

        async def run(client, tag, hold=0.05):
            async with admission.place(client, 1):
                order.append(tag)
                await asyncio.sleep(hold)
        first = asyncio.create_task(run("A", "a0"))
        await asyncio.sleep(0.01)
        later = [asyncio.create_task(run("A", f"a{i}")) for i in (1, 2)]
        await asyncio.sleep(0.01)
        later.append(asyncio.create_task(run("B", "b0")))
        await asyncio.gather(first, *later)
        assert order == ["a0", "a1", "b0", "a2"] and admission.running == 0 and not admission.waiting
        blocker = asyncio.create_task(run("A", "hold", hold=0.3))
        await asyncio.sleep(0.01)
        gone = asyncio.create_task(run("C", "never"))
        await asyncio.sleep(0.01)
        gone.cancel()
        await blocker
        await asyncio.wait_for(run("D", "d0"), timeout=1)  # not stuck behind the given-up turn
        assert "never" not in order and order[-1] == "d0" and admission.running == 0
    asyncio.run(scenario())
