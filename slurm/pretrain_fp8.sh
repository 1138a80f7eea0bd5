#!/bin/bash
# Baseline and fixed arm side by side: one array task per arm, each on its own nodes, one srun task per GPU.
#
#   sbatch slurm/pretrain_fp8.sh                          # gpt_1p3b_fp8 on 2 nodes x 8 GPUs per arm
#   RECIPE=gpt2_small_paper sbatch --nodes=1 slurm/pretrain_fp8.sh run.max_steps=8000
#
# Arguments after the script are recipe overrides (section.field=value). Environment knobs (export them, or put them
# on the sbatch line as VAR=value sbatch ...):
#   RECIPE         recipe name or YAML path (default gpt_1p3b_fp8)
#   ARMS           space-separated arms, one per array task (default "baseline fixed"; --array=0-<n-1> must match)
#   PYTHON         interpreter (default python3 in PATH, e.g. the project's .venv/bin/python)
#   MAX_REQUEUES   how many times the job may requeue itself (default 5): at the time limit, after preemption, and
#                  after a failed step (a crashed node, an NCCL error) when the newest checkpoint moved since this
#                  leg started; SLURM_RESTART_COUNT counts every requeue, also SLURM's own after a node failure
#   MASTER_PORT    rendezvous port (default: one per job, below the node's ephemeral port range, so arms and jobs
#                  never collide and no outgoing connection can hold it)
#   TRITON_CACHE_DIR  compiled kernels and autotuning results (default: node-local, /tmp/triton-$USER, shared by a
#                  node's processes and kept across requeues on that node; attention.autotune=false fixes the tiles)
#   NCCL_*         every NCCL setting below is a default only: a value in the environment wins
#
# One process per GPU whatever the site's binding: each task sees the node's GPUs (--gpu-bind=none, it takes its
# SLURM_LOCALID's) or only its own (--gpus-per-task=1, --gpu-bind=single:1, it takes that one). --cpus-per-task
# reaches srun (SRUN_CPUS_PER_TASK) and sets each process's thread count (OMP_NUM_THREADS); set it to the node's
# cores / 8. A hang of a collective ends the run after distributed.timeout_minutes, and NCCL's flight recorder
# writes what each rank waited on to <run.out_dir>/<experiment>/flight_recorder/ (docs/training.md, "Hangs").
#
# Time limit: SLURM sends USR1 to this script 10 minutes before the limit (--signal=B:USR1@600); the script passes it
# to the training processes, which finish the current step, save a checkpoint and exit; then the script requeues
# the job (scontrol requeue) and the requeued job resumes from that checkpoint. Preemption (PreemptMode=REQUEUE) and
# scancel send TERM to the processes: they save the same way; a preempted job is requeued, a cancelled one is not.
# When both arms have ended, slurm/compare.sh writes <run.out_dir>/<experiment>/report/ (submitted by array task 0).
#SBATCH --job-name=fp8-attention
#SBATCH --array=0-1
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=8
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=8
#SBATCH --exclusive
#SBATCH --time=24:00:00
#SBATCH --signal=B:USR1@600
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output=%x-%A_%a.out
set -euo pipefail

# Signals, from the first line on (an untrapped USR1 would kill this script): USR1 (time limit near) is passed on to
# the training processes, and the job requeues itself after they have saved; TERM (preemption, scancel) reaches them
# from SLURM directly, and this script only waits for their save. A signal before training starts skips training.
STOP=""
on_usr1() {
  if [[ -n "$STOP" ]]; then return; fi  # already stopping (e.g. preempted: SLURM requeues the job itself)
  STOP=time_limit
  echo "[slurm] time limit near: the trainer saves a checkpoint after this step"
  if [[ -n "${SRUN:-}" ]]; then
    scancel --signal=USR1 "$SLURM_JOB_ID" || true  # to the job's steps (the trainer), not to this script
  fi
}
on_term() { STOP=${STOP:-terminated}; }
trap on_usr1 USR1
trap on_term TERM

# Started with bash instead of sbatch, the script would fail on the first SLURM variable: say what it is instead.
if [[ -z "${SLURM_JOB_ID:-}" ]]; then
  echo "slurm/pretrain_fp8.sh is a batch script for SLURM: submit it with \`sbatch slurm/pretrain_fp8.sh\` from the" \
       "repository root. To try the training without SLURM: python -m launcher.pretrain ${RECIPE:-gpt_1p3b_fp8}" \
       "(or torchrun --nproc-per-node N -m launcher.pretrain RECIPE; smoke runs on a CPU)" >&2
  exit 2
fi

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
MAX_REQUEUES=${MAX_REQUEUES:-5}
RESTARTS=${SLURM_RESTART_COUNT:-0}
FIRST_NODE=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
FIRST_ADDR=$(scontrol show node "$FIRST_NODE" | sed -n 's/.*NodeAddr=\([^ ]*\).*/\1/p')  # node names need not resolve
export MASTER_ADDR=${MASTER_ADDR:-${FIRST_ADDR:-$FIRST_NODE}}
# A port per job below the ephemeral range (Linux default 32768-60999), where no outgoing connection can hold it.
EPHEMERAL_LOW=$(cut -f1 /proc/sys/net/ipv4/ip_local_port_range 2>/dev/null || echo 32768)
(( EPHEMERAL_LOW > 12000 )) || EPHEMERAL_LOW=32768  # a site whose range starts low: use the default's
export MASTER_PORT=${MASTER_PORT:-$(( 10000 + SLURM_JOB_ID % (EPHEMERAL_LOW - 10000) ))}
# Threads per process and srun's CPU share (since SLURM 22.05 srun does not inherit sbatch's --cpus-per-task).
if [[ -n "${SLURM_CPUS_PER_TASK:-}" ]]; then
  export SRUN_CPUS_PER_TASK=${SRUN_CPUS_PER_TASK:-$SLURM_CPUS_PER_TASK}
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$SLURM_CPUS_PER_TASK}
fi
# Triton's compiled kernels and autotuning results on the node's own disk, not the shared home: tuned once per node
# (processes of a node share it; a requeued leg on the same node reuses it), no metadata storm on the shared FS.
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/triton-${USER:-$(id -u)}}
export TRITON_CACHE_AUTOTUNING=${TRITON_CACHE_AUTOTUNING:-1}

# NCCL defaults an admin expects on InfiniBand H100 nodes; each one yields to a value already in the environment.
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}                     # INFO to see the rings and transports chosen
export NCCL_IB_TIMEOUT=${NCCL_IB_TIMEOUT:-22}             # ride out brief fabric hiccups instead of aborting
export NCCL_ASYNC_ERROR_HANDLING=${NCCL_ASYNC_ERROR_HANDLING:-1}  # a dead peer ends the job, not a silent hang
export TORCH_NCCL_ASYNC_ERROR_HANDLING=${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}            # NVLink SHARP off: not every fabric manager allows it
# NCCL_SOCKET_IFNAME / NCCL_IB_HCA: left to NCCL's detection; set them if the nodes have several networks.
# (The launcher itself sets CUDA_DEVICE_MAX_CONNECTIONS=1 for parallel.tp_async_grad_reduce, and the flight recorder's
# TORCH_FR_* / TORCH_NCCL_DUMP_ON_TIMEOUT from distributed.*: launcher/distributed.py.)

# One call validates the recipe for this arm and this job's process count (SLURM_NTASKS) before any node time is
# spent, and names the experiment folder for the report; a mistake ends here with a one-line message.
EXPERIMENT_DIR=$("$PYTHON" -m launcher.pretrain "$RECIPE" "$@" --arm "$ARM" --experiment-dir)

# The report job: submitted once (not again by a requeued task), its log beside the report.
if [[ "$TASK" == 0 && -n "${SLURM_ARRAY_JOB_ID:-}" && "$RESTARTS" == 0 && ${#ARM_LIST[@]} -gt 1 ]]; then
  mkdir -p "$EXPERIMENT_DIR"
  sbatch --dependency="afterany:${SLURM_ARRAY_JOB_ID}" --export=ALL,PYTHON="$PYTHON" \
    --output="$EXPERIMENT_DIR/report-%j.out" slurm/compare.sh "$EXPERIMENT_DIR" || \
    echo "could not submit the comparison job; run: python -m launcher.compare $EXPERIMENT_DIR" >&2
fi

# The newest published checkpoint (a step_XXXXXXXX folder appears only once complete): a failed leg that moved it
# made progress, and is requeued; one that did not (it fails before its next save) is not, so no crash loops.
newest_checkpoint() {
  local dir newest=""
  for dir in "$EXPERIMENT_DIR/$ARM"/checkpoints/step_*; do  # in step order: the names are zero-padded
    if [[ -d "$dir" && "${dir##*/}" =~ ^step_[0-9]+$ ]]; then newest=$dir; fi
  done
  echo "$newest"
}
START_CHECKPOINT=$(newest_checkpoint)

STATUS=130  # (what an interrupted trainer returns)
if [[ -z "$STOP" ]]; then
  echo "[slurm] arm $ARM of $RECIPE on $SLURM_NNODES node(s), $SLURM_NTASKS process(es), rendezvous" \
    "$MASTER_ADDR:$MASTER_PORT, restart $RESTARTS of at most $MAX_REQUEUES"
  srun --kill-on-bad-exit=1 "$PYTHON" -m launcher.pretrain "$RECIPE" "$@" --arm "$ARM" --no-report &
  SRUN=$!
  set +e
  wait "$SRUN"; STATUS=$?
  while kill -0 "$SRUN" 2>/dev/null; do  # a trapped signal ends `wait` early: keep waiting for the save
    wait "$SRUN"; STATUS=$?
  done
  set -e
else
  echo "[slurm] signalled ($STOP) before training started: not starting it"
fi

# Preemption sends TERM to the steps only; a job that ends within its GraceTime counts as ended, not preempted, and
# SLURM would not requeue it.
if [[ "$STATUS" != 0 && "$STOP" != time_limit ]] && scontrol show job "$SLURM_JOB_ID" | grep -q 'PreemptTime=[0-9]'
then
  STOP=preempted
fi
# A failed leg: not a signal's stop (130), a configuration mistake (2), a guard's stop (3) or the early warning's (4),
# which a requeue cannot mend. It is requeued when it saved a newer checkpoint than it started from.
if [[ "$STATUS" == 4 ]]; then  # the early warning stopped the arm (monitor.on_warning=stop): a verdict, not a fault
  echo "[slurm] arm $ARM stopped by the early warning (exit status 4): not requeueing; see its last log lines"
elif [[ -z "$STOP" && ! "$STATUS" =~ ^(0|2|3|130)$ ]]; then
  NOW_CHECKPOINT=$(newest_checkpoint)
  if [[ -n "$NOW_CHECKPOINT" && "$NOW_CHECKPOINT" != "$START_CHECKPOINT" ]]; then
    STOP=failed
    echo "[slurm] training failed (status $STATUS) after saving $(basename "$NOW_CHECKPOINT")" \
      "(this leg started from ${START_CHECKPOINT:+$(basename "$START_CHECKPOINT")}${START_CHECKPOINT:-none})"
  else
    echo "[slurm] training failed (status $STATUS) without a new checkpoint since this leg started" \
      "(${START_CHECKPOINT:+$(basename "$START_CHECKPOINT")}${START_CHECKPOINT:-none}): not requeueing; the log" \
      "above says why, a new sbatch resumes from the newest checkpoint" >&2
  fi
fi
# (status 0: completed before the signal; 4: the early warning's verdict, never requeued)
if [[ "$STOP" =~ ^(time_limit|preempted|failed)$ && ! "$STATUS" =~ ^(0|4)$ ]]; then
  if (( RESTARTS < MAX_REQUEUES )); then
    echo "[slurm] $STOP: requeueing job $SLURM_JOB_ID (restart $(( RESTARTS + 1 )) of at most $MAX_REQUEUES)"
    scontrol requeue "$SLURM_JOB_ID"
  else
    echo "[slurm] not requeueing: job $SLURM_JOB_ID was restarted $RESTARTS time(s), MAX_REQUEUES=$MAX_REQUEUES;" \
      "submit again to continue from the last checkpoint" >&2
  fi
fi
exit "$STATUS"
