"""Hopper (sm_90) flash attention in Gluon: warp-specialised forward, fused backward, rounding=fa2 numerics.

Gluon (``triton.experimental.gluon``) is Triton's tile-level language: layouts, shared memory, TMA, mbarriers,
asynchronous ``wgmma`` and warp specialisation are written out instead of left to the compiler. This file uses
them the way FA3 does on Hopper (Shah et al., "FlashAttention-3", arXiv 2407.08608):

- forward: persistent, one CTA per SM, each taking tiles of 128 query rows of one head from a global counter as it
  finishes one (heaviest causal blocks first, in sections of heads whose K and V fit in L2). A 1-warp producer
  partition streams K and V tiles by TMA through a ring of shared-memory stages; two 4-warp consumer warpgroups own
  64 query rows each and take the stages in turn, and stage their share of O in shared memory for a TMA store
  (FA3's epilogue). Inside a consumer the next tile's Q K^T is issued before this
  tile's softmax (FA3's order); in the machine code ptxas waits for the running PV product before the softmax's
  exponentials, so the softmax overlaps the other warpgroup's products, not its own (holding the wait back was
  measured no faster: docs/attention-kernel.md, Speed);
- backward (``_bwd_kernel``): one CTA per key tile of one k/v head; K and V are loaded once, Q, dO (TMA) and
  LSE, delta stream past; 5 matrix products per tile pair, P^T and dS^T kept in registers as the A operand of
  dV and dK, dS^T staged in shared memory for dQ's share, which the compute warps hand (while dK's product of the
  tile still runs) through shared memory to a writer warp that adds it into an FP32 buffer with one TMA
  reduce-add, in a fixed order per query tile (``deterministic``) or as tiles finish (FA3's dQ writer).

Numerics are rounding=fa2's exactly as ``kernels.reference`` states them (FP32 scores, the maximum taken on the raw
q.k, P_bar = exp2((q.k - m) * scale*log2(e)), bf16 P for the PV product, FP32 accumulator, one final rounding),
for the fixes that only change the forward's epilogue or the delta: none, fp32_output, stochastic_output and the
delta-error stress (``delta_gain``, ``delta_sign``). The dynamic-maximum fixes and rounding=paper keep the Triton
kernel (``supports`` says why). The order of FP32 sums follows the tiles (128 keys here, 64 in the reference and
the Triton kernel's fixed configuration), so results agree with the reference to FP32 rounding of the sums, not
bit for bit; tests/gpu compare them with a tolerance derived from that order.

Gluon's API moved between the Triton releases this project allows (3.6 to 3.9); the few names that changed are
resolved once below (``_tma_load``, ``_tma_store``, ``_tma_reduce_add``). ``kernels.offline_compile`` compiles these kernels for sm_90 without a GPU
(CI checks that they still compile under its Triton).
"""

from __future__ import annotations

import torch
import triton
from triton._C.libtriton import ir
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language._core import builtin
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                               warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from kernels import triton_flash
from kernels.modes import GLUON_AUTO_HEAD_DIMS, GLUON_FIXES, GLUON_HEAD_DIMS, FIX_CODE, AttentionSettings, Numerics
from kernels.triton_flash import _row_hash, _sr_bf16

# Names that moved between the Triton releases pyproject.toml allows: the TMA load and store (3.8's async_load and
# async_store; before them async_copy_global_to_shared and async_copy_shared_to_global, which 3.9 keeps only to
# raise an error) and the barrier of a partition's warps (3.6's thread_barrier, 3.7's barrier)
_tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
_tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global
_barrier = getattr(gl, "barrier", None) or gl.thread_barrier


@builtin
def _tma_reduce_add_op(tensor_desc, coord, src, _semantic=None):
    """A TMA reduce-add of a shared-memory tile into global memory (``cp.reduce.async.bulk.tensor ... .add``).
    Gluon names it ``tma.async_atomic_add`` in Triton 3.8 and 3.9; the operation it builds (``ttng.async_tma_reduce``)
    and the builder call are already in 3.6 and 3.7, which this reaches directly."""
    coord = _semantic._convert_to_ir_values(coord, require_i64=False)
    _semantic.builder.create_async_tma_reduce(ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle, coord, src.handle)


_tma_reduce_add = getattr(tma, "async_atomic_add", None) or _tma_reduce_add_op


@builtin
def _smem_reinterpret(smem, dtype, shape, layout, _semantic=None):
    """The same shared-memory bytes seen with another dtype, shape and layout (``reinterpret`` in Triton 3.9's
    Gluon, ``_reinterpret`` before)."""
    method = getattr(smem, "reinterpret", None) or smem._reinterpret
    return method(dtype, shape, layout, _semantic=_semantic)

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453

# Tiles: 128 query rows per CTA (64 per consumer warpgroup) and 128 keys per tile, as FA3 and TLX on Hopper.
FWD_BLOCK_M = 128
FWD_BLOCK_N = 128
FWD_STAGES = {64: 3, 128: 2}  # K/V ring depth per head_dim: shared memory holds Q + 2 x stages x 128 x d bf16
FWD_CONSUMER_REGS = 240  # registers per thread of a consumer warpgroup (setmaxnreg); the producer gets 24
FWD_PRODUCER_REGS = 24
# The consumers issue their products in turns (FA3's scheduler barrier) when True; measured 1-2% slower than
# letting the warp schedulers interleave them (device call 4, docs/attention-kernel.md), so off.
FWD_PINGPONG = False
FWD_PERSISTENT = 1  # programs per SM of the persistent forward (0: one program per tile)
# The persistent forward's programs take their next tile from a global counter as they finish (dynamic) instead of
# every programs-th tile (static): the causal tiles differ in length, and a fixed share leaves programs idle at the
# end (`python -m benchmarks.forward_schedule`, a model: the busiest program 6-12.5% above the mean at the benchmark
# shapes with the fixed share, 0.2-3% with the counter).
FWD_DYNAMIC = True
# Tiles run in sections of heads whose K and V fit this many bytes of L2 (FA3's L2 swizzle), heaviest query block
# first within a section; 0: one section of every head. With both, the forward at (4,16,4096,128) took 576 us
# against 669 for the static share over every head (16 MiB; 32 MiB: 586; device run 2026-12-04-sched, call 1).
FWD_L2_SECTION_BYTES = 16 << 20
# With fix=fp32_output the consumers stage the FP32 O in shared memory and a TMA store writes it (one 32 KiB buffer
# per consumer at head_dim 128), so the next tile starts while the copy runs; False: plain stores from registers.
# Timed on an H200 and an H100 (device run 2026-12-05-o32, calls 1 and 5): no difference beyond the timing noise;
# kept because it halves the forward's global store instructions. Where shared memory allows (`_fwd_store_plan`): not
# at head_dim 128 beside the bf16 O's buffers (FWD_O_TMA), which measured the better use of that space.
FWD_O32_TMA = True
# Q slots per consumer. With 2 the producer loads the next tile's Q while this tile runs (into the slot released at
# the end of the tile before) instead of after this tile's last product. The 2026-12-06 clock trace
# (docs/device-runs/2026-12-06-trace) showed ~7,000 cycles spent at a query-tile boundary at (8,12,1024,64), where a
# key tile takes ~2,300 (the next Q's load is one part of it). Built and compiled for sm_90 (`kernels.offline_compile`
# compiles both). Same bits, no faster on an H100 (2026-12-07: the next Q's wait is 2-4% of the consumers' time,
# docs/attention-kernel.md), so the default stays one slot.
FWD_Q_SLOTS = 1
# O = acc / l divided with one refined reciprocal per row (``_div_rows``) instead of gl.div_rn per element, whose
# machine code is 64 serial blocks per thread at head_dim 128. Same bits as gl.div_rn (exact-arithmetic check in
# docs/device-runs/2026-12-07-boundary/division_check.py; GPU cases in same_bits.py and
# tests/gpu/test_attention_gluon_gpu.py). Its first form made the forward 3-15% slower (its range test cost more
# than the divisions); the present one, with the bf16 O by TMA, 0-4.5% faster (H100, 2026-12-07-boundary, call 4).
FWD_ROW_DIVIDE = True
# The consumers stage the bf16 O in shared memory (8 stmatrix per thread at head_dim 128) and a TMA store writes
# it, as FA3 does, instead of 32 plain 4-byte stores from the product's register layout, each warp instruction
# half-filling eight 32-byte sectors. Where the FP32 O's buffers no longer fit beside it (fix=fp32_output at
# head_dim 128) the FP32 O goes by plain stores (`_fwd_store_plan`). Same bits; forward 3-7% faster on an H100, at
# head_dim 128 with fp32_output too (docs/device-runs/2026-12-07-boundary, calls 2 and 4).
FWD_O_TMA = True
# Consumer 1 starts its first tile once consumer 0 has finished that tile's first softmax, and keeps that lead: the
# two reach each tile's epilogue (a quarter of the forward, during which neither issues a product: device run
# 2026-12-07-boundary, call 1b) at different times, so that one's epilogue runs beside the other's products. The
# ring lets them drift by up to STAGES - 1 key tiles (the producer then loads the leader's first key tile of a tile
# between the two Q halves, so that the follower's Q release does not hold it back); the lead costs the leader one
# stage of prefetch. Same bits (each consumer's work is unchanged). Built 2026-12-08, not yet run on a GPU: off.
FWD_LAG = False
SHARED_MEMORY_BYTES = 227 * 1024  # per CTA on sm_90
MAXNREG = 168  # the kernels' per-thread budget: 12 warps x 32 threads x 168 <= 65,536 registers


# ----------------------------------------------------------------------------------------------------------------
# Forward
# ----------------------------------------------------------------------------------------------------------------


@gluon.jit
def _fwd_tile(t, BH, H, GROUP, T, n_m, SECTION, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
              CAUSAL: gl.constexpr):
    """The work of tile t of the persistent schedule: (b, h, k/v head, first query row, key tiles left of the
    diagonal (unmasked), key tiles in all). The (batch, head) pairs come in sections of SECTION (the last one may
    be smaller); within a section the query blocks run from the last (the heaviest causal one) to the first, each
    over the section's heads, so that the tiles running at once share the K and V of a few heads in L2 (ordering
    every head's query blocks together instead left programs of the static schedule with unequal work and made
    the 1,024-token forward 1.5x slower, 2026-12-02 call 3)."""
    per_section = SECTION * n_m
    section = t // per_section
    width = gl.minimum(SECTION, BH - section * SECTION)
    r = t - section * per_section
    bh = section * SECTION + r % width
    start_m = (n_m - 1 - r // width) * BLOCK_M
    b = bh // H
    h = bh % H
    if CAUSAL:
        n_full = start_m // BLOCK_N  # key tiles left of the diagonal: every entry valid for every row of the tile
        n_tiles = gl.cdiv(gl.minimum(start_m + BLOCK_M, T), BLOCK_N)
    else:
        n_full = T // BLOCK_N
        n_tiles = gl.cdiv(T, BLOCK_N)
    return bh, b, h, h // GROUP, start_m, n_full, n_tiles


@gluon.jit
def _put_tile(slot, t, layout: gl.constexpr):
    """Write tile index t into a 1-element shared-memory slot (the producer's message to a consumer)."""
    slot.store(gl.full([1], t, gl.int32, layout))


@gluon.jit
def _get_tile(slot, layout: gl.constexpr):
    return gl.max(slot.load(layout), 0)


@gluon.jit
def _fwd_load_kv(k_desc, v_desc, k_smem, v_smem, k_bars, v_bars, k_empty, v_empty, kv_it, b, hk, j,
                 BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    """Key tile j's K, then its V, into ring position ``kv_it`` once the consumers released the stage; returns the
    next position."""
    stage = kv_it % STAGES
    mbarrier.wait(k_empty.index(stage), ((kv_it // STAGES) & 1) ^ 1)
    mbarrier.expect(k_bars.index(stage), k_desc.block_type.nbytes)
    _tma_load(k_desc, [b, hk, j * BLOCK_N, 0], k_bars.index(stage), k_smem.index(stage))
    mbarrier.wait(v_empty.index(stage), ((kv_it // STAGES) & 1) ^ 1)
    mbarrier.expect(v_bars.index(stage), v_desc.block_type.nbytes)
    _tma_load(v_desc, [b, hk, j * BLOCK_N, 0], v_bars.index(stage), v_smem.index(stage))
    return kv_it + 1


@gluon.jit
def _fwd_producer(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_ready, q_empty, k_bars, v_bars, k_empty, v_empty,
                  tile_slots, TILE_COUNTER, BH, H, GROUP, T, n_m, n_work, SECTION, BLOCK_N: gl.constexpr,
                  STAGES: gl.constexpr, CAUSAL: gl.constexpr, DYNAMIC: gl.constexpr, Q_SLOTS: gl.constexpr,
                  LAG: gl.constexpr):
    """1 warp: for each tile of this CTA, Q's two 64-row halves into the tile's Q slot (tile number % Q_SLOTS, once
    its consumer released the tile that used it before; LAG: the first key tile between the two halves, so that the
    leading consumer need not wait for the other's release of its Q), then
    the tile's K and V tiles into the ring. K and V have their own release barriers (count 2: both consumers): a K
    stage is free once its Q K^T products ran, a step before its V stage, so K loads run further ahead.
    DYNAMIC: the first tile is the program's index, each next one is taken from TILE_COUNTER once this tile's last
    K/V load is issued (a few tiles before the consumers finish it); its index goes to each consumer in a shared
    slot with Q's ready barrier, and an index past the last tile (with a plain arrive) tells them to stop."""
    HALF: gl.constexpr = q_desc.block_type.shape[2]
    one_warp: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])
    kv_it = 0  # K/V tiles loaded so far: its stage and phase in the ring
    tile_it = 0
    t = gl.program_id(0)
    while t < n_work:
        bh, b, h, hk, start_m, n_full, n_tiles = _fwd_tile(t, BH, H, GROUP, T, n_m, SECTION, 2 * HALF, BLOCK_N,
                                                           CAUSAL)
        slot = (tile_it % Q_SLOTS) * 2
        q_phase = (tile_it // Q_SLOTS) & 1
        for c in gl.static_range(2):
            mbarrier.wait(q_empty.index(slot + c), q_phase ^ 1)  # a fresh barrier counts as released
            if DYNAMIC:
                _put_tile(tile_slots.index(slot + c), t, one_warp)
                _barrier()  # every lane's store precedes the elected lane's arrive (its release)
            mbarrier.expect(q_ready.index(slot + c), q_desc.block_type.nbytes)
            _tma_load(q_desc, [b, h, start_m + c * HALF, 0], q_ready.index(slot + c), q_smem.index(slot + c))
            if LAG:
                if c == 0:  # the leader's first key tile before the follower's Q, which it releases later
                    kv_it = _fwd_load_kv(k_desc, v_desc, k_smem, v_smem, k_bars, v_bars, k_empty, v_empty, kv_it,
                                         b, hk, 0, BLOCK_N, STAGES)
        for j in range(1 if LAG else 0, n_tiles):
            kv_it = _fwd_load_kv(k_desc, v_desc, k_smem, v_smem, k_bars, v_bars, k_empty, v_empty, kv_it, b, hk, j,
                                 BLOCK_N, STAGES)
        tile_it += 1
        if DYNAMIC:
            t = gl.atomic_add(TILE_COUNTER, 1) + gl.num_programs(0)
        else:
            t += gl.num_programs(0)
    if DYNAMIC:
        slot = (tile_it % Q_SLOTS) * 2
        for c in gl.static_range(2):
            mbarrier.wait(q_empty.index(slot + c), ((tile_it // Q_SLOTS) & 1) ^ 1)
            _put_tile(tile_slots.index(slot + c), t, one_warp)
            _barrier()
            mbarrier.arrive(q_ready.index(slot + c), count=1)


@gluon.jit
def _fwd_softmax(scores, m_i, l_i, rows, col0, T, exp_scale, MASKED: gl.constexpr, CAUSAL: gl.constexpr,
                 BLOCK_N: gl.constexpr, s_layout: gl.constexpr):
    """One key tile of fa2's online softmax on the raw FP32 q.k: (P_bar, new max, alpha, new row sum); MASKED
    applies the ragged tail (keys >= T) and, with CAUSAL, the diagonal (keys after the query)."""
    if MASKED:
        cols = col0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        valid = cols[None, :] < T
        if CAUSAL:
            valid = valid & (rows[:, None] >= cols[None, :])
        scores = gl.where(valid, scores, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(scores, 1))
    m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
    p = gl.exp2((scores - m_use[:, None]) * exp_scale)  # subtract first: the maximum's term is exactly 1
    alpha = gl.exp2((m_i - m_use) * exp_scale)
    l_i = l_i * alpha + gl.sum(p, 1)
    return p, m_new, alpha, l_i


@gluon.jit
def _turn_wait(turns, ti, HALF_INDEX: gl.constexpr, PINGPONG: gl.constexpr):
    """Ping-pong (FA3's warp-scheduler barrier): the two consumers issue their matrix products in turns, so that one
    warpgroup's softmax runs while the other's products occupy the tensor cores. Consumer 0 goes first (a fresh
    barrier counts as completed)."""
    if PINGPONG:
        mbarrier.wait(turns.index(HALF_INDEX), (ti & 1) ^ (1 - HALF_INDEX))


@gluon.jit
def _turn_pass(turns, HALF_INDEX: gl.constexpr, PINGPONG: gl.constexpr):
    if PINGPONG:
        mbarrier.arrive(turns.index(1 - HALF_INDEX), count=1)


@gluon.jit
def _fwd_tile_range(acc, m_i, l_i, p16, alpha, kv_it, ti, q, k_smem, v_smem, k_bars, v_bars, k_empty, v_empty, turns, rows, T,
                    exp_scale, lo, hi, MASKED: gl.constexpr, CAUSAL: gl.constexpr, BLOCK_N: gl.constexpr,
                    HEAD_DIM: gl.constexpr, STAGES: gl.constexpr, HALF_INDEX: gl.constexpr,
                    PINGPONG: gl.constexpr, s_layout: gl.constexpr, o_layout: gl.constexpr,
                    p_layout: gl.constexpr):
    """Key tiles [lo, hi) (lo >= 1) of the pipelined loop, in FA3's order: tile j's Q K^T is issued, the
    accumulator is rescaled by tile j-1's alpha and tile j-1's PV issued (``p16``: P_bar of j-1, its A operand),
    and tile j's softmax follows (ptxas places the PV wait before its exponentials); P_bar of j goes into ``p16``
    after the PV product finished. Each step is acc = acc * alpha_j-1 + P_j-1 V_j-1, the plain loop's order.
    ``kv_it``: the ring position of tile j (tile j-1 sits one before it)."""
    dtype: gl.constexpr = k_smem.dtype
    HALF: gl.constexpr = q.shape[0]
    for j in range(lo, hi):
        stage = kv_it % STAGES
        prev = (kv_it - 1) % STAGES
        mbarrier.wait(k_bars.index(stage), (kv_it // STAGES) & 1)
        mbarrier.wait(v_bars.index(prev), ((kv_it - 1) // STAGES) & 1)
        k_t = k_smem.index(stage).reshape([BLOCK_N, HEAD_DIM]).permute((1, 0))
        v_prev = v_smem.index(prev).reshape([BLOCK_N, HEAD_DIM])
        _turn_wait(turns, ti, HALF_INDEX, PINGPONG)
        s_tok = warpgroup_mma(q, k_t, gl.zeros([HALF, BLOCK_N], gl.float32, s_layout), use_acc=False,
                              is_async=True)
        acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
        acc = warpgroup_mma(p16, v_prev, acc, is_async=True)
        _turn_pass(turns, HALF_INDEX, PINGPONG)
        ti += 1
        scores = warpgroup_mma_wait(1, deps=(s_tok,))  # Q K^T done; the PV product may still run
        mbarrier.arrive(k_empty.index(stage), count=1)
        p, m_i, alpha, l_i = _fwd_softmax(scores, m_i, l_i, rows, j * BLOCK_N, T, exp_scale, MASKED, CAUSAL,
                                          BLOCK_N, s_layout)
        acc, p = warpgroup_mma_wait(0, deps=(acc, p))
        mbarrier.arrive(v_empty.index(prev), count=1)
        p16 = gl.convert_layout(p.to(dtype), p_layout)
        kv_it += 1
    return acc, m_i, l_i, p16, alpha, kv_it, ti


@gluon.jit
def _fwd_first_qk(q, k_smem, k_bars, kv_it, ti, turns, HALF_INDEX: gl.constexpr, PINGPONG: gl.constexpr,
                  STAGES: gl.constexpr, s_layout: gl.constexpr):
    """Issue Q K^T of a query tile's key tile 0 (ring position ``kv_it``) once its K is in, asynchronously; the
    caller waits."""
    HALF: gl.constexpr = q.shape[0]
    BLOCK_N: gl.constexpr = k_smem.shape[3]  # (stage, batch 1, head 1, key, channel)
    HEAD_DIM: gl.constexpr = k_smem.shape[4]
    stage = kv_it % STAGES
    mbarrier.wait(k_bars.index(stage), (kv_it // STAGES) & 1)
    k_t = k_smem.index(stage).reshape([BLOCK_N, HEAD_DIM]).permute((1, 0))
    _turn_wait(turns, ti, HALF_INDEX, PINGPONG)
    s_tok = warpgroup_mma(q, k_t, gl.zeros([HALF, BLOCK_N], gl.float32, s_layout), use_acc=False, is_async=True)
    _turn_pass(turns, HALF_INDEX, PINGPONG)
    return s_tok, ti + 1


@gluon.jit
def _div_rows(acc, l):
    """acc / l[:, None] rounded to nearest: the bits of gl.div_rn. CUDA's division of a by b takes an approximate
    reciprocal r0 of b, refines it (r = r0 + r0 (1 - b r0)), then corrects the quotient (q0 = a r, q = q0 + r (a -
    b q0)), all in fused multiply-adds, behind a check that sends operands near the ends of the FP32 range to a
    slow path. The same steps give the same bits, so here the reciprocal is taken and refined once per row and only
    the correction runs per element, with no branch between elements (the residual is formed as b q0 - a and
    subtracted, which is the same arithmetic and divides a signed zero to itself). A tile with any operand outside
    a range well inside the fast path's (|a| in [2^-64, 2^64] or a = 0, l in [2^-16, 2^32]) is divided by
    gl.div_rn. The range test works on the bits of |a| with two integer extremes per row (four instructions per
    element), since a first form with float comparisons per element cost more than the divisions it saved."""
    r0 = gl.inline_asm_elementwise("rcp.approx.ftz.f32 $0, $1;", "=f,f", [l], dtype=gl.float32, is_pure=True,
                                   pack=1)
    r = gl.fma(r0, gl.fma(-l, r0, gl.full_like(l, 1.0)), r0)
    r2 = r[:, None]
    q0 = acc * r2
    q = gl.fma(-r2, gl.fma(l[:, None], q0, -acc), q0)
    mag = acc.to(gl.uint32, bitcast=True) & 0x7FFFFFFF  # the bits of |a|, ordered as the magnitudes (NaN above inf)
    biggest = gl.max(mag, 1)
    smallest_nonzero = gl.min(mag - 1, 1)  # a zero wraps to the largest value and drops out
    row_ok = (biggest <= 0x5F800000) & (smallest_nonzero >= 0x1F7FFFFF)  # 2^64; 2^-64 less one
    row_ok = row_ok & (l >= 1.52587890625e-05) & (l <= 4294967296.0)
    if gl.min(row_ok.to(gl.int32), axis=0) == 1:
        o = q
    else:
        o = gl.div_rn(acc, l[:, None])
    return o


@gluon.jit
def _fwd_epilogue(acc, m_i, l_i, rows, offs_d, b, h, bh, start_m, o_smem, o32_smem, O, O32, LSE, KEYS, stride_ob,
                  stride_oh, stride_ot, T, head_offset, exp_scale, HALF_INDEX: gl.constexpr, FIX: gl.constexpr,
                  STORE_O32: gl.constexpr, O_TMA: gl.constexpr, O32_TMA: gl.constexpr, ROW_DIVIDE: gl.constexpr):
    """A consumer's rows of a finished query tile: O = acc / l (one rounding; stochastic with fix 4), the LSE in
    natural log and, where the mode keeps it, the FP32 O. O_TMA / O32_TMA: O (FP32 O) is staged in
    ``o_smem.index(HALF_INDEX)`` (``o32_smem``) and copied by TMA, so the next tile starts while the copy runs; O
    (O32) is then a TMA descriptor. ``offs_d``: the channels, in acc's column layout."""
    HALF: gl.constexpr = acc.shape[0]
    HEAD_DIM: gl.constexpr = acc.shape[1]
    ANY_TMA: gl.constexpr = O_TMA or (STORE_O32 and O32_TMA)
    row_o: gl.constexpr = gl.SliceLayout(1, acc.type.layout)
    l_o = gl.convert_layout(l_i, row_o)
    l_o = gl.where(l_o == 0.0, 1.0, l_o)  # l = 0 only for rows past T
    if ROW_DIVIDE:
        o = _div_rows(acc, l_o)
    else:
        o = gl.div_rn(acc, l_o[:, None])
    rows_o = gl.convert_layout(rows, row_o)
    row_ok = (rows_o < T)[:, None]
    o_off = b * stride_ob + h * stride_oh + rows_o[:, None] * stride_ot + offs_d[None, :]
    if FIX == 4:  # stochastic_output: the Triton kernel's hash of (row key, global head, position, channel)
        key = gl.load(KEYS + b).to(gl.uint32)
        o_out = _sr_bf16(o, _row_hash(key, head_offset + h, rows_o), offs_d)
    else:
        o_out = o
    if not O_TMA:
        gl.store(O + o_off, o_out.to(O.dtype.element_ty), mask=row_ok)
    if ANY_TMA:
        tma.store_wait(0)  # the previous tile's copies have read the buffers (the issuing thread waits)
        _barrier()  # ... before any thread of the warpgroup writes them
    if O_TMA:
        o_buf = o_smem.index(HALF_INDEX)
        o_buf.reshape([HALF, HEAD_DIM]).store(o_out.to(o_buf.dtype))
    if STORE_O32:
        if O32_TMA:
            o32_buf = o32_smem.index(HALF_INDEX)
            o32_buf.reshape([HALF, HEAD_DIM]).store(o)
        else:
            gl.store(O32 + o_off, o, mask=row_ok)
    if ANY_TMA:
        fence_async_shared()  # the stores are seen by the TMA unit (the async proxy)
        _barrier()  # every thread's share is in before one thread issues the copies
        if O_TMA:
            _tma_store(O, [b, h, start_m + HALF_INDEX * HALF, 0], o_buf)
        if STORE_O32 and O32_TMA:
            _tma_store(O32, [b, h, start_m + HALF_INDEX * HALF, 0], o32_buf)
    lse = (m_i * exp_scale + gl.log2(l_i)) * 0.6931471805599453
    gl.store(LSE + bh * T + rows, lse, mask=rows < T)


@gluon.jit
def _fwd_next_tile(t, tile_it, q_ready, tile_slots, HALF_INDEX: gl.constexpr, Q_SLOTS: gl.constexpr,
                   DYNAMIC: gl.constexpr):
    """The consumer's next tile after tile t, with its Q ready (DYNAMIC: the index the producer wrote beside that
    Q; static: t + programs, once its Q is in). ``tile_it``: how many tiles this consumer has finished."""
    q_next = (tile_it % Q_SLOTS) * 2 + HALF_INDEX
    if DYNAMIC:
        mbarrier.wait(q_ready.index(q_next), (tile_it // Q_SLOTS) & 1)
        t = _get_tile(tile_slots.index(q_next), gl.BlockedLayout([1], [32], [4], [0]))
    else:
        t += gl.num_programs(0)
    return t


@gluon.jit
def _fwd_consumer(q_smem, k_smem, v_smem, o_smem, o32_smem, q_ready, q_empty, k_bars, v_bars, k_empty, v_empty, turns,
                  tile_slots, lead, O, O32, LSE, KEYS, stride_ob, stride_oh, stride_ot, BH, H, GROUP, T, n_m, n_work,
                  SECTION, head_offset, exp_scale, HALF_INDEX: gl.constexpr, BLOCK_N: gl.constexpr,
                  HEAD_DIM: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr, FIX: gl.constexpr,
                  STORE_O32: gl.constexpr, PINGPONG: gl.constexpr, DYNAMIC: gl.constexpr, O_TMA: gl.constexpr,
                  O32_TMA: gl.constexpr, Q_SLOTS: gl.constexpr, ROW_DIVIDE: gl.constexpr, LAG: gl.constexpr):
    """One 4-warp consumer: for each tile of this CTA, the online softmax of query rows start_m + 64 * HALF_INDEX
    + [0, 64) over its key tiles (those from n_full on masked), then O (LP, or stochastically rounded), LSE and the
    FP32 O (``_fwd_epilogue``). The tile's Q slot is released after its last product; with two slots the producer
    loaded this tile's Q while the last one ran. DYNAMIC: the tile's index comes from the producer's slot once Q is
    ready (``_fwd_producer``). LAG: consumer 1 starts its first tile after consumer 0's first softmax (``lead``)."""
    HALF: gl.constexpr = q_smem.shape[3]
    dtype: gl.constexpr = q_smem.dtype
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HEAD_DIM, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    offs_d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, o_layout))
    kv_it = 0
    ti = 0
    tile_it = 0
    if DYNAMIC:
        mbarrier.wait(q_ready.index(HALF_INDEX), 0)
        t = _get_tile(tile_slots.index(HALF_INDEX), gl.BlockedLayout([1], [32], [4], [0]))
    else:
        t = gl.program_id(0)
    while t < n_work:
        bh, b, h, hk, start_m, n_full, n_tiles = _fwd_tile(t, BH, H, GROUP, T, n_m, SECTION, 2 * HALF, BLOCK_N,
                                                           CAUSAL)
        rows = start_m + HALF_INDEX * HALF + gl.arange(0, HALF, layout=gl.SliceLayout(1, s_layout))
        m_i = gl.full([HALF], float("-inf"), gl.float32, gl.SliceLayout(1, s_layout))
        l_i = gl.zeros([HALF], gl.float32, gl.SliceLayout(1, s_layout))
        acc = gl.zeros([HALF, HEAD_DIM], gl.float32, o_layout)
        q_slot = (tile_it % Q_SLOTS) * 2 + HALF_INDEX
        q = q_smem.index(q_slot).reshape([HALF, HEAD_DIM])

        # key tile 0 (masked: cheap for one tile, and it may be the diagonal or the tail)
        if not DYNAMIC:
            mbarrier.wait(q_ready.index(q_slot), (tile_it // Q_SLOTS) & 1)
        if LAG:
            if HALF_INDEX == 1:
                if tile_it == 0:  # (both consumers take the same tiles: consumer 0 has this one too)
                    mbarrier.wait(lead, 0)
        s_tok, ti = _fwd_first_qk(q, k_smem, k_bars, kv_it, ti, turns, HALF_INDEX, PINGPONG, STAGES, s_layout)
        scores = warpgroup_mma_wait(0, deps=(s_tok,))
        mbarrier.arrive(k_empty.index(kv_it % STAGES), count=1)
        p, m_i, alpha, l_i = _fwd_softmax(scores, m_i, l_i, rows, 0, T, exp_scale, True, CAUSAL, BLOCK_N, s_layout)
        if LAG:
            if HALF_INDEX == 0:
                if tile_it == 0:
                    mbarrier.arrive(lead, count=1)
        p16 = gl.convert_layout(p.to(dtype), p_layout)
        kv_it += 1

        split = gl.maximum(n_full, 1)
        acc, m_i, l_i, p16, alpha, kv_it, ti = _fwd_tile_range(
            acc, m_i, l_i, p16, alpha, kv_it, ti, q, k_smem, v_smem, k_bars, v_bars, k_empty, v_empty, turns, rows, T,
            exp_scale, 1,
            split, False, CAUSAL, BLOCK_N, HEAD_DIM, STAGES, HALF_INDEX, PINGPONG, s_layout, o_layout, p_layout)
        acc, m_i, l_i, p16, alpha, kv_it, ti = _fwd_tile_range(
            acc, m_i, l_i, p16, alpha, kv_it, ti, q, k_smem, v_smem, k_bars, v_bars, k_empty, v_empty, turns, rows, T,
            exp_scale, split, n_tiles, True, CAUSAL, BLOCK_N, HEAD_DIM, STAGES, HALF_INDEX, PINGPONG, s_layout, o_layout,
            p_layout)
        last = (kv_it - 1) % STAGES
        mbarrier.wait(v_bars.index(last), ((kv_it - 1) // STAGES) & 1)
        v_last = v_smem.index(last).reshape([BLOCK_N, HEAD_DIM])
        _turn_wait(turns, ti, HALF_INDEX, PINGPONG)
        acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
        pv = warpgroup_mma(p16, v_last, acc, is_async=True)
        _turn_pass(turns, HALF_INDEX, PINGPONG)
        ti += 1
        acc = warpgroup_mma_wait(0, deps=(pv,))
        mbarrier.arrive(v_empty.index(last), count=1)
        mbarrier.arrive(q_empty.index(q_slot), count=1)
        tile_it += 1
        _fwd_epilogue(acc, m_i, l_i, rows, offs_d, b, h, bh, start_m, o_smem, o32_smem, O, O32, LSE, KEYS, stride_ob,
                      stride_oh, stride_ot, T, head_offset, exp_scale, HALF_INDEX, FIX, STORE_O32, O_TMA, O32_TMA,
                      ROW_DIVIDE)
        t = _fwd_next_tile(t, tile_it, q_ready, tile_slots, HALF_INDEX, Q_SLOTS, DYNAMIC)
    if O_TMA or (STORE_O32 and O32_TMA):
        tma.store_wait(0)  # the buffers live until the last copies have read them


@gluon.jit
def _fwd_kernel(q_desc, k_desc, v_desc, O, O32, LSE, KEYS, TILE_COUNTER, stride_ob, stride_oh, stride_ot, H, GROUP,
                T, BH, SECTION, head_offset, exp_scale, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,
                STAGES: gl.constexpr, CAUSAL: gl.constexpr, FIX: gl.constexpr, STORE_O32: gl.constexpr,
                PINGPONG: gl.constexpr, DYNAMIC: gl.constexpr, O_TMA: gl.constexpr, O32_TMA: gl.constexpr,
                Q_SLOTS: gl.constexpr, CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr,
                ROW_DIVIDE: gl.constexpr, LAG: gl.constexpr):
    """Persistent: program i takes tile i of the (section, query block, batch x head) schedule (``_fwd_tile``),
    then the next untaken one (DYNAMIC: TILE_COUNTER, zero at launch, counts the tiles taken after the first
    programs' ones) or tiles i + programs, ...; a grid of one program per tile is the plain launch. O (O32): the
    (FP32) O's pointer, or its TMA descriptor (blocks of HALF rows) when O_TMA (O32_TMA)."""
    HALF: gl.constexpr = q_desc.block_type.shape[2]
    BLOCK_M: gl.constexpr = 2 * HALF
    dtype: gl.constexpr = q_desc.dtype
    n_m = gl.cdiv(T, BLOCK_M)
    n_work = n_m * BH
    q_smem = gl.allocate_shared_memory(dtype, [2 * Q_SLOTS] + q_desc.block_type.shape, q_desc.layout)  # slot, half
    k_smem = gl.allocate_shared_memory(dtype, [STAGES] + k_desc.block_type.shape, k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES] + v_desc.block_type.shape, v_desc.layout)
    if STORE_O32 and O32_TMA:  # one buffer per consumer
        o32_smem = gl.allocate_shared_memory(gl.float32, [2] + O32.block_type.shape, O32.layout)
    else:
        o32_smem = q_smem  # unused
    if O_TMA:
        o_smem = gl.allocate_shared_memory(O.dtype, [2] + O.block_type.shape, O.layout)
    else:
        o_smem = q_smem  # unused
    q_ready = gl.allocate_shared_memory(gl.int64, [2 * Q_SLOTS, 1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [2 * Q_SLOTS, 1], mbarrier.MBarrierLayout())
    turns = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    if LAG:  # consumer 0's signal that consumer 1 may start
        lead = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        mbarrier.init(lead, count=1)
    else:
        lead = turns  # unused
    tile_slots = gl.allocate_shared_memory(gl.int32, [2 * Q_SLOTS, 1], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    k_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2 * Q_SLOTS):
        mbarrier.init(q_ready.index(i), count=1)
        mbarrier.init(q_empty.index(i), count=1)
        if i < 2:
            mbarrier.init(turns.index(i), count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(k_bars.index(i), count=1)
        mbarrier.init(v_bars.index(i), count=1)
        mbarrier.init(k_empty.index(i), count=2)  # both consumers release a stage
        mbarrier.init(v_empty.index(i), count=2)
    fence_async_shared()

    # (constexprs must be written into each partition's argument tuple: a tuple built by concatenation turns them
    # into tensors)
    gl.warp_specialize([
        (_fwd_consumer, (q_smem, k_smem, v_smem, o_smem, o32_smem, q_ready, q_empty, k_bars, v_bars, k_empty, v_empty,
                         turns, tile_slots, lead, O, O32, LSE, KEYS, stride_ob, stride_oh, stride_ot, BH, H, GROUP,
                         T, n_m, n_work, SECTION, head_offset, exp_scale, 0, BLOCK_N, HEAD_DIM, STAGES, CAUSAL, FIX,
                         STORE_O32, PINGPONG, DYNAMIC, O_TMA, O32_TMA, Q_SLOTS, ROW_DIVIDE, LAG)),
        (_fwd_consumer, (q_smem, k_smem, v_smem, o_smem, o32_smem, q_ready, q_empty, k_bars, v_bars, k_empty, v_empty,
                         turns, tile_slots, lead, O, O32, LSE, KEYS, stride_ob, stride_oh, stride_ot, BH, H, GROUP,
                         T, n_m, n_work, SECTION, head_offset, exp_scale, 1, BLOCK_N, HEAD_DIM, STAGES, CAUSAL, FIX,
                         STORE_O32, PINGPONG, DYNAMIC, O_TMA, O32_TMA, Q_SLOTS, ROW_DIVIDE, LAG)),
        (_fwd_producer, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_ready, q_empty, k_bars, v_bars, k_empty,
                         v_empty, tile_slots, TILE_COUNTER, BH, H, GROUP, T, n_m, n_work, SECTION, BLOCK_N, STAGES,
                         CAUSAL, DYNAMIC, Q_SLOTS, LAG)),
    ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


# ----------------------------------------------------------------------------------------------------------------
# Backward
# ----------------------------------------------------------------------------------------------------------------

BWD_BLOCK_M = {64: 64, 128: 64}  # query rows per step, per head_dim
# Issue dQ's product before dK's and hand its share on while dK's runs: fwd+bwd 2-3.5% faster with atomics, 0-2.4%
# with ordered dQ, when the compute warps still added the shares themselves (device run 2026-12-04-sched, call 1)
BWD_DQ_UNDER_DK = True
BWD_ROWS_TMA = True  # LSE and delta rows come by TMA with Q and dO (where T * 4 bytes is a multiple of 16)
BWD_BLOCK_N = 128  # keys per CTA (64 per warpgroup of the 8-warp compute partition)
BWD_STAGES = 2  # Q / dO ring depth
BWD_PRODUCER_REGS = 24
BWD_WRITER_REGS = 24  # the dQ writer warp: a TMA issue and the counter, few registers
# With ordered dQ the first key tile to reach a query tile (its turn 0) writes its share with a TMA store instead of
# a reduce-add, so dQ's FP32 buffer needs no zeroing beforehand (a memset of B x H x T x head_dim x 4 bytes: 67 MB
# at (4,16,2048,128)). Same sums (0 + x = x; only the sign of a zero share can differ). fwd+bwd 5-7% faster with
# ordered dQ on an H100, same gradients (docs/device-runs/2026-12-07-boundary, call 6).
BWD_DQ_FIRST_STORE = True
# The same with atomic dQ: the first key tile in the ordered mode's turn order (the diagonal one when causal, which
# reaches the query tile first) stores its share and raises a per-tile flag; the others wait for the flag, then add
# in the order they finish. No memset; the key tiles launch in the ordered mode's order (last first), so that a
# tile never waits for one not yet launched. Built, not yet run on a GPU: off.
BWD_ATOMIC_FIRST_STORE = False
# dK and dV leave a key tile by TMA from shared memory (the dQ double buffer, free once the writer warp has read
# its last share: 2 x 64 x head_dim FP32 = 2 x 128 x head_dim bf16) instead of plain 4-byte stores from the
# products' registers, as the forward's O does (FWD_O_TMA). Built, not yet run on a GPU: off.
BWD_DKV_TMA = False
# The key tile that adds last into a query tile also finishes that tile's dQ: once its add is performed in global
# memory its writer warp loads the tile's FP32 sums back (TMA, from L2), scales and rounds them and stores dQ, so
# the separate finishing launch (a read of the whole FP32 buffer, B x H x T x head_dim x 4 bytes, and a write of
# dQ) goes. Ordered dQ: the last turn (key tile 0, which every query tile meets). Atomic dQ behind a stored first
# share (BWD_ATOMIC_FIRST_STORE): each add, once performed, counts itself, and the one that completes the count
# finishes (plain atomic dQ keeps the launch). Same bits: the same product of the same sums, rounded the same way
# (``_bwd_dq_round_out``). Built, not yet run on a GPU: off.
BWD_DQ_FINISH = False


@gluon.jit
def _bwd_producer(k_desc, v_desc, q_desc, do_desc, lse_desc, delta_desc, k_smem, v_smem, q_smem, do_smem, lse_smem,
                  delta_smem, kv_bar, qdo_ready, qdo_empty, b, hk, start_n, m_first, n_m, GROUP, H,
                  BLOCK_M: gl.constexpr, STAGES: gl.constexpr, ROWS_TMA: gl.constexpr):
    """1 warp: this CTA's K and V tiles once, then Q and dO (and, ROWS_TMA, the LSE and delta rows) of query
    tiles m_first.. (n_m of them) of each of the GROUP query heads that share the k/v head, through the ring."""
    mbarrier.expect(kv_bar, k_desc.block_type.nbytes + v_desc.block_type.nbytes)
    _tma_load(k_desc, [b, hk, start_n, 0], kv_bar, k_smem)
    _tma_load(v_desc, [b, hk, start_n, 0], kv_bar, v_smem)
    for it in range(GROUP * n_m):
        h = hk * GROUP + it // n_m
        m0 = (m_first + it % n_m) * BLOCK_M
        stage = it % STAGES
        mbarrier.wait(qdo_empty.index(stage), ((it // STAGES) & 1) ^ 1)
        ready = qdo_ready.index(stage)
        if ROWS_TMA:
            mbarrier.expect(ready, q_desc.block_type.nbytes + do_desc.block_type.nbytes
                            + lse_desc.block_type.nbytes + delta_desc.block_type.nbytes)
            _tma_load(lse_desc, [b * H + h, m0], ready, lse_smem.index(stage))
            _tma_load(delta_desc, [b * H + h, m0], ready, delta_smem.index(stage))
        else:
            mbarrier.expect(ready, q_desc.block_type.nbytes + do_desc.block_type.nbytes)
        _tma_load(q_desc, [b, h, m0, 0], ready, q_smem.index(stage))
        _tma_load(do_desc, [b, h, m0, 0], ready, do_smem.index(stage))


@gluon.jit
def _bwd_compute(k_smem, v_smem, q_smem, do_smem, ds_smem, dq_smem, lse_smem, delta_smem, kv_bar, qdo_ready, qdo_empty,
                 dq_full, dq_empty, LSE, DELTA, DK, DV, stride_dkb, stride_dkh, stride_dkt, stride_dvb, stride_dvh,
                 stride_dvt, b, hk, start_n, m_first, n_m, GROUP, H, T, exp_scale, sm_scale, BLOCK_M: gl.constexpr,
                 BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr,
                 ROWS_TMA: gl.constexpr, DQ_UNDER_DK: gl.constexpr, DKV_TMA: gl.constexpr):
    """The 8-warp compute partition: per query tile, S^T = K Q^T and dP^T = V dO^T (issued together), P^T from
    LSE, dV += P^T dO and dK += dS^T Q with P^T and dS^T as register operands, dS^T into shared memory for dQ's
    share dS K, which goes through the double buffer ``dq_smem`` to the writer warp (``_bwd_dq_writer``).
    DQ_UNDER_DK: dQ's product is issued before dK's and its share handed on while dK's runs. DKV_TMA: DK and DV are
    TMA descriptors (blocks of BLOCK_N rows) and dK, dV leave through ``dq_smem``."""
    dtype: gl.constexpr = k_smem.dtype
    st_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[8, 1],
                                                        instr_shape=[16, BLOCK_M, 16])
    kv_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[8, 1],
                                                        instr_shape=[16, HEAD_DIM, 16])
    op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=kv_layout, k_width=2)
    if BLOCK_M == 128:
        dq_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[8, 1],
                                                            instr_shape=[16, HEAD_DIM, 16])
    else:
        dq_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                            instr_shape=[16, HEAD_DIM // 2, 16])
    cols = start_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, st_layout))  # keys: the rows of S^T
    offs_m = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, st_layout))
    k_tile = k_smem.reshape([BLOCK_N, HEAD_DIM])
    v_tile = v_smem.reshape([BLOCK_N, HEAD_DIM])
    dk = gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, kv_layout)
    dv = gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, kv_layout)
    mbarrier.wait(kv_bar, 0)
    for it in range(GROUP * n_m):
        h = hk * GROUP + it // n_m
        bh = b * H + h
        m_idx = m_first + it % n_m
        rows = m_idx * BLOCK_M + offs_m
        stage = it % STAGES
        if ROWS_TMA:  # the producer brought them with Q and dO (zeros past T)
            mbarrier.wait(qdo_ready.index(stage), (it // STAGES) & 1)
            lse2 = lse_smem.index(stage).reshape([BLOCK_M]).load(gl.SliceLayout(0, st_layout)) * 1.4426950408889634
            delta = delta_smem.index(stage).reshape([BLOCK_M]).load(gl.SliceLayout(0, st_layout))
        else:
            lse2 = gl.load(LSE + bh * T + rows, mask=rows < T, other=0.0) * 1.4426950408889634
            delta = gl.load(DELTA + bh * T + rows, mask=rows < T, other=0.0)
            mbarrier.wait(qdo_ready.index(stage), (it // STAGES) & 1)
        q = q_smem.index(stage).reshape([BLOCK_M, HEAD_DIM])
        do = do_smem.index(stage).reshape([BLOCK_M, HEAD_DIM])
        zero_st = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, st_layout)
        st_tok = warpgroup_mma(k_tile, q.permute((1, 0)), zero_st, use_acc=False, is_async=True)
        dpt_tok = warpgroup_mma(v_tile, do.permute((1, 0)), zero_st, use_acc=False, is_async=True)
        st = warpgroup_mma_wait(1, deps=(st_tok,))
        pt = gl.exp2(st * exp_scale - lse2[None, :])  # one FMA per score, as the Triton kernel
        masked = (start_n + BLOCK_N > T) | (m_idx * BLOCK_M + BLOCK_M > T)
        if CAUSAL:
            masked = masked | (m_idx * BLOCK_M < start_n + BLOCK_N - 1)
        if masked:
            valid = (rows[None, :] < T) & (cols[:, None] < T)
            if CAUSAL:
                valid = valid & (rows[None, :] >= cols[:, None])
            pt = gl.where(valid, pt, 0.0)
        dpt = warpgroup_mma_wait(0, deps=(dpt_tok,))
        dv = warpgroup_mma(gl.convert_layout(pt.to(dtype), op_layout), do, dv, is_async=True)
        dst = (pt * (dpt - delta[None, :])).to(dtype)
        ds_smem.store(dst)
        fence_async_shared()
        _barrier()  # both warpgroups' halves of dS^T are in shared memory before dQ's product reads them
        if DQ_UNDER_DK:  # dQ's product first: its share is added while dK's product still runs
            dq_tok = warpgroup_mma(ds_smem.permute((1, 0)), k_tile,
                                   gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, dq_layout), use_acc=False, is_async=True)
            dk = warpgroup_mma(gl.convert_layout(dst, op_layout), q, dk, is_async=True)
            dv, dq_share = warpgroup_mma_wait(1, deps=(dv, dq_tok))
            _bwd_hand_on_dq(dq_share, it, dq_smem, dq_full, dq_empty)
            dk = warpgroup_mma_wait(0, deps=(dk,))
            mbarrier.arrive(qdo_empty.index(stage), count=1)
        else:
            dk = warpgroup_mma(gl.convert_layout(dst, op_layout), q, dk, is_async=True)
            dq_tok = warpgroup_mma(ds_smem.permute((1, 0)), k_tile,
                                   gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, dq_layout), use_acc=False, is_async=True)
            dv, dk, dq_share = warpgroup_mma_wait(0, deps=(dv, dk, dq_tok))
            mbarrier.arrive(qdo_empty.index(stage), count=1)
            _bwd_hand_on_dq(dq_share, it, dq_smem, dq_full, dq_empty)
    # epilogue: dK = scale * sum dS^T Q, dV = sum P^T dO, rounded once
    if DKV_TMA:
        # both dQ buffers are free once the writer has released them for the next two hand-ons
        n_it = GROUP * n_m
        mbarrier.wait(dq_empty.index(n_it % 2), ((n_it // 2) & 1) ^ 1)
        mbarrier.wait(dq_empty.index((n_it + 1) % 2), (((n_it + 1) // 2) & 1) ^ 1)
        dkv = _smem_reinterpret(dq_smem, dtype, [2] + DK.block_type.shape, DK.layout)
        dkv.index(0).reshape([BLOCK_N, HEAD_DIM]).store((dk * sm_scale).to(dtype))
        dkv.index(1).reshape([BLOCK_N, HEAD_DIM]).store(dv.to(dtype))
        fence_async_shared()  # the stores are seen by the TMA unit (the async proxy)
        _barrier()  # both warpgroups' rows are in before one thread issues the copies
        _tma_store(DK, [b, hk, start_n, 0], dkv.index(0))
        _tma_store(DV, [b, hk, start_n, 0], dkv.index(1))
        tma.store_wait(0)  # the buffer lives until the copies have read it
    else:
        cols_kv = start_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, kv_layout))
        offs_d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, kv_layout))
        ok = (cols_kv < T)[:, None]
        gl.store(DK + b * stride_dkb + hk * stride_dkh + cols_kv[:, None] * stride_dkt + offs_d[None, :],
                 (dk * sm_scale).to(dtype), mask=ok)
        gl.store(DV + b * stride_dvb + hk * stride_dvh + cols_kv[:, None] * stride_dvt + offs_d[None, :],
                 dv.to(dtype), mask=ok)


@gluon.jit
def _bwd_hand_on_dq(dq_share, it, dq_smem, dq_full, dq_empty):
    """Step ``it``'s dQ share leaves the compute warps: into buffer it % 2 of ``dq_smem`` for the writer warp, once
    the writer has read that buffer's last share."""
    buf = it % 2
    mbarrier.wait(dq_empty.index(buf), ((it // 2) & 1) ^ 1)  # a fresh barrier counts as released
    dq_smem.index(buf).reshape([dq_share.shape[0], dq_share.shape[1]]).store(dq_share)
    fence_async_shared()  # the stores are seen by the TMA unit (the async proxy) that reads them
    mbarrier.arrive(dq_full.index(buf), count=1)


@gluon.jit
def _bulk_writes_done(token):
    """Wait until this thread's TMA reduce-adds are performed in global memory (``cp.async.bulk.wait_group 0``).
    ``tma.store_wait`` waits only until they have read shared memory (Triton 3.6-3.8 have no other form): enough to
    reuse the buffer, not to let another CTA add after them. ``token``: any tensor (the asm is elementwise)."""
    return gl.inline_asm_elementwise("cp.async.bulk.wait_group 0; mov.b32 $0, $1;", "=r,r", [token], dtype=gl.int32,
                                     is_pure=False, pack=1)


@gluon.jit
def _async_proxy_acquire(token):
    """Order this thread's later TMA operations on global memory (the async proxy) after what it has acquired
    through ordinary loads and atomics (``fence.proxy.async.global``)."""
    return gl.inline_asm_elementwise("fence.proxy.async.global; mov.b32 $0, $1;", "=r,r", [token], dtype=gl.int32,
                                     is_pure=False, pack=1)


@gluon.jit
def _bwd_dq_round_out(sums, DQ, b, h, stride_dqb, stride_dqh, stride_dqt, m0, T, sm_scale):
    """dQ rows m0.. = LP(sm_scale * sums) from a shared-memory tile of FP32 sums (one query tile's, in the TMA
    descriptor's 128-byte-swizzled layout), as ``triton_flash``'s dQ finishing launch computes them (a product, one
    rounding), rows past T not written. One warp, in blocks of 8 rows x 32 columns (one swizzle span: 8 values per
    thread, so the writer's few registers suffice; two 16-byte shared loads and one 16-byte store per block)."""
    BLOCK_M: gl.constexpr = sums.shape[2]
    HEAD_DIM: gl.constexpr = sums.shape[3]
    tile = sums.reshape([BLOCK_M, HEAD_DIM])
    block: gl.constexpr = gl.BlockedLayout([1, 8], [8, 4], [1, 1], [1, 0])
    r = gl.arange(0, 8, layout=gl.SliceLayout(1, block))
    c = gl.arange(0, 32, layout=gl.SliceLayout(0, block))
    base = DQ + b * stride_dqb + h * stride_dqh
    for i in gl.static_range(BLOCK_M // 8):
        rows = m0 + i * 8 + r
        for j in gl.static_range(HEAD_DIM // 32):
            x = tile.slice(i * 8, 8, dim=0).slice(j * 32, 32, dim=1).load(block)
            gl.store(base + rows[:, None] * stride_dqt + (j * 32 + c)[None, :],
                     (x * sm_scale).to(DQ.dtype.element_ty), mask=(rows < T)[:, None])


@gluon.jit
def _bwd_dq_finish(dq_desc, buffer, fin_bar, fin_phase, DQ, b, h, stride_dqb, stride_dqh, stride_dqt, m0, T,
                   sm_scale):
    """The writer's last add into a query tile is performed: the tile's FP32 sums come back from L2 into the
    share's buffer (free: the add has read it) and leave as dQ (``_bwd_dq_round_out``). Returns the next phase
    of ``fin_bar``."""
    mbarrier.expect(fin_bar, dq_desc.block_type.nbytes)
    _tma_load(dq_desc, [b, h, m0, 0], fin_bar, buffer)
    mbarrier.wait(fin_bar, fin_phase)
    _bwd_dq_round_out(buffer, DQ, b, h, stride_dqb, stride_dqh, stride_dqt, m0, T, sm_scale)
    return fin_phase ^ 1


@gluon.jit
def _bwd_dq_writer(dq_desc, dq_smem, dq_full, dq_empty, fin_bar, SEM, DQ, stride_dqb, stride_dqh, stride_dqt, b, hk,
                   n_blk, m_first, n_m, n_m_total, n_blocks, GROUP, H, T, sm_scale, BLOCK_M: gl.constexpr,
                   BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr, DETERMINISTIC: gl.constexpr,
                   FIRST_STORE: gl.constexpr, FINISH: gl.constexpr):
    """1 warp: adds each of this key tile's dQ shares (unscaled, from the compute partition's double buffer) into
    rows m_idx * BLOCK_M.. of the FP32 buffer (B, H, T, head_dim) with one TMA reduce-add, so the compute warps
    never wait on global memory (FA3's dQ writer). Rows past T are not written (TMA bounds).

    DETERMINISTIC: the key tiles that touch a query tile add in a fixed order, from the last to the first: a
    per-(head, query tile) counter in SEM says how many have added; this tile waits for its turn (acquire), adds,
    waits until the add is performed in global memory, and counts itself (release). So every element of dQ sums its
    shares in the same order on every run: bit-reproducible. Otherwise the adds land in the order the tiles finish
    (the same FP32 sums in another order). FIRST_STORE: the tile whose turn is first in the ordered mode stores its
    share instead (the buffer starts unwritten); without DETERMINISTIC it then raises the counter, and the other
    tiles wait only for that before they add. FINISH: the tile that adds last also writes the query tile's dQ =
    LP(sm_scale * sum) (``_bwd_dq_finish``), which the dQ finishing launch does otherwise: with DETERMINISTIC the
    last turn (key tile 0); else (FIRST_STORE) the one whose performed add brings the counter to the number of
    adds."""
    lane: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])
    token = gl.zeros([32], gl.int32, lane)
    fin_phase = 0
    for it in range(GROUP * n_m):
        h = hk * GROUP + it // n_m
        m_idx = m_first + it % n_m
        buf = it % 2
        mbarrier.wait(dq_full.index(buf), (it // 2) & 1)
        if FINISH:
            complete = gl.to_tensor(False)  # whether this tile's add is the query tile's last
        if DETERMINISTIC or FIRST_STORE:
            if CAUSAL:
                last = gl.minimum(n_blocks - 1, ((m_idx + 1) * BLOCK_M - 1) // BLOCK_N)  # the last key tile it sees
            else:
                last = n_blocks - 1
            sem = SEM + (b * H + h) * n_m_total + m_idx
        if DETERMINISTIC:
            seen = gl.atomic_add(sem, 0, sem="acquire", scope="gpu")
            while seen != last - n_blk:
                seen = gl.atomic_add(sem, 0, sem="acquire", scope="gpu")
            token = _async_proxy_acquire(token)
            if FIRST_STORE:
                if n_blk == last:  # turn 0: nothing is in these rows yet
                    _tma_store(dq_desc, [b, h, m_idx * BLOCK_M, 0], dq_smem.index(buf))
                else:
                    _tma_reduce_add(dq_desc, [b, h, m_idx * BLOCK_M, 0], dq_smem.index(buf))
            else:
                _tma_reduce_add(dq_desc, [b, h, m_idx * BLOCK_M, 0], dq_smem.index(buf))
            token = _bulk_writes_done(token)
            _barrier()  # the lane that waited for the add precedes the lane that releases the counter
            gl.atomic_add(sem, 1, sem="release", scope="gpu")
            if FINISH:
                complete = n_blk == 0  # the last turn (its add performed: the wait above)
        elif FIRST_STORE:  # atomic order behind a stored first share
            if n_blk == last:
                _tma_store(dq_desc, [b, h, m_idx * BLOCK_M, 0], dq_smem.index(buf))
                token = _bulk_writes_done(token)
                _barrier()  # the lane that waited for the store precedes the lane that raises the flag
                gl.atomic_add(sem, 1, sem="release", scope="gpu")
                if FINISH:
                    complete = last == 0  # the only share
            else:
                seen = gl.atomic_add(sem, 0, sem="acquire", scope="gpu")
                while seen == 0:
                    seen = gl.atomic_add(sem, 0, sem="acquire", scope="gpu")
                token = _async_proxy_acquire(token)
                _tma_reduce_add(dq_desc, [b, h, m_idx * BLOCK_M, 0], dq_smem.index(buf))
                if FINISH:  # count the add once it is performed: the tile that brings the count to last finishes
                    token = _bulk_writes_done(token)
                    _barrier()  # the lane that waited for the add precedes the lane that counts it
                    before = gl.atomic_add(sem, 1, sem="acq_rel", scope="gpu")
                    complete = before == last  # the stored share and every other add are in
                else:
                    tma.store_wait(0)
        else:
            _tma_reduce_add(dq_desc, [b, h, m_idx * BLOCK_M, 0], dq_smem.index(buf))
            tma.store_wait(0)
        if FINISH:
            if complete:
                token = _async_proxy_acquire(token)  # the TMA load below after what the counter showed
                fin_phase = _bwd_dq_finish(dq_desc, dq_smem.index(buf), fin_bar, fin_phase, DQ, b, h, stride_dqb,
                                           stride_dqh, stride_dqt, m_idx * BLOCK_M, T, sm_scale)
        mbarrier.arrive(dq_empty.index(buf), count=1)


@gluon.jit
def _bwd_kernel(k_desc, v_desc, q_desc, do_desc, LSE, DELTA, DQ32, SEM, DK, DV, DQ, stride_dkb, stride_dkh,
                stride_dkt, stride_dvb, stride_dvh, stride_dvt, stride_dqb, stride_dqh, stride_dqt, H, GROUP, T,
                exp_scale, sm_scale, CAUSAL: gl.constexpr, DETERMINISTIC: gl.constexpr, STAGES: gl.constexpr,
                ROWS_TMA: gl.constexpr, DQ_UNDER_DK: gl.constexpr, PRODUCER_REGS: gl.constexpr,
                WRITER_REGS: gl.constexpr, FIRST_STORE: gl.constexpr, DKV_TMA: gl.constexpr, FINISH: gl.constexpr):
    """dK, dV of one key tile of one k/v head (summed over its GROUP query heads) and its shares of dQ. Key tiles
    run from the last to the first in launch order when DETERMINISTIC or FIRST_STORE (a tile only waits for tiles
    launched before it, so the order cannot deadlock however few of them are resident, and the causal ones are the
    shortest first, as FA3 orders them), else from the first (the heaviest causal ones) to the last. DQ32: a TMA
    descriptor of dQ's FP32 buffer; DQ: dQ itself, written here when FINISH."""
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[2]
    HEAD_DIM: gl.constexpr = k_desc.block_type.shape[3]
    BLOCK_M: gl.constexpr = q_desc.block_type.shape[2]
    dtype: gl.constexpr = k_desc.dtype
    n_blocks = gl.cdiv(T, BLOCK_N)
    if DETERMINISTIC or FIRST_STORE:  # a tile may wait for a later key tile of its head: launched before it
        n_blk = n_blocks - 1 - gl.program_id(0)
    else:
        n_blk = gl.program_id(0)
    start_n = n_blk * BLOCK_N
    bhk = gl.program_id(1)
    h_kv = H // GROUP
    b = bhk // h_kv
    hk = bhk % h_kv
    n_m_total = gl.cdiv(T, BLOCK_M)
    if CAUSAL:
        m_first = start_n // BLOCK_M
    else:
        m_first = 0
    n_m = n_m_total - m_first

    k_smem = gl.allocate_shared_memory(dtype, k_desc.block_type.shape, k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, v_desc.block_type.shape, v_desc.layout)
    q_smem = gl.allocate_shared_memory(dtype, [STAGES] + q_desc.block_type.shape, q_desc.layout)
    do_smem = gl.allocate_shared_memory(dtype, [STAGES] + do_desc.block_type.shape, do_desc.layout)
    ds_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_M], dtype)
    ds_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, BLOCK_M], ds_layout)
    if ROWS_TMA:  # LSE and DELTA are 2-D (B * H, T) descriptors of blocks [1, BLOCK_M]
        lse_smem = gl.allocate_shared_memory(gl.float32, [STAGES] + LSE.block_type.shape, LSE.layout)
        delta_smem = gl.allocate_shared_memory(gl.float32, [STAGES] + DELTA.block_type.shape, DELTA.layout)
    else:
        lse_smem = ds_smem  # unused
        delta_smem = ds_smem
    kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    qdo_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    qdo_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    dq_full = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    dq_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_bar, count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(qdo_ready.index(i), count=1)
        mbarrier.init(qdo_empty.index(i), count=1)
    for i in gl.static_range(2):
        mbarrier.init(dq_full.index(i), count=1)
        mbarrier.init(dq_empty.index(i), count=1)
    if FINISH:  # the writer's loads of finished sums
        fin_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        mbarrier.init(fin_bar, count=1)
    else:
        fin_bar = kv_bar  # unused
    fence_async_shared()

    # dQ's shares, double-buffered between the compute partition and the writer warp
    dq_smem = gl.allocate_shared_memory(gl.float32, [2] + DQ32.block_type.shape, DQ32.layout)
    gl.warp_specialize([
        (_bwd_compute, (k_smem, v_smem, q_smem, do_smem, ds_smem, dq_smem, lse_smem, delta_smem, kv_bar, qdo_ready,
                        qdo_empty, dq_full, dq_empty, LSE, DELTA, DK, DV, stride_dkb, stride_dkh, stride_dkt,
                        stride_dvb, stride_dvh, stride_dvt, b, hk, start_n, m_first, n_m, GROUP, H, T, exp_scale,
                        sm_scale, BLOCK_M, BLOCK_N, HEAD_DIM, STAGES, CAUSAL, ROWS_TMA, DQ_UNDER_DK, DKV_TMA)),
        (_bwd_producer, (k_desc, v_desc, q_desc, do_desc, LSE, DELTA, k_smem, v_smem, q_smem, do_smem, lse_smem,
                         delta_smem, kv_bar, qdo_ready, qdo_empty, b, hk, start_n, m_first, n_m, GROUP, H, BLOCK_M,
                         STAGES, ROWS_TMA)),
        (_bwd_dq_writer, (DQ32, dq_smem, dq_full, dq_empty, fin_bar, SEM, DQ, stride_dqb, stride_dqh, stride_dqt, b,
                          hk, n_blk, m_first, n_m, n_m_total, n_blocks, GROUP, H, T, sm_scale, BLOCK_M, BLOCK_N,
                          CAUSAL, DETERMINISTIC, FIRST_STORE, FINISH)),
    ], [1, 1], [PRODUCER_REGS, WRITER_REGS])


# ----------------------------------------------------------------------------------------------------------------
# Host side
# ----------------------------------------------------------------------------------------------------------------

_GL_DTYPES = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}
_GLUON_FIX_CODES = tuple(FIX_CODE[f] for f in GLUON_FIXES)


def _rows_descriptor(t: torch.Tensor, rows: int) -> TensorDescriptor:
    """A 4-D (batch, heads, seq, head_dim) TMA descriptor of t whose block is ``rows`` rows of one head; rows past
    the sequence are zero-filled on load and not written by a store or reduce."""
    block = [1, 1, rows, t.shape[-1]]
    layout = gl.NVMMASharedLayout.get_default_for(block, {torch.float32: gl.float32, **_GL_DTYPES}[t.dtype])
    return TensorDescriptor(t, list(t.shape), list(t.stride()), block, layout)

_SM90: dict = {}  # CUDA device index -> whether it is a Hopper GPU (compute capability 9.x)


def _row_vectors_descriptor(x: torch.Tensor, rows: int):
    """A TMA descriptor of a contiguous FP32 (B, H, T) tensor (LSE, delta) seen as (B * H, T), blocks of ``rows``
    positions of one head, or None where TMA cannot address it (T * 4 bytes not a multiple of 16)."""
    bsz, heads, seq = x.shape
    if seq % 4 or not x.is_contiguous() or x.data_ptr() % 16:
        return None
    block = [1, rows]
    layout = gl.NVMMASharedLayout.get_default_for(block, gl.float32)
    return TensorDescriptor(x.view(bsz * heads, seq), [bsz * heads, seq], [seq, 1], block, layout)


def unsupported(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, nm: Numerics) -> str | None:
    """Why this kernel cannot run the call (None if it can): the numerics it implements, a Hopper GPU, 16-bit
    inputs, head_dim 64 or 128, and what TMA needs (16-byte aligned base addresses and strides)."""
    if nm.paper:
        return "rounding=paper has its own rounding points (the Triton kernel implements them)"
    if nm.fix not in _GLUON_FIX_CODES:
        return "the dynamic-maximum fixes shift the softmax maximum per tile (the Triton kernel implements them)"
    if nm.output_amplified or nm.exact_pass:
        return "the output stress and the exact delta pass are the Triton kernel's"
    if q.device.type != "cuda":
        return "it needs a CUDA GPU"
    device = q.device.index
    if device not in _SM90:
        _SM90[device] = torch.cuda.get_device_capability(device)[0] == 9
    if not _SM90[device]:
        return "it is written for Hopper (sm_90): warpgroup MMA and TMA"
    if q.dtype not in _GL_DTYPES:
        return f"it takes bf16 or fp16 inputs, not {q.dtype}"
    if q.shape[-1] not in GLUON_HEAD_DIMS:
        return f"head_dim {q.shape[-1]} is not one of {GLUON_HEAD_DIMS}"
    for t in (q, k, v):
        size = t.element_size()
        if t.stride(-1) != 1 or t.data_ptr() % 16 or any(st * size % 16 for st in t.stride()[:-1]):
            return "TMA needs 16-byte aligned base addresses and strides"
    return None


_SM_COUNT: dict = {}


def _programs(device, per_sm: int) -> int:
    """Programs of a persistent launch: ``per_sm`` per streaming multiprocessor (0: unbounded, i.e. one per tile)."""
    if per_sm <= 0:
        return 1 << 30
    if device.index not in _SM_COUNT:
        _SM_COUNT[device.index] = torch.cuda.get_device_properties(device).multi_processor_count
    return per_sm * _SM_COUNT[device.index]


def _new(shape, dtype, device, fill: float | None = None) -> torch.Tensor:
    if fill is None:
        return torch.empty(shape, dtype=dtype, device=device)
    return torch.full(shape, fill, dtype=dtype, device=device)


def _heads_per_section(q: torch.Tensor, k: torch.Tensor) -> int:
    """The forward's section width (``_fwd_tile``): as many (batch, head) pairs as share K and V that fit
    FWD_L2_SECTION_BYTES (query heads of one k/v head share its tiles), at least one; every head when 0."""
    bsz, heads, seq, dim = q.shape
    pairs = bsz * heads
    if not FWD_L2_SECTION_BYTES:
        return pairs
    kv_bytes = 2 * seq * dim * k.element_size()  # K and V of one k/v head
    return max(1, min(pairs, FWD_L2_SECTION_BYTES * (heads // k.shape[1]) // kv_bytes))


def _forward(q, k, v, causal: bool, nm: Numerics, head_offset: int = 0, noise_keys=None, fill: float | None = None):
    """(O like q, LSE (B, H, T) FP32, the FP32 O where the mode keeps it, else an empty tensor); every tensor
    last-dim contiguous and ``unsupported`` None. Same contract as kernels.triton_flash's forward."""
    out, lse, o32 = triton_flash._forward_outputs(q, nm.keeps_fp32_output, fill)
    keys = triton_flash._keys_arg(nm, noise_keys, q.shape[0], q.device)
    grid, args, options = _fwd_launch(q, k, v, out, lse, o32, keys, causal, nm, head_offset)
    _fwd_kernel[grid](*args, **options)
    return out, lse, o32


def _fwd_launch(q, k, v, out, lse, o32, keys, causal: bool, nm: Numerics, head_offset: int = 0,
                programs: int | None = None, **choices):
    """(grid, arguments, compile-time options) of the forward's launch, as ``_forward`` makes it and
    kernels.offline_compile compiles it. ``programs``: the persistent grid's size (default FWD_PERSISTENT per
    streaming multiprocessor of q's GPU); ``choices``: DYNAMIC, Q_SLOTS, ROW_DIVIDE, O_TMA or LAG in place of the
    module's FWD_ values."""
    bsz, heads, seq, dim = q.shape
    choice = dict(DYNAMIC=FWD_DYNAMIC, Q_SLOTS=FWD_Q_SLOTS, ROW_DIVIDE=FWD_ROW_DIVIDE, O_TMA=FWD_O_TMA, LAG=FWD_LAG)
    unknown = set(choices) - set(choice)
    if unknown:
        raise ValueError(f"_fwd_launch: unknown choices {sorted(unknown)}; known: {sorted(choice)}")
    choice.update(choices)
    half = FWD_BLOCK_M // 2
    work = triton.cdiv(seq, FWD_BLOCK_M) * bsz * heads
    grid = (min(work, _programs(q.device, FWD_PERSISTENT) if programs is None else programs), )
    dynamic = choice["DYNAMIC"] and grid[0] < work  # with a program per tile there is nothing left to take
    counter = torch.zeros(1, dtype=torch.int32, device=q.device) if dynamic else lse  # (unused when static)
    o_tma, o32_tma = _fwd_store_plan(nm.keeps_fp32_output, dim, choice["Q_SLOTS"], choice["O_TMA"])
    o_arg = _rows_descriptor(out, half) if o_tma else out
    o32_arg = _rows_descriptor(o32, half) if o32_tma else o32
    args = (_rows_descriptor(q, half), _rows_descriptor(k, FWD_BLOCK_N), _rows_descriptor(v, FWD_BLOCK_N), o_arg,
            o32_arg, lse, keys, counter, out.stride(0), out.stride(1), out.stride(2), heads, heads // k.shape[1], seq,
            bsz * heads, _heads_per_section(q, k), int(head_offset), nm.exp_scale)
    options = dict(BLOCK_N=FWD_BLOCK_N, HEAD_DIM=dim, STAGES=FWD_STAGES[dim], CAUSAL=bool(causal), FIX=nm.fix,
                   STORE_O32=nm.keeps_fp32_output, PINGPONG=FWD_PINGPONG, DYNAMIC=dynamic, Q_SLOTS=choice["Q_SLOTS"],
                   ROW_DIVIDE=choice["ROW_DIVIDE"], O_TMA=o_tma, O32_TMA=o32_tma, LAG=choice["LAG"],
                   CONSUMER_REGS=FWD_CONSUMER_REGS, PRODUCER_REGS=FWD_PRODUCER_REGS, num_warps=4, maxnreg=MAXNREG)
    return grid, args, options


def _fwd_store_plan(store_o32: bool, head_dim: int, q_slots: int, o_tma_wanted: bool | None = None):
    """(O_TMA, O32_TMA): whether the bf16 O (FWD_O_TMA, or ``o_tma_wanted``) and the FP32 O (FWD_O32_TMA, where
    the mode keeps it) go through shared-memory buffers and TMA stores, each where its two buffers (one per
    consumer) still fit beside Q's slots and the K/V ring, the bf16 O's first (at head_dim 128 with the FP32 O, or
    with two Q slots, the FP32 O's 64 KiB do not fit)."""
    half = FWD_BLOCK_M // 2
    used = 2 * q_slots * half * head_dim * 2 + FWD_STAGES[head_dim] * 2 * FWD_BLOCK_N * head_dim * 2
    used += 1024  # barriers and alignment
    wanted = FWD_O_TMA if o_tma_wanted is None else o_tma_wanted
    o_tma = wanted and used + 2 * half * head_dim * 2 <= SHARED_MEMORY_BYTES
    used += 2 * half * head_dim * 2 if o_tma else 0
    o32_tma = store_o32 and FWD_O32_TMA and used + 2 * half * head_dim * 4 <= SHARED_MEMORY_BYTES
    return o_tma, o32_tma


def _backward(d_out, q, k, v, o_saved, lse, causal: bool, nm: Numerics, o32=None, noise_keys=None,
              head_offset: int = 0, fill: float | None = None, deterministic: bool = True):
    """(dq, dk, dv): delta (kernels.triton_flash's launch: plain or amplified), the fused launch, then dQ scaled
    and rounded from its FP32 sums (in the fused launch with BWD_DQ_FINISH); every tensor last-dim contiguous and
    TMA-addressable, d_out in q's dtype."""
    delta_launch, delta = triton_flash._delta_launch(d_out, o_saved, nm, o32, noise_keys, head_offset, fill)
    delta_launch()
    dq, dk, dv = triton_flash._backward_outputs(q, k, v, fill)
    grid, args, options, dq32 = _bwd_launch(d_out, q, k, v, lse, delta, dq, dk, dv, causal, nm, deterministic, fill)
    _bwd_kernel[grid](*args, **options)
    if not options["FINISH"]:  # dQ = LP(scale * sums) in a launch of its own
        triton_flash.dq_finish_launch(dq32, dq, nm)()
    return dq, dk, dv


def _bwd_launch(d_out, q, k, v, lse, delta, dq, dk, dv, causal: bool, nm: Numerics, deterministic: bool,
                fill: float | None = None, **choices):
    """(grid, arguments, compile-time options, dQ's FP32 buffer) of the fused backward's launch, as ``_backward``
    makes it and kernels.offline_compile compiles it: the buffer and the per-query-tile counters allocated as the
    options need them; ``choices``: ``_bwd_flags``'s first_store, dkv_tma or finish in place of the module's."""
    bsz, heads, seq, dim = q.shape
    kv_heads = k.shape[1]
    block_m = BWD_BLOCK_M[dim]
    # the options before the buffers: whether a tile's first dQ share is stored decides how dQ's buffer starts
    lse_arg, delta_arg = _row_vectors_descriptor(lse, block_m), _row_vectors_descriptor(delta, block_m)
    rows_tma = BWD_ROWS_TMA and lse_arg is not None and delta_arg is not None
    options = _bwd_flags(deterministic, causal, rows_tma, **choices)
    first_store = options["FIRST_STORE"]
    # FP32 sums of dQ: zeros for the adds, or (first_store) written whole by the first share of each tile
    dq32 = _new((bsz, heads, seq, dim), torch.float32, q.device, fill) if first_store else \
        torch.zeros((bsz, heads, seq, dim), dtype=torch.float32, device=q.device)
    counters = deterministic or first_store  # a turn counter (a first-share flag) per query tile
    sem = torch.zeros(bsz * heads * triton.cdiv(seq, block_m) if counters else 1, dtype=torch.int32,
                      device=q.device)
    if not rows_tma:
        lse_arg, delta_arg = lse, delta
    if options["DKV_TMA"]:  # TMA descriptors of key tiles
        dk_arg, dv_arg = _rows_descriptor(dk, BWD_BLOCK_N), _rows_descriptor(dv, BWD_BLOCK_N)
    else:
        dk_arg, dv_arg = dk, dv
    args = (_rows_descriptor(k, BWD_BLOCK_N), _rows_descriptor(v, BWD_BLOCK_N), _rows_descriptor(q, block_m),
            _rows_descriptor(d_out, block_m), lse_arg, delta_arg, _rows_descriptor(dq32, block_m), sem, dk_arg,
            dv_arg, dq, dk.stride(0), dk.stride(1), dk.stride(2), dv.stride(0), dv.stride(1), dv.stride(2),
            dq.stride(0), dq.stride(1), dq.stride(2), heads, heads // kv_heads, seq, nm.exp_scale, nm.sm_scale)
    grid = (triton.cdiv(seq, BWD_BLOCK_N), bsz * kv_heads)
    return grid, args, options, dq32


def _bwd_flags(deterministic: bool, causal: bool, rows_tma: bool, first_store: bool | None = None,
               dkv_tma: bool | None = None, finish: bool | None = None) -> dict:
    """The backward launch's compile-time options (kernels.offline_compile compiles the same ones); first_store:
    whether a query tile's first dQ share is stored (default: BWD_DQ_FIRST_STORE with ordered dQ,
    BWD_ATOMIC_FIRST_STORE with atomic dQ); dkv_tma: BWD_DKV_TMA's choice; finish: whether the last turn writes dQ
    (BWD_DQ_FINISH's choice; with atomic dQ only behind a stored first share). None: the module's choice."""
    if first_store is None:
        first_store = BWD_DQ_FIRST_STORE if deterministic else BWD_ATOMIC_FIRST_STORE
    if dkv_tma is None:
        dkv_tma = BWD_DKV_TMA
    if finish is None:
        finish = BWD_DQ_FINISH
    return dict(CAUSAL=bool(causal), DETERMINISTIC=bool(deterministic), STAGES=BWD_STAGES, ROWS_TMA=rows_tma,
                DQ_UNDER_DK=BWD_DQ_UNDER_DK, PRODUCER_REGS=BWD_PRODUCER_REGS, WRITER_REGS=BWD_WRITER_REGS,
                FIRST_STORE=bool(first_store), DKV_TMA=bool(dkv_tma),
                FINISH=bool(finish and (deterministic or first_store)),  # the finisher needs the turn counters
                num_warps=8, maxnreg=MAXNREG)


# ----------------------------------------------------------------------------------------------------------------
# The compiled-implementation interface (kernels/ops.py): what runs where
# ----------------------------------------------------------------------------------------------------------------

_SAID: set = set()


def _fallback(reason: str) -> None:
    """Say once per reason that the Triton kernel runs a call the Gluon kernel cannot."""
    if reason not in _SAID:
        _SAID.add(reason)
        print(f"attention: the Gluon kernel cannot run this call ({reason}); the Triton kernel runs it", flush=True)


def _gluon_runs(q, k, v, settings: AttentionSettings, nm: Numerics) -> bool:
    """Whether this call runs the Gluon kernel: it can (``unsupported``), and it was asked for by name, or by
    backend=auto at a head size where it is the faster kernel."""
    reason = unsupported(q, k, v, nm)
    if reason:
        _fallback(reason)
        return False
    return settings.backend == "gluon" or q.shape[-1] in GLUON_AUTO_HEAD_DIMS


prepare = triton_flash.prepare  # the same checks (tensors, devices, noise keys) and numerics
forward_outputs = triton_flash.forward_outputs  # the same allocations: the backward of either kernel takes them
backward_outputs = triton_flash.backward_outputs


def forward(q, k, v, settings: AttentionSettings, nm: Numerics, noise_keys: torch.Tensor | None = None):
    """(O, LSE, FP32 O or an empty tensor, the mode's O: empty, the output stress being the Triton kernel's): the
    Gluon forward, or the Triton kernel's where the Gluon one cannot run the call (its outputs are the same tensors:
    either backward takes them)."""
    q, k, v = (triton_flash._last_dim_contiguous(t) for t in (q, k, v))
    if not _gluon_runs(q, k, v, settings, nm):
        return triton_flash.forward(q, k, v, settings, nm, noise_keys)
    out, lse, o32 = _forward(q, k, v, settings.causal, nm, settings.head_offset, noise_keys, settings.out_fill)
    return out, lse, o32, triton_flash._mode_output(q, False)


def backward(d_out, q, k, v, o_saved, lse, o32, settings: AttentionSettings, nm: Numerics, noise_keys=None):
    """(dq, dk, dv): the fused Gluon backward, or the Triton kernel's where the Gluon one cannot run the call."""
    q, k, v = (triton_flash._last_dim_contiguous(t) for t in (q, k, v))
    if not _gluon_runs(q, k, v, settings, nm):
        return triton_flash.backward(d_out, q, k, v, o_saved, lse, o32, settings, nm, noise_keys)
    if d_out.dtype != q.dtype:
        d_out = d_out.to(q.dtype)
    if unsupported(d_out, d_out, d_out, nm):  # gradients may come with any strides; TMA needs aligned ones
        d_out = d_out.contiguous()
    o_saved = triton_flash._last_dim_contiguous(o_saved)
    return _backward(d_out, q, k, v, o_saved, lse, settings.causal, nm, o32, noise_keys, settings.head_offset,
                     settings.out_fill, settings.deterministic)
