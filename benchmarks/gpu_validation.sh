#!/usr/bin/env bash
# The GPU path on an H200 test host, from the repository root (the device tool runs it; results go to $OUT).
#   bash benchmarks/gpu_validation.sh flow    the real `datagen run` flow: halt a stand-in trainer holding GPU
#                                             memory, probe, plan one server per GPU, generate, merge, report
#   bash benchmarks/gpu_validation.sh bench   benchmarks/fleet_throughput.py on 1 and 2 GPUs, 64 and 256 in flight
#   bash benchmarks/gpu_validation.sh cpubench  `make bench` pinned to two cores (a quiet 2-core machine)
#   bash benchmarks/gpu_validation.sh tune    `datagen tune` on a real fleet (benchmarks/tune_on_fleet.py)
# Python packages the host lacks travel as wheels in .whl/ (see docs/gpu-validation.md).
set -uo pipefail
OUT=${OUT:-/tmp/dg/results}
mkdir -p /tmp/dg "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export DATAGEN_STATE_DIR=/tmp/dg/state PREFECT_HOME=/tmp/dg/prefect PREFECT_SERVER_ANALYTICS_ENABLED=false DO_NOT_TRACK=1
if [ ! -f /tmp/dg/model/config.json ] && [ "${1:-flow}" != cpubench ]; then
  python3 -c "from pathlib import Path; from benchmarks.fleet_throughput import build_qwen3_shaped_model as build; build(Path('/tmp/dg/model'))"
fi
case "${1:-flow}" in
flow)
  python3 benchmarks/make_prompt_files.py --rows-per-layout "${ROWS:-250}" --out /tmp/dg/prompts > /dev/null
  python3 -m datagen.host.standin_trainer --pidfile /tmp/dg/trainer.pid --checkpoint-dir /tmp/dg/checkpoints \
    --gpu-memory-gib 20 > /tmp/dg/trainer.log 2>&1 &
  sleep 10
  nvidia-smi --query-gpu=index,memory.used --format=csv > "$OUT/gpu-memory-before-halt.csv"
  start=$(date +%s)
  python3 -m flows.cli_entry run --config configs/h200-test-host.yaml --run-id h200 > "$OUT/flow.log" 2>&1
  echo "flow rc=$? wall_s=$(( $(date +%s) - start ))"
  grep -E "fleet ready|training halted|plan mode|progress 100|run complete" "$OUT/flow.log" | cut -c1-220
  tail -14 "$OUT/flow.log"
  cp /tmp/dg/out/runs/h200/report.md "$OUT/" 2>/dev/null
  tar czf "$OUT/run-records.tgz" -C /tmp/dg/out/runs/h200 attempts report.json manifest.json done tokenized/summary.json 2>/dev/null
  ;;
bench)
  # P5: datagen's dispatcher vs the direct client at 64 and 256 requests in flight per server (ABBA each).
  for conc in 64 256; do
    prompts=$(( conc * ${WAVES:-4} ))
    python3 benchmarks/fleet_throughput.py --model-dir /tmp/dg/model --servers "${SERVERS:-1,2}" --prompts "$prompts" \
      --max-tokens "${MAX_TOKENS:-64}" --concurrency "$conc" --device cuda --out "$OUT/fleet-$conc.json" 2>&1 | grep -v '^ '
  done
  ;;
cpubench)
  # P5: `make bench` (simulated servers) on two of the host's cores, away from any other work.
  taskset -c 0,1 python3 benchmarks/bench.py --scenarios "${SCENARIOS:-seed,high-rate,saturate}" \
    --rounds "${ROUNDS:-2}" --out "$OUT/bench.json" 2>&1 | grep -v "Writing model"
  ;;
tune)
  # P6: `datagen tune` against a real fleet (transformers serve on each GPU).
  python3 benchmarks/tune_on_fleet.py --model-dir /tmp/dg/model --servers "${SERVERS:-1}" --device cuda \
    --levels "${LEVELS:-16,32,64,128,256}" --max-tokens "${MAX_TOKENS:-64}" --out "$OUT/tune.json"
  ;;
esac
