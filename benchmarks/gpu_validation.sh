#!/usr/bin/env bash
# The GPU path on an H200 test host, from the repository root (the device tool runs it; results go to $OUT).
#   bash benchmarks/gpu_validation.sh flow    the real `datagen run` flow: halt a stand-in trainer holding GPU
#                                             memory, probe, plan one server per GPU, generate, merge, report
#   bash benchmarks/gpu_validation.sh bench   benchmarks/fleet_throughput.py on 1 and 2 GPUs, 64 and 256 in flight
#   bash benchmarks/gpu_validation.sh cpubench  `make bench` pinned to two cores (a quiet 2-core machine)
#   bash benchmarks/gpu_validation.sh tune    `datagen tune` on a real fleet (benchmarks/tune_on_fleet.py)
#   bash benchmarks/gpu_validation.sh walk    docs/first-run.md step by step with its own commands (transformers
#                                             engine; the model and datasets are made here: the host has no Hub)
# Python packages the host lacks travel as wheels in .whl/ (see docs/gpu-validation.md).
set -uo pipefail
OUT=${OUT:-/tmp/dg/results}
mkdir -p /tmp/dg "$OUT"
[ -n "${SKIP_WHEELS:-}" ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl || exit 1
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
    --rounds "${ROUNDS:-2}" ${CLIENTS:+--clients "$CLIENTS"} ${SHARD_SIZES:+--shard-sizes "$SHARD_SIZES"} \
    --out "$OUT/bench.json" 2>&1 | grep -v "Writing model"
  ;;
tune)
  # P6: `datagen tune` against a real fleet (transformers serve on each GPU).
  python3 benchmarks/tune_on_fleet.py --model-dir /tmp/dg/model --servers "${SERVERS:-1}" --device cuda \
    --levels "${LEVELS:-16,32,64,128,256}" --max-tokens "${MAX_TOKENS:-64}" --out "$OUT/tune.json"
  ;;
walk)
  # docs/first-run.md in order, each step's own commands through a `datagen` on PATH; what the test host cannot do
  # is replaced, and said: the install (wheels, above), `hf download` (a random model and prompt files made here).
  # WALK_DEVICE=cpu walks it on a machine without a GPU (the config's fleet.device edited as step 3 says).
  mkdir -p /tmp/dg/bin && printf '#!/bin/sh\nexec python3 -m flows.cli_entry "$@"\n' > /tmp/dg/bin/datagen
  chmod +x /tmp/dg/bin/datagen && export PATH=/tmp/dg/bin:$PATH
  step() { echo "== $1 ($(date +%T))"; }
  trainer() {  # the job a run halts: a fresh stand-in before each run (a run restarts nothing without a command)
    python3 -m datagen.host.standin_trainer --pidfile /tmp/dg/trainer.pid --checkpoint-dir /tmp/dg/checkpoints \
      --gpu-memory-gib "${TRAINER_GIB:-8}" >> /tmp/dg/trainer.log 2>&1 &
    sleep 5
  }
  step "1. datagen probe"; datagen probe > "$OUT/1-probe.txt" 2>&1; echo "rc=$?"; grep -ciE "problem" "$OUT/1-probe.txt"
  step "2. datasets (made here) and datagen datasets inspect"
  python3 benchmarks/make_prompt_files.py --rows-per-layout "${ROWS:-40}" --out /tmp/dg/prompts > /dev/null
  python3 - > /tmp/dg/datasets.txt <<'PY'
import yaml
for dataset in yaml.safe_load(open("configs/h200-test-host.yaml"))["datasets"]:
    print(dataset["path"], dataset["format"])
PY
  while read -r path layout; do
    datagen datasets inspect "$path" --format "$layout" --limit 2000 > "$OUT/2-inspect-$layout.txt" 2>&1
    echo "inspect $layout rc=$? $(grep -iE "prompts" "$OUT/2-inspect-$layout.txt" | head -1 | cut -c1-120)"
  done < /tmp/dg/datasets.txt
  step "3. the config for this box"
  cp configs/h200-test-host.yaml /tmp/dg/config.yaml
  [ "${WALK_DEVICE:-cuda}" = cuda ] || sed -i "s/device: cuda/device: ${WALK_DEVICE}/" /tmp/dg/config.yaml
  step "4. datagen probe --model, then a smoke run"
  datagen probe --model /tmp/dg/model --engine transformers > "$OUT/4-plan.txt" 2>&1; echo "plan rc=$?"
  trainer
  datagen run --config /tmp/dg/config.yaml --max-prompts 100 --datasets metamath --run-id smoke > "$OUT/4-smoke.log" 2>&1
  echo "smoke rc=$?"; tail -3 "$OUT/4-smoke.log" | cut -c1-400
  step "5. datagen tune on a server started from the plan's command line"
  datagen probe --model /tmp/dg/model --engine transformers --json 2> /dev/null > /tmp/dg/plan.json
  python3 - > /tmp/dg/serve.sh <<'PY'
import json, shlex
server = json.load(open("/tmp/dg/plan.json"))["plan"]["servers"][0]
env = " ".join(f"{name}={shlex.quote(value)}" for name, value in server["launch"]["env"].items())
print(f"exec env {env} {shlex.join(server['launch']['argv'])}")
print(f"# {server['url']} {server['launch']['argv'][server['launch']['argv'].index('serve') + 1 :][-1]}")
PY
  url=$(tail -1 /tmp/dg/serve.sh | cut -d' ' -f2)
  setsid sh /tmp/dg/serve.sh > /tmp/dg/tune-server.log 2>&1 &
  server=$!
  for _ in $(seq 300); do curl -sf "$url/health" > /dev/null || ! kill -0 "$server" 2> /dev/null && break; sleep 1; done
  # The name requests send: the plan's (transformers serve answers its own /v1/models with HTTP 500 offline).
  served=$(python3 -c "import json; print(json.load(open('/tmp/dg/plan.json'))['plan']['served_model_name'])")
  datagen tune --engine transformers --model "$served" --url "$url" --levels "${LEVELS:-16,64}" --max-tokens 64 \
    --output /tmp/dg/tune.json > "$OUT/5-tune.txt" 2>&1
  echo "tune rc=$?"; tail -4 "$OUT/5-tune.txt"
  kill -- -"$server"; wait "$server" 2> /dev/null
  step "6. the full run"
  trainer
  datagen run --config /tmp/dg/config.yaml --run-id full > "$OUT/6-full.log" 2>&1
  echo "full rc=$?"; tail -3 "$OUT/6-full.log" | cut -c1-400
  step "7. datagen corpus adopt (the smoke run's completions stand for the corpus the drafter trains on)"
  mkdir -p /tmp/dg/corpus/math
  find /tmp/dg/out/runs/smoke -path '*completions*' -name '*.jsonl' -exec cp {} /tmp/dg/corpus/math/ \;
  datagen corpus adopt /tmp/dg/corpus --output /tmp/dg/out --name drafter-corpus \
    --category-key-pattern '^(?P<category>[^/]+)/' --tokenizer /tmp/dg/model > "$OUT/7-adopt.txt" 2>&1
  echo "adopt rc=$?"; tail -2 "$OUT/7-adopt.txt"
  step "9. datagen export of the full run's version"
  version=$(ls /tmp/dg/out/datasets/drafter-expansion/v*.json | tail -1)
  datagen export "$version" --tokenizer /tmp/dg/model > "$OUT/9-export.txt" 2>&1
  echo "export rc=$?"; tail -6 "$OUT/9-export.txt"
  cp /tmp/dg/out/runs/full/report.md "$OUT/6-report.md" 2> /dev/null
  pkill -f "standin_trainer --pidfile /tmp/dg/trainer.pid"  # one a failed step left unhalted
  # One file back (the device tool returns at most 8): every step's output in walk.tgz.
  (cd "$OUT" && tar czf walk.tgz --remove-files -- *.txt *.log *.md)
  ;;
esac
