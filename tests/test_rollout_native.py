"""The native engine: parity with HF transformers on SmolLM2, continuous batching, weight updates,
pause / abort, prefix sharing, bad input."""
from __future__ import annotations

import dataclasses
import time

import pytest
import torch

from megatron_rl.rollout.config import NativeEngineConfig
from megatron_rl.rollout.engine import GenerateRequest, RequestError, SamplingParams
from megatron_rl.rollout.native import NativeEngine
from tests.helpers import prompt, tiny_state

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=24)


@pytest.fixture(scope="module")
def smol_engine(smollm2):
    with NativeEngine.from_pretrained(smollm2, NativeEngineConfig(max_batch_size=8, max_seq_len=512)) as engine:
        yield engine


def test_greedy_matches_hf_generate_and_logprobs_match_hf_forward(smollm2, hf_smollm2, smol_engine, chat_prompts):
    tok = smollm2.tokenizer
    ids = [tok.encode_chat([{"role": "user", "content": p}]) for p in chat_prompts]
    outs = smol_engine.generate([GenerateRequest(f"p{i}", x, GREEDY) for i, x in enumerate(ids)])
    worst = 0.0
    for x, out in zip(ids, outs):
        with torch.inference_mode():
            ref = hf_smollm2.generate(torch.tensor([x]), attention_mask=torch.ones(1, len(x), dtype=torch.long),
                                      max_new_tokens=24, do_sample=False, pad_token_id=tok.pad_token_id)
            hf_ids = ref[0, len(x):].tolist()
            assert out.output_ids == hf_ids, (tok.decode(out.output_ids), tok.decode(hf_ids))
            logits = hf_smollm2(torch.tensor([x + out.output_ids])).logits[0].float()
        ref_lp = torch.log_softmax(logits, -1)[len(x) - 1:-1].gather(1, torch.tensor(out.output_ids)[:, None])[:, 0]
        worst = max(worst, (ref_lp - torch.tensor(out.output_logprobs)).abs().max().item())
        assert out.weight_versions == [0] * len(out.output_ids)
        assert out.finish_reason == ("stop" if out.output_ids[-1] == tok.eos_token_id else "length")
    assert worst < 1e-4, worst


def test_stop_strings_and_stop_tokens(smollm2, smol_engine):
    tok = smollm2.tokenizer
    ids = tok.encode_chat([{"role": "user", "content": "What is 17 + 25?"}])
    free = smol_engine.generate([GenerateRequest("free", ids, GREEDY)])[0]
    text = tok.decode(free.output_ids)
    assert "=" in text
    stopped = smol_engine.generate([GenerateRequest("s", ids, SamplingParams(temperature=0, max_new_tokens=24,
                                                                             stop=["="]))])[0]
    assert stopped.finish_reason == "stop" and "=" in tok.decode(stopped.output_ids)
    assert "=" not in tok.decode(stopped.output_ids[:-1])
    assert stopped.output_ids == free.output_ids[:len(stopped.output_ids)]
    token = free.output_ids[2]
    by_id = smol_engine.generate([GenerateRequest("t", ids, SamplingParams(temperature=0, max_new_tokens=24,
                                                                           stop_token_ids=[token]))])[0]
    assert by_id.finish_reason == "stop" and by_id.output_ids == free.output_ids[:free.output_ids.index(token) + 1]


# --- tiny model ---------------------------------------------------------------------------------
def make_engine(arch, seed=0, **config):
    config.setdefault("max_seq_len", 128)
    return NativeEngine(arch, tiny_state(arch, seed), config=NativeEngineConfig(**config), eos_token_ids=[])


def test_continuous_batching_equals_running_alone(tiny_arch):
    requests = [GenerateRequest(f"r{i}", prompt(i, 3 + 5 * (i % 4)), SamplingParams(temperature=0, max_new_tokens=4 + 3 * i))
                for i in range(10)]
    with make_engine(tiny_arch, max_batch_size=3, max_prefill_tokens=16) as engine:
        batched = engine.generate(requests)
        assert engine.health()["steps"] < sum(r.sampling.max_new_tokens for r in requests)
        alone = [engine.generate([r])[0] for r in requests]
    for b, a, r in zip(batched, alone, requests):
        assert b.request_id == r.request_id and len(b.output_ids) == r.sampling.max_new_tokens
        assert b.output_ids == a.output_ids
        assert max(abs(x - y) for x, y in zip(b.output_logprobs, a.output_logprobs)) < 1e-5


def test_health_counts_the_pure_decode_steps(tiny_arch):
    """`decode_*` in health() (what `bench rollout` compares with the decode roofline) counts the steps
    without a prompt chunk and the tokens they sampled: here one prefill step samples every first token,
    then decode steps shrink as the answers end."""
    lengths = (3, 6, 9)
    requests = [GenerateRequest(f"r{i}", prompt(i, 4 + i), SamplingParams(temperature=0, max_new_tokens=n))
                for i, n in enumerate(lengths)]
    with make_engine(tiny_arch, max_batch_size=4) as engine:
        outs = engine.generate(requests)
        health = engine.health()
    assert [len(o.output_ids) for o in outs] == list(lengths)
    assert health["steps"] == max(lengths) and health["decode_steps"] == max(lengths) - 1
    assert health["decode_tokens"] == sum(lengths) - len(lengths) == health["generated_tokens"] - len(lengths)
    assert health["decode_seconds"] > 0


def test_caller_driven_batches_do_not_depend_on_timing(tiny_arch):
    """Under caller_driven the background thread starts nothing: two requests submitted 0.2 s apart
    share their batches as if submitted together, bit for bit (WaltzRL's sync resume relies on it)."""
    from megatron_rl.rollout.engine import caller_driven

    a = GenerateRequest("a", prompt(1, 5), SamplingParams(temperature=0, max_new_tokens=6))
    b = GenerateRequest("b", prompt(2, 9), SamplingParams(temperature=0, max_new_tokens=6))
    with make_engine(tiny_arch) as engine:
        together = engine.generate([a, b])
        steps_together = engine.health()["steps"]
        with caller_driven(engine):
            first = engine.submit([a])
            time.sleep(0.2)
            assert not first[0].done()
            apart = engine.wait(first + engine.submit([b]))
        assert engine.health()["steps"] == 2 * steps_together
        assert [c.output_logprobs for c in apart] == [c.output_logprobs for c in together]
        (alone,) = engine.submit([a])  # outside the scope the background thread serves it
        assert alone.result(timeout=60).output_ids == together[0].output_ids


def test_prefix_sharing_gives_the_same_results(tiny_arch):
    base = prompt(3, 40)
    requests = [GenerateRequest(f"r{i}", base[:30 + i] + prompt(50 + i, 3), SamplingParams(temperature=0, max_new_tokens=6))
                for i in range(6)]
    with make_engine(tiny_arch, max_batch_size=8) as shared, make_engine(tiny_arch, max_batch_size=8,
                                                                        prefix_sharing_min_tokens=0) as plain:
        a, b = shared.generate(requests), plain.generate(requests)
        assert shared.health()["shared_prefix_tokens"] > 100 and plain.health().get("shared_prefix_tokens", 0) == 0
    for x, y in zip(a, b):
        assert x.output_ids == y.output_ids
        assert max(abs(p - q) for p, q in zip(x.output_logprobs, y.output_logprobs)) < 1e-5


def test_update_weights_equals_fresh_engine(tiny_arch):
    requests = [GenerateRequest(f"r{i}", prompt(i, 6 + i), SamplingParams(temperature=0, max_new_tokens=10)) for i in range(4)]
    new_state = tiny_state(tiny_arch, seed=1)
    with make_engine(tiny_arch, seed=0) as engine, make_engine(tiny_arch, seed=1) as fresh:
        before = engine.generate(requests)
        buckets = [dict(list(new_state.items())[i:i + 7]) for i in range(0, len(new_state), 7)]
        assert engine.update_weights(iter(buckets), version=3) == len(new_state)
        assert engine.version == 3
        after, expected = engine.generate(requests), fresh.generate(requests)
        assert [c.output_ids for c in after] == [c.output_ids for c in expected]
        assert [c.output_ids for c in after] != [c.output_ids for c in before]
        assert all(c.weight_versions == [3] * len(c.output_ids) for c in after)
        with pytest.raises(ValueError, match="unknown tensor name"):
            engine.update_weights({"model.layers.0.mlp.gate.weight": torch.zeros(1)}, version=4)
        with pytest.raises(ValueError, match="shape"):
            engine.update_weights([("model.norm.weight", torch.zeros(3))], version=4)
        assert engine.version == 3


def test_adopted_weight_arena_equals_fresh_engine_packed_or_not(tiny_arch):
    """An engine switching to a buffer that already holds new weights (the double-buffered shared
    memory path) generates exactly what a fresh engine does, before and after its lazy GEMM re-pack."""
    from megatron_rl.rollout.native.weights import weight_arena_layout
    from megatron_rl.weight_sync.reshard import Bucket

    requests = [GenerateRequest(f"r{i}", prompt(i, 6 + i), SamplingParams(temperature=0, max_new_tokens=10))
                for i in range(4)]
    layout = weight_arena_layout(tiny_arch, torch.float32)
    arena = torch.empty(layout.numel)
    views = Bucket(layout, arena).unpack()
    for name, tensor in tiny_state(tiny_arch, seed=1).items():
        if name in views:
            views[name].copy_(tensor)
    config = NativeEngineConfig(max_batch_size=4, prepack_weights=True)
    with NativeEngine(tiny_arch, tiny_state(tiny_arch, seed=0), config=config) as engine, \
            NativeEngine(tiny_arch, None, weight_arena=arena.clone(), config=config) as fresh:
        before = engine.generate(requests)
        engine.adopt_weight_arena(arena, version=5)
        assert engine.weights.arena.data_ptr() == arena.data_ptr()  # used in place, not copied
        first = engine.generate(requests)   # packs a layer or two per step meanwhile
        again = engine.generate(requests)   # fully re-packed by now
        expected = fresh.generate(requests)
        assert [c.output_ids for c in first] == [c.output_ids for c in again] == [c.output_ids for c in expected]
        for got, want in zip(first, expected):  # packed and plain GEMMs round differently
            assert torch.allclose(torch.tensor(got.output_logprobs), torch.tensor(want.output_logprobs), atol=1e-5)
        assert [c.output_ids for c in first] != [c.output_ids for c in before]
        assert all(c.weight_versions == [5] * len(c.output_ids) for c in first)
        with pytest.raises(ValueError, match="flat"):
            engine.adopt_weight_arena(torch.empty(3))


def test_release_and_resume_memory_occupation(tiny_arch):
    requests = [GenerateRequest("r", prompt(0, 6), SamplingParams(temperature=0, max_new_tokens=6))]
    with make_engine(tiny_arch, seed=0) as engine:
        first = engine.generate(requests)
        released = engine.release_memory_occupation()
        assert released["kv_cache_bytes"] > 0 and not engine.kv_cache.allocated
        pending = engine.submit(requests)
        time.sleep(0.2)
        assert not pending[0].done()  # generation holds while the memory is released
        engine.resume_memory_occupation()
        assert engine.wait(pending)[0].output_ids == first[0].output_ids


def test_update_while_paused_mid_response(tiny_arch):
    with make_engine(tiny_arch, max_seq_len=256) as engine:
        future = engine.submit([GenerateRequest("long", prompt(0, 5), SamplingParams(max_new_tokens=200, seed=0))])[0]
        while engine.health().get("generated_tokens", 0) < 5:
            time.sleep(0.001)
        engine.pause()
        made = engine.health()["generated_tokens"]
        time.sleep(0.05)
        assert engine.health()["generated_tokens"] == made and not future.done()  # paused: no steps
        engine.update_weights(tiny_state(tiny_arch, seed=2), version=1)
        engine.resume()
        out = future.result(timeout=60)
    versions = out.weight_versions
    assert len(versions) == 200 and versions[0] == 0 and versions[-1] == 1
    assert versions == sorted(versions) and versions.count(0) == made


def test_abort_and_cancel(tiny_arch):
    with make_engine(tiny_arch) as engine:
        engine.pause()
        futures = engine.submit([GenerateRequest(f"r{i}", prompt(i, 5), SamplingParams(max_new_tokens=20, seed=i))
                                 for i in range(3)])
        engine.abort(["r1"])
        aborted = futures[1].result(timeout=10)
        assert aborted.finish_reason == "abort" and aborted.output_ids == []
        engine.resume()
        assert [f.result(timeout=30).finish_reason for f in (futures[0], futures[2])] == ["length", "length"]
        running = engine.submit([GenerateRequest("n", prompt(9, 5), SamplingParams(max_new_tokens=100, n=2, seed=1))])
        while engine.health().get("generated_tokens", 0) < 70:
            time.sleep(0.001)
        engine.abort("n")  # the parent id aborts every sample
        outs = [f.result(timeout=10) for f in running]
        assert [o.finish_reason for o in outs] == ["abort", "abort"]
        assert all(len(o.output_logprobs) == len(o.output_ids) == len(o.weight_versions) for o in outs)
        assert engine.flush_cache() and engine.health()["ok"]
        assert engine.generate([GenerateRequest("after", prompt(1, 4), SamplingParams(max_new_tokens=3))])[0].finish_reason == "length"


@pytest.mark.parametrize("ids, match", [([], "prompt_ids.*empty"), (list(range(128)), "prompt_ids.*context"),
                                        ([1, 2, 999], "prompt_ids.*vocabulary"), ([1, "a"], "prompt_ids")])
def test_bad_requests_fail_alone(tiny_arch, ids, match):
    with make_engine(tiny_arch) as engine:
        running = engine.submit([GenerateRequest("ok", prompt(0, 5), SamplingParams(max_new_tokens=30, seed=0))])
        with pytest.raises(RequestError, match=match) as info:
            engine.submit([GenerateRequest("bad", ids, SamplingParams(max_new_tokens=4))])
        assert info.value.request_id == "bad"
        assert running[0].result(timeout=30).finish_reason == "length"
        assert engine.health()["ok"]


def test_context_limit_ends_with_length(tiny_arch):
    with make_engine(tiny_arch, max_seq_len=20) as engine:
        out = engine.generate([GenerateRequest("c", prompt(0, 15), SamplingParams(max_new_tokens=50, seed=0))])[0]
    assert out.finish_reason == "length" and len(out.output_ids) == 5


def test_kv_pages_are_committed_as_sequences_grow_and_given_back_when_slots_free(tiny_arch):
    """A request that may use most of the context commits its cache a block of positions at a time, not the
    whole slot; once it ends with nothing waiting, its slot's pages go back to the system (they read as
    zeros), and the next request generates exactly what it did on a fresh cache."""
    import os

    from megatron_rl.rollout.native.kv_cache import ZERO_FILL_POSITIONS

    request = GenerateRequest("r0", prompt(0, 5), SamplingParams(temperature=0, max_new_tokens=600))
    with make_engine(tiny_arch, max_batch_size=2, max_seq_len=1024) as engine:
        ahead = []

        def on_token(sample_id, token, logprob, version):  # in the step's thread: the cache is still now
            ahead.append(max(engine.kv_cache.written) - (5 + len(ahead)))

        first = engine.wait(engine.submit([request], on_token=on_token))[0]
        assert 0 < max(ahead) <= ZERO_FILL_POSITIONS + 1  # never the whole slot (600 positions ahead)
        assert engine.kv_cache.written == [0, 0]  # given back: nothing was waiting
        k = engine.kv_cache.k
        with torch.inference_mode():  # the cache's tensors are the engine's inference tensors
            k[:, 1] = 1.0
        engine.kv_cache.written[1] = 1
        engine.kv_cache.return_pages([1])
        page = os.sysconf("SC_PAGE_SIZE") // k.element_size()
        inner = k[0, 1].reshape(-1)[page:-page]  # the whole pages inside the block: gone, zeros on the next read
        assert inner.numel() > 0 and bool((inner == 0).all())
        assert not bool((k[:, 0] == 1.0).any())  # another slot untouched
        again = engine.generate([dataclasses.replace(request, request_id="r0-again")])[0]
        assert again.output_ids == first.output_ids and again.output_logprobs == first.output_logprobs
