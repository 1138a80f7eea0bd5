# nvidia-h200, issue 33 call 2 (NOT RUN YET): does monitor.on_warning=switch_fix keep alive a margin arm that
# diverges without it? The same grid twice, side by side, seed 1337, kept sign: paper/none and paper/dynamic_max at
# g = 50 (they diverged at steps 730 and 620 in the margin session), fa2/none and fa2/stochastic_output at g = 100
# (1,050 and 1,190), each experiment with its fa2/fp32_output arm; on_warning=log (sw_off_*) against switch_fix
# (sw_on_*: attention.fix -> fp32_output at the onset). 12 arms, ~4-5 minutes.
# RULE: the thresholds call 1's calibration printed (its best rule out of sample), e.g.
#   RULE="monitor.warning_tie_rate=0 monitor.warning_qk_update_drop=0.3"
# Without RULE the default rule (layer 1's tie rate > 0.04) is used: it has warned paper arms only.
set -f  # the grid lists are passed unquoted: no globbing of their brackets
export PYTHONUNBUFFERED=1
mkdir -p $OUT /tmp/w
git log --oneline -1 > $OUT/machine.txt
M="python3 -m launcher.margin margin margin.schedule=full margin.signs=[kept] margin.seeds=[1337] margin.budget_minutes=0 ${RULE:-}"
PAPER="margin.numerics=[paper/none,paper/dynamic_max,fa2/fp32_output] margin.gains=[50] margin.processes=3"
FA2="margin.numerics=[fa2/none,fa2/stochastic_output,fa2/fp32_output] margin.gains=[100] margin.processes=3"
setsid nohup $M run.experiment=sw_off_paper $PAPER > /tmp/w/sw_off_paper.log 2>&1 &
setsid nohup $M run.experiment=sw_on_paper $PAPER monitor.on_warning=switch_fix > /tmp/w/sw_on_paper.log 2>&1 &
setsid nohup $M run.experiment=sw_off_fa2 $FA2 > /tmp/w/sw_off_fa2.log 2>&1 &
setsid nohup $M run.experiment=sw_on_fa2 $FA2 monitor.on_warning=switch_fix > /tmp/w/sw_on_fa2.log 2>&1 &
wait
set +f
for e in sw_off_paper sw_on_paper sw_off_fa2 sw_on_fa2; do
  cp /tmp/w/$e.log $OUT/; mkdir -p $OUT/$e
  cp runs/$e/margin_report/margin.md runs/$e/margin_report/*.png $OUT/$e/ 2>/dev/null
  python3 -m launcher.compare runs/$e/seed_1337 --out $OUT/$e/compare --no-layout > $OUT/$e/compare.log 2>&1
  for c in runs/$e/seed_1337/*/changes.yaml; do [ -f "$c" ] && cp "$c" "$OUT/$e/$(basename "$(dirname "$c")")_changes.yaml"; done
  grep -E "DIVERGED|survived" /tmp/w/$e.log
done
