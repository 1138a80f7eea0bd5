"""A model of the Gluon forward's persistent schedule: how long its busiest program works, against the mean.

    python -m benchmarks.forward_schedule [--shapes 8,12,1024,64 4,16,2048,128 4,16,4096,128] [--programs 132]

Causal query blocks differ in length (block m of 128 rows reads m + 1 key tiles of 128), so a schedule that fixes
each program's share in advance (program i takes tiles i, i + programs, ...) leaves programs idle at the end; one
that hands the next tile to whichever program finishes first (the kernel's tile counter) does not. This script
replays both on a model: a tile costs its key tiles + 1 (the epilogue and the Q load), every program runs at the
same speed, and nothing else (memory, L2) is modelled. It prints, per shape, the busiest program's work over the
mean for the static and the dynamic schedule, over every head at once and in L2 sections (the kernel's section
width for FWD_L2_SECTION_BYTES). It mirrors the tile order of ``kernels.gluon_flash._fwd_tile`` in Python (a Gluon
function cannot run on a CPU); the measured effect of the same choices is in docs/attention-kernel.md (Speed,
2026-12-04). No GPU needed; 132 programs is an H100/H200 (one per SM).
"""

from __future__ import annotations

import argparse
import heapq
import sys

import torch

from kernels import gluon_flash

BLOCK = gluon_flash.FWD_BLOCK_M  # query rows per tile (and keys per key tile: FWD_BLOCK_N is the same)


def tile_order(pairs: int, n_m: int, section: int) -> list[tuple[int, int]]:
    """(query block, batch x head) of every tile in schedule order: sections of ``section`` pairs (the last one may
    be smaller), within a section the last (heaviest causal) query block first, each over the section's pairs."""
    order = []
    for t in range(pairs * n_m):
        first_pair = (t // (section * n_m)) * section
        width = min(section, pairs - first_pair)
        r = t - first_pair * n_m
        order.append((n_m - 1 - r // width, first_pair + r % width))
    return order


def tile_cost(block: int) -> int:
    return (block + 1) + 1  # the key tiles up to the diagonal, plus one for the epilogue


def busiest_over_mean(order: list[tuple[int, int]], programs: int, dynamic: bool) -> float:
    """The busiest program's work over the mean work per program, for the static share or the dynamic counter."""
    costs = [tile_cost(block) for block, _ in order]
    if dynamic:  # the first tile of each program is its index; then whichever program is free takes the next
        finish = [(0, i) for i in range(programs)]
        for cost in costs:
            done, i = heapq.heappop(finish)
            heapq.heappush(finish, (done + cost, i))
        busiest = max(done for done, _ in finish)
    else:
        busiest = max(sum(costs[i::programs]) for i in range(programs))
    return busiest / (sum(costs) / programs)


def section_width(batch: int, heads: int, seq: int, head_dim: int) -> int:
    """The kernel's own section width (kernels.gluon_flash._heads_per_section) for bf16 inputs of this shape."""
    q = torch.empty(batch, heads, seq, head_dim, dtype=torch.bfloat16, device="meta")
    return gluon_flash._heads_per_section(q, q)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="+", default=["8,12,1024,64", "4,16,2048,128", "4,16,4096,128"],
                        help="B,H,T,D per shape (causal)")
    parser.add_argument("--programs", type=int, default=132, help="persistent programs (one per SM)")
    args = parser.parse_args(argv)
    try:
        shapes = [tuple(int(x) for x in s.split(",")) for s in args.shapes]
        if any(len(s) != 4 or min(s) < 1 for s in shapes) or args.programs < 1:
            raise ValueError
    except ValueError:
        print("forward_schedule: --shapes takes B,H,T,D with four positive integers, --programs a positive one",
              file=sys.stderr)
        return 2
    print(f"busiest program's work / mean work, {args.programs} programs, tile cost = key tiles + 1")
    print("| B,H,T,D | tiles | section (pairs) | static, all heads | dynamic, all heads | static, sections | "
          "dynamic, sections |")
    print("|---|---|---|---|---|---|---|")
    for b, h, t, d in shapes:
        pairs, n_m = b * h, -(-t // BLOCK)
        width = section_width(b, h, t, d)
        every, sectioned = tile_order(pairs, n_m, pairs), tile_order(pairs, n_m, width)
        cells = [busiest_over_mean(o, args.programs, dyn) for o in (every, sectioned) for dyn in (False, True)]
        print(f"| {b},{h},{t},{d} | {pairs * n_m} | {width} | " + " | ".join(f"{c:.3f}" for c in cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
