#!/usr/bin/env bash
# Call 3 of 2026-12-08 (prepared 2026-12-08; no machine was lent that session): the 1.3B FP8 recipe's fixed arm
# (fa2/fp32_output, FP8 FFNs, eager) against the Transformer Engine baseline on the final kernels, the other
# training target; the same command as ../2026-12-05-o32/call2.sh (0.975x TE then, on an H200). Needs Transformer
# Engine on the machine: the git-ignored `.devcache/` (filled on 2026-12-08 by the house's TE preparation script, the
# wheel re-split into 46 MiB pieces te.whl.00-05, since a 56 MiB piece plus the 11 MiB working tree passes the
# 64 MiB a call may carry), pieces 00-04 sent one call each in quick succession (carry [".devcache/te.whl.0N"],
# command `mkdir -p /tmp/te && cp .devcache/te.whl.0N /tmp/te/`), then this call with carry [".devcache/te.whl.05",
# ".devcache/whl", ".devcache/te_torch.tar.gz", ".devcache/install.sh", ".devcache/te.sha256", "data/cache/kjv"]:
#   cp .devcache/te.whl.05 /tmp/te/ && source .devcache/install.sh && bash docs/device-runs/2026-12-08-trainer/call3.sh
# (`run` timeout_s 600).
export PYTHONUNBUFFERED=1
{ nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader; sha256sum kernels/*.py; } \
  > $OUT/call3_machine.txt
head -1 $OUT/call3_machine.txt
F="arms.fixed.attention"
timeout 420 python3 -m benchmarks.train_speed gpt_1p3b_fp8 data.data_dir=data/cache/kjv data.global_batch_size=64 \
  --arm fixed --also "$F.backend=triton" --also "$F.backend=gluon $F.deterministic=false" \
  --baselines te --steps 6 --skip 2 --json $OUT/call3_gpt_1p3b_fp8.json > $OUT/call3_gpt_1p3b_fp8.log 2>&1
echo "gpt_1p3b_fp8 rc=$?"; grep -E "attention|kernel" $OUT/call3_gpt_1p3b_fp8.log | sort | uniq -c | head
tail -8 $OUT/call3_gpt_1p3b_fp8.log
