#!/usr/bin/env bash
# nvidia-h200, issue 31 item 7: the 1.3B FP8 recipe's fixed arm (fa2/fp32_output, FP8 FFNs, eager) with each
# attention backend against the Transformer Engine baseline, in one benchmarks.train_speed run (carry
# data/cache/kjv). Run after `source .devcache/install.sh` (Transformer Engine 2.20.2; README here, calls 1-6).
#   recipe                  attention.backend=auto (on sm_90 at head_dim 128: the Gluon forward, the Triton
#                           deterministic backward; the run prints which kernel it uses)
#   backend=triton          the Triton kernel forward and backward (the 2026-12-01 row: 0.938x TE)
#   backend=gluon, deterministic=false   the Gluon forward and its atomic-dQ backward
export PYTHONUNBUFFERED=1
mkdir -p $OUT
git log --oneline -1 > $OUT/call6_commit.txt 2>&1
F="arms.fixed.attention"
timeout 330 python3 -m benchmarks.train_speed gpt_1p3b_fp8 data.data_dir=data/cache/kjv data.global_batch_size=64 \
  --arm fixed --also "$F.backend=triton" --also "$F.backend=gluon $F.deterministic=false" \
  --baselines te --steps 6 --skip 2 --json $OUT/call6_gpt_1p3b_fp8.json > $OUT/call6_gpt_1p3b_fp8.log 2>&1
echo "gpt_1p3b_fp8 rc=$?"; grep -E "backend|kernel" $OUT/call6_gpt_1p3b_fp8.log | sort | uniq -c | head; tail -8 $OUT/call6_gpt_1p3b_fp8.log
