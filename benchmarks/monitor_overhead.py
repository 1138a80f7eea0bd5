"""Overhead of the monitors at a recipe's intervals, amortised per training step, on whatever device is present.

    python -m benchmarks.monitor_overhead [--recipe gpt2_small_paper] [--arm NAME] [--steps 10] [--calls 3]
                                          [section.field=value ...]

Measures (a) the median time of a full optimizer step of the recipe (all micro-batches of global_batch_size on this
one device, forward/backward under the trainer's autocast, clipping, fused AdamW on GPU), and (b) the median wall time
of one spectral-norm call and one probe call (activations, attention diagnostics, delta bias) of
``launcher.monitors.monitors.Monitors`` including their TensorBoard writes, after the one-time first call. The amortised
overhead is spectral_call / monitor.spectral_interval + probe_call / monitor.probe_interval, reported in ms per step
and as a fraction of the step time. Tokens are random (the costs do not depend on the text); no data set is needed.
Runs in well under two minutes for gpt2_small_paper on one H200; ``--recipe smoke`` is a CPU-sized check.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from launcher.config import ConfigError, arm_names, build_config, load_recipe
from launcher.parallel.engine import build_optimizer
from launcher.trainer import autocast_factory
from model import GPT, build_attention, resolve_backend


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn, device: torch.device) -> float:
    _sync(device)
    start = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - start


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.monitor_overhead", description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipe", default="gpt2_small_paper", help="recipe name or YAML path")
    parser.add_argument("--arm", default=None, help="arm of the recipe (default: its first)")
    parser.add_argument("--steps", type=int, default=10, help="timed optimizer steps (after 2 warm-up steps)")
    parser.add_argument("--calls", type=int, default=3, help="timed calls of each monitor part (after the first call)")
    parser.add_argument("overrides", nargs="*", help="config overrides, e.g. data.global_batch_size=64")
    args = parser.parse_args(argv)
    try:
        tree = load_recipe(args.recipe, args.overrides)
        config = build_config(tree, args.arm or arm_names(tree)[0])
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    from launcher.monitors import tags
    from launcher.monitors.monitors import Monitors
    from torch.utils.tensorboard import SummaryWriter

    device = torch.device("cuda" if torch.cuda.is_available() and config.run.device != "cpu" else "cpu")
    if config.model.vocab_size == 0:  # the data's vocabulary when it is prepared, else GPT-2's (padded)
        meta = Path(config.data.data_dir) / "meta.json"
        config.model.vocab_size = json.loads(meta.read_text())["vocab_size"] if meta.is_file() else 50304
    mon = config.monitor
    torch.manual_seed(config.run.seed)
    backend = resolve_backend(config.attention, device)
    model = GPT(config.model, build_attention(config.attention, device)).to(device)
    optimizer = build_optimizer(model, config, device)
    autocast = autocast_factory(config, device)
    seq, micro = config.data.seq_len, config.data.micro_batch_size
    accum = config.data.global_batch_size // micro
    gen = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, config.model.vocab_size, (micro, seq + 1), generator=gen).to(device)
               for _ in range(min(accum, 4))]
    probe = torch.randint(0, config.model.vocab_size, (mon.probe_batch_size, seq + 1), generator=gen).to(device)
    print(f"device {device.type} ({torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}) | "
          f"recipe {args.recipe}, arm {config.run.arm}: attention {backend} {config.attention.numerics} | "
          f"{model.num_parameters() / 1e6:.1f}M parameters | {config.data.global_batch_size * seq:,} tokens/step "
          f"({accum} x {micro} x {seq}) | intervals: spectral {mon.spectral_interval}, probe {mon.probe_interval}",
          flush=True)

    def train_step():
        for i in range(accum):
            x = batches[i % len(batches)]
            with autocast():
                _, loss = model(x[:, :-1], x[:, 1:])
            (loss / accum).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for _ in range(2):
        train_step()
    step_times = [_timed(train_step, device) for _ in range(args.steps)]
    step_s = statistics.median(step_times)
    print(f"train step: {step_s * 1e3:.1f} ms (median of {args.steps})", flush=True)

    results = {}
    with tempfile.TemporaryDirectory() as logdir:
        writer = SummaryWriter(logdir)
        for part, interval in (("spectral", mon.spectral_interval), ("probe", mon.probe_interval)):
            if interval <= 0:
                print(f"{part}: disabled (interval 0)")
                continue
            config.monitor.spectral_interval = interval if part == "spectral" else 0
            config.monitor.probe_interval = interval if part == "probe" else 0
            monitors = Monitors(config, model, (probe[:, :-1], probe[:, 1:]), writer, autocast, backend)
            first = _timed(lambda: monitors.after_step(1), device)
            calls, extra = [], []
            for k in range(1, args.calls + 1):
                train_step()  # the weights move between calls, as in training
                calls.append(_timed(lambda: extra.append(monitors.after_step(k * interval)), device))
            call_s = statistics.median(calls)
            parts = {name: [v[tag] for v in extra if tag in v] for name, tag in
                     (("delta bias", tags.DELTA_BIAS_SECONDS), ("Q-K update spectra", tags.QK_UPDATE_SECONDS))}
            results[part] = (call_s, interval)
            note = "".join(f" (of which {name} {statistics.median(t) * 1e3:.1f} ms)" for name, t in parts.items() if t)
            print(f"{part} call: {call_s * 1e3:.1f} ms{note}, every {interval} steps -> "
                  f"{call_s / interval * 1e3:.2f} ms/step = {100 * call_s / interval / step_s:.2f}% of a step "
                  f"(first call, once per run: {first * 1e3:.1f} ms)", flush=True)
        writer.close()
    config.monitor.spectral_interval, config.monitor.probe_interval = (results.get("spectral", (0, 0))[1],
                                                                       results.get("probe", (0, 0))[1])
    amortised = sum(call / interval for call, interval in results.values())
    print(f"all monitors at these intervals: {amortised * 1e3:.2f} ms/step = {100 * amortised / step_s:.2f}% of the "
          f"step time ({step_s * 1e3:.1f} ms)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
