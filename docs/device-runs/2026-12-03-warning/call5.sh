#!/usr/bin/env bash
# nvidia-h200, issue 33: switch_fix under the default rule the GPU calibration chose (layer 1's qk_act_drop >
# 0.8647, the tie rate off; launcher/config.py), on the two arms call1.sh used: paper/none g = 50 and fa2/none
# g = 100, kept sign, seed 1337, recipes/margin.yaml's setting (they diverged at steps 810/760 and 1,050/1,040 without
# a fix, call 1 and the calibration grid). Only the default rule, no threshold override; Q-K monitors on layer 1.
# margin.max_minutes keeps the call inside the session's last device minutes (an arm it stops says at which step).
set -f
export PYTHONUNBUFFERED=1
mkdir -p $OUT /tmp/w
M="python3 -m analysis.margin margin margin.schedule=full margin.signs=[kept] margin.seeds=[1337] margin.processes=1
   margin.budget_minutes=0 margin.max_minutes=${MAX_MINUTES:-2.5} monitor.qk_layers=[1] monitor.on_warning=switch_fix"
setsid nohup $M run.experiment=sd_paper margin.numerics=[paper/none] margin.gains=[50] > /tmp/w/sd_paper.log 2>&1 &
setsid nohup $M run.experiment=sd_fa2 margin.numerics=[fa2/none] margin.gains=[100] > /tmp/w/sd_fa2.log 2>&1 &
wait
set +f
for e in sd_paper sd_fa2; do
  cp /tmp/w/$e.log $OUT/; mkdir -p $OUT/$e
  for d in runs/$e/seed_1337/*/; do
    a=$(basename "$d")
    for f in changes.yaml status.yaml arm.log; do [ -f "$d$f" ] && cp "$d$f" "$OUT/$e/${a}_$f"; done
  done
  echo "== $e"; grep -E "DIVERGED|survived|WARNING|switch|stopped" /tmp/w/$e.log $OUT/$e/*arm.log | tail -6
done
