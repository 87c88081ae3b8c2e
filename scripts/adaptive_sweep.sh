#!/bin/sh
# The sweeps issue #17 asks for, as docs/benchmarks.md reports them: fixed k = 0..3 and adaptive side by side
# on code, k=0 and adaptive on random words at T = 1.5, then k=1 and adaptive under a load stepping 1 <-> 64
# streams every 10 s. Every instance is launched afresh for every round (identical launches differ by a few %).
#   scripts/adaptive_sweep.sh OUT_DIR [ROUNDS]    (~70 minutes on 2 cores at 3 rounds)
set -eu
out=${1:?usage: scripts/adaptive_sweep.sh OUT_DIR [ROUNDS]}
rounds=${2:-3}
bench="$(dirname "$0")/../.venv/bin/mtpserve bench serve --no-progress --relaunch --input-len 256 --output-len 128"
fixed() { echo "k$1=--num-speculative-tokens $1 --speculative-adaptive false"; }
adaptive="adaptive=--num-speculative-tokens 3"
mkdir -p "$out"
$bench --launch "$(fixed 0)" "$(fixed 1)" "$(fixed 2)" "$(fixed 3)" "$adaptive" --rounds "$rounds" \
  --concurrency 1 4 16 64 --level-prompts 64 160 480 960 --out "$out/code.json"
$bench --launch "$(fixed 0)" "$adaptive" --rounds "$rounds" --dataset random --temperature 1.5 \
  --concurrency 1 4 16 64 --level-prompts 64 160 480 960 --out "$out/random.json"
$bench --launch "$(fixed 1)" "$adaptive" --rounds 2 --step-load 1 64 --step-period 10 --duration 120 \
  --out "$out/step.json"
