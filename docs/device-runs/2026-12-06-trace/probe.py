"""Device probe of kernels/gluon_flash.py, 2026-12-06 (trace session). Call 2: the forward's PV wait held after
the softmax (``FWD_PIN_PV_WAIT``, removed after it) against ptxas's placement ("gluon ptxas-wait"); call 3
(prepared, not run): two Q slots per consumer ("gluon 2 Q slots", ``FWD_Q_SLOTS = 2``) against one; each next to
SDPA cuDNN, in one run. Copied from docs/device-runs/2026-12-06-d64/probe.py; VARIANTS set module attributes of
kernels.gluon_flash.

    PYTHONPATH=. python docs/device-runs/2026-12-06-trace/probe.py check [--deterministic]
    PYTHONPATH=. python docs/device-runs/2026-12-06-trace/probe.py time [--shapes 8,12,1024,64 ...]

check: every case's O, LSE and gradients against fp64 (the same bf16 inputs), next to the Triton kernel's errors
(fixed tiles), the reference with the Gluon key tile (block_n=128), NaN-filled outputs (an element no launch writes
shows up), and, with --deterministic, two backward runs compared bit for bit.
time: CUDA-graph GPU time (triton.testing.do_bench_cudagraph, median, us) of the forward and of fwd+bwd: fa2/none
and fa2/fp32_output, each Gluon variant, the Triton kernel and SDPA cuDNN, both dQ orders.
"""
import argparse
import sys

import torch
import triton

import kernels
from kernels import gluon_flash as gf
from kernels.modes import AttentionSettings
from tests.attention_common import fp64_out_and_grads, rel_err

NAN = float("nan")


def gluon(q, k, v, causal=True, fix="none", deterministic=True, fill=None):
    """The Gluon kernel by name (kernels.attention with backend=gluon). Calls 1-4 of this session ran an earlier
    form of this function that called kernels.gluon_flash's launches through an autograd.Function of its own, before
    the kernel was wired into kernels.attention; the launches are the same."""
    settings = AttentionSettings(causal=causal, fix=fix, backend="gluon", deterministic=deterministic, out_fill=fill)
    return kernels.attention(q, k, v, settings)


def grads_of(fn, q, k, v, d_out, **kw):
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out = fn(*leaves, **kw)
    out.backward(d_out)
    return out.detach(), [t.grad for t in leaves]


CASES = [  # (B, H, H_kv, T, D, causal, dtype)
    (2, 4, 2, 1000, 64, True, torch.bfloat16),
    (2, 4, 4, 1024, 128, True, torch.bfloat16),
    (1, 4, 1, 777, 128, False, torch.bfloat16),
    (3, 2, 2, 100, 64, True, torch.bfloat16),
    (2, 4, 4, 512, 64, True, torch.float16),
    (1, 2, 2, 2304, 128, True, torch.bfloat16),
    (3, 6, 2, 2085, 128, True, torch.bfloat16),  # more tiles (306) than programs: the dynamic schedule
    (8, 12, 12, 1024, 64, True, torch.bfloat16),
    (1, 4, 1, 777, 64, False, torch.bfloat16),  # head_dim 64 without the causal mask
    (2, 3, 3, 200, 64, True, torch.bfloat16),
    (3, 6, 2, 2085, 64, True, torch.bfloat16),  # more tiles than programs at head_dim 64
]


def check(deterministic: bool) -> int:
    """Every case against fp64 next to the Triton kernel (see the module docstring)."""
    bad = 0
    for (b, h, hk, t, d, causal, dtype) in CASES:
        for fix in ("none", "fp32_output", "stochastic_output"):
            if fix == "stochastic_output" and dtype != torch.bfloat16:
                continue
            torch.manual_seed(t + d)
            q = torch.randn(b, t, h, d, device="cuda").to(dtype).transpose(1, 2)  # the model's layout
            k, v = (torch.randn(b, t, hk, d, device="cuda").to(dtype).transpose(1, 2) for _ in range(2))
            d_out = torch.randn(b, h, t, d, device="cuda").to(dtype)
            name = f"{b},{h}/{hk},{t},{d} {'causal' if causal else 'full'} {str(dtype)[6:]} {fix}"
            try:
                out, g = grads_of(gluon, q, k, v, d_out, causal=causal, fix=fix, deterministic=deterministic,
                                  fill=NAN)
                tout, tg = grads_of(kernels.flash_attention, q, k, v, d_out, causal=causal, fix=fix, autotune=False)
                ex_out, ex_g = fp64_out_and_grads(q, k, v, d_out, causal)
                ref = kernels.reference_attention(q, k, v, causal, "fa2", fix, block_n=128)
                finite = bool(torch.isfinite(out).all()) and all(bool(torch.isfinite(x).all()) for x in g)
                e_out, te_out = rel_err(out, ex_out), rel_err(tout, ex_out)
                e_g = [rel_err(x, y) for x, y in zip(g, ex_g)]
                te_g = [rel_err(x, y) for x, y in zip(tg, ex_g)]
                differ = (out != ref).float().mean().item()
                ok = finite and e_out < 1.5 * te_out + 1e-4 and all(a < 1.5 * b_ + 1e-4 for a, b_ in zip(e_g, te_g))
                line = (f"{'ok ' if ok else 'BAD'} {name}: finite={finite} O err {e_out:.2e} (triton {te_out:.2e}), "
                        f"differs from ref(128) {differ:.3f}, grads q/k/v err "
                        + " ".join(f"{a:.2e}({b_:.2e})" for a, b_ in zip(e_g, te_g)))
                if deterministic:
                    _, g2 = grads_of(gluon, q, k, v, d_out, causal=causal, fix=fix, deterministic=True)
                    same = all(torch.equal(x, y) for x, y in zip(g, g2))
                    line += f" repeat-bit-equal={same}"
                    ok = ok and same
                bad += not ok
                print(line, flush=True)
            except Exception as exc:  # keep going: one broken case should not hide the others
                bad += 1
                print(f"ERR {name}: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
    print(f"check(deterministic={deterministic}): {bad} bad", flush=True)
    return 1 if bad else 0


VARIANTS = {  # name -> kernels.gluon_flash attributes set while timing (the default is the file's)
    "gluon": {},
    # call 2 (commit of the held PV wait): "gluon ptxas-wait": {"FWD_PIN_PV_WAIT": False}
    "gluon 2 Q slots": {"FWD_Q_SLOTS": 2},  # built for call 3 (not run: no device time left); default 1
}


class settings:
    def __init__(self, values):
        self.values, self.saved = values, {}

    def __enter__(self):
        for key, value in self.values.items():
            self.saved[key] = getattr(gf, key)
            setattr(gf, key, value)

    def __exit__(self, *exc):
        for key, value in self.saved.items():
            setattr(gf, key, value)


def time_shapes(shapes, rep, only=None) -> None:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def cudnn(q, k, v):
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)

    impls = [("sdpa-cudnn", cudnn, {})]
    for fix in ("none", "fp32_output"):
        for det in (True, False):
            tag = "det" if det else "atomic"
            impls.append((f"triton {fix} {tag}",
                          lambda q, k, v, fix=fix, det=det: kernels.flash_attention(q, k, v, True, "fa2", fix,
                                                                                    deterministic=det), {}))
            for variant, values in VARIANTS.items():
                impls.append((f"{variant} {fix} {tag}",
                              lambda q, k, v, fix=fix, det=det: gluon(q, k, v, True, fix, det), values))
    print("| B,H,T,D | impl | fwd us | fwd+bwd us | fwd / cuDNN | fwd+bwd / cuDNN |", flush=True)
    print("|---|---|---|---|---|---|", flush=True)
    for shape in shapes:
        b, h, t, d = shape
        base = None
        for name, fn, values in impls:
            if (only and name != "sdpa-cudnn"
                                                       and not any(o in name for o in only)):
                continue
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            q, k, v = (torch.randn(b, t, h, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2).requires_grad_()
                       for _ in range(3))  # fresh tensors: nothing of the last capture stays alive
            d_out = torch.randn(b, h, t, d, device="cuda", dtype=torch.bfloat16)
            try:
                with settings(values):
                    def fwd():
                        with torch.no_grad():
                            fn(q, k, v)

                    def both():
                        return torch.autograd.grad(fn(q, k, v), (q, k, v), d_out)

                    both()
                    fwd()
                    t_f = triton.testing.do_bench_cudagraph(fwd, rep=rep, return_mode="median") * 1e3
                    t_b = triton.testing.do_bench_cudagraph(both, rep=rep, return_mode="median") * 1e3
                if base is None:
                    base = (t_f, t_b)
                print(f"| {b},{h},{t},{d} | {name} | {t_f:.0f} | {t_b:.0f} | {base[0] / t_f:.2f} | "
                      f"{base[1] / t_b:.2f} |", flush=True)
            except Exception as exc:
                print(f"| {b},{h},{t},{d} | {name} | ERR {type(exc).__name__}: {str(exc)[:200]} | | | |", flush=True)
            del q, k, v, d_out


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("what", choices=["check", "time"])
    p.add_argument("--deterministic", action="store_true")
    p.add_argument("--shapes", nargs="+", default=["8,12,1024,64", "4,16,2048,128", "4,16,4096,128"])
    p.add_argument("--rep", type=int, default=50)
    p.add_argument("--only", nargs="+", default=None, help="time only the impls whose names contain one of these")
    a = p.parse_args()
    print(f"torch {torch.__version__} triton {triton.__version__} {torch.cuda.get_device_name()}", flush=True)
    if a.what == "check":
        return check(a.deterministic)
    time_shapes([tuple(int(x) for x in s.split(",")) for s in a.shapes], a.rep, a.only)
    return 0


if __name__ == "__main__":
    sys.exit(main())
