#!/usr/bin/env bash
# nvidia-h200, 2026-12-03, issue 33: does monitor.on_warning=switch_fix keep alive a margin arm that diverges
# without it? Four one-arm margin experiments side by side, seed 1337, kept sign, recipes/margin.yaml's setting
# (GPT 6 x 384 on data/cache/gcide, 1,600 steps): paper/none at g = 50 and fa2/none at g = 100 (they diverged at
# steps 730 and 1,050 in the 2026-12-01 margin grid), each once with on_warning=log (sw_off_*) and once with
# switch_fix (sw_on_*: attention.fix -> fp32_output at the onset). Warning rule: the default (layer 1's tie rate >
# 0.04) and, so that fa2 arms can warn at all, layer 1's first-order Q-K update entropy drop > 0.4638 (the
# threshold of the CPU toy calibration, docs/device-runs/2026-12-02-warning/cpu_calibration/: not a GPU
# calibration). Monitors every 25 steps, Q-K monitors on layer 1 only. margin.max_minutes stops every arm with a
# checkpoint before the call's limit.
set -f  # the grid lists are passed unquoted: no globbing of their brackets
export PYTHONUNBUFFERED=1
mkdir -p $OUT /tmp/w
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $OUT/machine.txt
M="python3 -m analysis.margin margin margin.schedule=full margin.signs=[kept] margin.seeds=[1337] margin.processes=1
   margin.budget_minutes=0 margin.max_minutes=7 monitor.qk_layers=[1] monitor.warning_qk_update_drop=0.4638"
PAPER="margin.numerics=[paper/none] margin.gains=[50]"
FA2="margin.numerics=[fa2/none] margin.gains=[100]"
setsid nohup $M run.experiment=sw_off_paper $PAPER > /tmp/w/sw_off_paper.log 2>&1 &
setsid nohup $M run.experiment=sw_on_paper $PAPER monitor.on_warning=switch_fix > /tmp/w/sw_on_paper.log 2>&1 &
setsid nohup $M run.experiment=sw_off_fa2 $FA2 > /tmp/w/sw_off_fa2.log 2>&1 &
setsid nohup $M run.experiment=sw_on_fa2 $FA2 monitor.on_warning=switch_fix > /tmp/w/sw_on_fa2.log 2>&1 &
wait
set +f
for e in sw_off_paper sw_on_paper sw_off_fa2 sw_on_fa2; do
  cp /tmp/w/$e.log $OUT/; mkdir -p $OUT/$e
  cp runs/$e/margin_report/margin.md runs/$e/margin_report/arms.json $OUT/$e/ 2>/dev/null
  for d in runs/$e/seed_1337/*/; do
    a=$(basename "$d")
    for f in changes.yaml status.yaml; do [ -f "$d$f" ] && cp "$d$f" "$OUT/$e/${a}_$f"; done
  done
  python3 -m launcher.compare runs/$e/seed_1337 --out $OUT/$e/compare --no-layout > $OUT/$e/compare.log 2>&1
  echo "== $e"; grep -E "DIVERGED|survived|warning|switch" /tmp/w/$e.log | tail -6
done
