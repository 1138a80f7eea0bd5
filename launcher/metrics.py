"""What a run reports: the progress line on the console and the trainer's TensorBoard scalars.

Only the logging rank (see launcher/parallel/dims.py) has a writer; every other rank's ``Metrics`` is silent, so the
trainer calls it unconditionally. Tag names come from launcher/monitors/tags.py, where the comparison reads them too.
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import TYPE_CHECKING

from launcher.monitors import tags

if TYPE_CHECKING:
    import torch  # imported where it is used: the tag names and this module load without torch

PEAK_BF16_TFLOPS = {"H100": 989.0, "H200": 989.0, "H800": 989.0, "A100": 312.0, "L40S": 362.0}


def peak_tflops(configured: float, device: torch.device) -> float:
    """Dense BF16 peak of one device for the MFU figure: the configured value, else looked up by name (0: unknown)."""
    if configured:
        return configured
    if device.type != "cuda":
        return 0.0
    import torch

    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_BF16_TFLOPS.items() if k in name), 0.0)


class Metrics:
    """Progress line and scalars of one arm; throughput is measured over the steps since the last line."""

    def __init__(self, run_dir: Path, arm: str, enabled: bool, start_step: int, max_steps: int, tokens_per_step: int,
                 flops_per_token: float, peak_tflops_per_device: float, devices: int):
        self.tag = f"[{arm}]"
        self.enabled = enabled
        self.max_steps = max_steps
        self.tokens_per_step = tokens_per_step
        self.flops_per_token = flops_per_token
        self.peak_flops = peak_tflops_per_device * 1e12 * devices
        self.writer = None
        if enabled:
            from torch.utils.tensorboard import SummaryWriter

            # purge_step drops events an interrupted earlier process logged past the checkpoint we resume from
            self.writer = SummaryWriter(str(run_dir), purge_step=start_step + 1 if start_step else None)
        self.restart_clock()

    def restart_clock(self) -> None:
        """Start a new throughput window (after evaluation or checkpointing, which are not training time)."""
        self._window_start, self._window_steps = time.perf_counter(), 0

    def print(self, text: str) -> None:
        if self.enabled:
            print(f"{self.tag} {text}", flush=True)

    def text(self, name: str, value: str) -> None:
        if self.writer is not None:
            self.writer.add_text(name, value)

    def scalar(self, tag: str, value: float, step: int) -> None:
        if self.writer is not None:
            self.writer.add_scalar(tag, value, step)

    def train_step(self, step: int, loss: float, lr: float, grad_norm: float, log_interval: int) -> None:
        """Count an applied step; every ``log_interval`` steps (and at the last) write scalars and a progress line."""
        self._window_steps += 1
        if not (step % log_interval == 0 or step == self.max_steps) or self.writer is None:
            return
        elapsed = time.perf_counter() - self._window_start
        steps = max(self._window_steps, 1)
        tok_s = self.tokens_per_step * steps / max(elapsed, 1e-9)
        mfu = self.flops_per_token * tok_s / self.peak_flops if self.peak_flops else float("nan")
        for tag, value in ((tags.TRAIN_LOSS, loss), (tags.TRAIN_LR, lr), (tags.TRAIN_GRAD_NORM, grad_norm),
                           (tags.TOKENS_PER_S, tok_s), (tags.STEP_TIME_S, elapsed / steps)):
            self.writer.add_scalar(tag, value, step)
        if not math.isnan(mfu):
            self.writer.add_scalar(tags.MFU, mfu, step)
        import torch  # loaded by the writer already

        if torch.cuda.is_available() and torch.cuda.is_initialized():  # this process's GPU, the peak since start
            self.writer.add_scalar(tags.MAX_MEMORY_GB, torch.cuda.max_memory_allocated() / 2**30, step)
        mfu_text = f"{100 * mfu:.1f}%" if not math.isnan(mfu) else "n/a"
        self.print(f"step {step:>6}/{self.max_steps} | loss {loss:.4f} | lr {lr:.2e} | grad norm {grad_norm:.3f} | "
                   f"{tok_s:,.0f} tok/s | MFU {mfu_text} | {elapsed / steps:.3f} s/step")
        self.restart_clock()

    def eval_loss(self, step: int, loss: float) -> None:
        self.scalar(tags.EVAL_LOSS, loss, step)
        self.print(f"step {step:>6} | eval loss {loss:.4f}")

    def bad_steps(self, step: int, count: int) -> None:
        self.scalar(tags.GUARD_BAD_STEPS, count, step)
        self.flush()

    def flush(self) -> None:
        if self.writer is not None:
            self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None
