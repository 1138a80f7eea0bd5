#!/usr/bin/env bash
# Call 2 of 2026-12-08 (prepared 2026-12-07, third session; `run` with timeout_s 300 and carry ["data/cache/kjv"],
# built by `python -m launcher.prepare_data --out data/cache/kjv`): GPT-2 small compiled, the fixed arm
# (fa2/fp32_output) per attention backend against the SDPA cuDNN trainer, the training target; the same
# command as 2026-12-05-o32's call 6. Writes gpt2_small.{log,json} under $OUT.
GPT2_LIMIT=250 bash docs/device-runs/2026-12-03-gluon/call4.sh gpt2
