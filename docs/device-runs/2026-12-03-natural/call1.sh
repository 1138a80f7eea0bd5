#!/usr/bin/env bash
# nvidia-h200, 2026-12-03, issue 34 item 6: a first search for a natural failure (paper/none at gain 1, no
# amplification, diverging while fa2/fp32_output trains on) within one short call. recipes/margin.yaml's setting
# (GPT 6 x 384 on data/cache/gcide, seed 1337, 16,384 tokens per step), 2,400 steps asked, at four learning-rate
# settings, each an experiment of two arms (paper/none and fa2/fp32_output), all eight side by side;
# margin.max_minutes stops them with a checkpoint before the call's limit, so the table says how far each got.
set -f
export PYTHONUNBUFFERED=1
mkdir -p $OUT /tmp/w
M="python3 -m analysis.margin margin margin.schedule=full margin.signs=[kept] margin.seeds=[1337] margin.gains=[1]
   margin.numerics=[paper/none,fa2/fp32_output] margin.processes=2 margin.budget_minutes=0 margin.max_minutes=3.8
   run.max_steps=2400 monitor.spectral_interval=100 monitor.probe_interval=100 monitor.qk_layers=[1]"
declare -A GRID=(
  [nf_lr2e3]=""
  [nf_lr4e3]="optim.lr=4e-3 optim.min_lr=4e-3"
  [nf_lr8e3]="optim.lr=8e-3 optim.min_lr=8e-3"
  [nf_lr8e3_w50]="optim.lr=8e-3 optim.min_lr=8e-3 optim.warmup_steps=50"
)
for e in "${!GRID[@]}"; do
  setsid nohup $M run.experiment=$e ${GRID[$e]} > /tmp/w/$e.log 2>&1 &
done
wait
set +f
for e in "${!GRID[@]}"; do
  $M run.experiment=$e ${GRID[$e]} --report-only > /dev/null 2>&1
  cp /tmp/w/$e.log $OUT/; cp runs/$e/margin_report/margin.md $OUT/${e}_margin.md 2>/dev/null
  echo "== $e ${GRID[$e]}"; grep -E "^\| (paper|fa2)-" runs/$e/margin_report/margin.md | cut -d'|' -f2,5,6,7 | cut -c1-160
  for l in runs/$e/seed_1337/logs/*.log; do echo "$(basename $l): $(grep ' step ' $l | tail -1 | cut -c1-110)"; done
done
