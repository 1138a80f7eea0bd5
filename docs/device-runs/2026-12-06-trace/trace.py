"""Where the Gluon forward's key-tile loop spends its time, from SM-clock stamps (device run 2026-12-06).

    python docs/device-runs/2026-12-06-trace/make_trace_kernel.py      # writes gluon_trace.py (done before the call)
    PYTHONPATH=. python docs/device-runs/2026-12-06-trace/trace.py run --out DIR [--shapes 4,16,4096,128 ...]
    PYTHONPATH=. python docs/device-runs/2026-12-06-trace/trace.py show DIR/*.pt

run: for each shape and variant (VARIANTS: module attributes of kernels.gluon_flash, set in the stamped copy too),
the forward's CUDA-graph GPU time with and without the stamps (what the stamps cost), then one stamped forward
whose trace goes to DIR. Calls 1-2 ran it with the variants (ping-pong, PV wait held) of commit 49345bb: ptxas's
wait, the held wait, the held wait with ping-pong (`call2_run.log`); the variants now are those of call 3.
show: per consumer and key tile, the clock cycles of each phase, the step from one key tile to the next, the
steps that cross a query-tile boundary, and the lag between the two consumers.
"""
import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
VARIANTS = {"1 Q slot": {"FWD_Q_SLOTS": 1}, "2 Q slots": {"FWD_Q_SLOTS": 2},
            "2 Q slots cross-tile": {"FWD_Q_SLOTS": 2, "FWD_CROSS_TILE": True}}
POINTS = ("start", "K,V ready", "QK done", "softmax+PV done", "P converted")


def run(args):
    import triton

    import gluon_trace as gt
    from kernels import gluon_flash as gf
    from kernels.modes import AttentionSettings

    args.out.mkdir(parents=True, exist_ok=True)
    for shape in args.shapes:
        b, h, t, d = (int(x) for x in shape.split(","))
        torch.manual_seed(0)
        q, k, v = (torch.randn(b, t, h, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2) for _ in range(3))
        nm = AttentionSettings(causal=True, fix="none").numerics(d, q.dtype)
        programs = min(triton.cdiv(t, gf.FWD_BLOCK_M) * b * h, gf._programs(q.device, gf.FWD_PERSISTENT))
        buf = torch.zeros(programs, 2, gt.MAX_IT.value, 5, dtype=torch.int64, device="cuda")
        ref = gf._forward(q, k, v, True, nm)[0]
        for variant, values in VARIANTS.items():
            saved = {key: getattr(gf, key) for key in values}
            for key, value in values.items():
                setattr(gf, key, value)
                setattr(gt, key, value)
            name = f"{shape} {variant}"
            gt.TRACE_BUF[0] = buf
            times = {label: triton.testing.do_bench_cudagraph(fn, rep=args.rep) * 1e3
                     for label, fn in (("plain", lambda: gf._forward(q, k, v, True, nm)),
                                       ("stamped", lambda: gt._forward(q, k, v, True, nm)))}
            buf.zero_()
            out = gt._forward(q, k, v, True, nm)[0]
            torch.cuda.synchronize()
            same = torch.equal(out, ref) and torch.equal(gf._forward(q, k, v, True, nm)[0], ref)
            print(f"{name}: forward {times['plain']:.0f} us, stamped {times['stamped']:.0f} us; O bit-equal to "
                  f"the first variant's: {same}", flush=True)
            torch.save({"shape": shape, "variant": name, "trace": buf.cpu(), "times": times},
                       args.out / f"trace_{shape.replace(',', 'x')}_{variant.replace(' ', '_')}.pt")
            for key, value in saved.items():
                setattr(gf, key, value)
                setattr(gt, key, value)


def forward(shape):
    from kernels import gluon_flash as gf
    from kernels.modes import AttentionSettings

    b, h, t, d = (int(x) for x in shape.split(","))
    q, k, v = (torch.randn(b, t, h, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2) for _ in range(3))
    nm = AttentionSettings(causal=True, fix="none").numerics(d, q.dtype)
    for _ in range(3):
        gf._forward(q, k, v, True, nm)
    torch.cuda.synchronize()


def show(paths):
    for path in paths:
        rec = torch.load(path)
        tr = rec["trace"].double()  # (programs, 2, MAX_IT, 5)
        done = tr[..., 4] > 0
        print(f"\n== {rec['variant']}: forward {rec['times']['plain']:.0f} us "
              f"(stamped {rec['times']['stamped']:.0f})")
        # phases per key tile (cycles): wait for K/V, Q K^T (from ready to done), softmax + PV, conversion, and the
        # step from one tile's start to the next one's
        phase = torch.stack([tr[..., i + 1] - tr[..., i] for i in range(4)], -1)
        ok = done
        names = ("K/V wait", "issue+QK", "softmax+PV", "convert")
        for i, n in enumerate(names):
            x = phase[..., i][ok]
            print(f"  {n:12s} median {x.median():7.0f}  p10 {x.quantile(0.1):7.0f}  p90 {x.quantile(0.9):7.0f}")
        # consecutive stamped key tiles: one apart (a step inside a query tile) or two apart (across a query-tile
        # boundary: the last PV product, the epilogue, the next Q and the next tile's first key tile, unstamped)
        steps, cross, span = [], [], 0.0
        for p in range(tr.shape[0]):
            for c in range(2):
                idx = torch.nonzero(done[p, c])[:, 0]
                gaps = idx[1:] - idx[:-1]
                dt = tr[p, c, idx[1:], 0] - tr[p, c, idx[:-1], 0]
                steps.append(dt[gaps == 1])
                cross.append(dt[gaps == 2])
                span += float(dt.sum())
        s, cross = torch.cat(steps), torch.cat(cross)
        # each consumer's time from its first traced key tile to its last, split by the kind of gap
        print(f"  share of the consumers' traced span: in-tile steps {100 * s.sum() / span:.0f}%, crossings "
              f"{100 * cross.sum() / span:.0f}% (of which beyond two in-tile steps each: "
              f"{100 * (cross.sum() - 2 * s.median() * len(cross)) / span:.0f}%), longer gaps "
              f"{100 * (span - s.sum() - cross.sum()) / span:.0f}% (query tiles with fewer than two key tiles)")
        print(f"  {'step':12s} median {s.median():7.0f}  p10 {s.quantile(0.1):7.0f}  p90 {s.quantile(0.9):7.0f}")
        if len(cross):
            print(f"  {'boundary':12s} median {cross.median():7.0f}  p10 {cross.quantile(0.1):7.0f}  p90 "
                  f"{cross.quantile(0.9):7.0f}  ({len(cross)} crossings; from the last key tile of a query tile to "
                  "the second of the next)")
        # relative phase of the two consumers: consumer 1's start minus consumer 0's, per key tile, as a fraction
        # of the step (0: lockstep; 0.5: alternating)
        both = done[:, 0] & done[:, 1]
        lag = (tr[:, 1, :, 0] - tr[:, 0, :, 0])[both]
        med = s.median()
        frac = (lag / med).remainder(1.0)
        frac = torch.minimum(frac, 1 - frac)
        hist = torch.histc(frac, bins=5, min=0, max=0.5)
        print(f"  consumer lag / step (0 = lockstep, 0.5 = alternating): median {frac.median():.2f}; "
              f"histogram over [0, 0.5] in 5 bins: {hist.int().tolist()}")
        # one program's first 12 key tiles, both consumers, relative to its first stamp
        p = 0
        t0 = tr[p, :, :, 0][done[p]].min()
        for c in range(2):
            rows = [" ".join(f"{int(v - t0):6d}" for v in tr[p, c, j]) for j in torch.nonzero(done[p, c])[:12, 0]]
            print(f"  program 0 consumer {c} ({', '.join(POINTS)}):")
            for r in rows:
                print("    " + r)


def main():
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--out", type=Path, required=True)
    r.add_argument("--shapes", nargs="+", default=["4,16,4096,128", "8,12,1024,64"])
    r.add_argument("--rep", type=int, default=40)
    f = sub.add_parser("forward", help="three plain forwards at one shape (for Nsight Compute)")
    f.add_argument("shape")
    s = sub.add_parser("show")
    s.add_argument("paths", nargs="+")
    args = parser.parse_args()
    if args.cmd == "run":
        run(args)
    elif args.cmd == "forward":
        forward(args.shape)
    else:
        show(args.paths)


if __name__ == "__main__":
    main()
