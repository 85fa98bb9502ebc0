#!/usr/bin/env bash
# On one GPU node: measure the model's blocks, plan with the measurements, run the plan for 20
# steps, fit the cost model's global factors to that run, and plan again with them
# (docs/running.md, "On a GPU"). Needs a CUDA build of torch and `pip install -e '.[run]'`.
#
# Usage: benchmarks/gpu_profile_plan_run.sh MODEL GPUS [WORKDIR]
#   e.g. benchmarks/gpu_profile_plan_run.sh llama-3-8b 8 runs/llama8b-check
set -euo pipefail

model=${1:?usage: $0 MODEL GPUS [WORKDIR]}
gpus=${2:?usage: $0 MODEL GPUS [WORKDIR]}
work=${3:-runs/${model}-profile-check}
mkdir -p "$work"

# 1. the blocks at micro-batch 1 (the cost model carries them to the plan's micro-batch)
dsplan profile --model "$model" --device cuda --micro-batch 1 --out "$work/profile.json" --force

# 2. the best plan on this node priced with the measurements, and its run directory
dsplan suggest --model "$model" --nodes 1 --gpus-per-node "$gpus" --profile "$work/profile.json" \
    --top 1 --json > "$work/suggest.json"
dsplan generate --plan "$work/suggest.json" --out "$work/run" --steps 20 --checkpoint-every 0 --force

# 3. 20 steps, measured against the prediction (report.json)
dsplan run "$work/run" --steps 20

# 4. the global factors fitted to the run, and the plan again with them
dsplan calibrate "$work/run/report.json" --out "$work/calibration.yaml" --force
dsplan suggest --model "$model" --nodes 1 --gpus-per-node "$gpus" --profile "$work/profile.json" \
    --calibration "$work/calibration.yaml" --top 3
