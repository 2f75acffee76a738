#!/bin/bash
# lmtune on several machines under SLURM: one launcher per node, 8 GPUs each.
#   sbatch examples/slurm.sh
# The output folder (checkpoints) must be on a file system every node can reach; the tokenized-data
# cache too, unless --cache-per-node. After a preemption or a time-out, `sbatch` it again (or let
# --requeue do it): the run resumes from the newest checkpoint by itself.
#SBATCH --job-name=lmtune
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=64
#SBATCH --time=24:00:00
#SBATCH --signal=TERM@120
#SBATCH --requeue
#SBATCH --output=%x-%j.log
set -euo pipefail

head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)

# --doctor checks the nodes first (versions, GPUs, all-reduce, the shared folders, disk, clocks) and
# stops with what to fix. A rank that stalls is named in OUTPUT/hang-report.txt and the job restarts.
# --signal=TERM@120 gives every node SIGTERM two minutes before the limit: lmtune finishes its step,
# saves a checkpoint and exits cleanly.
srun lmtune train --config run.yaml \
    --nnodes "$SLURM_NNODES" --node-rank "$SLURM_NODEID" --nproc-per-node 8 \
    --rdzv-endpoint "$head_node:29500" --rdzv-id "$SLURM_JOB_ID" \
    --output-dir "/shared/runs/$SLURM_JOB_NAME" --cache-dir /shared/cache/lmtune \
    --save-every 500 --keep-last 3 --max-restarts 3 --doctor
