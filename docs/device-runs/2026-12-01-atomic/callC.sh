# nvidia-h200, call C (warm, after call B): GPT-2 small compiled, the fixed arm's numerics (fa2/fp32_output) with the
# deterministic and the atomic dQ backward, against the nanoGPT-style SDPA cuDNN trainer.
export PYTHONUNBUFFERED=1
set +e
timeout 300 python3 -m benchmarks.train_speed gpt2_small_paper data.data_dir=data/cache/kjv model.vocab_size=50304 \
  --arm fixed arms.fixed.attention.rounding=fa2 run.compile=true --baselines cudnn \
  --also "arms.fixed.attention.deterministic=false" --steps 6 --skip 2 --json $OUT/train_gpt2.json \
  > $OUT/train_gpt2.log 2>&1; echo "gpt2 rc $?"; grep -A8 "^12 x" $OUT/train_gpt2.log
