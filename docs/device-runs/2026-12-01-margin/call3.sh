# nvidia-h200, 2026-12-01 (margin session) call 3: wait for the margin grid started by call2.sh, bring back its
# report, logs and TensorBoard events (no checkpoints).
for i in $(seq 1 110); do pgrep -f "launcher.margin margin" > /dev/null || break; sleep 5; done
mkdir -p $OUT; cp /tmp/margin.log $OUT/margin.log
tar czf $OUT/margin_runs.tgz --exclude='checkpoints' --exclude='*.pt' runs/margin
tail -60 /tmp/margin.log; ls -la $OUT
