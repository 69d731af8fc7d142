"""JEPO (arXiv 2503.19618): the implemented gradient against autograd of the closed-form bound, the
advantage pieces against hand formulas, the SFT loss, bad references, and the loop (sync and async)."""
from __future__ import annotations

import itertools
import json
import math
import os

import pytest
import torch

from megatron_rl.algorithms.config import LossConfig
from megatron_rl.algorithms.jepo import (
    JepoConfig,
    JepoTrainBatch,
    jepo_advantages,
    jepo_raw_advantages,
    make_jepo_loss_fn,
    make_sft_loss_fn,
    proxy_nll,
)
from megatron_rl.types import TrainBatch

VOCAB = 3


class TinyLM(torch.nn.Module):
    """A float64 GRU language model: small enough to enumerate every chain of thought."""

    def __init__(self, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.emb = torch.nn.Embedding(VOCAB + 1, 6).double()
        self.rnn = torch.nn.GRU(6, 6, batch_first=True).double()
        self.out = torch.nn.Linear(6, VOCAB).double()  # BOS (id VOCAB) is never predicted: chains sum to 1
        with torch.no_grad():
            self.out.weight.mul_(3.0)  # spread the distributions: the bound's terms differ clearly

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Token-aligned log pi(tokens[:, t] | tokens[:, :t]), [B, S] (column 0 is 0)."""
        hidden, _ = self.rnn(self.emb(tokens[:, :-1]))
        logp = torch.log_softmax(self.out(hidden), -1).gather(-1, tokens[:, 1:, None]).squeeze(-1)
        return torch.cat([logp.new_zeros(tokens.shape[0], 1), logp], 1)


def _chains(length: int) -> list[tuple[int, ...]]:
    return list(itertools.product(range(VOCAB), repeat=length))


def _rows(chains, answer):
    """Rows [BOS] + c + a*, with the c-mask and the a*-mask."""
    tokens = torch.tensor([[VOCAB, *c, *answer] for c in chains])
    width = tokens.shape[1]
    c_mask = torch.zeros(len(chains), width)
    a_mask = torch.zeros(len(chains), width)
    c_len = len(chains[0])
    c_mask[:, 1:1 + c_len] = 1
    a_mask[:, 1 + c_len:] = 1
    return tokens, c_mask, a_mask


def _grads(model, value):
    return torch.cat([g.flatten() for g in torch.autograd.grad(value, list(model.parameters()), retain_graph=True)])


@pytest.mark.parametrize("n,length,bound", [(1, 2, "multi"), (2, 2, "multi"), (4, 1, "multi"),
                                            (2, 2, "jensen"), (4, 1, "jensen")])
def test_gradient_equals_autograd_of_closed_form_bound(n, length, bound):
    """E over all n-tuples of chains of the implemented loss's gradient == -grad L_n, where
    L_n = sum_tuples prod_i pi(c_i|x) log mean_i pi(a*|x,c_i) (multi) or L_1 = sum_c pi(c|x) log pi(a*|x,c)
    (jensen), computed naively by enumeration in float64 and differentiated by autograd."""
    model = TinyLM(seed=n)
    answer = (2, 1)
    chains = _chains(length)
    tokens, c_mask, a_mask = _rows(chains, answer)
    logprobs = model(tokens)
    log_p_chain = (logprobs * c_mask).sum(-1)  # log pi(c|x)
    l = (logprobs * a_mask).sum(-1)            # log pi(a*|x,c)
    tuples = torch.tensor(list(itertools.product(range(len(chains)), repeat=n)))
    if bound == "multi":
        closed = (log_p_chain[tuples].sum(-1).exp() * (torch.logsumexp(l[tuples], -1) - math.log(n))).sum()
    else:
        closed = (log_p_chain.exp() * l).sum()
    expected = _grads(model, closed)

    config = JepoConfig(bound=bound, normalize_advantages=False, advantage_clip=None, beta_sup=1.0)
    loss_fn = make_jepo_loss_fn(config, LossConfig(name="aipo"), normalizer=float(n))  # one group
    total = 0.0
    for t in tuples:
        rows = logprobs[t]
        batch = JepoTrainBatch(tokens=tokens[t], loss_mask=c_mask[t], answer_mask=a_mask[t],
                               behaviour_logprobs=rows.detach(), group_size=n)
        loss, _ = loss_fn(rows, batch)
        total = total + log_p_chain[t].sum().exp().detach() * loss
    actual = _grads(model, total)
    assert expected.abs().max() > 1e-3  # the check is not vacuous
    torch.testing.assert_close(actual, -expected, rtol=1e-9, atol=1e-12)


def test_advantages_normalised_clipped_and_format_penalty():
    l = torch.tensor([[-3.0, -1.0, -2.0, -7.0], [-1.0, -1.0, -1.0, -1.0]], dtype=torch.float64)
    valid = torch.tensor([[True, True, True, False], [True, True, True, True]])
    raw = jepo_raw_advantages(l, valid, "multi")
    # By hand: n * (logmeanexp over usable - logmeanexp over the other usable samples).
    lme = lambda xs: math.log(sum(math.exp(x) for x in xs) / len(xs))  # noqa: E731
    usable = [-3.0, -1.0, -2.0]
    for i in range(3):
        others = [x for j, x in enumerate(usable) if j != i]
        assert raw[0, i].item() == pytest.approx(4 * (lme(usable) - lme(others)), rel=1e-12)
    assert raw[0, 3] == 0 and torch.all(raw[1] == 0)
    config = JepoConfig(advantage_clip=1.0, format_penalty=-10.0)
    adv = jepo_advantages(l, valid, config)
    a = raw[0, :3]
    std = ((a - a.mean()) ** 2).mean().sqrt()
    torch.testing.assert_close(adv[0, :3], (a / std).clamp(-1, 1))
    assert adv[0, 3] == -10.0  # no marker: the format penalty, not clipped
    assert torch.all(adv[1] == 0)  # equal likelihoods: no policy-gradient signal
    jensen = jepo_raw_advantages(l, valid, "jensen")
    assert jensen[0, 0].item() == pytest.approx(4 / 3 * (-3.0 - (-1.0 - 2.0) / 2), rel=1e-12)


def _random_group_batch(groups: int, n: int, width: int = 7, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    rows = groups * n
    logits = torch.randn(rows, width, 5, generator=g, dtype=torch.float64, requires_grad=True)
    tokens = torch.randint(0, 5, (rows, width), generator=g)
    logprobs = torch.log_softmax(logits, -1).gather(-1, tokens[..., None]).squeeze(-1)
    c_mask = torch.zeros(rows, width)
    a_mask = torch.zeros(rows, width)
    c_mask[:, 1:4] = 1
    a_mask[:, 4:] = 1
    a_mask[1] = 0  # sample 1 of group 0 wrote no marker
    return logits, logprobs, tokens, c_mask, a_mask


def test_micro_batches_of_whole_groups_sum_to_the_global_loss():
    n, groups = 4, 2
    logits, logprobs, tokens, c_mask, a_mask = _random_group_batch(groups, n)
    behaviour = (logprobs.detach() - 0.3 * torch.rand(logprobs.shape, dtype=torch.float64)).float()
    batch = JepoTrainBatch(tokens=tokens, loss_mask=c_mask, answer_mask=a_mask, behaviour_logprobs=behaviour,
                           advantages=torch.zeros_like(c_mask), group_size=n)
    loss_fn = make_jepo_loss_fn(JepoConfig(), LossConfig(name="aipo"), normalizer=float(groups * n))
    whole, _ = loss_fn(logprobs, batch)
    parts = sum(loss_fn(logprobs[i * n:(i + 1) * n], mb)[0] for i, mb in enumerate(batch.micro_batches(n)))
    torch.testing.assert_close(whole, parts)
    with pytest.raises(ValueError, match="whole groups"):
        JepoTrainBatch(tokens=tokens[:3], loss_mask=c_mask[:3], answer_mask=a_mask[:3], group_size=n)


def test_off_policy_weights_apply_to_the_policy_gradient_term_only():
    """Asynchronous samples: grad = -(1/N) sum_t min(pi/mu, rho) A~_i grad log pi(c_t) - beta_sup grad B / G."""
    n = 4
    logits, logprobs, tokens, c_mask, a_mask = _random_group_batch(1, n, seed=3)
    behaviour = (logprobs.detach() + torch.linspace(-2, 2, logprobs.numel()).view_as(logprobs)).float()
    config = JepoConfig(beta_sup=0.5)
    loss_cfg = LossConfig(name="aipo", aipo_rho=2.0)
    batch = JepoTrainBatch(tokens=tokens, loss_mask=c_mask, answer_mask=a_mask, behaviour_logprobs=behaviour,
                           group_size=n)
    loss, metrics = make_jepo_loss_fn(config, loss_cfg, normalizer=float(n))(logprobs, batch)
    (grad,) = torch.autograd.grad(loss, logits, retain_graph=True)

    l = (logprobs * a_mask).sum(-1).view(1, n)
    valid = (a_mask.sum(-1) > 0).view(1, n)
    adv = jepo_advantages(l.detach(), valid, config).view(n, 1)
    weight = torch.exp(logprobs.detach() - behaviour.double()).clamp(max=2.0)
    bound = torch.logsumexp(l[valid], -1) - math.log(int(valid.sum()))
    manual = -(weight * adv * logprobs * c_mask).sum() / n - 0.5 * bound
    (expected,) = torch.autograd.grad(manual, logits)
    torch.testing.assert_close(grad, expected)
    assert metrics["clip_frac"] > 0  # some weights were clipped at rho


def test_combined_mode_uses_verifier_advantages_and_no_bound_for_verified_groups():
    n = 4
    logits, logprobs, tokens, c_mask, a_mask = _random_group_batch(2, n, seed=5)
    verifier_rows = torch.tensor([True] * n + [False] * n)
    a_mask[:n] = 0  # verified groups are rows x + y (no a*)
    verifier_adv = torch.tensor([1.0, -1.0, 0.5, -0.5] + [0.0] * n)[:, None] * c_mask
    batch = JepoTrainBatch(tokens=tokens, loss_mask=c_mask, answer_mask=a_mask, advantages=verifier_adv,
                           behaviour_logprobs=logprobs.detach().float(), verifier_rows=verifier_rows, group_size=n)
    config = JepoConfig(mode="combined")
    loss, metrics = make_jepo_loss_fn(config, LossConfig(name="aipo"), normalizer=float(2 * n))(logprobs, batch)
    (grad,) = torch.autograd.grad(loss, logits, retain_graph=True)
    l = (logprobs[n:] * a_mask[n:]).sum(-1).view(1, n)
    valid = (a_mask[n:].sum(-1) > 0).view(1, n)
    adv = jepo_advantages(l.detach(), valid, config).view(n, 1)
    manual = (-(verifier_adv[:n] * logprobs[:n] * c_mask[:n]).sum() - (adv * logprobs[n:] * c_mask[n:]).sum()) / (2 * n) \
        - (torch.logsumexp(l[valid], -1) - math.log(int(valid.sum()))) * n / (2 * n)
    (expected,) = torch.autograd.grad(manual, logits)
    torch.testing.assert_close(grad, expected)
    assert metrics["jepo_verifier_groups"] == 1


def test_sft_loss_is_the_reference_nll_and_proxy_nll_is_the_negated_bound():
    logits, logprobs, tokens, c_mask, a_mask = _random_group_batch(1, 2, seed=7)
    loss, _ = make_sft_loss_fn(2.0)(logprobs, TrainBatch(tokens=tokens, loss_mask=a_mask))
    expected = -(logprobs * a_mask).sum() / 2.0
    torch.testing.assert_close(loss, expected)
    l = torch.tensor([[-2.0, -4.0], [-1.0, -9.0]], dtype=torch.float64)
    valid = torch.tensor([[True, True], [True, False]])
    nll = proxy_nll(l, valid)
    assert nll[0].item() == pytest.approx(-math.log((math.exp(-2) + math.exp(-4)) / 2))
    assert nll[1].item() == pytest.approx(1.0)


# --- bad references and the loop -------------------------------------------------------------------------

def _write_jsonl(path, rows):
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


def _loop_config(model_path, run_dir, data_path, *extra):
    from megatron_rl.config import load_yaml
    from megatron_rl.run_config import RunConfig

    recipe = os.path.join(os.path.dirname(__file__), "..", "examples", "configs", "jepo_champ.yaml")
    return load_yaml(RunConfig, recipe, [
        f"model.path={model_path}", f"run_dir={run_dir}", "steps=2", "rollout.prompts_per_step=2",
        "rollout.samples_per_prompt=2", "rollout.max_new_tokens=6", "trainer.micro_batch_size=2",
        "trainer.lr=1e-3", "data.train.kind=jsonl", f"data.train.path={data_path}", "data.train.answer_field=reference",
        "data.heldout_size=2", "eval.max_new_tokens=4", "eval.likelihood.max_new_tokens=4",
        "eval.likelihood.samples=2", "engine.max_batch_size=8", "engine.max_seq_len=256",
        "checkpoint.every_steps=0", "checkpoint.save_at_end=false", "logging.wandb=disabled", "logging.plots=false",
        # A random model never writes "The final answer is"; a one-letter marker appears in most samples.
        "algorithm.jepo.answer_marker=e", "eval.likelihood.answer_marker=e", "rollout.stop=[e]", *extra])


def _references(tmp_path, count=8, long_index=None):
    rows = [{"prompt": f"What is {i} plus {i + 1}?", "reference": f"{i} plus {i + 1} is {2 * i + 1}."}
            for i in range(count)]
    if long_index is not None:
        rows[long_index]["reference"] = "word " * 400
    path = str(tmp_path / "refs.jsonl")
    _write_jsonl(path, rows)
    return path


def test_missing_reference_is_an_error_naming_the_line_or_a_counted_skip(tmp_path):
    from megatron_rl.data.config import DataConfig, SourceConfig
    from megatron_rl.data.prompts import DataError
    from megatron_rl.data.sources import build_datasets

    path = str(tmp_path / "bad.jsonl")
    _write_jsonl(path, [{"prompt": "a?", "reference": "x"}, {"prompt": "b?"}, {"prompt": "c?", "reference": "y"}])
    with pytest.raises(DataError, match=r"bad.jsonl:2: missing field 'reference'"):
        build_datasets(DataConfig(train=SourceConfig(kind="jsonl", path=path, answer_field="reference"),
                                  heldout_size=0))
    train, _ = build_datasets(DataConfig(train=SourceConfig(kind="jsonl", path=path, answer_field="reference",
                                                            on_bad_row="skip"), heldout_size=0))
    assert len(train) == 2 and train.stats["bad_rows_skipped"] == 1


def test_reference_over_budget_is_an_error_or_a_counted_skip(tmp_path, tiny_chat_model):
    from types import SimpleNamespace

    from megatron_rl.data.prompts import DataError
    from megatron_rl.data.sources import build_datasets
    from megatron_rl.models.pretrained import load_pretrained
    from megatron_rl.recipes.jepo.objective import JepoObjective

    path = _references(tmp_path, long_index=3)
    model = load_pretrained(tiny_chat_model)
    config = _loop_config(tiny_chat_model, str(tmp_path / "run"), path, "data.heldout_size=0",
                          "algorithm.jepo.on_bad_reference=error")
    objective = JepoObjective(config, model.tokenizer, SimpleNamespace(arch=model.arch, state=model.state))
    train, heldout = build_datasets(config.data)
    with pytest.raises(DataError, match=r"refs.jsonl: row 4 .*reference is \d+ tokens, over algorithm.jepo.max_reference_tokens"):
        objective.prepare_data(train, heldout)
    config = _loop_config(tiny_chat_model, str(tmp_path / "run"), path, "data.heldout_size=0",
                          "algorithm.jepo.on_bad_reference=skip")
    objective = JepoObjective(config, model.tokenizer, SimpleNamespace(arch=model.arch, state=model.state))
    kept, _ = objective.prepare_data(train, heldout)
    assert len(kept) == len(train) - 1 and kept.stats["bad_reference_skipped"] == 1


@pytest.mark.parametrize("staleness", [0, 1])
def test_jepo_runs_in_the_one_loop_sync_and_async(tmp_path, tiny_chat_model, staleness):
    from megatron_rl.controller.loop import train

    run_dir = str(tmp_path / f"run{staleness}")
    # The asynchronous run also carries the KL term (a frozen reference copy sharing the policy's groups).
    kl = ["algorithm.loss.kl_coef=0.001"] if staleness else []
    summary = train(_loop_config(tiny_chat_model, run_dir, _references(tmp_path),
                                 f"rollout.max_staleness={staleness}", "steps=3", *kl))
    records = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    steps = [r for r in records if "train/jepo_bound" in r]
    assert len(steps) == 3
    assert max(r["rollout/staleness_max"] for r in steps) == staleness
    assert all(math.isfinite(r["train/loss"]) and r["train/grad_norm"] > 0 for r in steps)
    assert any(r["rollout/marker_fraction"] > 0 for r in steps) and any(r["train/jepo_bound"] < 0 for r in steps)
    if staleness:  # stale samples: the AIPO weights differ from 1 and are reported; KL to the reference too
        assert any(abs(r["train/is_weight_mean"] - 1.0) > 1e-6 for r in steps[1:])
        assert steps[0]["train/kl_ref"] == pytest.approx(0.0, abs=1e-5) and steps[-1]["train/kl_ref"] > 1e-6
    for when in (summary.eval_before, summary.eval_after):
        assert math.isfinite(when["eval/nll_bound"]) and when["eval/nll_bound"] > 0


def test_sft_objective_runs_in_the_loop_and_lowers_reference_nll(tmp_path, tiny_chat_model):
    from megatron_rl.controller.loop import train

    run_dir = str(tmp_path / "sft")
    summary = train(_loop_config(tiny_chat_model, run_dir, _references(tmp_path), "algorithm.objective=sft",
                                 "rollout.samples_per_prompt=1", "steps=4", "trainer.lr=3e-3"))
    records = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    nll = [r["train/sft_nll_seq"] for r in records if "train/sft_nll_seq" in r]
    assert len(nll) == 4 and nll[-1] < nll[0]


def test_champ_source_gives_worked_solutions_as_references_and_short_answers():
    from megatron_rl.data.config import DataConfig, SourceConfig
    from megatron_rl.data.sources import build_datasets

    train, heldout = build_datasets(DataConfig(train=SourceConfig(kind="champ"), heldout_size=10))
    assert train.stats["rows_read"] == 270 and len(train) + len(heldout) == 270
    assert not train.questions() & heldout.questions()
    first = next(p for p in train if p.metadata["row"] == "P_Combinatorics_1")
    assert first.answer.startswith("Let x_n, y_n, z_n be the number of length-n strings")
    assert "\n" in first.answer and first.metadata["short_answer"] == "239" and first.metadata["verifiable"]
    verifiable = sum(p.metadata["verifiable"] for p in list(train) + list(heldout))
    assert 60 <= verifiable <= 112  # numeric / arithmetic short answers only


def test_soft_match_uses_the_verifier_then_the_judge():
    from types import SimpleNamespace

    from megatron_rl.rewards.registry import Reward
    from megatron_rl.rewards.config import RewardConfig

    checkable = SimpleNamespace(prompt_id="p", answer="long proof", metadata={"short_answer": "239", "verifiable": True})
    open_ended = SimpleNamespace(prompt_id="q", answer="long proof", metadata={"short_answer": "n!", "verifiable": False})
    reward = Reward(RewardConfig(name="soft_match"))
    assert reward("The final answer is 239.", checkable).correct
    assert not reward("The final answer is 238.", checkable).correct
    assert not reward("anything", open_ended).ok and reward.num_errors == 1  # no judge: a counted error
    judged = Reward(RewardConfig(name="soft_match", kwargs={"judge": "tests.test_jepo:_length_judge"}))
    assert judged("a long enough answer", open_ended).reward == 1.0


def _length_judge(response, prompt, **kwargs):
    return float(len(response) > 10)


def test_cut_at_marker_keeps_the_shortest_prefix_with_the_marker():
    from megatron_rl.recipes.jepo.likelihood import cut_at_marker, reference_ids

    class Chars:  # one token per character
        eos_token_id = 0

        def decode(self, ids):
            return "".join(chr(i) for i in ids if i)

        def encode(self, text):
            return [ord(ch) for ch in text]

    tok = Chars()
    ids = tok.encode("so x=3. The final answer is 3, done")
    cut, found = cut_at_marker(tok, ids, "The final answer is")
    assert found and tok.decode(cut) == "so x=3. The final answer is"
    cut, found = cut_at_marker(tok, tok.encode("no marker here"), "The final answer is")
    assert not found and tok.decode(cut) == "no marker here"
    assert reference_ids(tok, " 42 ") == tok.encode(" 42") + [0]


class _CharTokenizer:
    """One token per character; eos/pad = 0. Chat rendering is the bare user text."""

    eos_token_id = pad_token_id = 0

    def decode(self, ids):
        return "".join(chr(i) for i in ids if i)

    def encode(self, text):
        return [ord(ch) for ch in text]

    def encode_chat(self, messages):
        return self.encode(messages[-1]["content"])


@pytest.mark.parametrize("missing_marker", ["penalty", "append"])
def test_rows_are_prompt_chain_and_reference_with_separate_masks(missing_marker):
    from types import SimpleNamespace

    from megatron_rl.config import load_yaml
    from megatron_rl.controller.episodes import Group, Sample
    from megatron_rl.data.prompts import Prompt
    from megatron_rl.recipes.jepo.objective import JepoObjective
    from megatron_rl.rewards.registry import RewardResult
    from megatron_rl.run_config import RunConfig
    from megatron_rl.types import Completion

    tok = _CharTokenizer()
    config = load_yaml(RunConfig, None, ["rollout.samples_per_prompt=2", "trainer.micro_batch_size=2",
                                         "algorithm.objective=jepo", "algorithm.jepo.answer_marker=ANS",
                                         f"algorithm.jepo.missing_marker={missing_marker}"])
    objective = JepoObjective(config, tok, SimpleNamespace(arch=SimpleNamespace(max_position_embeddings=512)))
    prompt = Prompt(prompt_id="p", messages=[{"role": "user", "content": "Q?"}], question="Q?", answer="42")
    outputs = ["hmm ANS 7", "no marker"]
    samples = [Sample(Completion(request_id=f"r{k}", prompt_ids=tok.encode("Q?"), output_ids=tok.encode(text) + [0],
                                 output_logprobs=[-0.5] * (len(text) + 1), weight_versions=[0] * (len(text) + 1),
                                 finish_reason="stop"), text, RewardResult(reward=0.0)) for k, text in enumerate(outputs)]
    step, _ = objective.prepare_step([Group(prompt, samples, 0)], trainer_version=0)
    batch = step.batch

    def span(row, mask):
        return tok.decode(batch.tokens[row][mask[row] > 0].tolist())

    assert tok.decode(batch.tokens[0].tolist()) == "Q?hmm ANS 42"
    assert span(0, batch.loss_mask) == "hmm ANS" and span(0, batch.answer_mask) == " 42"
    assert batch.answer_mask[0].sum() == 4  # " 42" and the end-of-turn token
    if missing_marker == "penalty":  # trained on (with the format penalty), never scored
        assert span(1, batch.loss_mask) == "no marker" and batch.answer_mask[1].sum() == 0
    else:  # the marker is appended as context: neither trained on nor scored
        assert tok.decode(batch.tokens[1].tolist()) == "Q?no marker ANS 42"
        assert span(1, batch.loss_mask) == "no marker" and span(1, batch.answer_mask) == " 42"
    assert step.metrics["rollout/marker_fraction"] == 0.5
