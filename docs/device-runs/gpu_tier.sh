#!/usr/bin/env bash
# The single-GPU test tier, for device calls from 2026-12-07 on (the calls before carry their own copy of these lines,
# as they ran): pytest processes side by side (sharing the GPU changes their time, not their results): the Gluon
# kernel's file (since 2026-12-08 the tests of its switches not yet run on a GPU in a process each), the Triton
# kernel's file in two halves (its tests in collection order, alternately), the trainer file, the plan and layout
# files; beside them the fp64 check of every Gluon case with the ordered dQ.
# Transformer Engine's tests skip where it is not installed (`pip install -e '.[gpu]'` on a GPU machine)
# Prints each log's verdict lines.
#
#     bash docs/device-runs/gpu_tier.sh LOG_DIR [LIMIT_SECONDS]
set -u
L=${1:?usage: gpu_tier.sh LOG_DIR [LIMIT_SECONDS]}
T=${2:-240}
mkdir -p "$L"
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 TRITON_DEFAULT_FP_FUSION=1
P="python3 -m pytest -q -p no:cacheprovider -rs --tb=short"
$P --collect-only tests/gpu/test_attention_gpu.py 2>/dev/null | grep :: > "$L/attention_ids.txt"
set -f  # test ids contain brackets: no globbing
timeout "$T" python3 docs/device-runs/2026-12-07-boundary/probe.py check --deterministic > "$L/check_det.log" 2>&1 &
# the tests of the Gluon switches not yet run on a GPU, each in a process of its own: a kernel that hangs there
# (a wait that never ends) cannot cut the rest of the Gluon file's log
NEW="first_dq_share_stored_under_atomic_adds dk_dv_by_tma_give_the_bits dq_finished_by_its_last_add lagging_consumer"
timeout "$T" $P tests/gpu/test_attention_gluon_gpu.py -k "not (${NEW// / or })" > "$L/tier_gluon.log" 2>&1 &
for name in $NEW; do
  timeout "$T" $P tests/gpu/test_attention_gluon_gpu.py -k "$name" > "$L/tier_gluon_$name.log" 2>&1 &
done
timeout "$T" $P $(awk 'NR % 2 == 1' "$L/attention_ids.txt") > "$L/tier_attention_a.log" 2>&1 &
timeout "$T" $P $(awk 'NR % 2 == 0' "$L/attention_ids.txt") > "$L/tier_attention_b.log" 2>&1 &
timeout "$T" $P tests/gpu/test_train_gpu.py > "$L/tier_train.log" 2>&1 &
timeout "$T" $P tests/gpu/test_plan_gpu.py tests/gpu/test_layouts_gpu.py > "$L/tier_plan_layouts.log" 2>&1 &
wait
set +f
for f in "$L"/*.log; do
  echo "== $(basename "$f")"
  grep -E "^(BAD|ERR|FAILED|ERROR)" "$f" | head -8
  tail -n 1 "$f"
done
