#!/usr/bin/env bash
# CPU (the 2-core machine, 2026-12-04; NOT a device run): issue 34 item 3's forward stress at toy scale while the
# GPU grid (docs/device-runs/2026-12-04/grids.sh output) waits for device time. margin.stress=output amplifies O's
# own rounding error in the forward (the O the next layer sees = LP(O32 + g s (O_mode - O32))), kept sign or random
# per row and step; fa2/fp32_output's forward O is fa2/none's BF16 one, its delta clean, so it separates the
# forward path from the backward's delta. The toy model of the 2026-12-02 CPU calibration (GPT 2 x 128, 2 heads,
# the embedded corpus with its BPE 8192, context 64, 512 tokens per step, lr 3e-3 after 20 warmup steps, seed
# 1337), 1,200 steps, g = 10, 100, 1000, both signs, every cell, two arms at a time.
set -f  # the grid lists are passed unquoted: no globbing of their brackets
export OMP_NUM_THREADS=1 PYTHONUNBUFFERED=1 PYTHONPATH=.
python -m launcher.prepare_data --source kjv --out data/cache/kjv
python -m analysis.margin margin margin.schedule=full margin.signs=[kept,random] margin.processes=2 \
  margin.budget_minutes=0 run.out_dir=${RUNS:-/tmp/os/runs} run.experiment=os_toy run.max_steps=1200 \
  model.n_layer=2 model.d_model=128 model.n_head=2 model.max_seq_len=64 data.seq_len=64 \
  data.global_batch_size=8 data.micro_batch_size=8 data.data_dir=data/cache/kjv optim.lr=3e-3 optim.min_lr=3e-3 \
  optim.warmup_steps=20 eval.interval=300 eval.batches=4 monitor.spectral_interval=50 monitor.probe_interval=50 \
  monitor.probe_batch_size=2 margin.seeds=[1337] margin.stress=output \
  margin.numerics=[fa2/none,paper/none,fa2/fp32_output] margin.gains=[10,100,1000] "$@"
