"""The RolloutEngine contract, run against every engine: the native engine, the HTTP client against a
live local `megatron-rl serve` server, and SGLang where it is installed with a GPU."""
from __future__ import annotations

import time

import pytest
import torch

from megatron_rl.rollout.config import NativeEngineConfig
from megatron_rl.rollout.engine import GenerateRequest, RolloutEngine, SamplingParams
from megatron_rl.rollout.native import NativeEngine
from tests.helpers import prompt, tiny_state


def _native(arch, seed=0):
    return NativeEngine(arch, tiny_state(arch, seed), config=NativeEngineConfig(max_batch_size=8, max_seq_len=64),
                        eos_token_ids=[])


@pytest.fixture(scope="module", params=["native", "http", "sglang"])
def engine(request, tiny_arch):
    if request.param == "native":
        e = _native(tiny_arch)
        yield e
        e.close()
    elif request.param == "http":
        from megatron_rl.rollout.client import HTTPEngine
        from megatron_rl.rollout.server import RolloutServer

        backend = _native(tiny_arch)
        server = RolloutServer(backend, host="127.0.0.1", port=0).start()
        client = HTTPEngine(server.url, timeout=60)
        yield client
        client.close()
        server.shutdown()
        backend.close()
    else:
        pytest.importorskip("sglang")
        if not torch.cuda.is_available():
            pytest.skip("SGLang needs a CUDA GPU")
        import shutil
        import tempfile

        from megatron_rl.checkpoints_tools.convert import save_hf
        from megatron_rl.rollout.sglang_engine import SGLangEngine

        path = tempfile.mkdtemp()
        save_hf(path + "/model", tiny_arch, tiny_state(tiny_arch), None)
        e = SGLangEngine(path + "/model", skip_tokenizer_init=True, mem_fraction_static=0.3, disable_cuda_graph=True,
                         dtype="float32")
        yield e
        e.close()
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def reference(tiny_arch):
    """Fresh native engines on weights 0 and 1: what every engine must reproduce (greedy)."""
    engines = {seed: _native(tiny_arch, seed) for seed in (0, 1)}
    yield engines
    for e in engines.values():
        e.close()


def greedy(i, n=8):
    return GenerateRequest(f"g{i}", prompt(i, 4 + 2 * i), SamplingParams(temperature=0, max_new_tokens=n))


def test_satisfies_protocol(engine):
    assert isinstance(engine, RolloutEngine)
    assert engine.health()["ok"]


def test_generate_returns_completions(engine, reference):
    reqs = [greedy(i) for i in range(5)] + [GenerateRequest("s", prompt(9, 6), SamplingParams(max_new_tokens=5, n=3, seed=4))]
    outs = engine.generate(reqs)
    assert [c.request_id for c in outs] == ["g0", "g1", "g2", "g3", "g4", "s-0", "s-1", "s-2"]
    assert [c.group_id for c in outs[-3:]] == ["s"] * 3
    version = engine.version
    for c, r in zip(outs, reqs[:5] + [reqs[5]] * 3):
        assert c.prompt_ids == r.prompt_ids
        assert len(c.output_ids) == len(c.output_logprobs) == len(c.weight_versions) > 0
        assert c.weight_versions == [version] * len(c.output_ids) and c.finish_reason in ("stop", "length")
        assert all(lp <= 0 for lp in c.output_logprobs)
    expected = reference[0].generate(reqs[:5])
    assert [c.output_ids for c in outs[:5]] == [c.output_ids for c in expected]
    for a, b in zip(outs[:5], expected):
        assert max(abs(x - y) for x, y in zip(a.output_logprobs, b.output_logprobs)) < 1e-4
    again = engine.generate([reqs[5]])
    assert [c.output_ids for c in again] == [c.output_ids for c in outs[-3:]]  # seeded


def test_submit_streams(engine):
    futures = engine.submit([greedy(i, n=4) for i in range(6)])
    assert len(futures) == 6
    assert sorted(f.result(timeout=60).request_id for f in futures) == [f"g{i}" for i in range(6)]


def test_bad_requests_raise_and_engine_keeps_working(engine):
    running = engine.submit([greedy(1, n=20)])
    for bad in (GenerateRequest("empty", [], SamplingParams()),
                GenerateRequest("long", list(range(64)), SamplingParams()),
                GenerateRequest("vocab", [1, 2, 10_000], SamplingParams())):
        with pytest.raises(ValueError, match="prompt_ids"):
            engine.generate([bad, greedy(2)])
    assert running[0].result(timeout=60).finish_reason == "length"
    assert engine.generate([greedy(3, n=2)])[0].output_ids
    assert engine.health()["ok"]


def test_update_weights_and_versions(engine, reference, tiny_arch):
    reqs = [greedy(i) for i in range(3)]
    start = engine.version
    engine.update_weights(tiny_state(tiny_arch, seed=1), start + 1)
    assert engine.version == start + 1
    outs = engine.generate(reqs)
    assert [c.output_ids for c in outs] == [c.output_ids for c in reference[1].generate(reqs)]
    assert all(c.weight_versions == [start + 1] * len(c.output_ids) for c in outs)
    engine.update_weights(tiny_state(tiny_arch, seed=0).items(), start + 2)
    assert [c.output_ids for c in engine.generate(reqs)] == [c.output_ids for c in reference[0].generate(reqs)]


def test_pause_abort_resume_flush(engine):
    engine.pause()
    try:
        futures = engine.submit([greedy(i, n=6) for i in range(3)])
        time.sleep(0.05)
        assert not any(f.done() for f in futures)
        engine.abort(["g1"])
        assert futures[1].result(timeout=30).finish_reason == "abort"
    finally:
        engine.resume()
    assert [futures[i].result(timeout=60).finish_reason for i in (0, 2)] == ["length", "length"]
    assert engine.flush_cache() is True
    assert engine.health()["ok"]
