"""Write gluon_boundary.py: kernels/gluon_flash.py with SM-clock stamps at the query-tile boundaries of the
forward's consumers (not in the key-tile loop, which 2026-12-06-trace stamped).

    python docs/device-runs/2026-12-07-boundary/make_boundary_kernel.py

Each consumer warpgroup records, for its first MAX_TILES query tiles, %clock64 at six points (POINTS in
boundary.py) and the tile's key-tile count into BTRACE[program, consumer, tile, point]. Only the default order is
stamped (the cross-tile order, removed after call 1b, never was). A diagnostic copy for device runs, not library code.
"""
from pathlib import Path

here = Path(__file__).parent
src = (here / "../../../kernels/gluon_flash.py").resolve().read_text()


def sub(old, new, count=1):
    global src
    assert src.count(old) == count, (old, src.count(old))
    src = src.replace(old, new)


HELPERS = '''
MAX_TILES = gl.constexpr(32)  # query tiles traced per consumer
N_POINTS = gl.constexpr(7)  # six clock stamps and the tile's key-tile count


@gluon.jit
def _bput(BTRACE, bt, HALF_INDEX: gl.constexpr, point: gl.constexpr, value):
    """value into BTRACE[program, consumer, bt, point] while bt < MAX_TILES."""
    if bt < MAX_TILES:
        lay: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
        slot = ((gl.program_id(0) * 2 + HALF_INDEX) * MAX_TILES + bt) * N_POINTS + point
        gl.store(BTRACE + slot + gl.arange(0, 1, lay), gl.full([1], 0, gl.int64, lay) + value)


@gluon.jit
def _bstamp(BTRACE, bt, HALF_INDEX: gl.constexpr, point: gl.constexpr):
    """%clock64 into BTRACE[program, consumer, bt, point]."""
    lay: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    zero = gl.full([1], 0, gl.int32, lay)
    c = gl.inline_asm_elementwise("mov.u64 $0, %clock64;", "=l,r", [zero], dtype=gl.int64, is_pure=False, pack=1)
    if bt < MAX_TILES:
        slot = ((gl.program_id(0) * 2 + HALF_INDEX) * MAX_TILES + bt) * N_POINTS + point
        gl.store(BTRACE + slot + gl.arange(0, 1, lay), c)


@gluon.jit
def _fwd_consumer('''
sub("\n\n@gluon.jit\ndef _fwd_consumer(", HELPERS)
sub("def _fwd_consumer(q_smem,", "def _fwd_consumer(BTRACE, q_smem,")
sub("    tile_it = 0\n    if DYNAMIC:\n        mbarrier.wait(q_ready.index(HALF_INDEX), 0)",
    "    tile_it = 0\n    bt = 0\n    if DYNAMIC:\n        mbarrier.wait(q_ready.index(HALF_INDEX), 0)")
sub("        rows = start_m + HALF_INDEX * HALF",
    "        _bstamp(BTRACE, bt, HALF_INDEX, 0)\n        _bput(BTRACE, bt, HALF_INDEX, 6, n_tiles)\n"
    "        rows = start_m + HALF_INDEX * HALF")
sub("        scores = warpgroup_mma_wait(0, deps=(s_tok,))\n",
    "        scores = warpgroup_mma_wait(0, deps=(s_tok,))\n        _bstamp(BTRACE, bt, HALF_INDEX, 1)\n")
sub("        p16 = gl.convert_layout(p.to(dtype), p_layout)\n        kv_it += 1\n\n        split",
    "        p16 = gl.convert_layout(p.to(dtype), p_layout)\n        _bstamp(BTRACE, bt, HALF_INDEX, 2)\n"
    "        kv_it += 1\n\n        split")
sub("        pv = warpgroup_mma(p16, v_last, acc, is_async=True)\n",
    "        pv = warpgroup_mma(p16, v_last, acc, is_async=True)\n        _bstamp(BTRACE, bt, HALF_INDEX, 3)\n")
sub("        acc = warpgroup_mma_wait(0, deps=(pv,))\n",
    "        acc = warpgroup_mma_wait(0, deps=(pv,))\n        _bstamp(BTRACE, bt, HALF_INDEX, 4)\n")
sub("        t = _fwd_next_tile(t, tile_it, q_ready, tile_slots, HALF_INDEX, Q_SLOTS, DYNAMIC)\n    if STORE_O32",
    "        _bstamp(BTRACE, bt, HALF_INDEX, 5)\n        bt += 1\n"
    "        t = _fwd_next_tile(t, tile_it, q_ready, tile_slots, HALF_INDEX, Q_SLOTS, DYNAMIC)\n    if STORE_O32")
sub("(_fwd_consumer, (q_smem,", "(_fwd_consumer, (BTRACE, q_smem,", count=2)
sub("def _fwd_kernel(q_desc,", "def _fwd_kernel(BTRACE, q_desc,")
sub("_fwd_kernel[grid](_rows_descriptor(q, half)", "_fwd_kernel[grid](BTRACE_BUF[0], _rows_descriptor(q, half)")
sub("\ndef _forward(q, k, v,",
    "\nBTRACE_BUF = [None]  # set by boundary.py: int64 (programs, 2, MAX_TILES, N_POINTS)\n\n\ndef _forward(q, k, v,")
(here / "gluon_boundary.py").write_text(src)
print("wrote", here / "gluon_boundary.py")
