# CPU (run on the 2-core machine shared with other work, 2026-12-02; NOT a device run): the early warning's
# calibration (issue 33) at toy scale, the CPU stand-in for call1.sh. Four margin experiments of 1,200 steps:
#   calibration: GPT 2 x 128 (2 heads), the embedded corpus with its BPE 8192 (data/cache/kjv), seed 1337;
#   held-out:    GPT 2 x 192 (3 heads), the embedded corpus with a BPE 2048 (data/cache/kjv2048), seed 2024.
# fa2/none at gains 1,000 / 1,500 / 2,000 and paper/none at 300, both signs, full schedule, each experiment with its
# fa2/fp32_output arm; context 64, 512 tokens per step, lr 3e-3 constant after 20 warmup steps, bf16, monitors every
# 10 steps (W_Q spectra, Q-K update and activation spectra of both layers, delta bias of both layers). Two arms at
# a time (margin.processes=2, one thread each). Then the calibration on the first two, judged on the last two, with
# the rule's structure set for runs this short (from step 100, W_Q growth over 100 steps), for warning layer 1
# (the default) and layer 0. ~18 minutes of wall time for the four grids (two arms at a time), ~15 s per
# calibration. The probes that chose the gains (same model, 600-800 steps, fa2/none at 300 to 100,000) are in
# docs/results.md, "Early warning for the numerics people run", with the measured run.
set -f  # the grid lists are passed unquoted: no globbing of their brackets
export OMP_NUM_THREADS=1 PYTHONUNBUFFERED=1
python -m launcher.prepare_data --source kjv --out data/cache/kjv
python -m launcher.prepare_data --source kjv --out data/cache/kjv2048 --tokenizer bpe --vocab-size 2048
M="nice -n 19 python -m launcher.margin margin margin.schedule=full margin.signs=[kept,random] margin.processes=2
  margin.budget_minutes=0 run.out_dir=/tmp/wc/runs run.max_steps=1200 model.n_layer=2 model.max_seq_len=64
  data.seq_len=64 data.global_batch_size=8 data.micro_batch_size=8 optim.lr=3e-3 optim.min_lr=3e-3
  optim.warmup_steps=20 eval.interval=0 monitor.spectral_interval=10 monitor.probe_interval=10
  monitor.probe_batch_size=2 monitor.delta_bias_layers=[0,1]"
CAL="margin.seeds=[1337] data.data_dir=data/cache/kjv model.d_model=128 model.n_head=2"
HELD="margin.seeds=[2024] data.data_dir=data/cache/kjv2048 model.d_model=192 model.n_head=3"
FA2="margin.numerics=[fa2/none,fa2/fp32_output] margin.gains=[1000,1500,2000]"
PAPER="margin.numerics=[paper/none,fa2/fp32_output] margin.gains=[300]"
$M run.experiment=w_cal_fa2 $CAL $FA2
$M run.experiment=w_held_fa2 $HELD $FA2
$M run.experiment=w_cal_paper $CAL $PAPER
$M run.experiment=w_held_paper $HELD $PAPER
R=/tmp/wc/runs
for layer in 1 0; do
  python -m launcher.warning_calibration --calibrate $R/w_cal_fa2 $R/w_cal_paper --holdout $R/w_held_fa2 \
    $R/w_held_paper --out /tmp/wc/calibration_L$layer monitor.warning_layer=$layer monitor.warning_after_step=100 \
    monitor.warning_window=100
done
python docs/device-runs/2026-12-02-warning/cpu_onsets.py  # each arm's first onset per signal at the chosen thresholds
# kept in cpu_calibration/: calibration_L1.md, calibration_L0.md (figure links removed), each grid's margin.md
# (figure links removed) and arms.json, onsets.txt (this last command's output); not kept: event files, PNGs
