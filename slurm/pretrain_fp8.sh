#!/bin/bash
# Baseline and fixed arm side by side: one array task per arm, each on its own set of nodes.
#
#   sbatch slurm/pretrain_fp8.sh                          # gpt_1p3b_fp8 on 2 nodes x 8 GPUs per arm
#   RECIPE=gpt2_small_paper sbatch --nodes=1 slurm/pretrain_fp8.sh run.max_steps=8000
#
# Arguments after the script are recipe overrides (section.field=value). Environment knobs: RECIPE, ARMS
# (space-separated, default "baseline fixed"; the array size must match), NPROC_PER_NODE (default: GPUs on the
# node, or 1 on a CPU partition), PYTHON (default: python3 in PATH, e.g. the project's .venv/bin/python).
# Both arms use the recipe's seed, so they see identical batches. SLURM sends SIGTERM 5 minutes before the time
# limit: each process saves a checkpoint and exits, and the requeued task resumes from it.
# When both arms have ended, slurm/compare.sh writes runs/<experiment>/report/ (submitted by array task 0).
#SBATCH --job-name=fp8-attention
#SBATCH --array=0-1
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --exclusive
#SBATCH --time=24:00:00
#SBATCH --signal=TERM@300
#SBATCH --requeue
#SBATCH --output=%x-%A_%a.out
set -euo pipefail

# SLURM runs a spooled copy of this script, so paths are taken from the submission folder: the repository root.
cd "${SLURM_SUBMIT_DIR:-.}"
if [[ ! -f launcher/pretrain.py ]]; then
  echo "submit from the repository root (cd to it, then: sbatch slurm/pretrain_fp8.sh)" >&2
  exit 2
fi
RECIPE=${RECIPE:-gpt_1p3b_fp8}
read -r -a ARM_LIST <<< "${ARMS:-baseline fixed}"
TASK=${SLURM_ARRAY_TASK_ID:-0}
if (( TASK >= ${#ARM_LIST[@]} )); then
  echo "array task $TASK has no arm: ARMS='${ARM_LIST[*]}' has ${#ARM_LIST[@]} (submit with --array=0-$(( ${#ARM_LIST[@]} - 1 )))" >&2
  exit 2
fi
ARM=${ARM_LIST[$TASK]}
PYTHON=${PYTHON:-python3}
NPROC_PER_NODE=${NPROC_PER_NODE:-${SLURM_GPUS_ON_NODE:-1}}
MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
MASTER_PORT=$(( 29500 + TASK ))   # the arms may share a node on small test partitions

# Validate the recipe before asking for the nodes' time; a mistake ends here with a message.
"$PYTHON" -m launcher.pretrain "$RECIPE" "$@" --arm "$ARM" --dry-run > /dev/null

if [[ "$TASK" == 0 && -n "${SLURM_ARRAY_JOB_ID:-}" && "${SLURM_RESTART_COUNT:-0}" == 0 ]]; then
  EXPERIMENT=$("$PYTHON" -m launcher.pretrain "$RECIPE" "$@" --arm "$ARM" --dry-run | sed -n 's/^  experiment: //p' | head -n 1)
  OUT_DIR=$("$PYTHON" -m launcher.pretrain "$RECIPE" "$@" --arm "$ARM" --dry-run | sed -n 's/^  out_dir: //p' | head -n 1)
  sbatch --dependency="afterany:${SLURM_ARRAY_JOB_ID}" --export=ALL,PYTHON="$PYTHON" \
    slurm/compare.sh "$OUT_DIR/$EXPERIMENT" || \
    echo "could not submit the comparison job; run: python -m launcher.compare $OUT_DIR/$EXPERIMENT" >&2
fi

echo "[slurm] arm $ARM of $RECIPE on $SLURM_NNODES node(s) x $NPROC_PER_NODE process(es), rendezvous $MASTER_ADDR:$MASTER_PORT"
srun --kill-on-bad-exit=1 "$PYTHON" -m torch.distributed.run \
  --nnodes="$SLURM_NNODES" --nproc-per-node="$NPROC_PER_NODE" \
  --rdzv-backend=c10d --rdzv-endpoint="$MASTER_ADDR:$MASTER_PORT" --rdzv-id="$SLURM_JOB_ID" \
  -m launcher.pretrain "$RECIPE" "$@" --arm "$ARM" --no-report
