#!/usr/bin/env bash
# nvidia-h200, issue 34 call 1: is fp32_output's delta bias-free? Margin grids against the exact delta
# (margin.reference=exact: delta = delta_exact + g * s * (delta_mode - delta_exact), delta_exact = rowsum(P * dP) /
# rowsum(P) with the backward's own FP32 P), three experiments side by side on one GPU (27 arms of 1,600 steps,
# recipes/margin.yaml: GPT 6 x 384, dictionary text), every cell run (schedule=full), both signs:
#   x34_fix:    seed 1337, fa2/fp32_output and paper/fp32_output at g = 200, 400, 800, and fa2/exact_delta (no error
#               against exact: one arm, a stable member of the median);
#   x34_fix_s2: seed 2024, the same fixes at g = 400 (the second seed on the middle gain);
#   x34_none:   seed 1337, fa2/none and fa2/stochastic_output at g = 100 and 300, and fa2/exact_delta.
# Gains: the residual delta_fp32 - delta_exact was ~2.3x smaller than fa2/none's O-rounding error in an emulation
# (issue 34), and fa2/none diverged from g = 100 (kept) against the FP32 reference (docs/results.md), so
# fp32_output's margin, if it has one within reach, should lie around g = 200-800.
# Beside them, the conformance suite on the H200 (Triton kernel at fixed tiles, and the Gluon kernel).
# margin.max_minutes=8.3 stops every arm with a checkpoint if the grids are not done; the same script continues.
set -f  # the grid lists are passed unquoted: no globbing of their brackets
export PYTHONUNBUFFERED=1 PYTHONPATH=.
mkdir -p $OUT /tmp/x
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $OUT/machine.txt
git log --oneline -1 >> $OUT/machine.txt 2>/dev/null
M="python3 -m analysis.margin margin margin.schedule=full margin.signs=[kept,random] margin.reference=exact margin.max_minutes=8.3 margin.budget_minutes=0"
declare -A GRID=(
  [x34_fix]="margin.seeds=[1337] margin.numerics=[fa2/fp32_output,paper/fp32_output,fa2/exact_delta] margin.gains=[200,400,800] margin.processes=13"
  [x34_fix_s2]="margin.seeds=[2024] margin.numerics=[fa2/fp32_output,paper/fp32_output,fa2/exact_delta] margin.gains=[400] margin.processes=5"
  [x34_none]="margin.seeds=[1337] margin.numerics=[fa2/none,fa2/stochastic_output,fa2/exact_delta] margin.gains=[100,300] margin.processes=9"
)
for e in "${!GRID[@]}"; do
  setsid nohup $M run.experiment=$e ${GRID[$e]} > /tmp/x/$e.log 2>&1 &
done
set +f
( timeout 420 python3 -m kernels.conformance --backend triton --fixed-tiles --rows 8192 --long-keys 8192 \
    --out $OUT/conformance-h200-triton.md > $OUT/conformance-triton.log 2>&1
  timeout 120 python3 -m kernels.conformance --backend gluon --rows 8192 --long-keys 8192 \
    --kernels fa2/none fa2/fp32_output fa2/stochastic_output \
    --out $OUT/conformance-h200-gluon.md > $OUT/conformance-gluon.log 2>&1 ) &
wait
set -f
for e in "${!GRID[@]}"; do  # the reports (arms.json) also when max_minutes stopped a grid before its end
  $M run.experiment=$e ${GRID[$e]} --report-only > /tmp/x/${e}_report.log 2>&1
  cp /tmp/x/$e.log /tmp/x/${e}_report.log $OUT/; mkdir -p $OUT/$e; cp runs/$e/margin_report/* $OUT/$e/ 2>/dev/null
  grep -E "DIVERGED|survived|FAILED|KILLED" /tmp/x/$e.log | tail -30
done
tar czf /tmp/x/events.tgz --exclude=checkpoints runs/x34_fix runs/x34_fix_s2 runs/x34_none
split -b 15M /tmp/x/events.tgz $OUT/events.tgz.
tail -5 $OUT/conformance-*.log
