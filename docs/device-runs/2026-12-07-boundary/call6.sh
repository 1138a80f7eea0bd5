#!/usr/bin/env bash
# Call 6 of 2026-12-07 (boundary): BWD_DQ_FIRST_STORE (ordered dQ: the first share of each query tile stored, no
# zeroing of the FP32 buffer). Its GPU test (same gradients, every element written), its time against adding into
# zeros, then, on the device's copy of the tree with the switch turned on (sha256 of that kernel file in
# call6_machine.txt, so that a commit turning it on can be shown to be the file that ran), the GPU tier.
export PYTHONPATH=. PYTHONUNBUFFERED=1 TRITON_DEFAULT_FP_FUSION=1
D=docs/device-runs/2026-12-07-boundary
nvidia-smi --query-gpu=name --format=csv,noheader > $OUT/call6_machine.txt
timeout 90 python3 -m pytest -q -p no:cacheprovider --tb=short tests/gpu/test_attention_gluon_gpu.py \
  -k first_dq_share 2>&1 | tail -n 3 | tee $OUT/call6_first_store_test.log
timeout 100 python3 $D/probe.py time --rep 20 --shapes 8,12,1024,64 4,16,2048,128 4,16,4096,128 \
  --only "gluon first add none det" "gluon first store none det" "gluon first add fp32_output det" \
  "gluon first store fp32_output det" 2>&1 | grep -v Warning | tee $OUT/call6_time.log
sed -i 's/^BWD_DQ_FIRST_STORE = False$/BWD_DQ_FIRST_STORE = True/' kernels/gluon_flash.py
sha256sum kernels/gluon_flash.py >> $OUT/call6_machine.txt; grep -n "^BWD_DQ_FIRST_STORE" kernels/gluon_flash.py
bash docs/device-runs/gpu_tier.sh /tmp/tier6 200 2>&1 | tee $OUT/call6_summary.txt
(cd /tmp/tier6 && tar czf $OUT/call6_logs.tgz *.log)
