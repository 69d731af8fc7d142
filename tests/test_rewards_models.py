"""Rewards from models. The LLM judge against `megatron-rl serve` with a scripted judge model: the rubric
reaches the judge, its last `Score: N` over max_score is the reward, replies are cached, a reply without a
score or a judge that stays down is a counted reward error; against a plain HTTP server: a batch is asked
concurrently, and 503s are retried. A Bradley-Terry reward model scores batches as transformers scores each
conversation alone."""
from __future__ import annotations

import http.server
import json
import threading

import pytest
import torch

from megatron_rl.data.prompts import Prompt
from megatron_rl.rewards.config import RewardConfig
from megatron_rl.rewards.registry import Reward
from megatron_rl.rollout.server import RolloutServer
from tests.test_serve_tools import ScriptedEngine


def _prompt(question: str, answer: str | None) -> Prompt:
    return Prompt(prompt_id=question, messages=[{"role": "user", "content": question}], question=question, answer=answer)


def _judge_script(text: str) -> str:
    """A judge that gives 9 to a response '42' when the reference is 42, 2 to anything else, and no score
    to a response asking for none."""
    response = text.split("Response:\n", 1)[1].split("\n\n", 1)[0]
    if response == "no score please":
        return "I refuse to grade."
    return "The answer matches.\nScore: 9" if response == "42" and "Reference answer (may be empty):\n42" in text \
        else "Wrong. Score: 2"


@pytest.fixture(scope="module")
def judge_url(smollm2):
    server = RolloutServer(ScriptedEngine(smollm2.tokenizer, _judge_script), port=0, tokenizer=smollm2.tokenizer,
                           model_name="judge").start()
    yield server.url + "/v1"
    server.shutdown()


def test_the_judge_scores_a_batch_and_caches(judge_url):
    reward = Reward(RewardConfig(name="judge", correct_threshold=0.8,
                                 kwargs={"url": judge_url, "model": "judge", "max_score": 10, "concurrency": 8}))
    prompts = [_prompt(f"What is 40 + 2? ({k})", "42") for k in range(8)]
    responses = ["42", "41"] * 4
    results = reward.score_batch(responses, prompts)
    assert [r.reward for r in results] == [0.9, 0.2] * 4
    assert [r.correct for r in results] == [True, False] * 4 and reward.num_errors == 0
    from megatron_rl.rewards.judge import judge_client

    client = judge_client(judge_url, "judge", concurrency=8)
    asked = client.requests
    assert [r.reward for r in reward.score_batch(responses, prompts)] == [0.9, 0.2] * 4
    assert client.requests == asked  # every reply came from the cache
    assert reward(responses[0], _prompt("What is 40 + 2? (0)", None)).reward == 0.2  # the reference matters


def test_no_score_or_no_judge_is_a_counted_reward_error(judge_url):
    reward = Reward(RewardConfig(name="judge", kwargs={"url": judge_url, "model": "judge"}))
    result = reward.score_batch(["no score please"], [_prompt("Q?", None)])[0]
    assert result.error and "no 'Score: N'" in result.error and reward.num_errors == 1
    down = Reward(RewardConfig(name="judge", kwargs={"url": "http://127.0.0.1:9/v1", "retries": 1, "timeout_s": 2}))
    result = down("42", _prompt("Q?", "42"))
    assert result.error and "unreachable after 2 attempts" in result.error and down.num_errors == 1


def _serve(answer):
    """A threading HTTP server whose POST handler is `answer(body) -> (status, reply text)`; its port."""
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 - the http.server hook
            status, text = answer(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
            body = json.dumps({"choices": [{"message": {"content": text}}]}).encode() if status == 200 else b"busy"
            self.send_response(status)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def test_a_batch_is_asked_concurrently():
    """Every request waits until four are in flight at once: a sequential client would leave each waiting
    alone until the barrier breaks, and every sample would fail."""
    barrier = threading.Barrier(4, timeout=30)

    def answer(body):
        try:
            barrier.wait()
        except threading.BrokenBarrierError:
            return 500, ""
        return 200, "Score: 1"

    server = _serve(answer)
    try:
        reward = Reward(RewardConfig(name="judge", kwargs={"url": f"http://127.0.0.1:{server.server_port}",
                                                           "concurrency": 4, "retries": 0, "max_score": 1}))
        results = reward.score_batch([f"r{k}" for k in range(8)], [_prompt(f"Q{k}?", None) for k in range(8)])
        assert [r.reward for r in results] == [1.0] * 8 and reward.num_errors == 0
    finally:
        server.shutdown()
        server.server_close()


def test_503s_are_retried():
    replies = [503, 503, 200]
    server = _serve(lambda body: (replies.pop(0), "Score: 7"))
    try:
        reward = Reward(RewardConfig(name="judge", kwargs={"url": f"http://127.0.0.1:{server.server_port}",
                                                           "retries": 3, "max_score": 7}))
        assert reward("anything", _prompt("Q?", None)).reward == 1.0
        assert replies == []
    finally:
        server.shutdown()
        server.server_close()


# --- a Bradley-Terry reward model --------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_reward_model(smollm2, tmp_path_factory):
    """A random LlamaForSequenceClassification with one output and SmolLM2's tokenizer (its chat template)."""
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=smollm2.arch.vocab_size, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      num_labels=1, pad_token_id=smollm2.tokenizer.pad_token_id)
    path = tmp_path_factory.mktemp("rm") / "hf"
    transformers.LlamaForSequenceClassification(config).save_pretrained(path)
    smollm2.tokenizer.hf_tokenizer.save_pretrained(path)
    return str(path)


def test_a_reward_model_scores_batches_like_transformers_one_by_one(tiny_reward_model):
    """Batched, right-padded scoring equals transformers' forward of each conversation alone (rendered with the
    reward model's own template); sigmoid and standardize are those functions of the logits."""
    import torch
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(tiny_reward_model)
    model = transformers.AutoModelForSequenceClassification.from_pretrained(tiny_reward_model, torch_dtype=torch.float32)
    prompts = [_prompt(f"What is {k} + {k}?", str(2 * k)) for k in range(5)]
    responses = ["2", "The answer is 4, since 2 + 2 = 4.", "", "6", "I am not sure about this one at all."]
    expected = []
    for response, prompt in zip(responses, prompts):
        text = tokenizer.apply_chat_template([{"role": "user", "content": prompt.question},
                                             {"role": "assistant", "content": response}], tokenize=False)
        with torch.no_grad():
            expected.append(float(model(**tokenizer(text, add_special_tokens=False, return_tensors="pt")).logits[0, 0]))
    for scale, transform in (("raw", lambda x: x), ("sigmoid", lambda x: torch.sigmoid(x)),
                             ("standardize", lambda x: (x - x.mean()) / (x.std() + 1e-6))):
        reward = Reward(RewardConfig(name="reward_model", kwargs={"path": tiny_reward_model, "batch_size": 2,
                                                                  "scale": scale}))
        got = [r.reward for r in reward.score_batch(responses, prompts)]
        want = transform(torch.tensor(expected, dtype=torch.float64)).tolist()
        assert got == pytest.approx(want, rel=1e-5, abs=1e-6), scale
        assert reward.num_errors == 0
    assert len(set(round(e, 6) for e in expected)) == len(expected)  # the conversations score apart


def test_a_reward_model_without_a_path_is_a_reward_error():
    result = Reward(RewardConfig(name="reward_model")).score_batch(["x"], [_prompt("Q?", None)])[0]
    assert result.error and "reward.kwargs.path" in result.error


def test_a_weighted_sum_combines_a_rule_with_the_judge_and_logs_each_term(judge_url):
    from megatron_rl.controller.batching import rollout_metrics
    from megatron_rl.controller.episodes import Group, Sample
    from megatron_rl.types import Completion

    reward = Reward(RewardConfig(name="weighted_sum", kwargs={"terms": [
        {"name": "exact_match"}, {"name": "judge", "weight": 0.5, "kwargs": {"url": judge_url, "model": "judge"}}]}))
    prompts = [_prompt("What is 40 + 2?", "42")] * 2
    results = reward.score_batch(["42", "41"], prompts)
    assert [r.reward for r in results] == [1.0 + 0.5 * 0.9, 0.0 + 0.5 * 0.2]
    assert [r.terms for r in results] == [{"exact_match": 1.0, "judge": 0.9}, {"exact_match": 0.0, "judge": 0.2}]
    assert [r.correct for r in results] == [True, False]  # the rule-based first term decides
    completion = Completion("r", [1], [2], [-0.1], [0], "stop")
    group = Group(prompt=None, samples=[Sample(completion, "", r) for r in results], requested_at_version=0)
    metrics = rollout_metrics([group], torch.tensor([r.reward for r in results]), torch.zeros(2), 0, 2)
    assert metrics["rollout/reward_term/exact_match"] == 0.5
    assert metrics["rollout/reward_term/judge"] == pytest.approx(0.55)
    failing = reward.score_batch(["no score please"], [_prompt("Q?", "1")])[0]
    assert failing.error and "no 'Score: N'" in failing.error


@pytest.mark.parametrize("terms,field", [
    ([], "kwargs.terms"), ([{"weight": 1.0}], "kwargs.terms[0]"), ([{"name": "nope"}], "kwargs.terms[0].name"),
    ([{"name": "math", "weight": "heavy"}], "kwargs.terms[0].weight"),
    ([{"name": "weighted_sum"}], "kwargs.terms[0].name"),
])
def test_weighted_sum_terms_are_checked_by_name(terms, field):
    from megatron_rl.config import ConfigError

    with pytest.raises(ConfigError) as error:
        RewardConfig(name="weighted_sum", kwargs={"terms": terms})
    assert error.value.field == field
