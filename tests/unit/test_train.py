"""The trainer end to end on CPU: loss falls, resume is exact, the CLI reports user mistakes without tracebacks."""

import math
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from launcher.checkpoint import CheckpointStore, read_whole_checkpoint
from launcher.config import load_config
from launcher.parallel.dims import ParallelDims
from launcher.stop_signals import STOP
from launcher.trainer import lr_at, train_arm
from tests.runs import scalars

REPO = Path(__file__).resolve().parents[2]


def cli(args, env_extra=None, **kw):
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env_extra or {})}
    return subprocess.Popen([sys.executable, "-m", "launcher.pretrain", *args], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **kw)


def test_lr_schedule_warmup_then_cosine():
    c = load_config("smoke", ["optim.lr=1.0", "optim.min_lr=0.1", "optim.warmup_steps=10", "run.max_steps=110"]).optim
    assert lr_at(0, c, 110) == pytest.approx(0.1) and lr_at(9, c, 110) == pytest.approx(1.0)
    assert lr_at(60, c, 110) == pytest.approx(0.55)
    assert lr_at(110, c, 110) == pytest.approx(0.1) and lr_at(500, c, 110) == pytest.approx(0.1)


def test_loss_falls_on_the_corpus(tiny_overrides):
    config = load_config("smoke", tiny_overrides + ["run.max_steps=40", "optim.decay_steps=40", "optim.lr=1e-2",
                                                    "attention.backend=sdpa", "arms.baseline.attention.rounding=fa2"])
    result = train_arm(config, ParallelDims())
    losses = scalars(result.run_dir, "train/loss")
    assert result.status == "completed" and len(losses) == 40
    assert losses[40] < losses[1] - 1.0, losses
    assert set(scalars(result.run_dir, "eval/loss")) == {3 * i for i in range(1, 14)} | {40}
    assert (result.run_dir / "batch_offsets.bin").stat().st_size == 40 * 4 * 8


def test_arms_see_the_same_batches_and_differ_in_attention(tiny_overrides):
    results = {arm: train_arm(load_config("smoke", tiny_overrides, arm=arm), ParallelDims())
               for arm in ("baseline", "fixed")}
    base, fixed = (results[a].run_dir for a in ("baseline", "fixed"))
    assert (base / "batch_offsets.bin").read_bytes() == (fixed / "batch_offsets.bin").read_bytes()
    lb, lf = scalars(base, "train/loss"), scalars(fixed, "train/loss")
    assert lb[1] == pytest.approx(lf[1], abs=0.05)  # same init and data
    assert lb != lf  # paper/none vs paper/dynamic_max really changes the numerics


def test_interrupted_run_resumes_to_identical_losses(tiny_overrides, tmp_path):
    common = tiny_overrides + ["run.max_steps=8", "optim.decay_steps=8", "attention.backend=sdpa",
                               "arms.baseline.attention.rounding=fa2"]
    straight = cli(["smoke", *common, "run.experiment=straight", "--arm", "baseline"])
    assert straight.wait(timeout=300) == 0, straight.stdout.read()

    interrupted = cli(["smoke", *common, "run.experiment=resumed", "--arm", "baseline"])
    lines = []
    for line in interrupted.stdout:
        lines.append(line)
        if "step      3/8" in line:
            interrupted.send_signal(signal.SIGTERM)
    assert interrupted.wait(timeout=300) == 130, "".join(lines)
    out = "".join(lines)
    assert "interrupted at step" in out
    resumed = cli(["smoke", *common, "run.experiment=resumed", "--arm", "baseline"])
    text = resumed.communicate(timeout=300)[0]
    assert resumed.returncode == 0, text
    assert "resumed from" in text
    a = scalars(tmp_path / "runs" / "straight" / "baseline", "train/loss")
    b = scalars(tmp_path / "runs" / "resumed" / "baseline", "train/loss")
    assert sorted(a) == sorted(b) == list(range(1, 9))
    assert a == b  # bit-identical FP32 losses on CPU


def test_time_limit_saves_and_the_same_command_continues(tiny_overrides):
    """run.max_minutes ends the run after the step that spends the budget, with a checkpoint; the same config
    (without the limit) resumes from there to the end, with the losses of an uninterrupted run."""
    common = tiny_overrides + ["run.max_steps=6", "checkpoint.interval=0"]
    full = train_arm(load_config("smoke", common + ["run.experiment=full"]), ParallelDims())
    first = train_arm(load_config("smoke", common + ["run.experiment=cut", "run.max_minutes=1e-6"]), ParallelDims())
    assert first.status == "interrupted" and first.steps == 1
    assert "run.max_minutes=1e-06 spent at step 1" in first.message
    assert (first.run_dir / "checkpoints" / "step_00000001").is_dir()
    rest = train_arm(load_config("smoke", common + ["run.experiment=cut"]), ParallelDims())
    assert rest.status == "completed" and rest.steps == 6
    a, b = scalars(full.run_dir, "train/loss"), scalars(rest.run_dir, "train/loss")
    assert sorted(b) == sorted(a) and all(abs(a[s] - b[s]) <= 1e-6 * abs(a[s]) for s in a)


def test_a_stop_during_the_last_step_leaves_a_complete_arm(tiny_overrides):
    """The stop (here run.max_minutes, as a signal would) comes during the last step: the arm is complete, says so
    (not "the same command resumes"), records it, and a rerun has nothing to train."""
    config = load_config("smoke", tiny_overrides + ["run.max_steps=1", "optim.decay_steps=1", "run.max_minutes=1e-6"])
    result = train_arm(config, ParallelDims())
    assert result.status == "completed" and result.stop_requested and "the arm is complete" in result.message
    assert "status: completed" in (result.run_dir / "status.yaml").read_text()
    again = train_arm(load_config("smoke", tiny_overrides + ["run.max_steps=1", "optim.decay_steps=1"]), ParallelDims())
    assert again.status == "completed" and "already complete" in again.message


@pytest.mark.parametrize("args, expect", [
    (["smoke", "model.n_layers=3"], "Valid keys in model: vocab_size"),
    (["smoke", "data.data_dir=/nonexistent/prepared"], "python -m launcher.prepare_data --source <your"),
    (["smoke", "attention.backend=triton", "run.device=cpu"], "needs a CUDA GPU"),
    (["nosuch"], "recipe 'nosuch' not found"),
])
def test_cli_reports_mistakes_without_traceback(args, expect, tmp_path):
    proc = cli([*args, f"run.out_dir={tmp_path}"])
    out = proc.communicate(timeout=120)[0]
    assert proc.returncode == 2, out
    assert expect in out and "Traceback" not in out, out


def test_experiment_dir_validates_and_prints_only_the_folder(tmp_path):
    """What slurm/pretrain_fp8.sh reads in one call: the experiment folder, or one error line and exit status 2."""
    proc = cli(["smoke", "--arm", "fixed", "--experiment-dir", f"run.out_dir={tmp_path}", "run.experiment=e1"])
    assert proc.communicate(timeout=120)[0] == f"{tmp_path / 'e1'}\n" and proc.returncode == 0
    proc = cli(["smoke", "--arm", "fixed", "--experiment-dir", f"run.out_dir={tmp_path}", "data.global_batch_size=7"])
    out = proc.communicate(timeout=120)[0]
    assert proc.returncode == 2 and out.startswith("error: ") and "Traceback" not in out, out
    assert not (tmp_path / "smoke").exists()  # validation only: nothing written


def test_repeated_cluster_signals_keep_the_save_and_a_second_ctrl_c_aborts():
    """SLURM may send TERM (preemption) and USR1 (time-limit warning) to the same step: neither may abort the save.
    Only a second Ctrl-C does."""
    with STOP.while_training() as stop:
        for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGTERM):
            os.kill(os.getpid(), sig)
        assert stop.requested
    assert not STOP.requested  # acted on: the next arm starts afresh
    with STOP.while_training() as stop, pytest.raises(KeyboardInterrupt):
        os.kill(os.getpid(), signal.SIGINT)
        assert stop.requested
        os.kill(os.getpid(), signal.SIGINT)
    assert signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL  # the previous handlers are back


def test_help_config_lists_documented_fields():
    proc = cli(["--help-config"])
    out = proc.communicate(timeout=60)[0]
    assert proc.returncode == 0 and "attention.fix" in out and "dynamic_max" in out


def _nan_at(monkeypatch, bad_call: int):
    """Make the ``bad_call``-th training forward return a NaN loss (one micro-batch per step in these tests)."""
    from model.gpt import GPT

    original = GPT.forward
    calls = {"n": 0}

    def forward(self, idx, targets=None):
        logits, loss = original(self, idx, targets)
        if self.training and targets is not None:
            calls["n"] += 1
            if calls["n"] == bad_call:
                loss = loss * float("nan")
        return logits, loss

    monkeypatch.setattr(GPT, "forward", forward)


def test_guard_stops_without_saving_the_bad_state(tiny_overrides, monkeypatch):
    _nan_at(monkeypatch, bad_call=5)
    config = load_config("smoke", tiny_overrides + ["data.micro_batch_size=4", "checkpoint.interval=2",
                                                    "eval.interval=0", "monitor.spectral_interval=1"])
    result = train_arm(config, ParallelDims())
    assert result.status == "stopped" and "loss is nan" in result.message
    assert CheckpointStore(result.run_dir).latest().name == "step_00000004"
    dump = (result.run_dir / "bad_step_00000005.yaml").read_text()
    assert "spectral/L00/wq" in dump  # the monitors' last values are kept for the post-mortem
    assert scalars(result.run_dir, "guard/bad_steps") == {5: 1.0}


@pytest.mark.parametrize("bad_step", [3, 6])
def test_guard_skip_drops_the_update_and_goes_on(tiny_overrides, monkeypatch, bad_step):
    _nan_at(monkeypatch, bad_call=bad_step)
    config = load_config("smoke", tiny_overrides + ["data.micro_batch_size=4", "guard.action=skip"])
    result = train_arm(config, ParallelDims())
    losses = scalars(result.run_dir, "train/loss")
    assert result.status == "completed" and result.steps == 6
    assert bad_step not in losses and all(math.isfinite(v) for v in losses.values())
    assert scalars(result.run_dir, "guard/bad_steps") == {bad_step: 1.0}
    # a skipped last step still ends with the final checkpoint (of the last good state)
    assert CheckpointStore(result.run_dir).latest().name == "step_00000006"


def test_activation_checkpointing_changes_no_bit(tiny_overrides):
    """Recomputing each block in the backward gives the same FP32 losses and monitor values, and its checkpoints use
    the model's own parameter names (a run with it resumes one without it)."""
    runs = {}
    for on in (False, True):
        config = load_config("smoke", tiny_overrides + [f"parallel.activation_checkpointing={on}",
                                                        f"run.experiment=ac_{on}", "monitor.spectral_interval=3",
                                                        "monitor.probe_interval=3"])
        runs[on] = train_arm(config, ParallelDims()).run_dir
    for tag in ("train/loss", "spectral/L01/wq", "attn/L01/tie_rate"):
        assert scalars(runs[True], tag) == scalars(runs[False], tag) != {}
    ckpt = read_whole_checkpoint(runs[True] / "checkpoints" / "step_00000006")
    assert "blocks.0.attn.q_proj.weight" in ckpt["model"]
