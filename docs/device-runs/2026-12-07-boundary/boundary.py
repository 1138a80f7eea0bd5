"""Where the Gluon forward's time goes between query tiles, from SM-clock stamps (device run 2026-12-07).

    python docs/device-runs/2026-12-07-boundary/make_boundary_kernel.py    # writes gluon_boundary.py
    PYTHONPATH=. python docs/device-runs/2026-12-07-boundary/boundary.py run --out DIR [--shapes 4,16,2048,128 ...]
    PYTHONPATH=. python docs/device-runs/2026-12-07-boundary/boundary.py show DIR/*.pt

The 2026-12-06 trace (``../2026-12-06-trace``) stamped the key-tile loop and found each step from one query tile's
last key tile to the next tile's second one five to six loop steps long; preloading Q (two Q slots) and issuing
the next tile's first Q K^T before the epilogue did not shorten it. This run stamps the boundary itself, per
consumer and query tile (POINTS), in the default kernel (one Q slot, not cross-tile) and with O divided by one
reciprocal per row (``FWD_ROW_DIVIDE``: the element-wise division is 64 serial blocks of machine code per thread
at head_dim 128), with fix none and fp32_output (which also stores the FP32 O).

run: per shape and fix, the forward's CUDA-graph GPU time with and without the stamps, then one stamped forward
whose stamps go to DIR (its O must equal the plain kernel's). show: the cycles of each phase (median over tiles)
and each phase's share of the consumers' time.
"""
import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
DEFAULT = {"FWD_ROW_DIVIDE": False}
VARIANTS = {"element divide": {}, "row divide": {"FWD_ROW_DIVIDE": True}}  # module attributes of kernels.gluon_flash
POINTS = ("tile start", "key tile 0 Q K^T done", "key tile 0 P converted", "last PV issued", "last PV done",
          "epilogue done")
PHASES = (  # (name, from point, to point); "next" runs from this tile's epilogue to the next tile's start
    ("Q, K0 wait + Q K^T of key tile 0", 0, 1),
    ("softmax of key tile 0", 1, 2),
    ("key-tile loop (tiles 1..n-1)", 2, 3),
    ("last PV product", 3, 4),
    ("epilogue (O, LSE, FP32 O)", 4, 5),
)


def run(args):
    import triton

    import gluon_boundary as gbd
    from kernels import gluon_flash as gf
    from kernels.modes import AttentionSettings

    args.out.mkdir(parents=True, exist_ok=True)
    for shape in args.shapes:
        b, h, t, d = (int(x) for x in shape.split(","))
        torch.manual_seed(0)
        q, k, v = (torch.randn(b, t, h, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2) for _ in range(3))
        programs = min(triton.cdiv(t, gf.FWD_BLOCK_M) * b * h, gf._programs(q.device, gf.FWD_PERSISTENT))
        buf = torch.zeros(programs, 2, gbd.MAX_TILES.value, gbd.N_POINTS.value, dtype=torch.int64, device="cuda")
        gbd.BTRACE_BUF[0] = buf
        for fix in args.fixes:
            nm = AttentionSettings(causal=True, fix=fix).numerics(d, q.dtype)
            base = gf._forward(q, k, v, True, nm)
            for variant, values in VARIANTS.items():
                for module in (gf, gbd):
                    for key, value in {**DEFAULT, **values}.items():
                        setattr(module, key, value)
                times = {label: triton.testing.do_bench_cudagraph(fn, rep=args.rep) * 1e3
                         for label, fn in (("plain", lambda: gf._forward(q, k, v, True, nm)),
                                           ("stamped", lambda: gbd._forward(q, k, v, True, nm)))}
                buf.zero_()
                out = gbd._forward(q, k, v, True, nm)
                torch.cuda.synchronize()
                same = all(torch.equal(x, y) for x, y in zip(out, base))
                same = same and all(torch.equal(x, y) for x, y in zip(gf._forward(q, k, v, True, nm), base))
                name = f"{fix} {variant}"
                print(f"{shape} {name}: forward {times['plain']:.0f} us, stamped {times['stamped']:.0f} us; "
                      f"outputs bit-equal to the default kernel's: {same}", flush=True)
                torch.save({"shape": shape, "fix": name, "trace": buf.cpu(), "times": times, "same": same},
                           args.out / f"boundary_{shape.replace(',', 'x')}_{fix}_{variant.replace(' ', '_')}.pt")
            for module in (gf, gbd):
                for key, value in DEFAULT.items():
                    setattr(module, key, value)


def show(paths):
    for path in paths:
        rec = torch.load(path)
        tr = rec["trace"].double()  # (programs, 2, MAX_TILES, 7): six stamps, key tiles
        done = (tr[..., :6] > 0).all(-1)
        print(f"\n== {rec['shape']} {rec['fix']}: forward {rec['times']['plain']:.0f} us (stamped "
              f"{rec['times']['stamped']:.0f}); bit-equal {rec['same']}")
        n_tiles = tr[..., 6]
        totals = {}
        for name, a, z in PHASES:
            x = (tr[..., z] - tr[..., a])[done]
            totals[name] = x.sum()
            extra = ""
            if a == 2:
                many = done & (n_tiles > 1)
                per = ((tr[..., 3] - tr[..., 2]) / (n_tiles - 1).clamp(min=1))[many]
                extra = f"   per key tile: median {per.median():6.0f}"
            print(f"  {name:36s} median {x.median():7.0f}  p10 {x.quantile(0.1):7.0f}  p90 "
                  f"{x.quantile(0.9):7.0f}{extra}")
        nxt = tr[:, :, 1:, 0] - tr[:, :, :-1, 5]
        both = done[:, :, 1:] & done[:, :, :-1]
        x = nxt[both]
        totals["next tile (index, Q)"] = x.sum()
        print(f"  {'next tile (index, Q)':36s} median {x.median():7.0f}  p10 {x.quantile(0.1):7.0f}  p90 "
              f"{x.quantile(0.9):7.0f}")
        whole = sum(totals.values())
        shares = ", ".join(f"{name.split(' (')[0]} {100 * v / whole:.0f}%" for name, v in totals.items())
        print(f"  share of the consumers' traced time: {shares}")
        print(f"  key tiles per query tile: mean {n_tiles[done].mean():.1f}; traced tiles {int(done.sum())}")


def main():
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--out", type=Path, required=True)
    r.add_argument("--shapes", nargs="+", default=["4,16,2048,128", "8,12,1024,64"])
    r.add_argument("--fixes", nargs="+", default=["none", "fp32_output"])
    r.add_argument("--rep", type=int, default=25)
    s = sub.add_parser("show")
    s.add_argument("paths", nargs="+")
    args = parser.parse_args()
    run(args) if args.cmd == "run" else show(args.paths)


if __name__ == "__main__":
    main()
