#!/usr/bin/env bash
# CPU machine, after calibrate.sh's device calls (issue 33): the calibration from the grids' event files, for
# warning layer 1 (the default) and layer 0, and the four margin reports again under the defaults this produced
# (monitor.warning_qk_act_drop=0.8647, the tie rate off). R: where the tarballs cal.tgz and held.tgz were unpacked
# (tar xzf in R; they hold runs/w_* and tmp/w/*.log). Writes into this folder's calibration/.
set -euf -o pipefail
R=${R:-/tmp/dev}
OUT=docs/device-runs/2026-12-03-warning/calibration
mkdir -p $OUT
for layer in 1 0; do
  python -m launcher.warning_calibration --calibrate $R/runs/w_cal_fa2 $R/runs/w_cal_paper \
    --holdout $R/runs/w_held_fa2 $R/runs/w_held_paper --out $R/calibration_L$layer monitor.warning_layer=$layer
  sed -e '/^## Figures/,$d' -e "s#$R/runs/##g" $R/calibration_L$layer/calibration.md > $OUT/calibration_L$layer.md
done
cp $R/calibration_L1/signal_qk_act_drop.png $R/calibration_L1/signal_tie_rate.png \
   $R/calibration_L1/signal_qk_update_drop.png $OUT/
M="margin margin.schedule=full margin.signs=[kept,random] margin.budget_minutes=0 monitor.qk_layers=[0,1]
   monitor.delta_bias_layers=[0,1] run.out_dir=$R/runs --report-only"
CAL="margin.seeds=[1337]"
HELD="margin.seeds=[2024] data.data_dir=data/cache/kjv8k model.d_model=512 model.n_head=8"
python -m analysis.margin $M run.experiment=w_cal_paper $CAL margin.numerics=[paper/none,fa2/fp32_output] margin.gains=[20,50,100]
python -m analysis.margin $M run.experiment=w_cal_fa2 $CAL margin.numerics=[fa2/none,fa2/dynamic_max,fa2/fp32_output] margin.gains=[50,100]
python -m analysis.margin $M run.experiment=w_held_paper $HELD margin.numerics=[paper/none,fa2/fp32_output] margin.gains=[20,50,100]
python -m analysis.margin $M run.experiment=w_held_fa2 $HELD margin.numerics=[fa2/none,fa2/fp32_output] margin.gains=[50,100]
for e in w_cal_paper w_cal_fa2 w_held_paper w_held_fa2; do
  sed -e '/^## Figures/,$d' $R/runs/$e/margin_report/margin.md > $OUT/${e}_margin.md
  cp $R/runs/$e/margin_report/arms.json $OUT/${e}_arms.json
done
