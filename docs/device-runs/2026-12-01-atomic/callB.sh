# nvidia-h200, call B (right after call A, TE still installed): the 1.3B FP8 recipe's fixed arm (fa2/fp32_output)
# against the Transformer Engine baseline, with the deterministic backward and with the atomic dQ backward.
export PYTHONUNBUFFERED=1
source .devcache/install.sh > /dev/null 2>&1; set +e
timeout 450 python3 -m benchmarks.train_speed gpt_1p3b_fp8 data.data_dir=data/cache/kjv data.global_batch_size=64 \
  --arm fixed --baselines te --also "arms.fixed.attention.deterministic=false" --steps 6 --skip 2 \
  --json $OUT/train_1p3b.json > $OUT/train_1p3b.log 2>&1; echo "1p3b rc $?"; grep -A8 "^24 x" $OUT/train_1p3b.log
grep "step\|train_speed" $OUT/train_1p3b.log | tail -30
