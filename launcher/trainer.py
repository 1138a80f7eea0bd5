"""Training of one arm, in small named pieces: build, one optimizer step, evaluation, checkpointing, the loop.

``Trainer(config, dims)`` builds everything in torchtitan's order: the config's vocabulary resolved against the data,
the single-device model on the meta device, the layout applied to it (launcher/parallelize.py: tensor parallelism,
attention, this rank's part materialised with the run seed's initial weights, so every layout starts from the same
weights, FP8, activation checkpointing, ZeRO-3 switches), then the engine around this rank's part (DDP, DeepSpeed
ZeRO or the pipeline; launcher/parallel/build.py), and on resume this rank's shards of the parameters and Adam
state read into it (launcher/checkpoint.py).
``Trainer.fit()`` runs the loop: :meth:`train_step` (one optimizer step over its micro-batches, vetoed by the guard
before the update), monitors, :meth:`evaluate`, :meth:`save_checkpoint` and the stop check.

Ctrl-C or SIGTERM finishes the current step, saves a checkpoint and returns; the same command resumes, and the
resumed run is identical to an uninterrupted one.
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist
import yaml

import kernels
from launcher import distributed
from launcher.arm_status import write_status
from launcher.checkpoint import (FORMAT, RUN, CheckpointStore, HashingWriter, check_fits, fp8_destinations,
                                 fp8_entries, load_fp8_scaling, rng_entry, rng_state, set_rng_state, training_entries)
from launcher.config import Config, ConfigError, OptimConfig, changes_refusal, config_changes, resolve_vocab_size
from launcher.data import BatchSchedule, OffsetRecorder, TokenData, eval_offsets, windows
from launcher.metrics import Metrics, peak_tflops
from launcher.parallel.dims import ParallelDims
from launcher.parallel.build import build_engine
from launcher.parallel.engine import Engine, autocast_dtype
from launcher.parallelize import parallelize, rebind_attention
from launcher import on_warning
from launcher.prepare_data import EMBEDDED_DATA_DIR, ensure_prepared
from launcher.run_folder import RunLock, start_fresh_or_resume
from launcher.sharded import saved_shapes
from launcher.stop_signals import STOP
from model import GPT, resolve_backend


@dataclass
class ArmResult:
    arm: str
    status: str  # completed | interrupted | stopped (a guard fired) | stopped_by_warning (monitor.on_warning=stop)
    steps: int
    last_loss: float
    run_dir: Path
    message: str = ""
    stop_requested: bool = False  # a signal or run.max_minutes ended this command's work (also on the last step)


@dataclass
class StepResult:
    """One optimizer step: its mean loss and gradient norm (over all ranks), and the guard's objection if any."""

    loss: float
    grad_norm: float
    lr: float
    problem: Optional[str] = None

    @property
    def applied(self) -> bool:
        return self.problem is None


def lr_at(step: int, optim: OptimConfig, max_steps: int) -> float:
    """Learning rate of optimizer step ``step`` (0-based): linear warmup to lr, cosine to min_lr, then flat."""
    if step < optim.warmup_steps:
        return optim.lr * (step + 1) / optim.warmup_steps
    decay_end = optim.decay_steps or max_steps
    if step >= decay_end:
        return optim.min_lr
    progress = (step - optim.warmup_steps) / max(1, decay_end - optim.warmup_steps)
    return optim.min_lr + 0.5 * (optim.lr - optim.min_lr) * (1 + math.cos(math.pi * progress))


class Guard:
    """Flags non-finite loss or gradients, and (if configured) spikes above a factor x the running mean."""

    def __init__(self, config: Config):
        self.cfg = config.guard
        self.loss_mean: Optional[float] = None
        self.grad_mean: Optional[float] = None
        self.good_steps = 0
        self.bad_steps = 0

    def check(self, loss: float, grad_norm: float) -> Optional[str]:
        if not math.isfinite(loss):
            return f"loss is {loss}"
        if not math.isfinite(grad_norm):
            return f"gradient norm is {grad_norm}"
        if self.good_steps >= self.cfg.warmup_steps:
            if self.cfg.loss_spike_factor and loss > self.cfg.loss_spike_factor * self.loss_mean:
                return f"loss {loss:.4f} > {self.cfg.loss_spike_factor} x running mean {self.loss_mean:.4f}"
            if self.cfg.grad_norm_spike_factor and grad_norm > self.cfg.grad_norm_spike_factor * self.grad_mean:
                return f"gradient norm {grad_norm:.3g} > {self.cfg.grad_norm_spike_factor} x running mean {self.grad_mean:.3g}"
        return None

    def accept(self, loss: float, grad_norm: float) -> None:
        decay = 0.95 if self.good_steps else 0.0  # running means over ~20 steps
        self.loss_mean = loss if self.loss_mean is None else decay * self.loss_mean + (1 - decay) * loss
        self.grad_mean = grad_norm if self.grad_mean is None else decay * self.grad_mean + (1 - decay) * grad_norm
        self.good_steps += 1

    def state_dict(self) -> dict:
        return {"loss_mean": self.loss_mean, "grad_mean": self.grad_mean, "good_steps": self.good_steps,
                "bad_steps": self.bad_steps}

    def load_state_dict(self, state: dict) -> None:
        self.__dict__.update({k: state[k] for k in ("loss_mean", "grad_mean", "good_steps", "bad_steps")})


def autocast_factory(config: Config, device: torch.device):
    """Zero-arg callable returning the forward-pass precision context: BF16 autocast, or none. (FP8 FFNs enter
    Transformer Engine's context themselves; launcher/fp8.py.)"""
    dtype = autocast_dtype(config, device)

    def context():
        if dtype == "bf16":
            return torch.autocast(device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    return context


def open_data(config: Config, dims: ParallelDims) -> TokenData:
    """Open the prepared data, preparing the embedded corpus on first use if the recipe points at it."""
    data_dir = Path(config.data.data_dir)
    if data_dir == Path(EMBEDDED_DATA_DIR) and not (data_dir / "meta.json").is_file():
        if dims.is_logging_rank:
            ensure_prepared(data_dir)
        if dims.distributed:
            dist.barrier()
    data = TokenData.open(data_dir)
    data.check_fits(config.data.seq_len)
    return data


def build_model(config: Config) -> tuple[GPT, int, float]:
    """The single-device GPT on the meta device (no storage; launcher/parallelize.py applies the layout and
    materialises this rank's part with the initial weights of the run's seed, the same in every arm and layout). Also
    returns its parameter count and training FLOPs per token (for MFU)."""
    with torch.device("meta"):
        model = GPT(config.model, seed=config.run.seed)
    return model, model.num_parameters(), model.flops_per_token(config.data.seq_len)


class Trainer:
    """One arm of an experiment on one layout (see the module docstring). ``checkpoint_writer``: how checkpoint bytes
    reach the file (launcher/checkpoint.py; tests inject a writer that pauses mid-save)."""

    def __init__(self, config: Config, dims: ParallelDims, checkpoint_writer=HashingWriter):
        self.data = open_data(config, dims)
        # model.vocab_size=0 (take the data's) becomes a number here: this trainer's config, the caller's unchanged
        self.config = config = resolve_vocab_size(config, self.data.vocab_size)
        self.dims = dims
        self.run_dir = config.run_dir
        self.schedule = BatchSchedule(self.data, config.run.seed, config.data.seq_len, config.data.global_batch_size,
                                      config.data.micro_batch_size, dims.dp_rank, dims.dp,
                                      config.data.replay_from or None, config.run.max_steps)
        self.backend = resolve_backend(config.attention, dims.device, config.model.head_dim)
        model, self.n_params, flops_per_token = build_model(config)

        self.store = CheckpointStore(self.run_dir, checkpoint_writer)
        self.lock = None
        if dims.is_logging_rank:  # one process group per run folder
            self.lock = RunLock(self.run_dir).acquire()
        latest = None
        if config.checkpoint.resume:  # verified by all ranks, falling back past damaged ones (CheckpointError if none)
            latest, damaged = self.store.resumable(dims)
            if damaged and dims.is_logging_rank:
                print(f"[{config.run.arm}] {damaged}", flush=True)
        if dims.is_logging_rank:  # the folder's earlier run, if any
            earlier = latest or self.store.newest_file()  # damaged or not: a fresh start must not eat it
            message = start_fresh_or_resume(self.run_dir, earlier, config.checkpoint.resume, config.run.overwrite)
            if message:
                print(f"[{config.run.arm}] {message}", flush=True)
        if dims.distributed:  # every rank goes on once the folder is settled
            dist.barrier()
        run = self.store.run_state(latest) if latest is not None else None
        self.switch: Optional[on_warning.Switch] = None  # an early warning's switch of attention.fix, if any
        tuning_note = ""  # what resuming did with the checkpoint's attention-kernel tiles
        if run is not None:  # a switch made before this checkpoint still holds (launcher/on_warning.py)
            config, self.switch = on_warning.resume_switch(config, run)
            self.config = config
        self.changes = self._check_changes(run) if run is not None else {}
        self.metrics_note = ""
        self._saved_step: Optional[int] = None
        saved = set()
        if run is not None:
            shapes = saved_shapes(latest)
            saved = set(shapes)
            check_fits(shapes, model, latest)
        self.engine: Engine = build_engine(parallelize(model, config, dims), config, dims, self.run_dir)
        self.model = self.engine.model  # on the device; under pipeline parallelism, this rank's stage
        self.guard = Guard(config)
        self.start_step = 0
        if run is not None:  # every rank reads its own shards of the parameters and Adam moments, nothing more
            entries = training_entries(self.engine.prepare_state_load(run["adam_step"]), dims)
            rng = rng_entry(min(dims.rank, run["world_size"] - 1))  # another layout: the rank with this index
            entries[rng] = None
            entries.update(fp8_destinations(self.engine, saved, config.precision))
            read = self.store.read(latest, entries)
            self.engine.finish_state_load()
            load_fp8_scaling(self.engine, read, config.precision)
            self.guard.load_state_dict(run["guard"])
            set_rng_state(read[rng])
            self.start_step = run["step"]
            # before the first launch: the tiles the run was autotuned to are part of its numerics
            tuning_note = kernels.install_tuning(run.get("kernel_tuning"))

        self.autocast = autocast_factory(config, dims.device)
        logging = dims.is_logging_rank
        if logging:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            self._record_config()
        self.metrics = Metrics(self.run_dir, config.run.arm, logging, self.start_step, config.run.max_steps,
                               config.data.global_batch_size * config.data.seq_len,
                               flops_per_token, peak_tflops(config.run.peak_tflops, dims.device),
                               dims.world_size)
        if self.start_step:
            self.metrics.print(f"resumed from {latest} at step {self.start_step}")
            if self.metrics_note:
                self.metrics.print(f"settings changed from step {self.start_step} (recorded in "
                                   f"{self.run_dir / 'changes.yaml'}): {self.metrics_note}")
            if tuning_note:
                self.metrics.print(tuning_note)
        else:
            self.metrics.text("config", "```\n" + yaml.safe_dump(config.to_dict(), sort_keys=False) + "\n```")
        self.monitors = self._build_monitors(latest, saved)
        self.recorder = OffsetRecorder(self.run_dir / "batch_offsets.bin", config.data.global_batch_size,
                                       self.start_step, self.schedule.offsets) if logging else None

    def _check_changes(self, state: dict) -> dict[str, tuple]:
        """Differences between the checkpoint's config and this one; refused (every rank raises the same error) when
        one changes the training and run.allow_changes is not set."""
        if "config" not in state:
            return {}
        safe, unsafe = config_changes(state["config"], self.config)
        if unsafe and not self.config.run.allow_changes:
            raise ConfigError(changes_refusal(unsafe, state["step"], self.run_dir))
        return {**safe, **unsafe}

    def _record_config(self) -> None:
        """config.yaml: the settings the run started with, written once; a resume with other settings appends them
        to changes.yaml with the step they took effect, so the two files together say what trained."""
        path = self.run_dir / "config.yaml"
        if self.start_step == 0 or not path.is_file():
            path.write_text(yaml.safe_dump(self.config.to_dict(), sort_keys=False))
        log = self.run_dir / "changes.yaml"
        entries = (yaml.safe_load(log.read_text()) or []) if self.start_step and log.is_file() else []
        # a resume from an earlier checkpoint redoes the steps after it: their entries no longer describe the run
        kept = [e for e in entries if on_warning.keeps_entry(e, self.start_step, self.switch)]
        if kept != entries:
            log.write_text(yaml.safe_dump(kept, sort_keys=False))
        if self.start_step and self.changes and self.start_step < self.config.run.max_steps:
            entries = kept
            entries.append({"step": self.start_step, "changes": {k: {"from": a, "to": b}
                                                                  for k, (a, b) in sorted(self.changes.items())}})
            log.write_text(yaml.safe_dump(entries, sort_keys=False))
            self.metrics_note = ", ".join(f"{k} {a!r} -> {b!r}" for k, (a, b) in sorted(self.changes.items()))

    def _build_monitors(self, latest: Optional[Path], saved: set[str]):
        config = self.config
        if not (config.monitor.spectral_interval or config.monitor.probe_interval):
            return None
        from launcher.monitors.monitors import Monitors

        probe_batch = windows(self.data.val, eval_offsets(len(self.data.val), config.data.seq_len,
                                                          config.monitor.probe_batch_size), config.data.seq_len)
        monitors = Monitors(config, self.model, tuple(t.to(self.dims.device) for t in probe_batch),
                            self.metrics.writer, self.autocast, self.backend, self.dims, self.engine)
        if latest is not None:  # collective: every rank reads (its share of) the monitors' state
            monitors.load_state_dict(self.store.read(latest, monitors.checkpoint_destinations(saved)))
        return monitors

    # ------------------------------------------------------------------------------------------------------------
    # The seams

    def train_step(self, step: int) -> StepResult:
        """Optimizer step ``step`` (0-based) over this rank's micro-batches; the guard may veto the update, in which
        case parameters and optimizer state are left exactly as they were."""
        lr = lr_at(step, self.config.optim, self.config.run.max_steps)
        device = self.dims.device
        micro = [(x.to(device, non_blocking=True), y.to(device, non_blocking=True))
                 for x, y in self.schedule.micro_batches(step)]
        if self.config.attention.needs_noise_keys:  # only then: every other run makes exactly the calls it made before
            micro = [(x, y, keys.to(device)) for (x, y), keys in zip(micro, self.row_keys(step))]

        def veto(loss: float, grad_norm: float) -> Optional[str]:
            problem = self.guard.check(loss, grad_norm)
            # Every rank must drop the same steps, or the replicas part ways: one objection drops it everywhere.
            if distributed.any_rank(problem is not None, self.dims) and problem is None:
                problem = "the guard of another rank rejected this step"
            return problem

        loss_value, grad_norm, problem = self.engine.train_step(micro, self.autocast, lr, veto)
        if problem is None:
            self.guard.accept(loss_value, grad_norm)
        else:
            self.guard.bad_steps += 1
        return StepResult(loss_value, grad_norm, lr, problem)

    def row_keys(self, step: int) -> list[torch.Tensor]:
        """Keys of the attention's random bits for this rank's micro-batches of ``step`` (int64 (mb,) each): a hash of
        (run seed, step, global batch row), so they do not depend on the layout, and a resumed run draws the same."""
        from kernels.rounding import row_keys  # kernels/ only when the run needs keys

        return [row_keys(self.config.run.seed, step, rows) for rows in self.schedule.global_rows()]

    def evaluate(self) -> float:
        """Mean loss on the fixed validation windows; each data-parallel rank takes an equal contiguous share. Runs
        without row keys (key 0 for every row, see model.attention.noise_keys): the same windows get the same bits
        at every evaluation and under every layout."""
        config, dims = self.config, self.dims
        mb, seq_len = config.data.micro_batch_size, config.data.seq_len
        offsets = eval_offsets(len(self.data.val), seq_len, config.eval.batches * mb)
        mine = np.array_split(offsets, dims.dp)[dims.dp_rank]
        batches = [tuple(t.to(dims.device) for t in windows(self.data.val, mine[i:i + mb], seq_len))
                   for i in range(0, len(mine), mb)]
        loss_sum, count = self.engine.eval_loss(batches, self.autocast)
        total = torch.tensor([loss_sum, count], device=dims.device, dtype=torch.float64)
        if dims.dp > 1:
            dist.all_reduce(total, group=dims.dp_group)
        return (total[0] / total[1]).item()

    def save_checkpoint(self, step: int) -> None:
        """Collective: every rank writes its own shards, and nothing is gathered (launcher/checkpoint.py)."""
        dims = self.dims
        entries = training_entries(self.engine.state_pieces(), dims)
        entries.update(fp8_entries(self.engine, dims))
        entries[rng_entry(dims.rank)] = rng_state()
        if self.monitors is not None:
            entries.update(self.monitors.state_dict())
        if dims.is_logging_rank:
            entries[RUN] = {"format": FORMAT, "step": step, "adam_step": self.engine.adam_step(),
                            "guard": self.guard.state_dict(), "layout": dims.describe(),
                            "world_size": dims.world_size, "config": self.config.to_dict(),
                            "warning_switch": self.switch.to_dict() if self.switch is not None else None,
                            "kernel_tuning": kernels.tuning_record()}
        self.store.save(step, entries, dims)
        self._saved_step = step

    def fit(self) -> ArmResult:
        """Train to run.max_steps, or until interrupted or stopped by the guard."""
        config, metrics = self.config, self.metrics
        max_steps = config.run.max_steps
        metrics.print(f"{self.n_params / 1e6:.2f}M parameters | attention {self.backend} "
                      f"{config.attention.numerics} | {self.dims.describe()} on {self.dims.device.type}, "
                      f"{self.engine.describe()} | {self.schedule.accum_steps} accumulation step(s) | "
                      f"{config.data.global_batch_size * config.data.seq_len:,} tokens/step | logs in {self.run_dir}")
        last_loss = float("nan")
        status, message = "completed", ""
        step = self.start_step
        metrics.restart_clock()
        deadline = time.monotonic() + 60 * config.run.max_minutes if config.run.max_minutes else None
        interrupted = False
        with STOP.while_training() as stop:
            while step < max_steps:
                result = self.train_step(step)
                step += 1
                if self.recorder is not None:
                    self.recorder.record(self.schedule.offsets(step - 1))
                if not result.applied:
                    self._report_bad_step(step, result)
                    if config.guard.action == "stop":
                        status, message = "stopped", result.problem
                        break
                    # skip: the update was dropped; evaluation, checkpointing and the stop check below still run
                else:
                    last_loss = result.loss
                    if self.monitors is not None:
                        self.monitors.after_step(step)
                        stopped = self.act_on_warning(step)
                        if stopped:
                            metrics.train_step(step, result.loss, result.lr, result.grad_norm, 1)
                            status, message = "stopped_by_warning", stopped
                            break
                    metrics.train_step(step, result.loss, result.lr, result.grad_norm, config.run.log_interval)
                if config.eval.interval and (step % config.eval.interval == 0 or step == max_steps):
                    metrics.eval_loss(step, self.evaluate())
                    metrics.restart_clock()  # evaluation time is not training throughput
                time_up = deadline is not None and time.monotonic() >= deadline
                interrupted = distributed.any_rank(stop.requested or time_up, self.dims)
                due = config.checkpoint.interval and step % config.checkpoint.interval == 0
                if config.checkpoint.enabled and (due or interrupted or step == max_steps) and self._saved_step != step:
                    self.save_checkpoint(step)
                    metrics.restart_clock()
                if interrupted and step < max_steps:  # a signal during the last step: the arm is complete
                    why = f"run.max_minutes={config.run.max_minutes:g} spent" if time_up else "stopped by a signal"
                    then = ("the same command resumes" if config.checkpoint.enabled else
                            "nothing saved (checkpoint.enabled=false): the same command starts over")
                    status, message = "interrupted", f"{why} at step {step}; {then}"
                    break
        metrics.close()
        self.engine.close()
        if self.lock is not None:
            self.lock.release()
        if step == self.start_step and status == "completed":
            message = "already complete; nothing to train (use another run.experiment or a larger run.max_steps)"
        elif interrupted and status == "completed":
            message = "the stop (a signal or run.max_minutes) came during the last step: the arm is complete"
        overhead = f", monitors {self.monitors.overhead_s:.1f}s" if self.monitors is not None else ""
        metrics.print(f"{status} at step {step}{overhead}{': ' + message if message else ''}")
        return ArmResult(config.run.arm, status, step, last_loss, self.run_dir, message, stop_requested=interrupted)

    def act_on_warning(self, step: int) -> Optional[str]:
        """What monitor.on_warning says to do when the early warning turned on at ``step`` (launcher/on_warning.py);
        every rank calls it after the monitors. Returns the one-line reason when the run is to stop, else None."""
        mode = self.config.monitor.on_warning
        if mode == "log" or not self.monitors.ran_at(step):
            return None
        onset = self.monitors.onset_at(step)  # only the logging rank evaluates the rule
        if not distributed.any_rank(onset is not None, self.dims):
            return None
        reason = f"early warning at step {step}: {onset.describe()}" if onset is not None else ""
        target = self.config.monitor.switch_fix_to
        if mode == "switch_fix" and self.switch is not None:
            return None  # switched at an earlier onset: this one is logged only
        if mode == "switch_fix" and self.config.attention.fix != target:
            self.switch = on_warning.Switch(step, self.config.attention.fix, target)
            self.config = on_warning.switched(self.config, target)
            rebind_attention(self.engine.blocks(), self.config, self.dims)
            self.monitors.attention_rebound()
            if self.dims.is_logging_rank:
                on_warning.record_switch(self.run_dir, self.switch, reason)
                self.metrics.print(f"switched attention.fix {self.switch.before} -> {target} after step {step} "
                                   f"(monitor.on_warning=switch_fix; recorded in {self.run_dir / 'changes.yaml'})")
        elif mode == "switch_fix":
            self.metrics.print(f"attention.fix is {self.config.attention.fix} already: monitor.on_warning=switch_fix "
                               "switches nothing at this onset")
        self.save_checkpoint(step)
        kept = self.store.keep(step, on_warning.KEPT_LABEL) if self.dims.is_logging_rank else None
        self.metrics.print(f"checkpoint of the early warning's onset kept: {kept}")
        if mode == "stop":
            return f"stopped by the {reason} (monitor.on_warning=stop; checkpoint {kept}; exit status {on_warning.EXIT_STATUS})"
        return None

    def _report_bad_step(self, step: int, result: StepResult) -> None:
        self.metrics.bad_steps(step, self.guard.bad_steps)
        if not self.dims.is_logging_rank:
            return
        latest = self.store.latest()
        self.metrics.print(f"BAD STEP {step}: {result.problem} (loss {result.loss}, grad norm {result.grad_norm}); "
                           f"the update was not applied and nothing was saved. Last good checkpoint: "
                           f"{latest or 'none yet'}")
        details = self.monitors.last_values() if self.monitors is not None else {}
        dump = self.run_dir / f"bad_step_{step:08d}.yaml"  # the report reads it (launcher/arm_status.py)
        record = {"step": step, "problem": result.problem, "loss": result.loss, "grad_norm": result.grad_norm}
        if details:
            record["monitors_last_values"] = {k: float(v) for k, v in details.items()}
        dump.write_text(yaml.safe_dump(record))
        if details:
            self.metrics.print(f"monitors' last values written to {dump}")


def train_arm(config: Config, dims: ParallelDims, checkpoint_writer=HashingWriter) -> ArmResult:
    """Build the arm's trainer and run it; its run folder records how it ended (launcher/arm_status.py)."""
    trainer = Trainer(config, dims, checkpoint_writer)
    record = dims.is_logging_rank
    max_steps = config.run.max_steps
    if record:
        write_status(trainer.run_dir, "running", trainer.start_step, max_steps)
    try:
        result = trainer.fit()
    except KeyboardInterrupt:  # a second Ctrl-C
        if record:
            write_status(trainer.run_dir, "interrupted", trainer.start_step, max_steps, "aborted by a second Ctrl-C "
                         "without saving; the same command resumes from the newest checkpoint")
        raise
    except Exception as err:
        if record:
            first = (str(err).strip().splitlines() or [""])[0]
            write_status(trainer.run_dir, "crashed", trainer.start_step, max_steps, f"{type(err).__name__}: {first}")
        raise
    if record:
        write_status(trainer.run_dir, result.status, result.steps, max_steps, result.message)
    return result
