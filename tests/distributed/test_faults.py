"""Faults without SLURM: a damaged newest checkpoint, and kill -9 at random points (during a step, during a checkpoint
write, of one worker of two). After each fault the same command resumes from the newest intact checkpoint and reaches
the losses of an uninterrupted run bit for bit (FP32 on CPU). Each random choice is printed, so a failure can be
replayed."""

import os
import random
import re
import signal
import subprocess
import sys
import threading

import pytest

from launcher.checkpoint import CheckpointStore
from tests.runs import REPO, all_scalars, free_port, launch, launcher_env

pytestmark = pytest.mark.distributed

STEPS, INTERVAL = 24, 4


@pytest.fixture(scope="module")
def out_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("faults")


@pytest.fixture(scope="module")
def common(kjv_data, out_dir) -> list[str]:
    return ["smoke", "--arm", "baseline", "--no-report", f"data.data_dir={kjv_data}", f"run.out_dir={out_dir}",
            "run.log_interval=1", "model.n_layer=2", "model.d_model=64", "model.n_head=1", "model.max_seq_len=64",
            "data.seq_len=64", "data.global_batch_size=4", "data.micro_batch_size=2", "optim.warmup_steps=2",
            f"run.max_steps={STEPS}", f"optim.decay_steps={STEPS}", "eval.interval=6", "eval.batches=2",
            "monitor.spectral_interval=0", "monitor.probe_interval=0", f"checkpoint.interval={INTERVAL}",
            "attention.backend=sdpa", "arms.baseline.attention.rounding=fa2", "precision.dtype=fp32"]


def run_dir(out_dir, experiment):
    return out_dir / experiment / "baseline"


@pytest.fixture(scope="module")
def straight(common, out_dir):
    """One process, uninterrupted: the losses every faulty run must reach."""
    launch([*common, "run.experiment=straight"])
    return all_scalars(run_dir(out_dir, "straight"))


@pytest.fixture(scope="module")
def straight_ddp(common, out_dir):
    launch([*common, "run.experiment=straight_ddp"], nproc=2)
    return all_scalars(run_dir(out_dir, "straight_ddp"))


def start(args, nproc=1, env_extra=None, module="launcher.pretrain") -> subprocess.Popen:
    cmd = [sys.executable, "-m", module, *args] if nproc == 1 else \
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-addr", "127.0.0.1",
         "--master-port", str(free_port()), "-m", module, *args]
    return subprocess.Popen(cmd, cwd=REPO, env={**launcher_env(), **(env_extra or {})}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def run_until(proc: subprocess.Popen, kill_when, kill) -> str:
    """Read the run's output; on the first line where kill_when(line) holds, call kill(). Returns the output."""
    lines, killed = [], False
    for line in proc.stdout:
        lines.append(line)
        if not killed and kill_when(line):
            kill()
            killed = True
    proc.wait(timeout=60)
    out = "".join(lines)
    assert killed, "the run ended before the fault was injected:\n" + out
    assert proc.returncode != 0, out  # killed, not completed
    return out


def resume_and_compare(common, out_dir, experiment, reference, nproc=1) -> str:
    """Rerun the same command; it must resume from the newest intact checkpoint and match the reference exactly."""
    newest = CheckpointStore(run_dir(out_dir, experiment)).latest()
    print(f"newest intact checkpoint after the fault: {newest.name if newest else 'none'}")
    out = launch([*common, f"run.experiment={experiment}"], nproc).stdout
    assert "Traceback" not in out
    if newest is None:  # killed before the first checkpoint: a fresh start
        assert "resumed from" not in out, out
    else:
        step = int(newest.name[5:13])
        assert f"resumed from {newest} at step {step}" in out, out
    got = all_scalars(run_dir(out_dir, experiment))
    assert got["train/loss"] == reference["train/loss"]  # every step 1..STEPS, bit for bit
    assert got["eval/loss"] == reference["eval/loss"]
    return out


def test_a_truncated_newest_checkpoint_resumes_from_the_previous_one(common, out_dir, straight):
    launch([*common, "run.experiment=truncated"])
    store = CheckpointStore(run_dir(out_dir, "truncated"))
    newest = store.steps()[-1]
    assert newest.name == f"step_{STEPS:08d}"
    shard = newest / "__0_0.distcp"
    with open(shard, "r+b") as f:  # e.g. a full disk or a half-copied folder
        f.truncate(shard.stat().st_size // 3)
    out = resume_and_compare(common, out_dir, "truncated", straight)
    said = [line for line in out.splitlines() if "damaged" in line]
    previous = f"step_{STEPS - INTERVAL:08d}"
    assert len(said) == 1 and re.search(rf"{re.escape(str(newest))} is damaged \(truncated: __0_0.distcp has \d+ of "
                                        rf"\d+ bytes\); renamed to \*\.damaged, resuming from {previous}", said[0]), out
    assert f"at step {STEPS - INTERVAL}" in out


def test_kill_9_during_a_step(common, out_dir, straight):
    rng = random.Random(os.urandom(8))
    after = rng.choice([s for s in range(INTERVAL + 1, STEPS - 2) if s % INTERVAL in (1, 2)])  # no save right after
    print(f"kill -9 right after the progress line of step {after}")
    proc = start([*common, "run.experiment=killed_in_step"])
    run_until(proc, lambda line: f"step {after:6d}/{STEPS}" in line, lambda: proc.send_signal(signal.SIGKILL))
    newest = CheckpointStore(run_dir(out_dir, "killed_in_step")).latest()
    assert newest.name == f"step_{after // INTERVAL * INTERVAL:08d}"
    resume_and_compare(common, out_dir, "killed_in_step", straight)


def test_kill_9_at_a_random_time(common, out_dir, straight):
    """Anywhere in the loop: a step, an evaluation, a checkpoint write or its rename."""
    rng = random.Random(os.urandom(8))
    # the 24 steps with their saves and evaluations take ~0.33 s on the 2-core machine (~12 ms a step): kill within them
    delay = rng.uniform(0.0, 0.28)
    print(f"kill -9 {delay:.3f} s after the first step's progress line")
    proc = start([*common, "run.experiment=killed_at_random"])
    timer = threading.Timer(delay, lambda: proc.poll() is None and proc.send_signal(signal.SIGKILL))
    run_until(proc, lambda line: f"step {1:6d}/{STEPS}" in line, timer.start)
    timer.join()
    resume_and_compare(common, out_dir, "killed_at_random", straight)


@pytest.mark.parametrize("save", [1, 2])
def test_kill_9_during_a_checkpoint_write(common, out_dir, straight, save):
    """tests/paused_save_worker.py stops each save after its first bytes; the run is killed inside the
    first save (step 4: only partial files, so the rerun starts over) or the second (step 8: a partial temporary file
    beside the step-4 checkpoint, which the rerun resumes)."""
    experiment = f"killed_in_save_{save}"
    proc = start([*common, f"run.experiment={experiment}"], env_extra={"CHECKPOINT_TEST_PAUSE_S": "2"},
                 module="tests.paused_save_worker")
    pauses = []

    def in_that_save(line):
        if "[checkpoint] test pause" in line:
            pauses.append(line)
        return len(pauses) == save

    run_until(proc, in_that_save, lambda: proc.send_signal(signal.SIGKILL))
    folder = run_dir(out_dir, experiment) / "checkpoints"
    assert (folder / f"step_{save * INTERVAL:08d}.tmp").exists()  # the torn write, under its temporary name
    latest = CheckpointStore(folder.parent).latest()
    assert (latest.name if latest else None) == (f"step_{INTERVAL:08d}" if save == 2 else None)
    out = resume_and_compare(common, out_dir, experiment, straight)
    if save == 1:
        assert "started over" in out and "the earlier run never saved a checkpoint" in out, out


def _worker_pids(parent: int) -> dict[int, int]:
    """{RANK: pid} of the torchrun workers below ``parent``."""
    found = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            environ = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
            status = open(f"/proc/{pid}/status").read()
        except OSError:
            continue
        ppid = int(re.search(r"PPid:\s+(\d+)", status).group(1))
        rank = next((v[5:] for v in environ if v.startswith(b"RANK=")), None)
        if ppid == parent and rank is not None:
            found[int(rank)] = int(pid)
    return found


def test_kill_9_of_one_worker_of_two(common, out_dir, straight_ddp):
    """torchrun notices the dead worker and stops the other; the rerun resumes both from the newest checkpoint."""
    rng = random.Random(os.urandom(8))
    after = rng.choice([s for s in range(INTERVAL + 1, STEPS - 2) if s % INTERVAL in (1, 2)])
    print(f"kill -9 of rank 1 right after the progress line of step {after}")
    proc = start([*common, "run.experiment=killed_worker"], nproc=2)
    run_until(proc, lambda line: f"step {after:6d}/{STEPS}" in line,
              lambda: os.kill(_worker_pids(proc.pid)[1], signal.SIGKILL))
    resume_and_compare(common, out_dir, "killed_worker", straight_ddp, nproc=2)


def test_kill_9_of_one_worker_during_a_sharded_save(common, out_dir, straight_ddp):
    """Two processes write their own shards of each checkpoint; rank 1 is killed while both are inside the second
    save (step 8): the folder is left as step_00000008.tmp, never published, and the rerun resumes both ranks from
    step 4 to the uninterrupted 2-process losses bit for bit."""
    experiment = "killed_in_sharded_save"
    proc = start([*common, f"run.experiment={experiment}"], nproc=2, env_extra={"CHECKPOINT_TEST_PAUSE_S": "3"},
                 module="tests.paused_save_worker")
    pauses = []

    def in_second_save(line):
        if "[checkpoint] test pause" in line:
            pauses.append(line)
        return len(pauses) == 3  # each rank pauses once per save: the third pause is in the second save

    run_until(proc, in_second_save, lambda: os.kill(_worker_pids(proc.pid)[1], signal.SIGKILL))
    folder = run_dir(out_dir, experiment) / "checkpoints"
    assert (folder / f"step_{2 * INTERVAL:08d}.tmp").is_dir() and not (folder / f"step_{2 * INTERVAL:08d}").exists()
    assert CheckpointStore(folder.parent).latest().name == f"step_{INTERVAL:08d}"
    resume_and_compare(common, out_dir, experiment, straight_ddp, nproc=2)
