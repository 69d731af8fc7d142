"""Exact sampling: empirical frequencies match the temperature / top-k / top-p / min-p distribution
(chi-square with fixed seeds, plus a negative control showing the test has power), and seeds
reproduce samples whatever the batch."""
from __future__ import annotations

import pytest
import torch

from megatron_rl.rollout.config import NativeEngineConfig
from megatron_rl.rollout.engine import GenerateRequest, SamplingParams
from megatron_rl.rollout.native import NativeEngine
from megatron_rl.rollout.native.sampling import inverse_cdf, sample_tokens
from tests.helpers import prompt, tiny_state

LOGITS = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0])


def reference_distribution(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """Written independently of the engine: plain loops over a sorted list."""
    z = (logits / p.temperature).tolist()
    order = sorted(range(len(z)), key=lambda i: -z[i])
    keep = order if p.top_k < 0 else order[:p.top_k]
    m = max(z[i] for i in keep)
    weights = {i: pow(2.718281828459045, z[i] - m) for i in keep}
    total = sum(weights.values())
    kept, mass = [], 0.0
    for i in keep:  # top-p: smallest prefix whose mass reaches top_p
        if mass >= p.top_p:
            break
        kept.append(i)
        mass += weights[i] / total
    if p.min_p > 0:
        top = max(weights[i] for i in kept)
        kept = [i for i in kept if weights[i] >= p.min_p * top]
    out = torch.zeros(len(z), dtype=torch.float64)
    for i in kept:
        out[i] = weights[i]
    return out / out.sum()


def chi_square_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    support = probs > 0
    expected = probs[support] * counts.sum()
    stat = ((counts[support] - expected) ** 2 / expected).sum()
    df = int(support.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2.0, dtype=torch.float64), stat / 2.0))


def draw(params: SamplingParams, n: int, seed: int) -> torch.Tensor:
    gens = [torch.Generator().manual_seed(seed * 100_000 + i) for i in range(n)]
    logits = LOGITS.expand(n, -1).contiguous()
    tokens, logprobs = sample_tokens(logits, [params] * n, gens)
    assert torch.allclose(logprobs, torch.log_softmax(LOGITS, -1)[tokens])  # raw-policy log-probs
    return torch.bincount(tokens, minlength=len(LOGITS)).double()


CASES = [SamplingParams(), SamplingParams(temperature=0.6), SamplingParams(temperature=1.5, top_k=4),
         SamplingParams(top_p=0.7), SamplingParams(temperature=0.8, top_k=6, top_p=0.9),
         SamplingParams(min_p=0.2)]


@pytest.mark.parametrize("params", CASES, ids=lambda p: f"T{p.temperature}-k{p.top_k}-p{p.top_p}-minp{p.min_p}")
def test_frequencies_match_distribution(params):
    counts = draw(params, 20_000, seed=1)
    probs = reference_distribution(LOGITS, params)
    assert counts[probs == 0].sum() == 0, "sampled a token outside the top-k/top-p/min-p set"
    assert chi_square_pvalue(counts, probs) > 1e-3


def test_chi_square_has_power():
    # The same samples fail against a subtly wrong distribution (temperature 1.1 instead of 1.0).
    counts = draw(SamplingParams(), 20_000, seed=2)
    assert chi_square_pvalue(counts, reference_distribution(LOGITS, SamplingParams())) > 1e-3
    assert chi_square_pvalue(counts, reference_distribution(LOGITS, SamplingParams(temperature=1.1))) < 1e-3


def test_inverse_cdf_never_picks_zero_mass_and_handles_tiny_probabilities():
    probs = torch.zeros(4, 1000)
    probs[:, 3] = 1.0
    probs[:, 999] = 1e-9
    probs[1, 500] = 1.0
    u = torch.tensor([0.0, 0.75, 1.0 - 1e-16, 0.5], dtype=torch.float64)
    out = inverse_cdf(probs, u)
    assert out.tolist()[0] == 3 and out.tolist()[1] == 500 and out.tolist()[2] in (999, 3) and out.tolist()[3] == 3
    # a token of probability 1e-9 is drawn when u falls in its interval
    assert inverse_cdf(probs[:1], torch.tensor([1.0 - 5e-10], dtype=torch.float64)).item() == 999


def test_greedy_rows_take_argmax():
    logits = torch.randn(5, 50)
    tokens, _ = sample_tokens(logits, [SamplingParams(temperature=0)] * 5, [None] * 5)
    assert tokens.tolist() == logits.argmax(-1).tolist()


@pytest.fixture(scope="module")
def engine(tiny_arch):
    with NativeEngine(tiny_arch, tiny_state(tiny_arch), config=NativeEngineConfig(max_batch_size=32, max_seq_len=128),
                      eos_token_ids=[]) as e:
        yield e


def test_engine_samples_match_its_next_token_distribution(engine):
    # End to end on the tiny vocabulary: 2500 one-token samples of one prompt vs softmax(z / T) with top-k.
    ids = prompt(0, 12)
    params = SamplingParams(max_new_tokens=1, temperature=0.8, top_k=12, n=2500, seed=5)
    out = engine.generate([GenerateRequest("dist", ids, params)])
    counts = torch.bincount(torch.tensor([c.output_ids[0] for c in out]), minlength=256).double()
    logits = engine.forward_logits(ids)[-1]
    probs = reference_distribution(logits, params)
    assert counts[probs == 0].sum() == 0
    assert chi_square_pvalue(counts, probs) > 1e-3
    raw = torch.log_softmax(logits.double(), -1)
    for c in out[:50]:
        assert abs(c.output_logprobs[0] - raw[c.output_ids[0]].item()) < 1e-5


def test_seed_reproducible_whatever_the_batch(engine):
    sp = SamplingParams(max_new_tokens=16, temperature=1.0, seed=1234, ignore_eos=True)
    alone = engine.generate([GenerateRequest("a", prompt(1, 9), sp)])[0]
    crowd = engine.generate([GenerateRequest(f"o{i}", prompt(10 + i, 5 + i), SamplingParams(max_new_tokens=20, seed=i))
                             for i in range(6)] + [GenerateRequest("a", prompt(1, 9), sp)])[-1]
    assert alone.output_ids == crowd.output_ids
    other = engine.generate([GenerateRequest("b", prompt(1, 9), SamplingParams(max_new_tokens=16, seed=99, ignore_eos=True))])[0]
    assert other.output_ids != alone.output_ids
    group = engine.generate([GenerateRequest("g", prompt(1, 9), SamplingParams(max_new_tokens=8, seed=7, n=4))])
    assert [c.request_id for c in group] == ["g-0", "g-1", "g-2", "g-3"] and {c.group_id for c in group} == {"g"}
    assert len({tuple(c.output_ids) for c in group}) > 1
    again = engine.generate([GenerateRequest("g", prompt(1, 9), SamplingParams(max_new_tokens=8, seed=7, n=4))])
    assert [c.output_ids for c in again] == [c.output_ids for c in group]


@pytest.mark.parametrize("kwargs, field", [
    ({"temperature": -0.1}, "temperature"), ({"temperature": float("nan")}, "temperature"),
    ({"top_p": 0.0}, "top_p"), ({"top_p": 1.5}, "top_p"), ({"top_k": -3}, "top_k"),
    ({"max_new_tokens": 0}, "max_new_tokens"), ({"n": 0}, "n"), ({"min_p": 2.0}, "min_p"),
    ({"stop": [""]}, "stop"), ({"seed": 2**64}, "seed"),
])
def test_invalid_sampling_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_sglang_dict_round_trip():
    sp = SamplingParams.from_sglang({"max_new_tokens": 5, "temperature": 0.5, "top_k": -1, "sampling_seed": 3,
                                     "stop": "\n", "skip_special_tokens": True, "top_p": None})
    assert sp.seed == 3 and sp.stop == ["\n"] and sp.top_p == 1.0
    assert SamplingParams.from_sglang(sp.to_sglang()) == sp
    with pytest.raises(ValueError, match="sampling_params.top_p"):
        SamplingParams.from_sglang({"top_p": 7})
    with pytest.raises(ValueError, match="unknown sampling parameter 'bogus'"):
        SamplingParams.from_sglang({"bogus": 1})
    with pytest.raises(ValueError, match="repetition_penalty"):
        SamplingParams.from_sglang({"repetition_penalty": 1.2})
