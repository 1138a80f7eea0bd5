"""What the forward's epilogue costs, part by part (issue 31, 2026-12-07 boundary, call 2). The stamped boundary
(call 1b) put a quarter of the consumers' time in the epilogue (O = acc / l, the bf16 O store, the FP32 O by TMA,
the LSE store): ~9,200 cycles per query tile at (4,16,2048,128), ~3 key tiles' work. This script writes copies of
kernels/gluon_flash.py with parts of the epilogue removed (their outputs are wrong: timing only, never library
code) and times each copy's forward against the intact kernel, fa2/none and fp32_output.

    PYTHONPATH=. python docs/device-runs/2026-12-07-boundary/epilogue.py [--shapes 4,16,2048,128 8,12,1024,64]
"""
import argparse
import importlib.util
from pathlib import Path

import torch
import triton

from kernels import gluon_flash as gf
from kernels.modes import AttentionSettings

SOURCE = Path(gf.__file__).read_text()
DIVIDE = "        o = gl.div_rn(acc, l_o[:, None])\n"
O_STORE = "        gl.store(O + o_off, o_out.to(O.dtype.element_ty), mask=row_ok)\n"
LSE_STORE = "    gl.store(LSE + bh * T + rows, lse, mask=rows < T)\n"
REMOVED = {  # copy name -> (line of the epilogue, its stand-in)
    "no division": [(DIVIDE, "        o = acc\n")],
    "no O store": [(O_STORE, "        pass\n")],
    "no LSE store": [(LSE_STORE, "    pass\n")],
    "none of the three": [(DIVIDE, "        o = acc\n"), (O_STORE, "        pass\n"), (LSE_STORE, "    pass\n")],
}


def copy_without(name, parts, folder):
    src = SOURCE
    for old, new in parts:
        assert src.count(old) == 1, (name, old)
        src = src.replace(old, new)
    path = folder / f"gluon_epi_{name.replace(' ', '_').replace(',', '')}.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", nargs="+", default=["4,16,2048,128", "8,12,1024,64"])
    p.add_argument("--rep", type=int, default=20)
    p.add_argument("--folder", type=Path, default=Path("/tmp/epilogue_copies"))
    args = p.parse_args()
    args.folder.mkdir(parents=True, exist_ok=True)
    copies = {"intact": gf, **{name: copy_without(name, parts, args.folder) for name, parts in REMOVED.items()}}
    print("| B,H,T,D | fix | copy | forward us | saved us | saved of intact |", flush=True)
    print("|---|---|---|---|---|---|", flush=True)
    for shape in args.shapes:
        b, h, t, d = (int(x) for x in shape.split(","))
        torch.manual_seed(0)
        q, k, v = (torch.randn(b, t, h, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2) for _ in range(3))
        for fix in ("none", "fp32_output"):
            nm = AttentionSettings(causal=True, fix=fix).numerics(d, q.dtype)
            intact = None
            for name, module in copies.items():
                try:
                    module._forward(q, k, v, True, nm)
                    us = triton.testing.do_bench_cudagraph(lambda: module._forward(q, k, v, True, nm), rep=args.rep,
                                                           return_mode="median") * 1e3
                except Exception as exc:  # a copy that fails to build costs only its own row
                    print(f"| {shape} | {fix} | {name} | ERR {type(exc).__name__}: {str(exc)[:150]} | | |", flush=True)
                    continue
                intact = intact or us
                print(f"| {shape} | {fix} | {name} | {us:.1f} | {intact - us:.1f} | {(intact - us) / intact:.1%} |",
                      flush=True)


if __name__ == "__main__":
    main()
