# nvidia-h200, 2026-12-01 (house session) call 1: the issue-19 second seed on the deciding cells (two grids in
# the background, 14 arms) and the single-GPU test tier beside them (three pytest processes, no Transformer Engine:
# its tests skip here and run in the final call). call2.sh collects.
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl > /dev/null 2>&1
export PYTHONPATH=/tmp/site
mkdir -p $OUT /tmp/gpu
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $OUT/machine.txt
git log --oneline -1 >> $OUT/machine.txt
M="python3 -m launcher.margin margin margin.seeds=[2024] margin.schedule=full"
setsid nohup $M run.experiment=margin_s2_paper 'margin.numerics=[paper/none,paper/dynamic_max,fa2/fp32_output]' \
  'margin.gains=[50]' margin.processes=5 > /tmp/gpu/margin_paper.log 2>&1 &
setsid nohup $M run.experiment=margin_s2_fa2 \
  'margin.numerics=[fa2/none,fa2/dynamic_max,fa2/stochastic_output,paper/stochastic_output,fa2/fp32_output]' \
  'margin.gains=[100]' margin.processes=9 > /tmp/gpu/margin_fa2.log 2>&1 &
for f in attention train layouts; do
  setsid nohup timeout 900 python3 -m pytest tests/gpu/test_${f}_gpu.py -rA -p no:cacheprovider \
    --junitxml=/tmp/gpu/junit_$f.xml > /tmp/gpu/tests_$f.log 2>&1 &
done
sleep 500
cp /tmp/gpu/*.log /tmp/gpu/*.xml $OUT/ 2>/dev/null
for f in attention train layouts; do echo "== $f"; tail -3 /tmp/gpu/tests_$f.log; done
tail -2 /tmp/gpu/margin_*.log
