# warm nvidia-h200-x2 (after run19.sh): the evidence run, both arms side by side (one GPU each), then the report
# and the trained-layer probe of both final checkpoints
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
mkdir -p $OUT/logs $OUT/report
R=/tmp/runs; MIN=${MIN:-6.5}
for arm_gpu in baseline:0 fixed:1; do
  arm=${arm_gpu%:*}; gpu=${arm_gpu#*:}
  CUDA_VISIBLE_DEVICES=$gpu timeout 480 python3 -m launcher.pretrain paper_evidence --arm $arm --no-report \
    run.out_dir=$R run.max_minutes=$MIN > $OUT/logs/evidence_$arm.log 2>&1 &
done
wait
tail -2 $OUT/logs/evidence_baseline.log $OUT/logs/evidence_fixed.log
python3 -m launcher.compare $R/paper_evidence --out $OUT/report > $OUT/logs/compare.log 2>&1; echo "compare rc=$?"
tail -15 $OUT/logs/compare.log
for arm_gpu in baseline:0 fixed:1; do
  arm=${arm_gpu%:*}; gpu=${arm_gpu#*:}
  CUDA_VISIBLE_DEVICES=$gpu timeout 60 python3 -m launcher.probe_checkpoint $R/paper_evidence/$arm --batches 2 \
    --out $OUT/logs/trained_probe_$arm.md > $OUT/logs/trained_probe_$arm.log 2>&1 &
done
wait
tail -3 $OUT/logs/trained_probe_*.log
for arm in baseline fixed; do mkdir -p $OUT/tb/$arm; cp $R/paper_evidence/$arm/events.* $R/paper_evidence/$arm/config.yaml $OUT/tb/$arm/; done
