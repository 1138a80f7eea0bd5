"""Ctrl-C as a user presses it (issue 21): under torchrun one line and exit 130 with the checkpoint saved; a second
Ctrl-C says what is really on disk; a CPU run picks a sane thread count and says so. Subprocess CLI tests."""

import os
import signal
import subprocess
import sys
import time

from launcher.checkpoint import CheckpointStore
from launcher.distributed import default_cpu_threads
from tests.runs import REPO, free_port, launcher_env


def start(args, env=None):
    return subprocess.Popen([sys.executable, "-m", *args], cwd=REPO, env=env or launcher_env(), text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)


def wait_for(proc, text, lines, timeout=180):
    deadline = time.monotonic() + timeout
    for line in proc.stdout:
        lines.append(line)
        if text in line or time.monotonic() > deadline:
            return
    raise AssertionError("".join(lines))


def long_run(tiny_overrides):
    return [*tiny_overrides, "--arm", "baseline", "run.max_steps=100000", "optim.decay_steps=100000"]


def test_ctrl_c_under_the_torchrun_wrapper_saves_and_ends_in_one_line(tiny_overrides, tmp_path):
    proc = start(["launcher.torchrun", "--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port",
                  str(free_port()), "-m", "launcher.pretrain", "smoke", *long_run(tiny_overrides)])
    lines = []
    wait_for(proc, "step      2/", lines)
    os.kill(proc.pid, signal.SIGINT)  # the terminal's Ctrl-C reaches torchrun; its workers run in their own session
    out = "".join(lines) + proc.communicate(timeout=120)[0]
    assert proc.returncode == 130, out
    assert "Traceback" not in out and out.count("SIGINT: finishing this step") == 1, out
    assert "plain torchrun ends a stop" not in out  # the hint is for plain torchrun only
    assert "interrupted at step" in out and "the same command resumes" in out, out
    assert list((tmp_path / "runs" / "smoke" / "baseline" / "checkpoints").glob("step_*[0-9]")), out


def test_a_second_ctrl_c_before_any_checkpoint_says_there_is_none(tiny_overrides, tmp_path):
    slow = ["data.global_batch_size=64"]  # 32 accumulation steps: the second Ctrl-C comes within the step
    proc = start(["launcher.pretrain", "smoke", *long_run(tiny_overrides), *slow, "checkpoint.enabled=false"])
    lines = []
    wait_for(proc, "step      1/", lines)
    os.kill(proc.pid, signal.SIGINT)
    wait_for(proc, "SIGINT: finishing this step", lines)
    os.kill(proc.pid, signal.SIGINT)
    out = "".join(lines) + proc.communicate(timeout=120)[0]
    assert proc.returncode == 130 and "Traceback" not in out, out
    assert "holds no checkpoint yet: the same command starts this arm over" in out and "intact" not in out, out


def signal_trapped(pid: int, sig: signal.Signals) -> bool:
    """Whether process ``pid`` has a handler for ``sig`` (Linux: the SigCgt mask of /proc/PID/status)."""
    caught = next(line for line in open(f"/proc/{pid}/status") if line.startswith("SigCgt:"))
    return bool(int(caught.split()[1], 16) >> (sig - 1) & 1)


def test_a_time_limit_warning_while_the_launcher_starts_stops_it_after_one_step(tiny_overrides, tmp_path):
    """SLURM's USR1 may come while a requeued leg still imports torch or resumes: it stops the run after its first
    step, with a checkpoint, instead of killing the process without a word (tests/slurm saw a leg die so)."""
    proc = start(["launcher.pretrain", "smoke", *long_run(tiny_overrides)])
    deadline = time.monotonic() + 30
    while not signal_trapped(proc.pid, signal.SIGUSR1):  # trapped on the module's first lines, before torch loads
        assert time.monotonic() < deadline and proc.poll() is None, proc.communicate()[0]
        time.sleep(0.005)
    os.kill(proc.pid, signal.SIGUSR1)
    out = proc.communicate(timeout=180)[0]
    assert proc.returncode == 130 and "Traceback" not in out, out
    assert out.count("SIGUSR1: came outside the training loop") == 1 and "interrupted at step 1" in out, out
    assert "step      1/" in out and "step      2/" not in out, out
    assert CheckpointStore(tmp_path / "runs" / "smoke" / "baseline").latest().name == "step_00000001"


def test_cpu_threads_default_to_the_free_cores_and_are_named(tiny_overrides):
    assert default_cpu_threads(cores=2, processes=1, load=4.0) == 1  # a shared, loaded 2-core machine
    assert default_cpu_threads(cores=16, processes=1, load=0.2) == 16
    assert default_cpu_threads(cores=16, processes=2, load=0.0) == 8
    env = {k: v for k, v in launcher_env().items() if k != "OMP_NUM_THREADS"}
    proc = start(["launcher.pretrain", "smoke", *tiny_overrides, "--arm", "baseline", "run.max_steps=1"], env)
    out = proc.communicate(timeout=180)[0]
    assert proc.returncode == 0 and "[train] CPU threads: " in out and "set OMP_NUM_THREADS to choose" in out, out


def test_a_gpt2_sized_model_on_cpu_is_warned_about_before_its_first_step(tmp_path):
    proc = start(["launcher.pretrain", "gpt2_small_paper", f"run.out_dir={tmp_path}", "run.device=cpu",
                  f"data.data_dir={tmp_path / 'no_data'}"])  # stops at the missing data, after the warning
    out = proc.communicate(timeout=180)[0]
    assert "TFLOP per step, minutes to hours per step here" in out, out


def test_the_slurm_script_outside_slurm_says_it_is_for_sbatch():
    env = {k: v for k, v in launcher_env().items() if not k.startswith("SLURM_")}
    proc = subprocess.run(["bash", "slurm/pretrain_fp8.sh"], cwd=REPO, env=env, capture_output=True, text=True)
    assert proc.returncode == 2 and "unbound variable" not in proc.stderr, proc.stderr
    assert "is a batch script for SLURM: submit it with `sbatch slurm/pretrain_fp8.sh`" in proc.stderr
    assert "python -m launcher.pretrain gpt_1p3b_fp8" in proc.stderr
