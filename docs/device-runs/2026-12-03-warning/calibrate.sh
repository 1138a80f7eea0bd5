#!/usr/bin/env bash
# nvidia-h200, issue 33: the early warning's GPU calibration, in two device calls of two margin experiments each
# (docs/device-runs/2026-12-02-warning/call1.sh ran all four at once in its plan: 28 arms on 16 CPU cores were
# measured at ~5x the step time of 16 arms, so they are split here).
#   bash calibrate.sh cal    the calibration grids: the dictionary text (data/cache/gcide), GPT 6 x 384 (6 heads), seed 1337
#   bash calibrate.sh held   the held-out grids: the embedded corpus with its own BPE 8192 (data/cache/kjv8k),
#                            GPT 6 x 512 (8 heads), seed 2024
# Each: paper/none at g = 20, 50, 100 and fa2/none (and in the calibration grid fa2/dynamic_max) at g = 50, 100,
# both signs, every cell run (margin.schedule=full), plus each experiment's fa2/fp32_output arm; recipes/margin.yaml
# otherwise (1,600 steps, monitors every 25 steps). Q-K update and activation spectra and the delta bias on layers
# 0 and 1 (the calibration is judged for warning layer 1 and layer 0). The event files come back as one tarball;
# the calibration itself (python -m launcher.warning_calibration) then runs on the CPU machine from them.
# Carry: data/cache/gcide (cal) or data/cache/kjv8k (held).
set -f  # the grid lists are passed unquoted: no globbing of their brackets
export PYTHONUNBUFFERED=1
part=$1
mkdir -p $OUT /tmp/w
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $OUT/machine_$part.txt
git log --oneline -1 >> $OUT/machine_$part.txt
M="python3 -m analysis.margin margin margin.schedule=full margin.signs=[kept,random] margin.max_minutes=${MAX_MINUTES:-7.5}
   margin.budget_minutes=0 monitor.qk_layers=[0,1] monitor.delta_bias_layers=[0,1]"
case $part in
  cal)  COMMON="margin.seeds=[1337]"
        declare -A GRID=(
          [w_cal_paper]="$COMMON margin.numerics=[paper/none,fa2/fp32_output] margin.gains=[20,50,100] margin.processes=7"
          [w_cal_fa2]="$COMMON margin.numerics=[fa2/none,fa2/dynamic_max,fa2/fp32_output] margin.gains=[50,100] margin.processes=9") ;;
  held) COMMON="margin.seeds=[2024] data.data_dir=data/cache/kjv8k model.d_model=512 model.n_head=8"
        declare -A GRID=(
          [w_held_paper]="$COMMON margin.numerics=[paper/none,fa2/fp32_output] margin.gains=[20,50,100] margin.processes=7"
          [w_held_fa2]="$COMMON margin.numerics=[fa2/none,fa2/fp32_output] margin.gains=[50,100] margin.processes=5") ;;
  *) echo "usage: bash calibrate.sh cal|held" >&2; exit 2 ;;
esac
for e in "${!GRID[@]}"; do
  setsid nohup $M run.experiment=$e ${GRID[$e]} > /tmp/w/$e.log 2>&1 &
done
wait
set +f
for e in "${!GRID[@]}"; do  # the reports (arms.json) also when max_minutes stopped a grid before its end
  set -f; $M run.experiment=$e ${GRID[$e]} --report-only > /tmp/w/${e}_report.log 2>&1; set +f
  echo "== $e"; grep -E "DIVERGED|survived|stopped|spent" /tmp/w/$e.log | tail -20
done
# everything but checkpoints and figures, in one file (the device returns a limited number of files)
tar czf $OUT/$part.tgz --exclude=checkpoints --exclude='*.png' /tmp/w runs/w_${part}_paper runs/w_${part}_fa2 2>/dev/null
ls -la $OUT
