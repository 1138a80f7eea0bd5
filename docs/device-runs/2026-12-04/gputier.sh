#!/usr/bin/env bash
# nvidia-h200: the single-GPU test tier, three pytest processes at once (the Gluon kernel's file, the Triton
# kernel's file, the trainer / plan / layout files), started in the background by call7.sh beside the exact_paper
# grid (a correctness tier: sharing the GPU changes its time, not its results); logs in /tmp/gputier, collected by
# call8.sh. Transformer Engine from .devcache/install.sh must be on PYTHONPATH (its FP8 tests skip otherwise).
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 TRITON_DEFAULT_FP_FUSION=1
mkdir -p /tmp/gputier && cd "$(dirname "$0")/../../.."
git log --oneline -1 > /tmp/gputier/commit.txt 2>&1
P="python3 -m pytest -q -p no:cacheprovider -rs"
timeout 900 $P tests/gpu/test_attention_gluon_gpu.py > /tmp/gputier/gpu_gluon.log 2>&1 &
timeout 900 $P tests/gpu/test_attention_gpu.py > /tmp/gputier/gpu_attention.log 2>&1 &
timeout 900 $P tests/gpu/test_train_gpu.py tests/gpu/test_plan_gpu.py tests/gpu/test_layouts_gpu.py > /tmp/gputier/gpu_train.log 2>&1 &
wait
touch /tmp/gputier/done
