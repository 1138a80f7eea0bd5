#!/usr/bin/env bash
# nvidia-h200, issue 34 call 2: call 1's grids ran at 0.8 s per step with 27 arms (monitor steps of ~17 s each
# under that contention) and were cut at step ~500 of 1,600. Here the cells that decide the claim, to the end:
# fp32_output (fa2 and paper rounding) at g = 200 and 400, both signs, seed 1337, and at g = 400 seed 2024, each
# experiment with its fa2/exact_delta arm, against the exact delta (margin.reference=exact). The monitors run every
# 100 steps instead of 25 and the Q-K update / activation signals are off: monitors do not change training (the
# arms' losses are those of call 1 for the steps both ran), only how often the curves are sampled.
set -f
export PYTHONUNBUFFERED=1 PYTHONPATH=.
mkdir -p $OUT /tmp/x
M="python3 -m analysis.margin margin margin.schedule=full margin.signs=[kept,random] margin.reference=exact margin.max_minutes=7 margin.budget_minutes=0 monitor.spectral_interval=100 monitor.probe_interval=100 monitor.qk_update=false monitor.qk_activation=false"
declare -A GRID=(
  [x34b_fix]="margin.seeds=[1337] margin.numerics=[fa2/fp32_output,paper/fp32_output,fa2/exact_delta] margin.gains=[200,400] margin.processes=9"
  [x34b_fix_s2]="margin.seeds=[2024] margin.numerics=[fa2/fp32_output,paper/fp32_output,fa2/exact_delta] margin.gains=[400] margin.processes=5"
)
for e in "${!GRID[@]}"; do
  setsid nohup $M run.experiment=$e ${GRID[$e]} > /tmp/x/$e.log 2>&1 &
done
wait
for e in "${!GRID[@]}"; do
  $M run.experiment=$e ${GRID[$e]} --report-only > /tmp/x/${e}_report.log 2>&1
  grep -E "DIVERGED|survived|FAILED|KILLED" /tmp/x/$e.log | tail -20
done
set +f
cat /tmp/x/*.log > $OUT/logs.txt
tar czf $OUT/x34b.tgz --exclude=checkpoints runs/x34b_fix runs/x34b_fix_s2
