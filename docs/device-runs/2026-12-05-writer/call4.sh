#!/usr/bin/env bash
# Call 4 of 2026-12-05 (carry data/cache/kjv): what the new backward does to the 1.3B recipe's training speed: its
# fixed arm with a BF16 FFN (Transformer Engine is not installed in this call), eager as the recipe runs, with
# backend=triton, backend=auto (now the Gluon forward and ordered Gluon backward) and gluon with atomic dQ, against
# the compiled SDPA cuDNN trainer. Logs in $OUT.
export PYTHONPATH=. PYTHONUNBUFFERED=1 TRITON_DEFAULT_FP_FUSION=1
F="arms.fixed.attention"
timeout 300 python3 -m benchmarks.train_speed gpt_1p3b_fp8 data.data_dir=data/cache/kjv data.global_batch_size=64 \
  --arm fixed precision.fp8_ffn=false $F.backend=triton \
  --also "$F.backend=auto" --also "$F.backend=gluon $F.deterministic=false" \
  --baselines cudnn --steps 6 --skip 2 --json $OUT/call4_gpt_1p3b.json > $OUT/call4_gpt_1p3b.log 2>&1
echo "gpt_1p3b rc=$?"; tail -8 $OUT/call4_gpt_1p3b.log
