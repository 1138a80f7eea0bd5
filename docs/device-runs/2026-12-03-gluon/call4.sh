#!/usr/bin/env bash
# nvidia-h200, issue 31 item 7: what the Gluon kernel does to training speed, next to the Triton kernel and the
# compiled SDPA cuDNN trainer, in one benchmarks.train_speed run per model (carry data/cache/kjv: GPT-2 BPE).
#   GPT-2 small (head_dim 64), compiled, fa2/fp32_output (the fixed arm's numerics): backend=triton, backend=gluon
#     (Gluon forward and ordered Gluon backward), backend=gluon with deterministic=false (atomic dQ).
#   gpt_1p3b_fp8's fixed arm (head_dim 128, context 2048) with precision.fp8_ffn=false (Transformer Engine is not
#     installed on the device in this call): the same three, eager as the recipe runs, against the cuDNN trainer
#     (also BF16 everywhere), so the attention backend is the only difference between the recipe's rows.
export PYTHONUNBUFFERED=1 PYTHONPATH=.
mkdir -p $OUT
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $OUT/machine.txt
git log --oneline -1 >> $OUT/machine.txt
G="arms.baseline.attention"
timeout ${GPT2_LIMIT:-250} python3 -m benchmarks.train_speed gpt2_small_paper data.data_dir=data/cache/kjv model.vocab_size=50304 \
  $G.rounding=fa2 $G.fix=fp32_output $G.backend=triton run.compile=true \
  --also "$G.backend=gluon" --also "$G.backend=gluon $G.deterministic=false" \
  --baselines cudnn --steps 6 --skip 2 --json $OUT/gpt2_small.json > $OUT/gpt2_small.log 2>&1
echo "gpt2_small rc=$?"; tail -8 $OUT/gpt2_small.log
[ "${1:-all}" = gpt2 ] && exit 0  # `bash call4.sh gpt2`: GPT-2 small only
F="arms.fixed.attention"
timeout 250 python3 -m benchmarks.train_speed gpt_1p3b_fp8 data.data_dir=data/cache/kjv data.global_batch_size=64 \
  --arm fixed precision.fp8_ffn=false $F.backend=triton \
  --also "$F.backend=gluon" --also "$F.backend=gluon $F.deterministic=false" \
  --baselines cudnn --steps 6 --skip 2 --json $OUT/gpt_1p3b.json > $OUT/gpt_1p3b.log 2>&1
echo "gpt_1p3b rc=$?"; tail -8 $OUT/gpt_1p3b.log
