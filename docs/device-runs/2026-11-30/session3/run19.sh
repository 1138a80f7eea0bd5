# fresh nvidia-h200-x2, no TE: small wheels, then the attention kernel's GPU tests (512-key paper tiles, fa2
# cross-tile safe fix), the bias probe on the GPU with SDPA, and the attention benchmark of the paper modes
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site \
  $(ls .devcache/whl/*.whl | grep -v -e transformer_engine -e deepspeed) > /dev/null || exit 1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
mkdir -p $OUT/logs
echo "commit c92ef73" > $OUT/logs/machine.txt; nvidia-smi -L >> $OUT/logs/machine.txt
timeout 150 python3 -m pytest tests/gpu/test_attention_gpu.py -v -p no:cacheprovider -rs --tb=short -x \
  > $OUT/logs/gpu_attention.log 2>&1
grep -E "passed|failed|^FAILED|^E  " $OUT/logs/gpu_attention.log | head -12
timeout 60 python3 -m kernels.bias_probe --backend triton --sequences 64 --seed 20261201 --out $OUT/logs/bias_probe_h200.md \
  > $OUT/logs/bias_probe_h200.log 2>&1; echo "probe rc=$?"
timeout 60 python3 -m benchmarks.attention --modes fa2/none paper/none paper/dynamic_max --rep-ms 50 \
  --out $OUT/logs/attention_paper_modes.md > $OUT/logs/attention_paper_modes.log 2>&1; echo "bench rc=$?"
tail -8 $OUT/logs/attention_paper_modes.md
