#!/usr/bin/env bash
# Slurm batch template for distribuuuu: one process per GPU, launched by srun.
#
# Usage (from the repository root):
#   sbatch tools/slurm_train.sh                                  # default recipe, 2 nodes x 8 GPUs
#   CFG=config/imagenet/resnet50_b256_8gpu.yaml sbatch --nodes=1 tools/slurm_train.sh
#   CFG=config/imagenet/resnet18_b8192_64gpu.yaml sbatch --nodes=8 tools/slurm_train.sh
#   sbatch tools/slurm_train.sh TRAIN.PRECISION bf16             # extra KEY VALUE overrides
#
# Options given to sbatch on the command line override the #SBATCH lines below. Check that
# nodes x ntasks-per-node equals the GPU count stated in the recipe's header comment, or adjust
# TRAIN.BATCH_SIZE so that the global batch stays the same (see config/imagenet/README.md).
# Example: the default recipe assumes 8 GPUs; on the default 2 nodes (16 GPUs) either submit with
# --nodes=1, or add TRAIN.BATCH_SIZE 16 to keep its global batch of 256.
#
# Rendezvous: distribuuuu reads SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, SLURM_NODELIST and
# SLURM_JOB_ID itself. The master address is the first host of SLURM_NODELIST, so no MASTER_ADDR
# is needed; the port is derived from the job id (set MASTER_PORT to force one).
#
# Preemption and time limits: --signal=USR1@90 makes Slurm send SIGUSR1 to the job steps 90 s
# before the time limit (Slurm may also send SIGTERM on preemption). distribuuuu then stops at a
# step synchronised across all ranks, writes a checkpoint to OUT_DIR/checkpoints and exits with
# code 75 (EX_TEMPFAIL: "try again later"). With DIST.REQUEUE True, rank 0 also runs
# `scontrol requeue $SLURM_JOB_ID`; --requeue allows that, and the requeued job keeps its job id,
# so it runs this script again with the same OUT_DIR and TRAIN.AUTO_RESUME True picks the
# checkpoint up. --open-mode=append keeps the log of every attempt in the same file.
# An exit code other than 0 or 75 is a real failure: read logs/<name>-<jobid>.out.

#SBATCH --job-name=distribuuuu
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=8
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=8
#SBATCH --time=24:00:00
#SBATCH --signal=USR1@90
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output=logs/%x-%j.out
#SBATCH --error=logs/%x-%j.out
# Site-specific lines, uncomment and edit as needed:
# #SBATCH --partition=gpu
# #SBATCH --account=my_account
# #SBATCH --mem=0

set -euo pipefail

# Slurm opens the --output file before this script runs, so logs/ must exist at submission time
# (mkdir -p logs once); creating it here helps later attempts and interactive use.
mkdir -p logs

# DataLoader workers (TRAIN.WORKERS) give the parallelism; one OpenMP thread per process avoids
# oversubscribing the CPUs.
export OMP_NUM_THREADS=1

echo "job ${SLURM_JOB_ID:-?} (${SLURM_JOB_NAME:-?}) restart ${SLURM_RESTART_COUNT:-0}:" \
    "${SLURM_NNODES:-?} nodes, ${SLURM_NTASKS:-?} tasks on ${SLURM_JOB_NODELIST:-?}"

# srun starts one task per GPU on every node; --kill-on-bad-exit=1 ends the whole step as soon as
# one rank fails, instead of leaving the others blocked in a collective until DIST.TIMEOUT_S.
# "$@" forwards the extra arguments given to sbatch after the script name as KEY VALUE overrides.
srun --kill-on-bad-exit=1 python -u tools/train_net.py --cfg "${CFG:-config/imagenet/resnet18_b256_8gpu.yaml}" OUT_DIR "output/${SLURM_JOB_NAME}" TRAIN.AUTO_RESUME True DIST.REQUEUE True "$@"
