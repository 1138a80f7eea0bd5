# nvidia-h200, 2026-12-01 (speed session) call B (right after call A, TE still installed): the attention benchmark
# at the three shapes; the 1.3B FP8 recipe against Transformer Engine layers and the SDPA cuDNN trainer;
# GPT-2 small compiled against the SDPA cuDNN trainer. Fixed arm = fa2/fp32_output (the margin issue's choice).
export PYTHONUNBUFFERED=1
source .devcache/install.sh > /dev/null 2>&1; set +e
mkdir -p $OUT/prof_1p3b $OUT/prof_gpt2
timeout 230 python3 -m benchmarks.attention --shapes 4,16,4096,128 2,16,4096,128 8,12,1024,64 \
  --modes fa2/none fa2/fp32_output fa2/dynamic_max fa2/stochastic_output paper/none --rep-ms 60 \
  --out $OUT/attention.md > $OUT/attention.log 2>&1; echo "attention rc $?"; cat $OUT/attention.md
timeout 200 python3 -m benchmarks.train_speed gpt_1p3b_fp8 data.data_dir=data/cache/kjv data.global_batch_size=64 \
  --arm fixed --baselines te,cudnn --steps 7 --skip 3 --profile $OUT/prof_1p3b --json $OUT/train_1p3b.json \
  > $OUT/train_1p3b.log 2>&1; echo "1p3b rc $?"; grep -A30 "^24 x" $OUT/train_1p3b.log | head -30
timeout 150 python3 -m benchmarks.train_speed gpt2_small_paper data.data_dir=data/cache/kjv model.vocab_size=50304 \
  --arm fixed arms.fixed.attention.rounding=fa2 run.compile=true --baselines cudnn --steps 6 --skip 2 --profile $OUT/prof_gpt2 \
  --json $OUT/train_gpt2.json > $OUT/train_gpt2.log 2>&1; echo "gpt2 rc $?"; grep -A30 "^12 x" $OUT/train_gpt2.log | head -30
