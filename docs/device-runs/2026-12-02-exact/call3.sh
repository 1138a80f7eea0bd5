#!/usr/bin/env bash
# nvidia-h200, issue 34 call 3: what exact_delta costs in training, against fp32_output and none (paper rounding,
# the rounding of the recipes whose fixed arm would move), GPT-2 small compiled, as docs/results.md's earlier table.
export PYTHONUNBUFFERED=1 PYTHONPATH=.
timeout 250 python3 -m benchmarks.train_speed gpt2_small_paper data.data_dir=data/cache/kjv model.vocab_size=50304 \
  arms.baseline.attention.rounding=paper arms.baseline.attention.fix=fp32_output run.compile=true \
  --also "arms.baseline.attention.fix=exact_delta" --also "arms.baseline.attention.fix=none" \
  --baselines cudnn --steps 6 --skip 2 --json $OUT/train_speed.json > $OUT/train_speed.log 2>&1
echo "train_speed rc=$?"; tail -12 $OUT/train_speed.log
