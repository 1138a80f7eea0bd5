#!/usr/bin/env bash
# nvidia-h200, issue 34's open grids: `bash docs/device-runs/2026-12-04/grids.sh PART`,
# carry data/cache/gcide (docs/device-runs/2026-12-02-warning/prepare_data.sh). One part per device call; each
# stops its arms with checkpoints at margin.max_minutes (MAX_MINUTES, default 8) and the same command continues
# them while the machine stays warm (the runs/ folder survives between calls of one lease only).
#   exact_fa2    exact-referenced margins (margin.reference=exact) of fa2/none, fa2/stochastic_output and
#                fa2/dynamic_max at g = 100, 200, both signs, seed 1337 (12 arms; fa2/exact_delta runs in exact_paper)
#   exact_paper  the same for paper/none, paper/stochastic_output, paper/dynamic_max at g = 20, 50, 100 (19 arms)
#   exact_paper_fp32  paper/fp32_output against the exact delta at g = 50, 100, both signs (4 arms), beside
#                exact_paper: the 2026-12-02 grid ran it at g >= 200 only
#   decide       paper/stochastic_output and paper/fp32_output against the exact delta at g = 200, both signs,
#                seeds 1337 and 2024 (8 arms): the cells that decide the paper-rounding recipes' fix
#   output       the forward stress (margin.stress=output: O the next layer sees = LP(O32 + g s (O_mode - O32)))
#                of fa2/none, paper/none and fa2/fp32_output (its forward O is the BF16 one of fa2/none, its delta
#                clean) at g = 10, 100, 1000, both signs (18 arms); gains not probed before: a first bracket
#   tokens4x     item 5: recipes/margin.yaml at 4x the tokens per step (global batch 256 in 4 micro-batches of
#                64, the same 1,600 steps): paper/none and fa2/none at g = 20, 50, 100, both signs, +
#                fa2/fp32_output (13 arms; ~4x the GPU work per step: expect two calls)
# Monitors: W_Q spectra every 100 steps, the probe every 25 (tie rate, delta bias of layer 1, the pre-softmax
# score entropy the early warning reads: each grid is also a third grid for the warning of issue 33, seen by
# neither its calibration nor its held-out step), the Q-K update spectra off (its SVDs are the monitors' slow part).
# Sizing (estimates): this session's 16-arm grids with every monitor every 25 steps took ~11 min for 1,600 steps;
# issue 34's 14-arm exact grid with monitors every 100 and no Q-K signals took 4.6 min.
set -f  # the grid lists are passed unquoted: no globbing of their brackets
export PYTHONUNBUFFERED=1 PYTHONPATH=.
part=$1
mkdir -p $OUT /tmp/p34
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $OUT/machine_$part.txt
M="python3 -m analysis.margin margin margin.schedule=full margin.signs=[kept,random] margin.seeds=[1337]
   margin.budget_minutes=0 margin.max_minutes=${MAX_MINUTES:-8} monitor.spectral_interval=100
   monitor.probe_interval=${PROBE:-25} monitor.qk_update=false monitor.qk_layers=[1] run.experiment=p34_$part"
case $part in
  exact_fa2)   G="margin.reference=exact margin.numerics=[fa2/none,fa2/stochastic_output,fa2/dynamic_max]
                  margin.gains=[100,200] margin.processes=12" ;;  # g = 50 dropped for device time (2026-12-04)
  exact_paper) G="margin.reference=exact margin.numerics=[paper/none,paper/stochastic_output,paper/dynamic_max,fa2/exact_delta]
                  margin.gains=[20,50,100] margin.processes=19" ;;
  exact_paper_fp32) G="margin.reference=exact margin.numerics=[paper/fp32_output] margin.gains=[50,100]
                  margin.processes=4" ;;  # below the g = 200 where its kept sign diverged (2026-12-02)
  decide)      G="margin.reference=exact margin.numerics=[paper/stochastic_output,paper/fp32_output] margin.gains=[200]
                  margin.seeds=[1337,2024] margin.processes=8" ;;  # the cells that pick the paper recipes' fix
  output)      G="margin.stress=output margin.numerics=[fa2/none,paper/none,fa2/fp32_output] margin.gains=[10,100,1000]
                  margin.processes=18" ;;
  tokens4x)    G="data.global_batch_size=256 data.micro_batch_size=64 margin.numerics=[paper/none,fa2/none,fa2/fp32_output]
                  margin.gains=[20,50,100] margin.processes=13" ;;
  *) echo "usage: bash grids.sh exact_fa2|exact_paper|exact_paper_fp32|decide|output|tokens4x" >&2; exit 2 ;;
esac
$M $G > /tmp/p34/$part.log 2>&1
$M $G --report-only > /tmp/p34/${part}_report.log 2>&1  # the report also when max_minutes stopped the grid
set +f
grep -E "DIVERGED|survived|stopped|spent" /tmp/p34/$part.log | tail -25
cp /tmp/p34/$part*.log $OUT/
tar czf $OUT/$part.tgz --exclude=checkpoints --exclude='*.png' runs/p34_$part 2>/dev/null
ls -la $OUT
