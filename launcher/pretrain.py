"""Train the arms of an experiment: ``python -m launcher.pretrain RECIPE [section.field=value ...] [--arm NAME]``.

Runs alone, under ``torchrun --nproc-per-node N`` or under ``srun`` (one process per device; gloo on CPU, NCCL on
GPU). Every arm of the recipe is trained in turn with the same seed and the same batches; the arms differ only in
attention numerics. Each arm writes TensorBoard events, checkpoints and its batch offsets to
``<run.out_dir>/<run.experiment>/<arm>/``; at the end the comparison report of the arms is written
(``launcher/compare.py``). Ctrl-C or SIGTERM saves a checkpoint at the end of the current step; the same command
resumes.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
import yaml

from launcher import distributed
from launcher.checkpoint import CheckpointStore, rng_state, set_rng_state
from launcher.compare import CompareError
from launcher.config import Config, ConfigError, OptimConfig, arm_names, build_config, describe, load_recipe
from launcher.data import BatchSchedule, DataError, OffsetRecorder, TokenData, eval_offsets, windows
from launcher.prepare_data import EMBEDDED_DATA_DIR, ensure_prepared
from model import GPT, build_attention, resolve_backend

PEAK_BF16_TFLOPS = {"H100": 989.0, "H200": 989.0, "H800": 989.0, "A100": 312.0, "L40S": 362.0}


class StopRequested:
    """Set by SIGINT/SIGTERM; the loop checks it at the end of each step, saves and returns."""

    def __init__(self):
        self.requested = False
        self._previous = {}

    def __enter__(self):
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame):
        if self.requested:  # a second Ctrl-C means: stop now
            raise KeyboardInterrupt
        self.requested = True
        print(f"\n[train] {signal.Signals(signum).name}: finishing this step, then saving a checkpoint "
              "(press Ctrl-C again to abort without saving)", flush=True)

    def __exit__(self, *exc):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


@dataclass
class ArmResult:
    arm: str
    status: str  # completed | interrupted | stopped (a guard fired)
    steps: int
    last_loss: float
    run_dir: Path
    message: str = ""


def lr_at(step: int, optim: OptimConfig, max_steps: int) -> float:
    """Learning rate of optimizer step ``step`` (0-based): linear warmup to lr, cosine to min_lr, then flat."""
    if step < optim.warmup_steps:
        return optim.lr * (step + 1) / optim.warmup_steps
    decay_end = optim.decay_steps or max_steps
    if step >= decay_end:
        return optim.min_lr
    progress = (step - optim.warmup_steps) / max(1, decay_end - optim.warmup_steps)
    return optim.min_lr + 0.5 * (optim.lr - optim.min_lr) * (1 + math.cos(math.pi * progress))


def build_optimizer(model: torch.nn.Module, optim: OptimConfig, device: torch.device) -> torch.optim.AdamW:
    """AdamW; weight decay on matrices only (not on biases, LayerNorm gains or embeddings)."""
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.dim() >= 2 and id(p) not in embeddings else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": optim.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=optim.lr, betas=(optim.beta1, optim.beta2), eps=optim.adam_eps,
                             fused=device.type == "cuda")


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
    """Zero-arg callable returning the forward-pass precision context (BF16 autocast, plus FP8 for TE modules)."""
    dtype = config.precision.dtype
    if dtype == "auto":
        dtype = "bf16" if device.type == "cuda" else "fp32"

    def context():
        stack = contextlib.ExitStack()
        if dtype == "bf16":
            stack.enter_context(torch.autocast(device.type, dtype=torch.bfloat16))
        if config.precision.fp8_ffn:
            from launcher.fp8 import fp8_context

            stack.enter_context(fp8_context(config.precision))
        return stack

    return context


def peak_tflops(config: Config, device: torch.device) -> float:
    if config.run.peak_tflops:
        return config.run.peak_tflops
    if device.type != "cuda":
        return 0.0
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_BF16_TFLOPS.items() if k in name), 0.0)


def open_data(config: Config, info: distributed.DistInfo) -> TokenData:
    """Open the prepared data, preparing the embedded corpus on first use if the recipe points at it."""
    data_dir = Path(config.data.data_dir)
    if data_dir == Path(EMBEDDED_DATA_DIR) and not (data_dir / "meta.json").is_file():
        if info.is_main:
            ensure_prepared(data_dir)
        if info.distributed:
            torch.distributed.barrier()
    data = TokenData.open(data_dir)
    data.check_fits(config.data.seq_len)
    return data


def evaluate(model, data: TokenData, config: Config, info: distributed.DistInfo, autocast) -> float:
    """Mean loss on fixed validation windows, split across ranks."""
    mb = config.data.micro_batch_size
    offsets = eval_offsets(len(data.val), config.data.seq_len, config.eval.batches * mb)[info.rank::info.world_size]
    total = torch.zeros(2, device=info.device, dtype=torch.float64)
    model.eval()
    with torch.no_grad():
        for i in range(0, len(offsets), mb):
            x, y = windows(data.val, offsets[i:i + mb], config.data.seq_len)
            with autocast():
                _, loss = model(x.to(info.device), y.to(info.device))
            total += torch.tensor([loss.item() * len(x), len(x)], device=info.device, dtype=torch.float64)
    model.train()
    if info.distributed:
        torch.distributed.all_reduce(total)
    return (total[0] / total[1]).item()


def train_arm(config: Config, info: distributed.DistInfo) -> ArmResult:
    """Train one arm to run.max_steps (or until interrupted / stopped by a guard)."""
    run_dir = config.run_dir
    tag = f"[{config.run.arm}]"
    data = open_data(config, info)
    if config.model.vocab_size == 0:
        config.model.vocab_size = data.vocab_size
    elif config.model.vocab_size < data.vocab_size:
        raise ConfigError(f"model.vocab_size={config.model.vocab_size} is smaller than the data's vocabulary "
                          f"({data.vocab_size}); set model.vocab_size=0 to take it from the data")
    torch.manual_seed(config.run.seed)  # the same initial weights in every arm
    backend = resolve_backend(config.attention, info.device)
    if backend == "triton" and info.device.type != "cuda":
        raise ConfigError("attention.backend=triton needs a CUDA GPU; use attention.backend=auto or reference on CPU")
    model = GPT(config.model, build_attention(config.attention, info.device)).to(info.device)
    if config.precision.fp8_ffn:
        from launcher.fp8 import apply_fp8_ffn

        apply_fp8_ffn(model, info.device)
    optimizer = build_optimizer(model, config.optim, info.device)
    guard = Guard(config)
    autocast = autocast_factory(config, info.device)
    store = CheckpointStore(run_dir)
    dp_size = info.world_size // (config.parallel.tensor_parallel * config.parallel.pipeline_parallel)
    schedule = BatchSchedule(data, config.run.seed, config.data.seq_len, config.data.global_batch_size,
                             config.data.micro_batch_size, info.rank, dp_size, config.data.replay_from or None)
    start_step, state = 0, None
    latest = store.latest() if config.checkpoint.resume else None
    if latest is not None:
        state = store.load(latest, map_location=info.device)
        try:
            model.load_state_dict(state["model"])
            optimizer.load_state_dict(state["optimizer"])
        except (RuntimeError, ValueError, KeyError) as err:
            raise ConfigError(f"checkpoint {latest} does not fit this configuration ({str(err).splitlines()[0]}); "
                              "use another run.experiment or checkpoint.resume=false") from None
        guard.load_state_dict(state["guard"])
        set_rng_state(state["rng"][min(info.rank, len(state["rng"]) - 1)])
        start_step = state["step"]
        if info.is_main:
            print(f"{tag} resumed from {latest} at step {start_step}", flush=True)

    writer = None
    if info.is_main:
        from torch.utils.tensorboard import SummaryWriter

        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.yaml").write_text(yaml.safe_dump(config.to_dict(), sort_keys=False))
        # purge_step drops events an interrupted earlier process logged past the checkpoint we resume from
        writer = SummaryWriter(str(run_dir), purge_step=start_step + 1 if start_step else None)
        if start_step == 0:
            writer.add_text("config", "```\n" + yaml.safe_dump(config.to_dict(), sort_keys=False) + "\n```")

    monitors = None
    if config.monitor.spectral_interval or config.monitor.probe_interval:
        from launcher.monitors import Monitors

        probe_batch = windows(data.val, eval_offsets(len(data.val), config.data.seq_len,
                                                     config.monitor.probe_batch_size), config.data.seq_len)
        monitors = Monitors(config, model, tuple(t.to(info.device) for t in probe_batch), writer, autocast, backend)
        if state is not None and state.get("monitors") is not None:
            monitors.load_state_dict(state["monitors"])
    del state
    recorder = OffsetRecorder(run_dir / "batch_offsets.bin", config.data.global_batch_size, start_step) \
        if info.is_main else None

    train_model = model
    if info.distributed:
        train_model = torch.nn.parallel.DistributedDataParallel(
            model, device_ids=[info.device.index] if info.device.type == "cuda" else None)
    if config.run.compile:
        train_model = torch.compile(train_model)

    max_steps = config.run.max_steps
    tokens_per_step = config.data.global_batch_size * config.data.seq_len
    flops_per_token = model.flops_per_token(config.data.seq_len)
    peak = peak_tflops(config, info.device)
    if info.is_main:
        print(f"{tag} {model.num_parameters() / 1e6:.2f}M parameters | attention {backend} {config.attention.numerics} | "
              f"{info.world_size} process(es) on {info.device.type} | {schedule.accum_steps} accumulation step(s) | "
              f"{tokens_per_step:,} tokens/step | logs in {run_dir}", flush=True)

    last_loss = float("nan")
    status, message = "completed", ""
    window_start, window_steps = time.perf_counter(), 0
    step = start_step
    with StopRequested() as stop:
        while step < max_steps:
            lr = lr_at(step, config.optim, max_steps)
            for group in optimizer.param_groups:
                group["lr"] = lr
            loss_sum = torch.zeros((), device=info.device)
            micro = schedule.micro_batches(step)
            for i, (x, y) in enumerate(micro):
                sync = i == len(micro) - 1 or not info.distributed
                with contextlib.nullcontext() if sync else train_model.no_sync():
                    with autocast():
                        _, loss = train_model(x.to(info.device, non_blocking=True), y.to(info.device, non_blocking=True))
                    (loss / len(micro)).backward()
                loss_sum += loss.detach()
            clip = config.optim.grad_clip if config.optim.grad_clip > 0 else float("inf")
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip).item()
            loss_value = loss_sum / len(micro)
            if info.distributed:
                torch.distributed.all_reduce(loss_value, op=torch.distributed.ReduceOp.AVG)
            loss_value = loss_value.item()

            problem = guard.check(loss_value, grad_norm)
            if problem is None:
                optimizer.step()
                guard.accept(loss_value, grad_norm)
            optimizer.zero_grad(set_to_none=True)
            step += 1
            if recorder is not None:
                recorder.record(schedule.offsets(step - 1))
            if problem is not None:
                guard.bad_steps += 1
                details = monitors.last_values() if monitors is not None else {}
                if writer is not None:
                    writer.add_scalar("guard/bad_steps", guard.bad_steps, step)
                    writer.flush()
                if info.is_main:
                    report_bad_step(tag, step, problem, loss_value, grad_norm, details, run_dir, store)
                if config.guard.action == "stop":
                    status = "stopped"
                    message = f"stopped at step {step}: {problem}"
                    break
                # skip: the update was dropped; evaluation, checkpointing and the stop check below still run
            else:
                last_loss = loss_value
                window_steps += 1
                if monitors is not None:
                    monitors.after_step(step)
                if writer is not None and (step % config.run.log_interval == 0 or step == max_steps):
                    elapsed = time.perf_counter() - window_start
                    tok_s = tokens_per_step * window_steps / max(elapsed, 1e-9)
                    mfu = flops_per_token * tok_s / (peak * 1e12 * info.world_size) if peak else float("nan")
                    for name, value in (("train/loss", loss_value), ("train/lr", lr), ("train/grad_norm", grad_norm),
                                        ("perf/tokens_per_s", tok_s), ("perf/step_time_s", elapsed / window_steps)):
                        writer.add_scalar(name, value, step)
                    if peak:
                        writer.add_scalar("perf/mfu", mfu, step)
                    mfu_text = f"{100 * mfu:.1f}%" if peak else "n/a"
                    print(f"{tag} step {step:>6}/{max_steps} | loss {loss_value:.4f} | lr {lr:.2e} | grad norm "
                          f"{grad_norm:.3f} | {tok_s:,.0f} tok/s | MFU {mfu_text} | "
                          f"{elapsed / window_steps:.3f} s/step", flush=True)
                    window_start, window_steps = time.perf_counter(), 0
            if config.eval.interval and (step % config.eval.interval == 0 or step == max_steps):
                val = evaluate(model, data, config, info, autocast)
                if writer is not None:
                    writer.add_scalar("eval/loss", val, step)
                    print(f"{tag} step {step:>6} | eval loss {val:.4f}", flush=True)
                window_start = time.perf_counter()  # evaluation time is not training throughput
            interrupted = distributed.all_ranks_agree(stop.requested, info)
            due = config.checkpoint.interval and step % config.checkpoint.interval == 0
            if due or interrupted or step == max_steps:
                save_checkpoint(store, step, model, optimizer, guard, monitors, info, config)
            if interrupted:
                status, message = "interrupted", f"interrupted at step {step}; the same command resumes"
                break
    if writer is not None:
        writer.close()
    if step == start_step and status == "completed":
        message = "already complete; nothing to train (use another run.experiment or a larger run.max_steps)"
    if info.is_main:
        overhead = f", monitors {monitors.overhead_s:.1f}s" if monitors is not None else ""
        print(f"{tag} {status} at step {step}{overhead}{': ' + message if message else ''}", flush=True)
    return ArmResult(config.run.arm, status, step, last_loss, run_dir, message)


def save_checkpoint(store, step, model, optimizer, guard, monitors, info, config) -> None:
    rngs = distributed.gather_objects(rng_state(), info)
    if info.is_main:
        state = {"step": step, "model": model.state_dict(), "optimizer": optimizer.state_dict(),
                 "guard": guard.state_dict(), "monitors": monitors.state_dict() if monitors is not None else None,
                 "rng": rngs, "config": config.to_dict()}
        store.save(step, state)


def report_bad_step(tag, step, problem, loss, grad_norm, details, run_dir, store) -> None:
    latest = store.latest()
    print(f"{tag} BAD STEP {step}: {problem} (loss {loss}, grad norm {grad_norm}); the update was not applied and "
          f"nothing was saved. Last good checkpoint: {latest or 'none yet'}", flush=True)
    if details:
        dump = run_dir / f"bad_step_{step:08d}.yaml"
        dump.write_text(yaml.safe_dump({"step": step, "problem": problem, "loss": loss, "grad_norm": grad_norm,
                                        "monitors_last_values": {k: float(v) for k, v in details.items()}}))
        print(f"{tag} monitors' last values written to {dump}", flush=True)


def parse_args(argv):
    parser = argparse.ArgumentParser(prog="python -m launcher.pretrain", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("recipe", nargs="?", help="recipe name in recipes/ (e.g. smoke) or a YAML path")
    parser.add_argument("overrides", nargs="*", help="section.field=value, e.g. run.max_steps=100 optim.lr=3e-4")
    parser.add_argument("--arm", action="append", help="train only this arm (repeatable); default: every arm")
    parser.add_argument("--no-report", action="store_true", help="skip the comparison report at the end")
    parser.add_argument("--dry-run", action="store_true", help="print the resolved config of each arm and exit")
    parser.add_argument("--help-config", action="store_true", help="list every config field with its meaning")
    args = parser.parse_intermixed_args(argv)  # overrides may come before or after --arm
    if args.help_config:
        print(describe())
        sys.exit(0)
    if not args.recipe:
        parser.error("give a recipe, e.g. `python -m launcher.pretrain smoke`")
    return args


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    info = None
    try:
        tree = load_recipe(args.recipe, args.overrides)
        arms = args.arm or arm_names(tree)
        world = distributed.world_size_from_env()
        configs = [build_config(tree, arm, world) for arm in arms]  # validate every arm before any work starts
        if args.dry_run:
            for config in configs:
                print(f"# arm {config.run.arm}\n" + yaml.safe_dump(config.to_dict(), sort_keys=False))
            return 0
        info = distributed.init(configs[0].run.device)
        results = []
        for config in configs:
            results.append(train_arm(config, info))
            if results[-1].status == "interrupted":
                break  # the user asked to stop: do not start the next arm
        if info.is_main and not args.no_report and len(results) > 1 and results[-1].status != "interrupted":
            from launcher.compare import write_report

            write_report(configs[0].run_dir.parent)  # prints its summary and the report's path
    except (ConfigError, DataError, CompareError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("aborted without saving; the last checkpoint is intact", file=sys.stderr)
        return 130
    finally:
        distributed.shutdown()
    if info is not None and info.is_main:
        for r in results:
            loss = f"last loss {r.last_loss:.4f}" if math.isfinite(r.last_loss) else r.message or "no finite loss"
            print(f"[summary] {r.arm}: {r.status} at step {r.steps}, {loss}  ({r.run_dir})")
    if any(r.status == "interrupted" for r in results):
        return 130
    return 3 if any(r.status == "stopped" for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
