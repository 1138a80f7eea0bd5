#!/bin/bash
# Writes the comparison report of an experiment once its arms have ended (submitted by pretrain_fp8.sh).
#SBATCH --job-name=fp8-attention-report
#SBATCH --nodes=1
#SBATCH --ntasks=1
#SBATCH --time=00:30:00
#SBATCH --output=%x-%j.out
set -euo pipefail
if [[ $# -ne 1 ]]; then
  echo "usage: sbatch slurm/compare.sh <run.out_dir>/<experiment> (submitted by slurm/pretrain_fp8.sh); without" \
       "SLURM: python -m launcher.compare runs/<experiment>" >&2
  exit 2
fi
cd "${SLURM_SUBMIT_DIR:-.}"  # the repository root (see pretrain_fp8.sh)
"${PYTHON:-python3}" -m launcher.compare "$1"
