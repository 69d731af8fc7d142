"""Rollout engines that fail without failing the run (rollout/pool.py): a pool of real engine servers
(`megatron-rl serve`'s RolloutServer over the native engine, reached over HTTP) where one is shut down under
load; its groups go to the live engine whole and complete as the live engine alone would have made them, a
restartable engine comes back with the current weights and version, and with every engine gone the requests
fail with one line naming them."""
from __future__ import annotations

import os
import time
from concurrent.futures import Future

import pytest

from megatron_rl.rollout.client import EngineHTTPError, HTTPEngine
from megatron_rl.rollout.config import NativeEngineConfig
from megatron_rl.rollout.engine import GenerateRequest, RequestError, SamplingParams
from megatron_rl.rollout.native import NativeEngine
from megatron_rl.rollout.pool import EnginePool, EnginePoolDead, is_engine_failure
from megatron_rl.rollout.server import RolloutServer
from megatron_rl.types import Completion
from tests.helpers import prompt, tiny_state


def _server(arch, state):
    engine = NativeEngine(arch, state, config=NativeEngineConfig(max_batch_size=4, max_seq_len=64), eos_token_ids=[])
    return engine, RolloutServer(engine, port=0).start()


class ServedEngine(HTTPEngine):
    """An HTTP engine over a server this test owns (and can kill)."""

    def __init__(self, arch, state):
        self.arch, self.state = arch, state
        self.native, self.server = _server(arch, state)
        self.address = self.server.address
        self.restarted_with: tuple | None = None
        self.killed = False
        super().__init__(self.server.url, timeout=60)

    def kill(self):
        if not self.killed:
            self.server.shutdown()
            self.native.close()
            self.killed = True

    def close(self):
        super().close()
        self.kill()


class RestartableEngine(ServedEngine):
    """`restart` starts a fresh server on the same port with the weights it is given (what VLLMEngine.restart
    does with a vLLM server the run launched)."""

    def update_weights(self, named_tensors, version=None):
        named = dict(named_tensors)
        count = super().update_weights(named, version)
        self.state, self.held_version = named, version  # what it serves, as a vLLM engine's staged directory
        return count

    def staged_weights(self):
        return None, getattr(self, "held_version", 0)

    def restart(self, weights_dir, version):
        self.native = NativeEngine(self.arch, self.state, config=NativeEngineConfig(max_batch_size=4, max_seq_len=64),
                                   eos_token_ids=[])
        self.native.update_weights(self.state, version)
        host, port = self.address
        self.server = RolloutServer(self.native, host=host, port=port).start()
        self.restarted_with = (weights_dir, version)
        self.killed = False


def _wait_for_restarts(pool, count, timeout=60.0):
    deadline = time.monotonic() + timeout
    while pool.engine_metrics["rollout/engine_restarts"] < count and time.monotonic() < deadline:
        time.sleep(0.2)


def _groups(count, n=3, tokens=12):
    return [GenerateRequest(prompt_ids=prompt(i, 6), request_id=f"p{i}",
                            sampling=SamplingParams(max_new_tokens=tokens, n=n, seed=100 + i)) for i in range(count)]


def test_a_dead_engines_groups_go_whole_to_the_live_one_and_equal_its_own(tiny_arch):
    state = tiny_state(tiny_arch)
    engines = [ServedEngine(tiny_arch, state) for _ in range(2)]  # no restart: the pool carries on with one engine
    reference_engine, reference = _server(tiny_arch, state)
    pool = EnginePool(engines, dead_engine_timeout_s=30)
    try:
        expected = HTTPEngine(reference.url).generate(_groups(8))
        futures = pool.submit(_groups(8))
        engines[1].kill()  # mid-flight: some of its groups are running, some queued
        completions = pool.wait(futures, timeout=120)
        # seeded: the same tokens; the log-probs to float rounding (a row's last bits depend on its batch)
        assert [(c.request_id, c.output_ids) for c in completions] == [(c.request_id, c.output_ids) for c in expected]
        assert max(abs(a - b) for c, e in zip(completions, expected)
                   for a, b in zip(c.output_logprobs, e.output_logprobs)) < 1e-5
        # later groups go to the live engine only
        more = pool.generate(_groups(2))
        assert len(more) == 6
        assert pool.engine_metrics == {"rollout/engine_restarts": 0.0, "rollout/engines_live": 1.0}
        health = pool.health()
        assert health["ok"] and list(health["dead"]) == [engines[1].base_url]
    finally:
        pool.close()
        reference.shutdown()
        reference_engine.close()


def test_a_restartable_engine_comes_back_with_the_current_weights_and_version(tiny_arch):
    state = tiny_state(tiny_arch)
    engines = [RestartableEngine(tiny_arch, state) for _ in range(2)]
    pool = EnginePool(engines, dead_engine_timeout_s=30)
    try:
        new_state = {k: v + 0.01 for k, v in state.items()}
        pool.update_weights(new_state, version=4)
        engines[1].kill()
        completions = pool.generate(_groups(6))
        assert {v for c in completions for v in c.weight_versions} == {4}
        _wait_for_restarts(pool, 1)
        assert pool.engine_metrics == {"rollout/engine_restarts": 1.0, "rollout/engines_live": 2.0}
        assert engines[1].restarted_with == (None, 4) and engines[1].version == 4
        # found dead by a weight update: it restarts from the newest weights on disk (the live engine's, or its
        # own when the restart began before the live engine took the update) and then takes any it missed
        engines[0].kill()
        pool.update_weights({k: v + 0.02 for k, v in state.items()}, version=5)
        _wait_for_restarts(pool, 2)
        assert engines[0].restarted_with in ((None, 4), (None, 5)) and engines[0].version == 5
    finally:
        pool.close()


def test_weights_pushed_while_the_only_engine_is_down_reach_it_after_its_restart(tiny_arch):
    state = tiny_state(tiny_arch)
    engine = RestartableEngine(tiny_arch, state)
    pool = EnginePool([engine], dead_engine_timeout_s=60)
    try:
        pool.update_weights(state, version=1)
        engine.kill()
        pool.update_weights({k: v + 0.01 for k, v in state.items()}, version=2)  # it fails there: no engine has them
        completions = pool.generate(_groups(2))  # wait for the restart, then served with the missed weights
        assert {v for c in completions for v in c.weight_versions} == {2}
        assert engine.restarted_with == (None, 1) and engine.version == 2
        assert pool.engine_metrics == {"rollout/engine_restarts": 1.0, "rollout/engines_live": 1.0}
    finally:
        pool.close()


class TransferEngine(RestartableEngine):
    """Weights that live only in the server (VLLMEngine with a weight transfer): a restart comes back with the
    launch weights, and nothing of an update is on disk."""

    stages_weights = False

    def __init__(self, arch, state):
        super().__init__(arch, state)
        self.launch_state = state

    def staged_weights(self):
        return None, 0

    def restart(self, weights_dir, version):
        self.state = self.launch_state
        super().restart(weights_dir, version)


def test_an_engine_whose_weights_live_only_in_its_server_restarts_with_the_last_weights_pushed(tiny_arch):
    state = tiny_state(tiny_arch)
    engines = [TransferEngine(tiny_arch, state) for _ in range(2)]
    pool = EnginePool(engines, dead_engine_timeout_s=60)
    try:
        new_state = {k: v + 0.05 for k, v in state.items()}
        pool.update_weights(new_state, version=3)
        engines[1].kill()
        pool.generate(_groups(2))
        _wait_for_restarts(pool, 1)
        assert engines[1].restarted_with == (None, 0)  # relaunched from its launch weights ...
        assert engines[1].version == 3  # ... then given the pool's last push
        for name, tensor in new_state.items():
            assert engines[1].native.named_weights([name])[name].equal(tensor)
        greedy = [GenerateRequest(prompt_ids=prompt(i, 6), request_id=f"g{i}",
                                  sampling=SamplingParams(max_new_tokens=8, temperature=0.0)) for i in range(3)]
        assert [c.output_ids for c in engines[1].generate(greedy)] == [c.output_ids for c in engines[0].generate(greedy)]
    finally:
        pool.close()


def test_with_every_engine_gone_requests_fail_with_one_line_naming_them(tiny_arch):
    state = tiny_state(tiny_arch)
    engines = [ServedEngine(tiny_arch, state) for _ in range(2)]
    pool = EnginePool(engines, dead_engine_timeout_s=1.0)
    for engine in engines:
        engine.kill()
    try:
        futures = pool.submit(_groups(1))
        with pytest.raises(EnginePoolDead, match=r"no rollout engine left: http://127\.0\.0\.1:\d+: EngineHTTPError: "
                                                 r"HTTP 0: cannot reach .*; http://127\.0\.0\.1:\d+: .* \(none came "
                                                 r"back within 1 s\)"):
            pool.wait(futures, timeout=60)
    finally:
        pool.close()


def test_a_refused_request_is_the_callers_error_not_the_engines():
    assert not is_engine_failure(RequestError("field 'prompt_ids': is empty"))
    assert not is_engine_failure(EngineHTTPError(401, "bad key"))
    assert is_engine_failure(EngineHTTPError(0, "cannot reach"))
    assert is_engine_failure(EngineHTTPError(500, "EngineCore encountered an issue"))
    assert is_engine_failure(ConnectionResetError())



def test_the_cli_reports_a_dead_pool_in_one_line_and_exits_1(monkeypatch, capsys, tmp_path):
    import megatron_rl.cli.train as train_command
    from megatron_rl.cli import main

    def every_engine_gone(config, **kwargs):
        raise EnginePoolDead("no rollout engine left: http://n1:30000: EngineHTTPError: HTTP 0: cannot reach "
                             "http://n1:30000 (none came back within 900 s)")

    monkeypatch.setattr(train_command, "train", every_engine_gone)
    recipe = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "configs",
                          "quickstart.yaml")
    code = main(["train", recipe, f"run_dir={tmp_path / 'run'}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1 and err == ["megatron-rl train: failed: no rollout engine left: http://n1:30000: EngineHTTPError: "
                                 "HTTP 0: cannot reach http://n1:30000 (none came back within 900 s); the run directory "
                                 "keeps its last checkpoint: continue with --resume"]


def test_an_engine_that_keeps_dying_stays_out_after_its_restarts(tiny_arch):
    state = tiny_state(tiny_arch)

    class CrashLooping(RestartableEngine):
        def restart(self, weights_dir, version):
            super().restart(weights_dir, version)
            self.kill()  # comes back dead every time

    engines = [ServedEngine(tiny_arch, state), CrashLooping(tiny_arch, state)]
    pool = EnginePool(engines, dead_engine_timeout_s=30, max_restarts_per_engine=2)
    try:
        engines[1].kill()
        for _ in range(6):  # each round finds it dead again, until it stays out
            assert len(pool.generate(_groups(2))) == 6
            time.sleep(0.5)
        assert pool._restarts_of == [0, 2] and pool.engine_metrics["rollout/engines_live"] == 1.0
    finally:
        pool.close()


class HungEngine:
    """An engine that accepts requests and never answers (a deadlocked server); `answer_late` resolves what it
    holds with completions of its own, as a hung server that wakes up would."""

    version = 0

    def __init__(self):
        self.held: list[tuple[GenerateRequest, list[Future]]] = []

    def submit(self, requests):
        futures = []
        for request in requests:
            mine = [Future() for _ in range(request.sampling.n)]
            self.held.append((request, mine))
            futures.extend(mine)
        return futures

    def answer_late(self):
        for request, futures in self.held:
            for i, future in enumerate(futures):
                future.set_result(Completion(request_id=f"{request.request_id}-{i}", prompt_ids=request.prompt_ids,
                                             output_ids=[0], output_logprobs=[0.0], weight_versions=[0],
                                             finish_reason="stop"))

    def update_weights(self, named_tensors, version=None):
        pass

    def health(self):
        return {"ok": True}

    def close(self):
        pass


def test_a_hung_engines_groups_go_to_the_live_one_and_its_late_answers_are_ignored(tiny_arch):
    state = tiny_state(tiny_arch)
    hung, live = HungEngine(), ServedEngine(tiny_arch, state)
    reference_engine, reference = _server(tiny_arch, state)
    pool = EnginePool([hung, live], dead_engine_timeout_s=30, hung_engine_timeout_s=1.0)
    try:
        expected = HTTPEngine(reference.url).generate(_groups(6))
        futures = pool.submit(_groups(6))
        completions = pool.wait(futures, timeout=120)
        assert hung.held  # it took groups, and they finished on the live engine
        assert [(c.request_id, c.output_ids) for c in completions] == [(c.request_id, c.output_ids) for c in expected]
        assert pool.engine_metrics == {"rollout/engine_restarts": 0.0, "rollout/engines_live": 1.0}
        assert "hung" in pool.health()["dead"]["HungEngine"]
        hung.answer_late()  # a hung server that wakes up changes nothing
        assert [c.output_ids for c in (f.result() for f in futures)] == [c.output_ids for c in expected]
        assert len(pool.generate(_groups(2))) == 6
    finally:
        pool.close()
        reference.shutdown()
        reference_engine.close()


def test_an_engine_busy_with_a_long_request_is_not_hung(tiny_arch):
    """The watchdog counts time since the engine last finished a sample: groups that keep finishing are progress."""
    state = tiny_state(tiny_arch)
    engines = [ServedEngine(tiny_arch, state) for _ in range(2)]
    pool = EnginePool(engines, dead_engine_timeout_s=30, hung_engine_timeout_s=2.0)
    try:
        completions = pool.generate(_groups(12, tokens=40))
        assert len(completions) == 36
        assert pool.engine_metrics["rollout/engines_live"] == 2.0
    finally:
        pool.close()
