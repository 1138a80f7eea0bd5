import torch, triton
from kernels import triton_flash as tf
from benchmarks import attention_tiles as at
shape = (4, 16, 4096, 128)
for tma in (True, False):
    tf.set_tma(tma)
    launches, nm = at.prepare(shape, "fa2/none", autotune=False)
    dq = launches["dq"]
    print("tma", tma, "descriptor args:", [type(t).__name__ for t in dq.tensors[1:3]], flush=True)
    for st in (3, 2):
        cfg = dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=st)
        dq.with_config(cfg)
        ms = triton.testing.do_bench_cudagraph(lambda: dq.with_config(cfg), rep=10, return_mode="median")
        print(f"tma={tma} 128x64 w8 s{st}: {ms*1e3:.1f} us", flush=True)
