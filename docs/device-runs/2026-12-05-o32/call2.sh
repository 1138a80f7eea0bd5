#!/usr/bin/env bash
# Call 2 of 2026-12-05 (second session), issue 31 item 7: the 1.3B FP8 recipe's fixed arm (fa2/fp32_output, FP8
# FFNs, eager) per attention backend against the Transformer Engine baseline, in one benchmarks.train_speed run
# (carry data/cache/kjv), after `source .devcache/install.sh` (Transformer Engine 2.20.2 from a local wheel;
# README.md of this folder). The same command as docs/device-runs/2026-12-04/call6.sh; what changed is the code:
#   recipe                  attention.backend=auto: at head_dim 128 on sm_90 now the Gluon forward AND the Gluon
#                           backward with ordered dQ (the dQ writer, the FP32 O by TMA store)
#   backend=triton          the Triton kernel forward and backward
#   backend=gluon, deterministic=false   the Gluon forward and its atomic-dQ backward
export PYTHONUNBUFFERED=1
git log --oneline -1 > $OUT/call2_commit.txt 2>&1
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader >> $OUT/call2_commit.txt
F="arms.fixed.attention"
timeout 400 python3 -m benchmarks.train_speed gpt_1p3b_fp8 data.data_dir=data/cache/kjv data.global_batch_size=64 \
  --arm fixed --also "$F.backend=triton" --also "$F.backend=gluon $F.deterministic=false" \
  --baselines te --steps 6 --skip 2 --json $OUT/call2_gpt_1p3b_fp8.json > $OUT/call2_gpt_1p3b_fp8.log 2>&1
echo "gpt_1p3b_fp8 rc=$?"; grep -E "attention|kernel" $OUT/call2_gpt_1p3b_fp8.log | sort | uniq -c | head; tail -8 $OUT/call2_gpt_1p3b_fp8.log
