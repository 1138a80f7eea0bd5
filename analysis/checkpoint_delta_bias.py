"""The delta bias of a trained checkpoint: does real trained attention meet the tie mechanism?

    python -m analysis.checkpoint_delta_bias RUN_DIR_OR_CHECKPOINT [--batches N]
                                             [--modes fa2/none paper/dynamic_max ...] [--device cpu|cuda]
                                             [--out FILE.md]

Loads a checkpoint (a run folder's newest intact one, or the given ``step_XXXXXXXX`` folder; its files' SHA-256 are
verified), builds the model from the run's saved ``config.yaml`` (layout independent: a checkpoint holds the
single-device model's tensors, in whatever shards the layout wrote; this one process reads them whole), and runs
``--batches`` probe batches (the monitors' probe batch: ``monitor.probe_batch_size`` validation windows each,
consecutive windows for later batches) through it in eval mode under the run's autocast and attention. Every layer's
q, k, v and dO are captured (launcher/monitors/capture.py); then, per layer, head and mode, delta_lp - delta_hp =
rowsum(dO * O_mode) - rowsum(dO * O_fp64) on every row, where O_mode is the O that mode's backward uses (emulated
by the reference on CPU, the Triton kernel on CUDA, from the same bf16 q, k, v) and O_fp64 is exact attention.

Printed per layer, head and mode: the mean and RMS of the delta error over all rows, the fraction of rows where it
is positive (0.5: no preferred sign; 0 or 1: one-signed) and the fraction of batches whose mean has the sign of the
overall mean (1: the sign repeats batch after batch, the accumulating case); per layer and head the tie rate
(maximum repeated within eps) and the tile tie rate (repeated inside one tile of the run's numerics, within the
fix's band; see docs/monitoring.md). FP8 FFNs of a run are replaced by their BF16 weights here.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import yaml

from kernels.tie_bias import Mode, default_modes
from kernels.modes import AttentionSettings, tie_tile_keys
from launcher.checkpoint import CheckpointError, CheckpointStore, load_model_weights
from launcher.config import ConfigError, build_config
from launcher.data import eval_offsets, windows
from launcher.monitors.attention_stats import head_stats, kernel_inputs, scores
from kernels.reference import exact_attention
from launcher.monitors.delta_bias import delta_difference, saved_output
from launcher.monitors.capture import capture_model
from launcher.parallel.dims import ParallelDims
from launcher.parallel.materialize import materialize
from launcher.parallel.names import named_parameters
from launcher.parallelize import bind_attention
from launcher.trainer import autocast_factory, build_model, open_data


class InputError(Exception):
    """A path or setting this tool cannot use; the message says what to give instead."""


def find_checkpoint(path: Path) -> tuple[Path, Path]:
    """(run folder, verified checkpoint file) for a run folder or a checkpoint file."""
    if not path.exists():
        raise InputError(f"{path} does not exist; give a run folder (runs/<experiment>/<arm>) or one of its "
                         "checkpoints/step_XXXXXXXX folders")
    if path.is_dir() and path.parent.name != "checkpoints":
        run_dir = path
        checkpoint = CheckpointStore(run_dir).latest()
        if checkpoint is None:
            raise InputError(f"{path} holds no complete checkpoint (checkpoints/step_XXXXXXXX/ with its "
                             "checksums.json); give a run folder trained with checkpoint.interval > 0, or a checkpoint")
    else:
        run_dir, checkpoint = path.resolve().parent.parent, path
        if not path.is_dir() or not checkpoint.name.startswith(("step_", "warning_step_")):
            raise InputError(f"{path} is not a checkpoint: expected <run folder>/checkpoints/step_XXXXXXXX")
    problem = CheckpointStore(run_dir).problem(checkpoint)
    if problem:
        raise InputError(f"checkpoint {checkpoint} fails verification ({problem}); give an intact one")
    if not (run_dir / "config.yaml").is_file():
        raise InputError(f"{run_dir} has no config.yaml: this tool builds the model from the run's saved config")
    return run_dir, checkpoint


def load_model(run_dir: Path, checkpoint: Path, device: torch.device):
    """(config, model on ``device`` with the checkpoint's parameters, in eval mode)."""
    tree = yaml.safe_load((run_dir / "config.yaml").read_text())
    config = build_config(tree, tree.get("run", {}).get("arm"))
    config.precision.fp8_ffn = False  # this looks at attention; BF16 FFNs need no Transformer Engine
    dims = ParallelDims(device=device)
    model, _, _ = build_model(config)
    materialize(named_parameters(model), config.model, model.seed, ParallelDims())  # on the CPU, then read into
    try:
        load_model_weights(checkpoint, model)
    except ConfigError as err:
        raise InputError(str(err)) from None
    bind_attention(model, config, dims)  # one process: of the layout's steps only the attention applies
    return config, model.to(device).eval()


def parse_modes(names: list[str] | None) -> list[Mode]:
    if not names:
        return default_modes()
    modes = []
    for name in names:
        rounding, _, fix = name.partition("/")
        if Mode(rounding, fix) not in default_modes():
            raise InputError(f"--modes: {name!r} is not a mode; use rounding/fix, e.g. "
                             f"{', '.join(m.label for m in default_modes())}")
        modes.append(Mode(rounding, fix))
    return modes


@torch.no_grad()
def measure_checkpoint(path: Path, batches: int = 2, modes: list[Mode] | None = None, device: str | None = None,
                       progress=None) -> dict:
    """Measure the checkpoint (see the module docstring). Returns {'checkpoint', 'config', 'modes', 'delta':
    {(layer, head, label): {'mean', 'rms', 'rows_positive', 'batches_same_sign'}}, 'ties': {(layer, head):
    {'tie_rate', 'tile_tie_rate'}}}."""
    say = progress or (lambda msg: None)
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    modes = modes or default_modes()
    run_dir, checkpoint = find_checkpoint(path)
    say(f"checkpoint {checkpoint} (verified)")
    config, model = load_model(run_dir, checkpoint, dev)
    att = config.attention
    paper_block_keys = att.paper_block_keys
    tile = tie_tile_keys(att.rounding, paper_block_keys)
    backend = "triton" if dev.type == "cuda" else "reference"
    data = open_data(config, ParallelDims(device=dev))
    size, seq_len = config.monitor.probe_batch_size, config.data.seq_len
    offsets = eval_offsets(len(data.val), seq_len, batches * size)
    autocast = autocast_factory(config, dev)
    layers = list(range(config.model.n_layer))
    diffs: dict[tuple[int, str], list[torch.Tensor]] = {}
    tie_parts: dict[int, list[dict]] = {i: [] for i in layers}
    for b in range(batches):
        t0 = time.time()
        batch = tuple(t.to(dev) for t in windows(data.val, offsets[b * size:(b + 1) * size], seq_len))
        with torch.enable_grad():
            captured = capture_model(model, batch, autocast, layers)
        for i in layers:
            cap = captured.layers[i]
            qi, ki, vi = (kernel_inputs(t, "reference") for t in (cap.q, cap.k, cap.v))
            o_exact, _ = exact_attention(qi, ki, vi, causal=True)
            tie_parts[i].append(head_stats(scores(qi, ki, att.rounding), att.eps, tile))
            for mode in modes:
                settings = AttentionSettings(rounding=mode.rounding, fix=mode.fix, beta=att.beta, eps=att.eps,
                                             paper_block_keys=paper_block_keys, backend=backend)
                o_saved = saved_output(cap.q, cap.k, cap.v, cap.o, backend, settings)
                diffs.setdefault((i, mode.label), []).append(delta_difference(cap.d_out, o_saved, o_exact).cpu())
        say(f"[batch {b + 1}/{batches}] {len(layers)} layers x {len(modes)} modes: {time.time() - t0:.1f} s "
            f"(loss {captured.loss:.3f})")
    delta = {}
    for (i, label), parts in diffs.items():
        per_batch = torch.stack(parts)  # (batches, B, H, T)
        for h in range(per_batch.shape[2]):
            rows = per_batch[:, :, h]
            mean = rows.mean()
            batch_means = rows.flatten(1).mean(1)
            delta[(i, h, label)] = {
                "mean": mean.item(), "rms": rows.square().mean().sqrt().item(),
                "rows_positive": (rows > 0).double().mean().item(),
                "batches_same_sign": (torch.sign(batch_means) == torch.sign(mean)).double().mean().item(),
            }
    ties = {}
    for i, parts in tie_parts.items():
        for stat in ("tie_rate", "tile_tie_rate"):
            per_head = torch.stack([p[stat] for p in parts]).mean(0)
            for h, value in enumerate(per_head.tolist()):
                ties.setdefault((i, h), {})[stat] = value
    return {"checkpoint": checkpoint, "config": config, "modes": modes, "batches": batches, "tile": tile,
            "backend": backend, "delta": delta, "ties": ties}


def to_markdown(result: dict) -> str:
    config = result["config"]
    att = config.attention
    lines = [f"Delta bias of the trained layers of {result['checkpoint']} (run numerics {att.rounding}/{att.fix}, "
             f"emulated by the {result['backend']} backend), {result['batches']} batch(es) x "
             f"{config.monitor.probe_batch_size} x {config.data.seq_len} tokens.", "",
             "Delta error delta_lp - delta_hp per row against fp64: mean, RMS, fraction of rows positive, fraction "
             "of batches whose mean has the overall mean's sign.", "",
             "| layer | head | mode | mean | RMS | rows > 0 | batches same sign |", "|---|---|---|---|---|---|---|"]
    for (i, h, label), r in sorted(result["delta"].items(), key=lambda kv: kv[0]):
        lines.append(f"| {i} | {h} | {label} | {r['mean']:+.3e} | {r['rms']:.3e} | {r['rows_positive']:.3f} | "
                     f"{r['batches_same_sign']:.2f} |")
    tile = result["tile"] or "row"
    lines += ["", f"Tie rates (maximum repeated within eps = {att.eps:g}; tile: repeated inside one {tile}-key "
              "tile within the fix's band):", "", "| layer | head | tie rate | tile tie rate |", "|---|---|---|---|"]
    for (i, h), r in sorted(result["ties"].items()):
        lines.append(f"| {i} | {h} | {r['tie_rate']:.4f} | {r['tile_tie_rate']:.4f} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m analysis.checkpoint_delta_bias",
                                     description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("path", type=Path, help="run folder (its newest intact checkpoint) or a checkpoint file")
    parser.add_argument("--batches", type=int, default=2, help="probe batches (default 2)")
    parser.add_argument("--modes", nargs="+", default=None, metavar="ROUNDING/FIX",
                        help="modes to emulate (default: every rounding x fix)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default=None, help="default: cuda when present")
    parser.add_argument("--out", type=Path, default=None, help="also write the markdown tables to this file")
    args = parser.parse_args(argv)
    if args.batches < 1:
        parser.error("--batches must be >= 1")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device here; leave --device out or use cpu")
    if args.out is not None and not args.out.resolve().parent.is_dir():
        parser.error(f"--out: folder {args.out.resolve().parent} does not exist")
    progress = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    try:
        result = measure_checkpoint(args.path, args.batches, parse_modes(args.modes), args.device, progress)
    except (InputError, CheckpointError, ConfigError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    table = to_markdown(result)
    print(table)
    if args.out is not None:
        args.out.write_text(table)
        print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
