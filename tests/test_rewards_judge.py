"""The LLM-judge reward against `megatron-rl serve` with a scripted judge model: the rubric reaches the judge,
its last `Score: N` over max_score is the reward, replies are cached, a reply without a score or a judge that
stays down is a counted reward error; against a plain HTTP server: a batch is asked concurrently, and 503s
are retried."""
from __future__ import annotations

import http.server
import json
import threading

import pytest

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
