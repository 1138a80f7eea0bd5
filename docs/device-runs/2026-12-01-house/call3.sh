# nvidia-h200, 2026-12-01 (house session) call 3 (after calls that copied te.whl.00-03 to /tmp/te): install
# Transformer Engine and DeepSpeed (../shared/device/README.md), then the delta-launch FMA check. call4.sh runs the
# single-GPU test tier on the same warm machine.
export PYTHONUNBUFFERED=1
mkdir -p $OUT /tmp/gpu
cp .devcache/te.whl.04 /tmp/te/ && source .devcache/install.sh > $OUT/te_install.log 2>&1 || { tail $OUT/te_install.log; exit 1; }
set +e  # install.sh sets -e
tail -1 $OUT/te_install.log
python3 -c "import datasets" 2>/dev/null && echo "datasets IS installed" || echo "no datasets module (as intended)"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $OUT/machine.txt
git log --oneline -1 >> $OUT/machine.txt
python3 docs/device-runs/2026-12-01-house/delta_fma_check.py > $OUT/delta_fma_check.log 2>&1
cat $OUT/delta_fma_check.log
