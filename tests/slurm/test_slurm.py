"""``sbatch slurm/pretrain_fp8.sh`` against a real slurmctld and two slurmd (tests/slurm/conftest.py), on CPU:
both arms side by side on two nodes each, then the report; a job past its time limit signalled, checkpointed,
requeued and resumed to the losses of an uninterrupted run (bit for bit), and one that may not requeue again
stopping with its checkpoint; a scancel in the middle of a checkpoint write leaving a run that the next
submission resumes; a preempted job saving and being requeued."""

import re
import subprocess
import sys
import time

import pytest

from launcher.checkpoint import CheckpointStore
from tests.runs import REPO, all_scalars, launcher_env

pytestmark = pytest.mark.slurm

# sbatch options that fit the test cluster's 2-CPU "nodes" (the script asks for 8 GPUs per node and whole nodes)
CPU_JOB = ["--gpus-per-node=0", "--oversubscribe", "--cpus-per-task=1", "--mem=1G", f"--chdir={REPO}"]


def tiny(kjv_data, out_dir, steps: int) -> list[str]:
    return [f"data.data_dir={kjv_data}", f"run.out_dir={out_dir}", f"run.max_steps={steps}",
            f"optim.decay_steps={steps}", "model.n_layer=2", "model.d_model=64", "model.n_head=1",
            "model.max_seq_len=64", "data.seq_len=64", "data.global_batch_size=4", "data.micro_batch_size=2",
            "optim.warmup_steps=2", "eval.batches=2", "monitor.spectral_interval=0", "monitor.probe_interval=0",
            "precision.dtype=fp32"]


def job_env(**extra) -> dict:
    return {**launcher_env(), "RECIPE": "smoke", "PYTHON": sys.executable, **extra}


def worker_python(folder, module: str) -> str:
    """An interpreter for the batch script (its PYTHON) that runs ``python -m <module>`` (a test worker that takes
    the launcher's arguments: tests/paused_save_worker.py, tests/paced_steps_worker.py) where the script runs
    launcher.pretrain, anything else as is."""
    wrapper = folder / f"python-{module.rsplit('.', 1)[-1]}"
    wrapper.write_text('#!/bin/sh\n'
                       'if [ "$1" = -m ] && [ "$2" = launcher.pretrain ]; then\n'
                       f'  shift 2; set -- -m {module} "$@"\n'
                       'fi\n'
                       f'exec {sys.executable} "$@"\n')
    wrapper.chmod(0o755)
    return str(wrapper)


def start_straight_run(common: list[str]) -> subprocess.Popen:
    """The uninterrupted run of the same overrides (experiment "straight", arm baseline), in the background: the
    reference a job's losses must match, trained while the job runs or waits in the queue."""
    return subprocess.Popen([sys.executable, "-m", "launcher.pretrain", "smoke", "--arm", "baseline", "--no-report",
                             *common, "run.experiment=straight"], cwd=REPO, env=launcher_env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def output(tmp_path) -> str:
    return "\n".join(p.read_text() for p in sorted(tmp_path.glob("fp8-attention-*.out")))


def test_both_arms_on_two_nodes_each_then_the_report(slurm, kjv_data, tmp_path):
    out_dir = tmp_path / "runs"
    overrides = [*tiny(kjv_data, out_dir, 6), "eval.interval=3", "run.log_interval=1", "checkpoint.interval=0"]
    job = slurm.sbatch(["--nodes=2", "--ntasks-per-node=1", *CPU_JOB, f"--output={tmp_path}/%x-%A_%a.out",
                        "slurm/pretrain_fp8.sh", *overrides], job_env(), REPO)
    tasks = slurm.wait(job, timeout=300)
    said = output(tmp_path)
    assert [t.state for t in tasks] == ["COMPLETED", "COMPLETED"], said + slurm.logs()
    starts = re.findall(r"\[slurm\] arm (\w+) of smoke on 2 node\(s\), 2 process\(es\), rendezvous ([\d.]+):(\d+)",
                        said)
    assert sorted(arm for arm, _, _ in starts) == ["baseline", "fixed"], said
    assert len({port for _, _, port in starts}) == 2  # one port per job: the arms never collide
    assert all(t.fields["NodeList"] == "n[1-2]" for t in tasks)

    # one process's run of the same steps, while the report job waits and runs
    single_run = start_straight_run([*overrides, f"run.out_dir={tmp_path / 'single'}"])
    report_job = re.search(r"Submitted batch job (\d+)", said).group(1)
    assert [t.state for t in slurm.wait(report_job, timeout=120)] == ["COMPLETED"], slurm.logs()
    assert (out_dir / "smoke" / "report" / "report.html").is_file()
    assert "report:" in (out_dir / "smoke" / f"report-{report_job}.out").read_text()

    # The two-node arm trained what one process trains (data parallel 2 matches 1 process to 1e-4)
    assert single_run.wait(timeout=300) == 0, single_run.stderr.read()
    single = all_scalars(tmp_path / "single" / "straight" / "baseline")["train/loss"]
    arms = {arm: all_scalars(out_dir / "smoke" / arm)["train/loss"] for arm in ("baseline", "fixed")}
    assert sorted(arms["baseline"]) == sorted(arms["fixed"]) == list(range(1, 7))
    assert arms["baseline"][1] == pytest.approx(arms["fixed"][1], rel=1e-3)  # same weights, same batch
    assert arms["baseline"] != arms["fixed"]  # but each task trained its own arm
    for step, value in single.items():
        assert abs(arms["baseline"][step] - value) <= 1e-4 * abs(value), (step, arms["baseline"][step], value)


def test_time_limit_checkpoints_requeues_and_resumes_exactly(slurm, kjv_data, tmp_path):
    """--time=2 with the time-limit warning 75 s ahead: each leg gets USR1, saves after its step, requeues itself
    and the next leg resumes, until the run completes. A second job with MAX_REQUEUES=0 stops after its first save.
    slurmctld sends the warning from a check it runs every ~30 s, so it comes 45-75 s before the limit, i.e. 15-45 s
    after a leg starts (with --time=1 and @45 a requeued leg was signalled the moment it started). The run is paced
    to >= 25 ms a step (tests/paced_steps_worker.py), so its 2,000 steps outlast the first leg on any machine; on a
    slow one they take longer, which only adds legs (each leg costs ~60 s: its training, then waiting in the queue).
    A leg whose warning comes while the trainer still starts trains one step, then saves (launcher/stop_signals.py)."""
    steps = 2000
    common = [*tiny(kjv_data, tmp_path / "runs", steps), "eval.interval=2000", "run.log_interval=1000",
              "checkpoint.interval=0", "attention.backend=sdpa", "arms.baseline.attention.rounding=fa2"]
    for name in ("requeued", "capped"):
        (tmp_path / name).mkdir()  # SLURM opens the output file but does not make its folder

    def paced(**extra) -> dict:
        return job_env(ARMS="baseline", TRAIN_TEST_STEP_MIN_S="0.025",
                       PYTHON=worker_python(tmp_path, "tests.paced_steps_worker"), **extra)

    limit = ["--array=0", "--nodes=1", "--ntasks-per-node=1", "--time=2", "--signal=B:USR1@75", *CPU_JOB]
    requeued = slurm.sbatch([*limit, f"--output={tmp_path}/requeued/%x-%A_%a.out", "slurm/pretrain_fp8.sh", *common,
                             "run.experiment=requeued"], paced(MAX_REQUEUES="8"), REPO)
    capped = slurm.sbatch([*limit, f"--output={tmp_path}/capped/%x-%A_%a.out", "slurm/pretrain_fp8.sh", *common,
                           "run.experiment=capped"], paced(MAX_REQUEUES="0"), REPO)

    [capped_job] = slurm.wait(capped, timeout=300)
    # the uninterrupted run, beside the second leg (not beside the first two: the 2 cores would slow them down)
    straight = start_straight_run(common)
    said = output(tmp_path / "capped")
    assert "SIGUSR1: finishing this step" in said and "not requeueing: job" in said, said
    assert capped_job.restarts == 0 and capped_job.state == "FAILED"  # exit 130: interrupted, with its checkpoint
    stopped_at = int(re.search(r"interrupted at step (\d+)", said).group(1))
    assert 0 < stopped_at < steps
    assert CheckpointStore(tmp_path / "runs" / "capped" / "baseline").latest().name == f"step_{stopped_at:08d}"

    [job] = slurm.wait(requeued, timeout=600)
    said = output(tmp_path / "requeued")
    print(f"capped job stopped at step {stopped_at}; requeued job: {job.restarts} restart(s), {job.state}")
    assert job.state == "COMPLETED" and job.restarts >= 1, said + slurm.logs()
    assert said.count("[slurm] time_limit: requeueing job") == job.restarts
    # each leg but the last got the warning: while training, or while starting (then it stops after one step)
    assert said.count("[train] SIGUSR1: ") == job.restarts
    assert len(re.findall(r"resumed from .* at step \d+", said)) == job.restarts
    assert f"completed at step {steps}" in said
    assert straight.wait(timeout=300) == 0, straight.stderr.read()
    got, ref = (all_scalars(tmp_path / "runs" / e / "baseline") for e in ("requeued", "straight"))
    assert got["train/loss"] == ref["train/loss"] and got["eval/loss"] == ref["eval/loss"]  # bit for bit


def test_scancel_during_a_checkpoint_write_leaves_a_resumable_run(slurm, kjv_data, tmp_path):
    steps = 40
    common = [*tiny(kjv_data, tmp_path / "runs", steps), "eval.interval=10", "run.log_interval=1",
              "checkpoint.interval=10", "attention.backend=sdpa", "arms.baseline.attention.rounding=fa2"]
    args = ["--array=0", "--nodes=1", "--ntasks-per-node=1", *CPU_JOB, f"--output={tmp_path}/%x-%A_%a.out",
            "slurm/pretrain_fp8.sh", *common]
    paused = job_env(ARMS="baseline", CHECKPOINT_TEST_PAUSE_S="3", PYTHON=worker_python(tmp_path, "tests.paused_save_worker"))
    first = slurm.sbatch(args, paused, REPO)
    deadline = time.time() + 120
    while output(tmp_path).count("[checkpoint] test pause") < 2:  # inside the second save (step 20)
        assert time.time() < deadline, output(tmp_path) + slurm.logs()
        time.sleep(0.2)
    slurm.run("scancel", first)  # TERM to the job: the save finishes, the trainer exits
    [cancelled] = slurm.wait(first, timeout=120)
    said = output(tmp_path)
    assert cancelled.state == "CANCELLED" and "SIGTERM: finishing this step" in said, said
    # the signal came inside the step-20 save: that save completes, and one more step is saved (21) before exiting
    saved = CheckpointStore(tmp_path / "runs" / "smoke" / "baseline").latest().name
    assert saved in ("step_00000020", "step_00000021"), said

    second = slurm.sbatch(args, job_env(ARMS="baseline"), REPO)
    straight = start_straight_run(common)
    [done] = slurm.wait(second, timeout=300)
    said = output(tmp_path)
    assert done.state == "COMPLETED" and f"resumed from {saved}" not in said  # (the path is absolute)
    assert re.search(rf"resumed from \S*{saved} at step {int(saved[5:13])}", said), said
    assert straight.wait(timeout=300) == 0, straight.stderr.read()
    got, ref = (all_scalars(tmp_path / "runs" / e / "baseline") for e in ("smoke", "straight"))
    assert got["train/loss"] == ref["train/loss"] and got["eval/loss"] == ref["eval/loss"]


def test_preemption_saves_and_requeues_the_job(slurm, kjv_data, tmp_path):
    """PreemptMode=REQUEUE: a whole-node job in a higher-tier partition preempts the run, which gets TERM, saves after
    its step and is requeued; it resumes when the node is free again and ends with the uninterrupted losses."""
    steps = 1000
    common = [*tiny(kjv_data, tmp_path / "runs", steps), "eval.interval=1000", "run.log_interval=100",
              "checkpoint.interval=0", "attention.backend=sdpa", "arms.baseline.attention.rounding=fa2"]
    job = slurm.sbatch(["--array=0", "--nodes=1", "--ntasks-per-node=1", "--nodelist=n1", *CPU_JOB,
                        f"--output={tmp_path}/%x-%A_%a.out", "slurm/pretrain_fp8.sh", *common],
                       job_env(ARMS="baseline"), REPO)
    deadline = time.time() + 120
    while f"step    200/{steps}" not in output(tmp_path):
        assert time.time() < deadline, output(tmp_path) + slurm.logs()
        time.sleep(0.2)
    urgent = slurm.sbatch(["--partition=urgent", "--nodelist=n1", "--exclusive", f"--output={tmp_path}/urgent.out",
                           "--wrap", "sleep 2"], {}, tmp_path)
    # the uninterrupted run, while the preempted job waits in the queue
    straight = start_straight_run(common)
    [done] = slurm.wait(job, timeout=300)
    said = output(tmp_path)
    assert done.state == "COMPLETED" and done.restarts == 1, f"{done}\n{said}\n{slurm.logs()}"
    assert [j.state for j in slurm.wait(urgent, timeout=60)] == ["COMPLETED"]
    # the trainer saved within the grace time, so the script requeues the job (SLURM would count it as ended)
    assert "SIGTERM: finishing this step" in said and "[slurm] preempted: requeueing job" in said, said
    stopped_at = int(re.search(r"interrupted at step (\d+)", said).group(1))
    assert re.search(rf"resumed from \S*step_{stopped_at:08d} at step {stopped_at}", said), said
    assert straight.wait(timeout=300) == 0, straight.stderr.read()
    got, ref = (all_scalars(tmp_path / "runs" / e / "baseline") for e in ("smoke", "straight"))
    assert got["train/loss"] == ref["train/loss"] and got["eval/loss"] == ref["eval/loss"]


def test_a_failed_step_requeues_the_job_when_its_checkpoint_moved(slurm, kjv_data, tmp_path):
    """The training process is killed (SIGKILL) in the first leg: after step 6, past its step-4 checkpoint, the
    script requeues the job, which resumes from step 4 to the uninterrupted losses bit for bit; after step 2, before
    any checkpoint, it does not (a crash that made no progress would only crash again) and the job fails."""
    steps = 12
    common = [*tiny(kjv_data, tmp_path / "runs", steps), "eval.interval=6", "run.log_interval=1",
              "checkpoint.interval=4", "attention.backend=sdpa", "arms.baseline.attention.rounding=fa2"]
    jobs = {}
    for name, crash_step, node in (("moved", 6, "n1"), ("stuck", 2, "n2")):
        (tmp_path / name).mkdir()
        jobs[name] = slurm.sbatch(["--array=0", "--nodes=1", "--ntasks-per-node=1", f"--nodelist={node}", *CPU_JOB,
                                   f"--output={tmp_path}/{name}/%x-%A_%a.out", "slurm/pretrain_fp8.sh", *common,
                                   f"run.experiment={name}"],
                                  job_env(ARMS="baseline", TRAIN_TEST_CRASH_STEP=str(crash_step),
                                          PYTHON=worker_python(tmp_path, "tests.crash_worker")), REPO)
    straight = start_straight_run(common)
    [stuck] = slurm.wait(jobs["stuck"], timeout=300)
    said = output(tmp_path / "stuck")
    assert stuck.state == "FAILED" and stuck.restarts == 0, f"{stuck}\n{said}"
    assert "without a new checkpoint since this leg started (none): not requeueing" in said, said
    [moved] = slurm.wait(jobs["moved"], timeout=300)
    said = output(tmp_path / "moved")
    assert moved.state == "COMPLETED" and moved.restarts == 1, f"{moved}\n{said}\n{slurm.logs()}"
    assert "after saving step_00000004 (this leg started from none)" in said and \
        "failed: requeueing job" in said, said
    assert re.search(r"resumed from \S*step_00000004 at step 4", said), said
    assert straight.wait(timeout=300) == 0, straight.stderr.read()
    got, ref = (all_scalars(tmp_path / "runs" / e / "baseline") for e in ("moved", "straight"))
    assert got["train/loss"] == ref["train/loss"] and got["eval/loss"] == ref["eval/loss"]
