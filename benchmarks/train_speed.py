"""Training throughput of this recipe's trainer against a minimal nanoGPT-style trainer of the same shape, in one
process on whatever device is present.

    python -m benchmarks.train_speed RECIPE [section.field=value ...] [--arm NAME] [--steps 12] [--skip 4]
                                     [--baselines flash,cudnn] [--no-compile-baseline] [--also "OVERRIDES"]
                                     [--profile DIR] [--json FILE]

Both sides train the recipe's model shape (layers, width, heads, vocabulary, context) on the same global batch, with
the same micro-batches, BF16 autocast on a GPU, FP32 weights and fused AdamW:

- ``recipe``: ``launcher.trainer.Trainer`` for the recipe's arm exactly as a run builds it (attention backend and
  numerics, ``run.compile``, FP8 FFNs, its guard), without evaluation, monitors or checkpoints; one
  ``Trainer.train_step`` per optimizer step.
- ``sdpa_<backend>``: a plain GPT written here (fused QKV, ``scaled_dot_product_attention`` restricted to one SDPA
  backend, tied embeddings, pre-LN, tanh-GELU), compiled with ``torch.compile`` unless ``--no-compile-baseline``:
  what a user of a nanoGPT-style trainer runs today.
- ``te``: the same GPT built from Transformer Engine layers, what a Megatron/TE user runs today: LayerNormLinear
  QKV and Linear projection in BF16, ``DotProductAttention`` on TE's fused (cuDNN) backend, and ``LayerNormMLP`` in
  FP8 with the recipe's scaling recipe (``precision.fp8_recipe``) when ``precision.fp8_ffn`` is on, else BF16.
  Eager (TE's modules are not meant for torch.compile); GPU only.

Reported per side: tokens/s (median over the steps after the first ``--skip``), MFU against the device's dense BF16
peak (same FLOPs per token for both sides: 6N + 12 L d T), and the ratio to the first baseline. On a CPU use the
``math`` baseline (the fast SDPA backends need a GPU); CPU numbers say nothing about GPUs.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from launcher.config import ConfigError, arm_names, build_config, load_recipe
from launcher.metrics import peak_tflops
from launcher.parallel.dims import ParallelDims

SDPA_BACKENDS = {"flash": "FLASH_ATTENTION", "cudnn": "CUDNN_ATTENTION", "efficient": "EFFICIENT_ATTENTION",
                 "math": "MATH"}
BASELINES = (*SDPA_BACKENDS, "te")


class _Block(nn.Module):
    def __init__(self, d: int, heads: int, backend: str | None):
        super().__init__()
        self.heads, self.backend = heads, backend
        self.ln1, self.ln2 = nn.LayerNorm(d, bias=False), nn.LayerNorm(d, bias=False)
        self.qkv, self.proj = nn.Linear(d, 3 * d, bias=False), nn.Linear(d, d, bias=False)
        self.fc, self.out = nn.Linear(d, 4 * d, bias=False), nn.Linear(4 * d, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        if self.backend is None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:  # inside the compiled code: a backend chosen around the compiled call does not reach the graph
            with sdpa_kernel(getattr(SDPBackend, SDPA_BACKENDS[self.backend])):
                y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))


class _TEBlock(nn.Module):
    """One block of Transformer Engine layers (the ``te`` baseline): attention in BF16 through TE's fused
    attention, the LayerNorm + MLP in FP8 under ``te.autocast`` when ``recipe`` is given."""

    def __init__(self, d: int, heads: int, recipe):
        super().__init__()
        import transformer_engine.pytorch as te

        self.te, self.heads, self.recipe = te, heads, recipe
        self.qkv = te.LayerNormLinear(d, 3 * d, bias=False, params_dtype=torch.float32)
        self.attn = te.DotProductAttention(heads, d // heads, attn_mask_type="causal", qkv_format="bshd")
        self.proj = te.Linear(d, d, bias=False, params_dtype=torch.float32)
        self.mlp = te.LayerNormMLP(d, 4 * d, bias=False, activation="gelu", params_dtype=torch.float32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        x = x + self.proj(self.attn(q, k, v))
        with self.te.autocast(enabled=self.recipe is not None, recipe=self.recipe):
            return x + self.mlp(x)


class MinimalGPT(nn.Module):
    """The baseline: nanoGPT's structure in a few lines (no dropout, no biases, tied embeddings). ``backend`` "te":
    Transformer Engine blocks (``_TEBlock``, FP8 MLPs with ``fp8_recipe``), else SDPA blocks on that backend."""

    def __init__(self, vocab: int, context: int, layers: int, heads: int, d: int, backend: str | None = None,
                 fp8_recipe=None):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(context, d)
        if backend == "te":
            self.blocks = nn.ModuleList(_TEBlock(d, heads, fp8_recipe) for _ in range(layers))
        else:
            self.blocks = nn.ModuleList(_Block(d, heads, backend) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d, bias=False)
        for p in self.parameters():
            if p.dim() > 1:
                nn.init.normal_(p, std=0.02)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        logits = F.linear(self.ln_f(x), self.tok.weight)
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# Kernel-name patterns of the profile's categories, first match wins (lower-case substrings).
CATEGORIES = [
    ("attention: SDPA flash / cuDNN", ("flash_fwd", "flash_bwd", "fmha", "cudnn", "sdpa")),
    ("attention: this project's kernels (Triton, Gluon)", ("_fwd_kernel", "_bwd_delta", "_bwd_dkdv_kernel",
                                                           "_bwd_dq_kernel", "_bwd_dq_finish", "_bwd_kernel")),
    ("matmuls (cuBLAS / CUTLASS / TE)", ("gemm", "nvjet", "xmma", "cutlass", "cublas", "sm90_", "fp8")),
    ("optimizer (fused AdamW, clipping)", ("adam", "multi_tensor", "foreach", "norm_kernel")),
    ("fused elementwise, norms, losses (Inductor Triton)", ("triton_",)),
    ("copies and fills", ("memcpy", "memset", "copy", "fill")),
]


def _category(name: str) -> str:
    low = name.lower()
    for label, patterns in CATEGORIES:
        if any(p in low for p in patterns):
            return label
    return "other kernels (aten elementwise, reductions, ...)"


def kernel_times(prof, on_gpu: bool) -> dict[str, tuple[float, int]]:
    """{kernel name: (us of GPU time, launches)} of a finished torch.profiler run; on a CPU (``on_gpu`` False) the
    "kernels" are the ops' own CPU time (a smoke test of the same path)."""
    kernels: dict[str, tuple[float, int]] = {}
    for evt in prof.key_averages():
        if evt.device_type != (torch.autograd.DeviceType.CUDA if on_gpu else torch.autograd.DeviceType.CPU):
            continue
        us = evt.self_device_time_total if on_gpu else evt.self_cpu_time_total
        if us > 0:
            kernels[evt.key] = (kernels.get(evt.key, (0.0, 0))[0] + us, evt.count)
    return kernels


def profile_step(step, step_index: int, device: torch.device, out_dir: Path | None, side: str) -> dict:
    """Kernel time of one step by category (torch.profiler; one CUDA stream, so busy = the kernels' sum), the
    step's wall time and the GPU's idle share; the top kernels go to out_dir/<side>_kernels.md."""
    from torch.profiler import ProfilerActivity, profile

    _sync(device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        step(step_index)
        _sync(device)
        wall_us = (time.perf_counter() - start) * 1e6
    kernels = kernel_times(prof, on_gpu=device.type == "cuda")
    busy = sum(us for us, _ in kernels.values())
    by_category: dict[str, float] = {}
    for name, (us, _) in kernels.items():
        by_category[_category(name)] = by_category.get(_category(name), 0.0) + us
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        top = sorted(kernels.items(), key=lambda kv: -kv[1][0])[:40]
        lines = [f"Top kernels of one step, {side} (torch.profiler; us of GPU time, share of the step's kernel time)",
                 "", "| kernel | calls | us | share | category |", "|---|---|---|---|---|"]
        lines += [f"| `{name[:110]}` | {n} | {us:,.0f} | {100 * us / busy:.1f}% | {_category(name)} |"
                  for name, (us, n) in top]
        (out_dir / f"{re.sub(r'[^A-Za-z0-9_.-]+', '_', side)}_kernels.md").write_text("\n".join(lines) + "\n")
    return {"wall_us": wall_us, "busy_us": busy, "categories": by_category}


def _median_tokens_per_s(step, steps: int, skip: int, tokens: int, device: torch.device,
                         profile_to: Path | None = None, side: str = "") -> float | tuple[float, dict]:
    times = []
    for i in range(steps):
        _sync(device)
        start = time.perf_counter()
        step(i)
        _sync(device)
        times.append(time.perf_counter() - start)
        print(f"  step {i + 1}/{steps}: {times[-1]:.3f} s", flush=True)
    rate = tokens / statistics.median(times[skip:])
    if profile_to is None:
        return rate
    return rate, profile_step(step, steps, device, profile_to, side)


def time_recipe(config, steps: int, skip: int, device: torch.device, profile_to: Path | None = None,
                side: str = "recipe"):
    from launcher.trainer import Trainer

    trainer = Trainer(config, ParallelDims(device=device))
    try:
        return _median_tokens_per_s(trainer.train_step, steps, skip,
                                    config.data.global_batch_size * config.data.seq_len, device, profile_to, side)
    finally:
        trainer.engine.close()
        if trainer.lock is not None:
            trainer.lock.release()


def time_baseline(config, backend: str, compile_model: bool, steps: int, skip: int, device: torch.device,
                  profile_to: Path | None = None):
    m, data = config.model, config.data
    torch.manual_seed(config.run.seed)
    fp8_recipe = None
    if backend == "te":
        fp8_recipe = _te_baseline_setup(config, device)
        compile_model = False
    with device if backend == "te" else contextlib.nullcontext():  # TE's modules allocate on the current device
        model = MinimalGPT(m.vocab_size, m.max_seq_len, m.n_layer, m.n_head, m.d_model, backend, fp8_recipe)
    model = model.to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.optim.lr, fused=device.type == "cuda")
    forward = torch.compile(model) if compile_model else model
    accumulation = data.global_batch_size // data.micro_batch_size
    shape = (data.micro_batch_size, data.seq_len)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")

    def step(_):
        for _ in range(accumulation):
            x = torch.randint(0, m.vocab_size, shape, device=device)  # the costs do not depend on the tokens
            with autocast:
                loss = forward(x, torch.roll(x, -1, 1))
            (loss / accumulation).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), config.optim.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return _median_tokens_per_s(step, steps, skip, data.global_batch_size * data.seq_len, device, profile_to,
                                _side_name(backend))


def _side_name(backend: str) -> str:
    return "te" if backend == "te" else f"sdpa_{backend}"


def _te_baseline_setup(config, device: torch.device):
    """Checks for the ``te`` baseline and its FP8 scaling recipe (None: BF16 MLPs). TE's attention is pinned to its
    fused (cuDNN) backend, the one it picks on Hopper when the flash-attn package is absent."""
    import os

    from launcher.fp8 import make_recipe

    if device.type != "cuda":
        raise ConfigError("--baselines te runs Transformer Engine, which needs a CUDA GPU; leave it out on a CPU")
    try:
        import transformer_engine.pytorch  # noqa: F401
    except (ImportError, OSError) as err:
        raise ConfigError(f"--baselines te needs Transformer Engine ({type(err).__name__}: {err}); install the "
                          "'gpu' extra") from None
    os.environ.setdefault("NVTE_FLASH_ATTN", "0")
    os.environ.setdefault("NVTE_FUSED_ATTN", "1")
    return make_recipe(config.precision) if config.precision.fp8_ffn else None


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.train_speed", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("recipe")
    parser.add_argument("overrides", nargs="*")
    parser.add_argument("--arm", help="the recipe's arm (default: its first)")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--skip", type=int, default=4, help="first steps left out of the median (compilation)")
    parser.add_argument("--baselines", default="flash,cudnn",
                        help=f"comma-separated: SDPA backends ({', '.join(SDPA_BACKENDS)}) and/or te (Transformer "
                             "Engine layers, GPU)")
    parser.add_argument("--no-compile-baseline", action="store_true", help="run the baseline eagerly")
    parser.add_argument("--also", action="append", default=[], metavar="OVERRIDES",
                        help="time the recipe again with these extra overrides (space-separated section.field=value); "
                             "repeatable, one row each")
    parser.add_argument("--profile", metavar="DIR",
                        help="after the timed steps, profile one more step of every side: kernel time by category "
                             "(printed) and each side's top kernels (DIR/<side>_kernels.md)")
    parser.add_argument("--json", help="also write the rows to this file")
    args = parser.parse_intermixed_args(argv)
    profile_to = Path(args.profile) if args.profile else None
    baselines = [b for b in args.baselines.split(",") if b]
    unknown = [b for b in baselines if b not in BASELINES]
    if unknown or not baselines or args.steps <= args.skip:
        parser.error(f"--baselines takes one or more of {', '.join(BASELINES)} (got {args.baselines!r}), and "
                     f"--steps must exceed --skip")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    with tempfile.TemporaryDirectory() as tmp:
        quiet = ["eval.interval=0", "monitor.spectral_interval=0", "monitor.probe_interval=0",
                 "checkpoint.enabled=false", f"run.out_dir={tmp}", f"run.max_steps={args.steps + 1}",
                 "run.log_interval=1000000"]
        try:
            variants = []  # (row name, config) of every recipe row
            for extra in ["", *args.also]:
                tree = load_recipe(args.recipe, [*args.overrides, *extra.split(), *quiet])
                variants.append((f"recipe {extra}".strip(), build_config(tree, args.arm or arm_names(tree)[0])))
            config = variants[0][1]
            if config.model.vocab_size == 0:
                raise ConfigError("set model.vocab_size (the baseline needs it before any data is opened)")
        except ConfigError as err:
            print(f"error: {err}", file=sys.stderr)
            return 2
        baseline_rows, recipe_rows = [], []

        def row(side, result):
            rate, prof = result if profile_to is not None else (result, None)
            return {"side": side, "tokens_per_s": rate, **({"profile": prof} if prof else {})}

        for backend in baselines:
            compiled = not args.no_compile_baseline and backend != "te"
            print(f"[train_speed] {_side_name(backend)} (compile={compiled})", flush=True)
            try:
                result = time_baseline(config, backend, compiled, args.steps, args.skip, device, profile_to)
            except ConfigError as err:
                print(f"error: {err}", file=sys.stderr)
                return 2
            baseline_rows.append(row(_side_name(backend), result))
        for name, variant in variants:
            print(f"[train_speed] {name} ({args.recipe}, arm {variant.run.arm}): attention "
                  f"{variant.attention.backend} {variant.attention.numerics}, compile={variant.run.compile}, "
                  f"fp8_ffn={variant.precision.fp8_ffn}", flush=True)
            recipe_rows.append(row(name, time_recipe(variant, args.steps, args.skip, device, profile_to, name)))
        rows = recipe_rows + baseline_rows
    flops = _flops_per_token(config)
    peak = peak_tflops(config.run.peak_tflops, device)
    reference = baseline_rows[0]["tokens_per_s"]
    print(f"\n{config.model.n_layer} x {config.model.d_model}, {config.model.n_head} heads, context "
          f"{config.data.seq_len}, {config.data.global_batch_size} sequences per step, micro-batch "
          f"{config.data.micro_batch_size}, on {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'CPU'}")
    print(f"| side | tokens/s | MFU | vs {baseline_rows[0]['side']} |\n|---|---|---|---|")
    for row in rows:
        row["mfu"] = row["tokens_per_s"] * flops / (peak * 1e12) if peak else math.nan
        row["ratio"] = row["tokens_per_s"] / reference
        print(f"| {row['side']} | {row['tokens_per_s']:,.0f} | {100 * row['mfu']:.1f}% | {row['ratio']:.3f} |")
    if profile_to is not None:
        print(profile_table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps({"recipe": args.recipe, "overrides": args.overrides,
                                               "device": str(device), "rows": rows}, indent=1))
    return 0


def profile_table(rows) -> str:
    """Milliseconds of GPU time per step by kernel category, one column per side, plus wall time and GPU idle."""
    labels = [label for label, _ in CATEGORIES] + ["other kernels (aten elementwise, reductions, ...)"]
    sides = [r for r in rows if "profile" in r]
    lines = ["", "One profiled step per side (torch.profiler), ms of GPU time by kernel category:", "",
             "| category | " + " | ".join(r["side"] for r in sides) + " |", "|---|" + "---|" * len(sides)]
    for label in labels:
        values = [r["profile"]["categories"].get(label, 0.0) / 1e3 for r in sides]
        if any(values):
            lines.append(f"| {label} | " + " | ".join(f"{v:.1f}" for v in values) + " |")
    lines.append("| **all kernels (GPU busy)** | " + " | ".join(f"{r['profile']['busy_us'] / 1e3:.1f}" for r in sides)
                 + " |")
    lines.append("| step wall time | " + " | ".join(f"{r['profile']['wall_us'] / 1e3:.1f}" for r in sides) + " |")
    lines.append("| GPU idle share | " + " | ".join(
        f"{100 * max(0.0, 1 - r['profile']['busy_us'] / r['profile']['wall_us']):.1f}%" for r in sides) + " |")
    return "\n".join(lines)


def _flops_per_token(config) -> float:
    """Training FLOPs per token as the trainer counts them for its MFU (model.GPT.flops_per_token), computed on the
    meta device so that no memory is allocated."""
    from model import GPT

    with torch.device("meta"):
        return GPT(config.model).flops_per_token(config.data.seq_len)


if __name__ == "__main__":
    sys.exit(main())
