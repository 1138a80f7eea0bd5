"""Compile the Gluon Hopper kernels for sm_90 without a GPU: the PTX and machine code a GPU would run.

    python -m kernels.offline_compile [--quick] [--out DIR]

CI runs it (tests/integration/test_offline_compile.py) under whatever Triton pyproject.toml lets pip install, so a
release that changes Gluon's API fails there rather than on a user's first GPU run; developers use it to read the
instruction mix (wgmma, TMA copies, register reallocation, spills) before spending device time. Triton compiles to
PTX and runs the ptxas of its wheel, so the whole chain runs on a CPU machine. One line per kernel configuration (the
ones kernels.gluon_flash launches: forward with fix none, fp32_output (the FP32 O from the accumulator) and
stochastic_output (the Triton kernel's hash helpers called from Gluon) with the tile counter, fix none also with the
static schedule, fp32_output also with the other number of Q slots per consumer (``FWD_Q_SLOTS``), with the other
division of O (``FWD_ROW_DIVIDE``) and with the other start of consumer 1 (``FWD_LAG``), none and fp32_output with the
other way of storing O (``FWD_O_TMA``), backward with both dQ orders, each also with the other way of writing a tile's
first dQ share (``BWD_DQ_FIRST_STORE``, ``BWD_ATOMIC_FIRST_STORE``), the ordered one with the other way of writing dK
and dV (``BWD_DKV_TMA``) and of finishing dQ (``BWD_DQ_FINISH``, also behind the atomic dQ's stored first share),
head_dim 64 and 128; ``--quick``: one configuration of each code path, what CI compiles) with its PTX instruction
counts; exit status 1 if one does not compile. For each forward it also reads the machine code (the wheel's
``nvdisasm``) and prints the fewest softmax exponentials that run while a tile's PV product is in flight (between the
wait for Q K^T and the wait for PV, over the key-tile loops): a tile's full count (64 per thread) means the softmax
overlaps the product. Every line counts the machine code's spill stores (``STL``: values ptxas could not keep in
registers; PTX cannot show them). Each line ends with ptxas's performance messages for that kernel (the wheel's ptxas
run again with ``-v``), e.g. C7518 when ptxas serialises the asynchronous products of a loop.

The arguments come from kernels.gluon_flash's own launch helpers (``_fwd_launch``, ``_bwd_launch``, which its GPU
calls use), given CPU tensors, so this also runs the host side of every launch; it then drives Triton's own launch
path up to the compile call (binding, specialisation, options): there is no public API for compiling a kernel for
another machine's GPU.
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
import time
from pathlib import Path

import torch

TARGET = ("cuda", 90, 32)  # backend, compute capability (sm_90: H100, H200), warp size
COUNTED = ("wgmma.mma_async", "cp.async.bulk.tensor", "setmaxnreg", "mbarrier.try_wait", "atom.global", "ld.local")


def compile_for_target(fn, args: tuple, kwargs: dict, target=None):
    """Compile the JIT function ``fn`` (Triton or Gluon) for ``target`` (default sm_90) as a launch with these
    arguments would, without launching it."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature

    target = target or GPUTarget(*TARGET)
    backend = make_backend(target)
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound, specialization, options)
    if fn.is_gluon():
        from triton.experimental.gluon._runtime import GluonASTSource as Source
    else:
        from triton.compiler.compiler import ASTSource as Source
    return triton.compile(Source(fn, signature, constexprs, attrs), target=target, options=options.__dict__)


QUICK = ("forward d128 fp32_output", "forward d64 stochastic_output", "forward d128 none static schedule",
         "backward d128 deterministic", "backward d64 atomic dQ", "backward d128 deterministic dQ finished",
         "backward d64 atomic dQ first store dQ finished")


def configurations(quick: bool = False):
    """(name, kernel, args, kwargs) of the launches kernels.gluon_flash makes, built by its own launch helpers
    (``_fwd_launch``, ``_bwd_launch``: the arguments a GPU call passes) on CPU tensors of the model's layout
    ((B, T, H, D) seen as (B, H, T, D)), T a multiple of 4 (the backward's TMA row vectors) and not of the tiles."""
    from kernels import gluon_flash as gf
    from kernels import triton_flash
    from kernels.modes import AttentionSettings

    out = []
    b, h, t = 2, 4, 1000
    for dim in gf.GLUON_HEAD_DIMS:
        q, k, v, d_out = (torch.empty(b, t, h, dim, dtype=torch.bfloat16).transpose(1, 2) for _ in range(4))
        # none, fp32_output, stochastic_output as launched for a long sequence (the module's defaults; 16 programs
        # for 64 tiles: the tile counter); fix none also with the static schedule (a program per tile: short
        # sequences, small batches); fp32_output also with each choice built but not the default: the other Q-slot
        # count, the other division of O, the other start of consumer 1; none and fp32_output with the other way of
        # storing O
        default = dict(DYNAMIC=gf.FWD_DYNAMIC, Q_SLOTS=gf.FWD_Q_SLOTS, ROW_DIVIDE=gf.FWD_ROW_DIVIDE,
                       O_TMA=gf.FWD_O_TMA, LAG=gf.FWD_LAG)
        variants = (("none", {}), ("fp32_output", {}), ("stochastic_output", {}),
                    ("none", dict(DYNAMIC=not gf.FWD_DYNAMIC)), ("fp32_output", dict(Q_SLOTS=3 - gf.FWD_Q_SLOTS)),
                    ("fp32_output", dict(ROW_DIVIDE=not gf.FWD_ROW_DIVIDE)), ("none", dict(O_TMA=not gf.FWD_O_TMA)),
                    ("fp32_output", dict(O_TMA=not gf.FWD_O_TMA)), ("fp32_output", dict(LAG=not gf.FWD_LAG)))
        words = dict(DYNAMIC=("static schedule", "dynamic schedule"), ROW_DIVIDE=("element divide", "row divide"),
                     O_TMA=("O stored", "O by TMA"), LAG=("consumers together", "consumer 1 lagging"))
        for fix, changed in variants:
            nm = AttentionSettings(fix=fix).numerics(dim, torch.bfloat16)
            o, lse, o32 = triton_flash._forward_outputs(q, nm.keeps_fp32_output)
            keys = triton_flash._keys_arg(nm, None, b, q.device)
            _, args, kwargs = gf._fwd_launch(q, k, v, o, lse, o32, keys, True, nm, programs=16, **changed)
            # the name says what differs from the defaults, in the order the choices were added
            choice = {**default, **changed}
            extra = "".join(f" {choice[key]} Q slots" if key == "Q_SLOTS" else f" {words[key][choice[key]]}"
                            for key in default if choice[key] != default[key])
            out.append((f"forward d{dim} {fix}{extra}", gf._fwd_kernel, args, kwargs))
        nm = AttentionSettings().numerics(dim, torch.bfloat16)
        lse, delta = torch.empty(b, h, t), torch.empty(b, h, t)
        dq, dk, dv = triton_flash._backward_outputs(q, k, v)
        # both dQ orders as launched, and each with the other way of writing a tile's first dQ share (and the
        # ordered one with the other way of writing dK and dV, and of finishing dQ, also behind the atomic dQ's
        # stored first share)
        bwd_words = dict(first_store=("first add", "first store"), dkv_tma=("dK dV stored", "dK dV by TMA"),
                         finish=("dQ finish launch", "dQ finished"))
        for deterministic, changed in (
                (True, {}), (False, {}), (True, dict(first_store=not gf.BWD_DQ_FIRST_STORE)),
                (False, dict(first_store=not gf.BWD_ATOMIC_FIRST_STORE)), (True, dict(dkv_tma=not gf.BWD_DKV_TMA)),
                (True, dict(finish=not gf.BWD_DQ_FINISH)), (False, dict(first_store=True, finish=not gf.BWD_DQ_FINISH))):
            _, args, kwargs, _ = gf._bwd_launch(d_out, q, k, v, lse, delta, dq, dk, dv, True, nm, deterministic,
                                                **changed)
            extra = "".join(f" {bwd_words[key][value]}" for key, value in changed.items())
            out.append((f"backward d{dim} {'deterministic' if deterministic else 'atomic dQ'}{extra}", gf._bwd_kernel,
                        args, kwargs))
    return [c for c in out if c[0] in QUICK] if quick else out


def exponentials_under_pv(sass: str) -> list[int]:
    """For each wait for a PV product in the machine code (``WARPGROUP.DEPBAR.LE gsb0, 0x0`` that follows a
    ``... 0x1``, the wait for Q K^T with PV still running), the number of ``MUFU.EX2`` between the two: the
    exponentials that overlap the product. An empty list: no such pair (no pipelined loop)."""
    counts, inside = [], None
    for line in sass.splitlines():
        if "WARPGROUP.DEPBAR.LE" in line:
            if line.rstrip(" ;").endswith("0x1"):
                inside = 0
            elif inside is not None:
                counts.append(inside)
                inside = None
        elif inside is not None and "MUFU.EX2" in line:
            inside += 1
    return counts


def ptxas_performance_messages(ptx: str, workdir: Path) -> list[str]:
    """ptxas's "Potential Performance Loss" and injected-wait messages for this PTX (sm_90a, ``-v``): Triton runs
    ptxas without showing them. Each message shortened to its code and reason. The ptxas is the one Triton compiled
    with (Triton 3.9 uses its wheel's newer ``ptxas-blackwell`` for sm_90 too; the older ``ptxas`` beside it rejects
    its PTX version, and reading that failure as "no messages" hid the messages until 2026-12-06)."""
    import subprocess

    from triton.backends.nvidia.compiler import get_ptxas

    (workdir / "kernel.ptx").write_text(ptx)
    proc = subprocess.run([get_ptxas(TARGET[1]).path, "-arch=sm_90a", "-v", str(workdir / "kernel.ptx"), "-o",
                           str(workdir / "ptxas.cubin")], capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"ptxas -v failed: {proc.stderr.strip()[-300:]}")
    found = re.findall(r"\((C75\d\d)\) ([^\n]*?)(?: in (?:the )?function|$)", proc.stderr, flags=re.M)
    return [f"{code} {reason.strip()}" for code, reason in found]


def disassemble(cubin: bytes, workdir: Path) -> str:
    """The SASS of a cubin by the ``nvdisasm`` that ships in Triton's wheel."""
    import subprocess

    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "nvdisasm"
    path = workdir / "kernel.cubin"
    path.write_bytes(cubin)
    return subprocess.run([str(tool), "-c", str(path)], capture_output=True, text=True, check=True).stdout


def failure_reason(exc: BaseException) -> str:
    """One line for a failed configuration: the innermost cause (Triton wraps an error in a kernel's helper in one
    CompilationError per call site, each ending in the source line's caret)."""
    while exc.__cause__ is not None:
        exc = exc.__cause__
    lines = [line.strip() for line in str(exc).splitlines() if line.strip() and set(line.strip()) != {"^"}]
    return f"{type(exc).__name__}: {(lines[-1] if lines else '')[:300]}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kernels.offline_compile", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="one configuration per code path (CI)")
    parser.add_argument("--out", type=Path, default=None,
                        help="also write each configuration's PTX and disassembly (.ptx, .sass) into this folder")
    args = parser.parse_args(argv)
    import triton

    try:
        configs = configurations(args.quick)
    except ImportError as exc:  # a Triton without Gluon's Hopper module
        print(f"offline_compile: this Triton ({triton.__version__}) cannot import the Gluon kernels: {exc}",
              file=sys.stderr)
        return 1
    print(f"triton {triton.__version__}, target sm_{TARGET[1]}: {len(configs)} kernel configurations", flush=True)
    failed = 0
    for name, fn, fn_args, kwargs in configs:
        t0 = time.perf_counter()
        try:
            compiled = compile_for_target(fn, fn_args, kwargs)
            ptx = compiled.asm["ptx"]
            counts = ", ".join(f"{op} {len(re.findall(re.escape(op), ptx))}" for op in COUNTED)
            with tempfile.TemporaryDirectory() as tmp:
                sass = disassemble(compiled.asm["cubin"], Path(tmp))
                # registers ptxas could not hold (PTX has no local memory of its own: ld.local counts 0 even then)
                counts += f"; spill stores {len(re.findall(r'STL[. ]', sass))}"
                if name.startswith("forward"):
                    under = exponentials_under_pv(sass)
                    counts += (f"; exponentials under a PV product: min {min(under, default=0)} over {len(under)} "
                               "loops")
                messages = ptxas_performance_messages(ptx, Path(tmp))
        except Exception as exc:  # report every configuration, not only the first that fails
            failed += 1
            print(f"FAILED  {name}: {failure_reason(exc)}", flush=True)
            continue
        counts += "; ptxas: " + ("; ".join(messages) if messages else "no performance messages")
        print(f"ok      {name} ({time.perf_counter() - t0:.1f} s): {counts}", flush=True)
        if args.out:
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / (name.replace(" ", "_") + ".ptx")).write_text(ptx)
            (args.out / (name.replace(" ", "_") + ".sass")).write_text(sass)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
