"""The real Slurm launch scripts (examples/run_70b.sh -> examples/slurm_common.sh) against stand-ins for
srun, sbatch and scontrol (tests/fake_slurm/): which steps start with which flags, resume, requeue near
the time limit, a dead engine failing the job, singleton chains. The planner and launch_env are real."""
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FAKE_SLURM = os.path.join(REPO, "tests", "fake_slurm")
SCRIPT = os.path.join(REPO, "examples", "run_70b.sh")


def _env(tmp_path, **extra):
    run_dir = tmp_path / "run"
    engine_model = tmp_path / "engine-fp8"  # an existing fp8 copy: the launcher must not write one
    engine_model.mkdir(exist_ok=True)
    (engine_model / "config.json").write_text("{}")
    env = dict(os.environ, PATH=f"{FAKE_SLURM}:{os.environ['PATH']}", FAKE_SLURM_LOG=str(tmp_path),
               PYTHON=sys.executable, RUN_DIR=str(run_dir), MODEL_DIR="/models/llama-70b",
               ENGINE_MODEL_DIR=str(engine_model), SLURM_JOB_ID="4242", SLURM_JOB_NAME="rl70b",
               SLURM_JOB_NUM_NODES="32", SLURM_JOB_NODELIST="node[0-31]", MEGATRON_RL_HOME=REPO)
    env.pop("SLURM_RESTART_COUNT", None)
    env.update(extra)
    return env


def _launch(tmp_path, *args, **env):
    return subprocess.Popen(["bash", SCRIPT, *args], env=_env(tmp_path, **env), cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)


def _finish(proc, timeout=120):
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    return proc.returncode, out, err


def _lines(tmp_path, name):
    path = tmp_path / name
    return path.read_text().splitlines() if path.exists() else []


def test_every_step_gets_the_container_resources_and_the_planned_server_flags(tmp_path):
    code, _, err = _finish(_launch(tmp_path, CONTAINER_IMAGE="nvcr.io/org/rl:1", CONTAINER_MOUNTS="/data:/data",
                                     SRUN_EXTRA_ARGS="--mpi=pmix", FAKE_ENGINES="32"))
    assert code == 0, err
    steps = _lines(tmp_path, "srun.log")
    engines = [s for s in steps if "sglang.launch_server" in s]
    trainers = [s for s in steps if "torch.distributed.run" in s]
    assert len(engines) == 32 and len(trainers) == 1  # 32 engines x TP4 on 16 nodes, as the recipe plans
    for step in steps:
        assert "--container-image=nvcr.io/org/rl:1" in step and "--container-mounts=/data:/data" in step
        assert "--mpi=pmix" in step and "--cpus-per-task=" in step
    for engine in engines:
        assert "--gpus=4" in engine
        # what the planner priced: TP 4, fp8 weights, a continuous batch of 256, CUDA graphs on
        assert "--tp-size 4 --max-running-requests 256 --quantization fp8" in engine
        assert "--disable-cuda-graph" not in engine
        assert f"--model-path {tmp_path}/engine-fp8" in engine
    assert "--gpus-per-node=8" in trainers[0] and "--resume" not in trainers[0]
    assert f"run_dir={tmp_path}/run" in trainers[0]


def test_the_8b_launch_places_engines_and_trainers_on_their_nodes(tmp_path, tiny_arch):
    from megatron_rl.checkpoints_tools.convert import save_hf
    from tests.helpers import tiny_state

    model_dir = str(tmp_path / "ckpt")
    save_hf(model_dir, tiny_arch, tiny_state(tiny_arch), None)  # stands in for the policy checkpoint
    env = _env(tmp_path, MODEL_DIR=model_dir, DATA_FILE="/data/math.jsonl", FAKE_ENGINES="128",
               ENGINE_MODEL_DIR=str(tmp_path / "ckpt-fp8"))  # missing: this time the launcher writes it
    result = subprocess.run(["bash", os.path.join(REPO, "examples", "run_8b.sh"), "trainer.lr=2e-6"],
                            capture_output=True, text=True, env=env, cwd=REPO, timeout=300)
    assert result.returncode == 0, result.stderr
    lines = _lines(tmp_path, "srun.log")
    servers = [line for line in lines if "sglang.launch_server" in line]
    trainers = [line for line in lines if "torch.distributed.run" in line]
    assert len(servers) == 16 * 8 and len(trainers) == 1  # 8B recipe: 16 generator nodes x 8 engines of TP 1
    placed = {re.search(r"--nodelist=(node\d+) .*CUDA_VISIBLE_DEVICES=(\d+) .*--port (\d+)", line).groups()
              for line in servers}  # the servers start in the background, in any order
    assert placed == {(f"node{n}", str(e), str(30000 + e)) for n in range(16, 32) for e in range(8)}
    assert all("--tp-size 1" in s and f"--model-path {tmp_path}/ckpt-fp8 " in s for s in servers)
    assert (tmp_path / "ckpt-fp8" / "config.json").is_file()  # the fp8 engines' checkpoint was written
    launch = trainers[0]
    assert "--nodes=16" in launch and "--nodelist=node0,node1," in launch and "node15 " in launch + " "
    assert "--nnodes=16 --nproc-per-node=8 --rdzv-backend=c10d --rdzv-endpoint=node0:29500 --rdzv-id=4242" in launch
    for override in ("trainer.lr=2e-6", "cluster.nodes=32", f"model.path={model_dir}",
                     "data.train.path=/data/math.jsonl", "cluster.generator.urls=[http://node16:30000,"):
        assert override in launch, override
    assert launch.count("http://node") == 128


def test_resume_is_passed_on_request_and_after_a_requeue(tmp_path):
    code, _, err = _finish(_launch(tmp_path, "--resume"))
    assert code == 0, err
    assert "--resume" in [s for s in _lines(tmp_path, "srun.log") if "torch.distributed.run" in s][0]

    (tmp_path / "srun.log").unlink()
    # the second attempt of a requeued job resumes once the first left a checkpoint
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    (tmp_path / "run" / "checkpoints" / "latest").write_text("step_00000020")
    code, _, err = _finish(_launch(tmp_path, SLURM_RESTART_COUNT="1"))
    assert code == 0, err
    assert "--resume" in [s for s in _lines(tmp_path, "srun.log") if "torch.distributed.run" in s][0]


def test_the_time_limit_signal_checkpoints_stops_and_requeues(tmp_path):
    proc = _launch(tmp_path, FAKE_TRAINER="until_stop")
    deadline = time.time() + 60
    while not any("torch.distributed.run" in s for s in _lines(tmp_path, "srun.log")):
        assert time.time() < deadline and proc.poll() is None, proc.stderr.read() if proc.poll() is not None else ""
        time.sleep(0.2)
    os.kill(proc.pid, signal.SIGUSR1)  # what `#SBATCH --signal=B:USR1@600` sends the batch shell
    code, _, err = _finish(proc)
    assert code == 0, err
    assert "requeue 4242" in _lines(tmp_path, "scontrol.log")
    assert not (tmp_path / "run" / "STOP").exists()  # the next attempt must not stop at once


def test_a_dead_engine_fails_the_job_within_a_minute(tmp_path):
    start = time.time()
    code, _, err = _finish(_launch(tmp_path, FAKE_ENGINE="die", FAKE_TRAINER="long"), timeout=90)
    elapsed = time.time() - start
    assert code != 0
    assert elapsed < 60
    assert "SGLang engine" in err and "logs/engine-node" in err  # names the dead step and its log


def test_one_dead_engine_leaves_the_job_running_on_the_others(tmp_path):
    code, _, err = _finish(_launch(tmp_path, FAKE_ENGINE="die_one", FAKE_TRAINER="brief"), timeout=90)
    assert code == 0, err  # the trainer's pool re-routed around it and the trainer finished
    assert re.search(r"SGLang engine \d+ on node\d+ \(log: .*\) exited with status 3", err)
    assert "no engine left" not in err


def test_a_vllm_recipe_starts_vllm_servers_with_the_planned_flags(tmp_path):
    code, _, err = _finish(_launch(tmp_path, "cluster.generator.backend=vllm", FAKE_ENGINES="32",
                                   VLLM_PYTHON="/opt/vllm/bin/python"))
    assert code == 0, err
    steps = _lines(tmp_path, "srun.log")
    engines = [s for s in steps if "vllm.entrypoints.openai.api_server" in s]
    assert len(engines) == 32 and not [s for s in steps if "sglang" in s]
    for engine in engines:
        # vLLM quantizes to fp8 itself: it starts from the model, not from an fp8 copy
        assert "VLLM_SERVER_DEV_MODE=1 /opt/vllm/bin/python -m vllm.entrypoints.openai.api_server --model " \
               "/models/llama-70b --tensor-parallel-size 4 --max-num-seqs 256 --seed " in engine
        # weights reach them through vLLM's NCCL weight-transfer backend (the trainer's auto on a GPU)
        assert "--enable-scale-out --weight-transfer-config.backend nccl --quantization fp8 " \
               "--gpu-memory-utilization 0." in engine
        assert "--enforce-eager" not in engine and "--gpus=4" in engine
    trainer = next(s for s in steps if "torch.distributed.run" in s)
    assert "cluster.generator.backend=vllm" in trainer and "cluster.generator.urls=[http://node" in trainer


def test_a_vllm_reload_on_a_cluster_is_refused_by_name(tmp_path):
    code, _, err = _finish(_launch(tmp_path, "cluster.generator.backend=vllm",
                                   "cluster.generator.vllm_weight_transfer=reload", FAKE_ENGINES="32"))
    assert code == 2
    assert "cluster.generator.vllm_weight_transfer: reload reads the weights from the trainer's tmpfs" in err


def test_a_chain_submits_singleton_jobs_that_resume(tmp_path):
    env = _env(tmp_path)
    for name in ("SLURM_JOB_ID", "SLURM_JOB_NUM_NODES", "SLURM_JOB_NODELIST"):
        env.pop(name)
    result = subprocess.run(["bash", SCRIPT, "--chain", "3", "rollout.temperature=0.9"], env=env, cwd=REPO,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    jobs = _lines(tmp_path, "sbatch.log")
    assert len(jobs) == 3
    assert all("--dependency=singleton" in j and "--job-name=megatron-rl-run" in j for j in jobs)
    assert all(j.endswith("rollout.temperature=0.9") for j in jobs)
    assert ["--resume" in j for j in jobs] == [False, True, True]


@pytest.mark.parametrize("args", [["--chain", "x"], ["--bogus"]])
def test_bad_launcher_arguments_are_one_line(tmp_path, args):
    result = subprocess.run(["bash", SCRIPT, *args], env=_env(tmp_path), cwd=REPO, capture_output=True, text=True)
    assert result.returncode == 2
    assert len(result.stderr.strip().splitlines()) == 1


def _launch_deepseek(tmp_path, **env):
    """examples/run_deepseek_v3.sh (64 nodes: 32 trainer nodes, 8 SGLang engines of TP 32 over 4 nodes each)."""
    return subprocess.Popen(["bash", os.path.join(REPO, "examples", "run_deepseek_v3.sh")],
                            env=_env(tmp_path, SLURM_JOB_NUM_NODES="64", SLURM_JOB_NODELIST="node[0-63]", **env),
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def test_an_engine_wider_than_a_node_is_one_sglang_server_over_whole_nodes(tmp_path):
    code, _, err = _finish(_launch_deepseek(tmp_path, FAKE_ENGINES="32"))
    assert code == 0, err
    steps = _lines(tmp_path, "srun.log")
    servers = [s for s in steps if "sglang.launch_server" in s]
    assert len(servers) == 8 * 4  # a process per node of each engine
    placed = {re.search(r"--nodelist=(node\d+) .*--node-rank (\d) --dist-init-addr (node\d+):31000", s).groups()
              for s in servers}
    heads = [32 + 4 * e for e in range(8)]
    assert placed == {(f"node{h + r}", str(r), f"node{h}") for h in heads for r in range(4)}
    assert all("--gpus=8 " in s and "--tp-size 32 " in s and "--nnodes 4 " in s for s in servers)
    contract = json.loads((Path(REPO) / "tests" / "fixtures" / "sglang_0.5.23_contract.json").read_text())
    assert {"--nnodes", "--node-rank", "--dist-init-addr", "--tp-size"} <= set(contract["server_flags"])
    trainer = next(s for s in steps if "torch.distributed.run" in s)
    assert "--nnodes=32 " in trainer  # the trainer's half of the 64 nodes
    urls = re.search(r"cluster\.generator\.urls=\[([^\]]*)\]", trainer).group(1).split(",")
    assert urls == [f"http://node{h}:30000" for h in heads]  # only each engine's first node serves


def test_a_dead_node_of_a_multi_node_engine_takes_out_that_engine_only(tmp_path):
    code, _, err = _finish(_launch_deepseek(tmp_path, FAKE_ENGINES="32", FAKE_ENGINE="die_one",
                                            FAKE_TRAINER="brief", FAKE_TRAINER_SECONDS="8"), timeout=120)
    assert code == 0, err  # seven engines left: the trainer's pool goes on with them
    died = re.findall(r"SGLang engine on (node\d+) \(node (\d) of 4: (node\d+); log: .*\) exited with status (\d+)",
                      err)
    assert died and died[0][3] == "3"
    engine = died[0][0]
    # the engine's other nodes were stopped with it; no other engine's node ended before the trainer did
    assert {d[0] for d in died} == {engine} and "no engine left" not in err
