"""Write gluon_trace.py: kernels/gluon_flash.py with SM-clock stamps in the forward consumers' key-tile loop.

    python docs/device-runs/2026-12-06-trace/make_trace_kernel.py

Each consumer warpgroup records, for its first MAX_IT key tiles, %clock64 at five points of an iteration (start;
K and V ready; Q K^T done; PV done; P_bar converted) into TRACE[program, consumer, key tile, point]. A diagnostic
copy for one device run, not library code.
"""
from pathlib import Path

here = Path(__file__).parent
src = (here / "../../../kernels/gluon_flash.py").resolve().read_text()


def sub(old, new, count=1):
    global src
    assert src.count(old) == count, (old, src.count(old))
    src = src.replace(old, new)


STAMP = '''
MAX_IT = gl.constexpr(96)  # key tiles traced per consumer


@gluon.jit
def _stamp(TRACE, slot, point: gl.constexpr):
    """%clock64 into TRACE[slot * 5 + point] (slot < 0: not traced)."""
    if slot >= 0:
        lay: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
        zero = gl.full([1], 0, gl.int32, lay)
        c = gl.inline_asm_elementwise("mov.u64 $0, %clock64;", "=l,r", [zero], dtype=gl.int64, is_pure=False, pack=1)
        gl.store(TRACE + slot * 5 + point + gl.arange(0, 1, lay), c)


@gluon.jit
def _slot(kv_it, HALF_INDEX: gl.constexpr):
    s = (gl.program_id(0) * 2 + HALF_INDEX) * MAX_IT + kv_it
    return gl.where(kv_it < MAX_IT, s, -1)


@gluon.jit
def _fwd_tile_range('''
sub("\n\n@gluon.jit\ndef _fwd_tile_range(", STAMP)
# thread TRACE through the loop
sub("def _fwd_tile_range(acc, m_i,", "def _fwd_tile_range(TRACE, acc, m_i,")
sub("""        stage = kv_it % STAGES
        prev = (kv_it - 1) % STAGES
        mbarrier.wait(k_bars.index(stage), (kv_it // STAGES) & 1)
        mbarrier.wait(v_bars.index(prev), ((kv_it - 1) // STAGES) & 1)
""", """        slot = _slot(kv_it, HALF_INDEX)
        _stamp(TRACE, slot, 0)
        stage = kv_it % STAGES
        prev = (kv_it - 1) % STAGES
        mbarrier.wait(k_bars.index(stage), (kv_it // STAGES) & 1)
        mbarrier.wait(v_bars.index(prev), ((kv_it - 1) // STAGES) & 1)
        _stamp(TRACE, slot, 1)
""")
sub("""        scores = warpgroup_mma_wait(1, deps=(s_tok,))  # Q K^T done; the PV product may still run
""", """        scores = warpgroup_mma_wait(1, deps=(s_tok,))  # Q K^T done; the PV product may still run
        _stamp(TRACE, slot, 2)
""")
sub("""        acc, p = warpgroup_mma_wait(0, deps=(acc, p))
        mbarrier.arrive(v_empty.index(prev), count=1)
        p16 = gl.convert_layout(p.to(dtype), p_layout)
        kv_it += 1
""", """        acc, p = warpgroup_mma_wait(0, deps=(acc, p))
        _stamp(TRACE, slot, 3)
        mbarrier.arrive(v_empty.index(prev), count=1)
        p16 = gl.convert_layout(p.to(dtype), p_layout)
        _stamp(TRACE, slot, 4)
        kv_it += 1
""")
sub("_fwd_tile_range(\n            acc, m_i,", "_fwd_tile_range(\n            TRACE, acc, m_i,", count=2)
sub("def _fwd_consumer(q_smem,", "def _fwd_consumer(TRACE, q_smem,")
sub("(_fwd_consumer, (q_smem,", "(_fwd_consumer, (TRACE, q_smem,", count=2)
sub("def _fwd_kernel(q_desc,", "def _fwd_kernel(TRACE, q_desc,")
sub("_fwd_kernel[grid](_rows_descriptor(q, half)", "_fwd_kernel[grid](TRACE_BUF[0], _rows_descriptor(q, half)")
sub("\ndef _forward(q, k, v,", "\nTRACE_BUF = [None]  # set by the probe: int64 tensor (programs, 2, MAX_IT, 5)\n\n\ndef _forward(q, k, v,")
(here / "gluon_trace.py").write_text(src)
print("wrote", here / "gluon_trace.py")
