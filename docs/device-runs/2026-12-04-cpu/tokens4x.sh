#!/usr/bin/env bash
# CPU (the 2-core machine, 2026-12-04; NOT a device run): issue 34 item 5 (does the margin move with the tokens per
# step?) at toy scale while the GPU grid (docs/device-runs/2026-12-04/grids.sh tokens4x) waits for device time.
# The model and gains of the 2026-12-02 CPU calibration grid (GPT 2 x 128, 2 heads, the embedded corpus with its
# BPE 8192, context 64, lr 3e-3 after 20 warmup steps, seed 1337, 1,200 steps; fa2/none at g = 1000, 1500, 2000 with
# its fa2/fp32_output arm, paper/none at g = 300 (with fa2/fp32_output); both signs, every cell), at 512 tokens per step (that grid's, run
# again on this commit) and at 4x: 2,048 tokens per step in 4 micro-batches of 8 sequences, the same steps.
set -f  # the grid lists are passed unquoted: no globbing of their brackets
export OMP_NUM_THREADS=1 PYTHONUNBUFFERED=1 PYTHONPATH=.
python -m launcher.prepare_data --source kjv --out data/cache/kjv
M="python -m analysis.margin margin margin.schedule=full margin.signs=[kept,random] margin.processes=2
  margin.budget_minutes=0 run.out_dir=${RUNS:-/tmp/t4/runs} run.max_steps=1200 model.n_layer=2 model.d_model=128
  model.n_head=2 model.max_seq_len=64 data.seq_len=64 data.micro_batch_size=8 data.data_dir=data/cache/kjv
  optim.lr=3e-3 optim.min_lr=3e-3 optim.warmup_steps=20 eval.interval=300 eval.batches=4
  monitor.spectral_interval=50 monitor.probe_interval=50 monitor.probe_batch_size=2 margin.seeds=[1337]"
FA2="margin.numerics=[fa2/none,fa2/fp32_output] margin.gains=[1000,1500,2000]"
PAPER="margin.numerics=[paper/none,fa2/fp32_output] margin.gains=[300]"  # 3 arms: the rule's median, as on 2026-12-02
for tokens in 1x 4x; do
  B="data.global_batch_size=$([ $tokens = 1x ] && echo 8 || echo 32)"
  $M $B run.experiment=t4_${tokens}_fa2 $FA2
  $M $B run.experiment=t4_${tokens}_paper $PAPER
done
