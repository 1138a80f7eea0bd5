# nvidia-h200, issue 33 call 1 (NOT RUN YET): calibrate the early warning on one margin grid and judge it on a
# held-out one, with the new signals logged. Four margin experiments side by side on one GPU (28 arms of 1,600 steps):
#   calibration: the dictionary text (data/cache/gcide), GPT 6 x 384 (6 heads), seed 1337;
#   held-out:    the embedded corpus with its own BPE 8192 (data/cache/kjv8k), GPT 6 x 512 (8 heads), seed 2024.
# Gains up to each numerics' margin and one below (paper: 20 / 50 / 100, fa2: 50 / 100), both signs, full schedule
# (every cell run, so every diverging arm and every arm one gain below the margin is observed), and in each
# experiment the fa2/fp32_output arm (no delta error) so that the median of the divergence rule is a stable arm's.
# Diverging arms expected from the earlier grids (docs/results.md): calibration paper/none 50 kept, 100 kept, 100
# random; fa2/none and fa2/dynamic_max 100 kept; the held-out grid's margins at this width and text are unknown.
# Sizing (docs/margin.md): 16 arms of the 6 x 384 model shared the H200 at 0.14-0.15 s per step (~110 arm-steps/s
# in all) and 3.5 GB each; 28 arms, 12 of them 6 x 512 (~1.5x the work, memory not measured), are ~54k arm-steps
# less the diverged arms' early stops: ~8 minutes if the aggregate rate holds with 28 processes on 16 CPU cores
# (not measured). margin.max_minutes=9 stops every arm with a checkpoint if not; running this script again
# continues them.
set -f  # the grid lists are passed unquoted: no globbing of their brackets
export PYTHONUNBUFFERED=1
mkdir -p $OUT /tmp/w
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $OUT/machine.txt
git log --oneline -1 >> $OUT/machine.txt
M="python3 -m launcher.margin margin margin.schedule=full margin.signs=[kept,random] margin.max_minutes=9 margin.budget_minutes=0"
CAL="margin.seeds=[1337]"
HELD="margin.seeds=[2024] data.data_dir=data/cache/kjv8k model.d_model=512 model.n_head=8"
declare -A GRID=(
  [w_cal_paper]="$CAL margin.numerics=[paper/none,fa2/fp32_output] margin.gains=[20,50,100] margin.processes=7"
  [w_cal_fa2]="$CAL margin.numerics=[fa2/none,fa2/dynamic_max,fa2/fp32_output] margin.gains=[50,100] margin.processes=9"
  [w_held_paper]="$HELD margin.numerics=[paper/none,fa2/fp32_output] margin.gains=[20,50,100] margin.processes=7"
  [w_held_fa2]="$HELD margin.numerics=[fa2/none,fa2/fp32_output] margin.gains=[50,100] margin.processes=5"
)
for e in "${!GRID[@]}"; do
  setsid nohup $M run.experiment=$e ${GRID[$e]} > /tmp/w/$e.log 2>&1 &
done
wait
set +f
for e in "${!GRID[@]}"; do  # the reports (arms.json) also when max_minutes stopped a grid before its end
  $M run.experiment=$e ${GRID[$e]} --report-only > /tmp/w/${e}_report.log 2>&1
  cp /tmp/w/$e.log $OUT/; mkdir -p $OUT/$e; cp runs/$e/margin_report/* $OUT/$e/ 2>/dev/null
  tail -3 /tmp/w/$e.log
done
python3 -m launcher.warning_calibration --calibrate runs/w_cal_paper runs/w_cal_fa2 \
  --holdout runs/w_held_paper runs/w_held_fa2 --out $OUT/calibration 2>&1 | tee $OUT/calibration.log | tail -40
# the event files, for later calibrations (no checkpoints); split under the return limit
tar czf /tmp/w/events.tgz --exclude=checkpoints runs/w_cal_paper runs/w_cal_fa2 runs/w_held_paper runs/w_held_fa2
split -b 15M /tmp/w/events.tgz $OUT/events.tgz.
