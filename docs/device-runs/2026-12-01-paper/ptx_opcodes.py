"""sm_90 PTX of the forward kernel, compiled on the CPU machine (no GPU needed), for a before/after comparison.

    python docs/device-runs/2026-12-01-paper/ptx_opcodes.py <tree> <label>

<tree>: the repository whose kernels/ is compiled; <label>: a name for the output files. Compiles fa2 and paper,
fix none and dynamic_max, head_dim 64, 64 x 64 tiles, 4 warps, 3 stages; prints the number of PTX instructions and
a hash, and writes /tmp/ptx_<label>_<paper>_<fix>.ptx. The paper-speed session compared two trees' files by their
sorted opcode counts (`grep -E '^\s+[a-z]' FILE | awk '{print $1}' | sort | uniq -c`).
"""
import sys, hashlib, re
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
sys.path.insert(0, sys.argv[1])
from kernels import triton_flash as tf
target = GPUTarget("cuda", 90, 32)
fn = tf._fwd_kernel
sig = {}
for name in fn.arg_names:
    sig[name] = "i32"
for name in ("Q", "K", "V", "O"):
    sig[name] = "*bf16"
for name in ("O32", "LSE"):
    sig[name] = "*fp32"
sig["KEYS"] = "*i64"
for name in ("score_scale", "exp_scale", "shift_scale", "beta", "eps_cmp"):
    sig[name] = "fp32"
for paper, fix in ((False, 0), (True, 0), (False, 1), (True, 1)):
    consts = dict(HEAD_DIM=64, BLOCK_M=64, BLOCK_N=64, CAUSAL=True, PAPER=paper, PAPER_TILE=512 if paper else 0,
                  FIX=fix, IS_BF16=True, EXPLICIT=False, STORE_O32=False)
    if "SCALE_POW2" in fn.arg_names:
        consts["SCALE_POW2"] = paper
    for k in consts: sig[k] = "constexpr"
    src = ASTSource(fn, sig, constexprs={(fn.arg_names.index(k),): v for k, v in consts.items()})
    ptx = triton.compile(src, target=target, options=dict(num_warps=4, num_stages=3)).asm["ptx"]
    body = "\n".join(l for l in ptx.splitlines() if not l.strip().startswith(("//", ".file", ".loc", "$L__")) )
    body = re.sub(r"\.loc.*", "", body)
    n = sum(1 for l in body.splitlines() if l.strip().endswith(";"))
    print(paper, fix, n, hashlib.sha1(body.encode()).hexdigest()[:12])
    open(f"/tmp/ptx_{sys.argv[2]}_{int(paper)}_{fix}.ptx", "w").write(ptx)
