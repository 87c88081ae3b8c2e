#!/bin/sh
# The sweeps issue #17 asks for, as docs/benchmarks.md reports them: fixed k = 0..3 and adaptive side by side
# on code, k=0 and adaptive on random words at T = 1.5, then k=1 and adaptive under a load stepping 1 <-> 64
# streams every 10 s. Every instance is launched afresh for every round (identical launches differ by a few %).
#   scripts/adaptive_sweep.sh OUT_DIR [CODE_ROUNDS [RANDOM_ROUNDS [STEP_ROUNDS]]]
# (3 3 2 by default: ~80 minutes on the 2-core Xeon hosts; 3 5 4 took 51 minutes on an EPYC twice as fast, 7 5 2 69.)
# The random words' visits are shorter than the code's (about a third fewer prompts): their ratios are closest
# to the bar, and one configuration's rounds have moved by up to a quarter between visits on these hosts, so
# more rounds of shorter visits say more than fewer of longer.
set -eu
out=${1:?usage: scripts/adaptive_sweep.sh OUT_DIR [CODE_ROUNDS [RANDOM_ROUNDS [STEP_ROUNDS]]]}
code_rounds=${2:-3}
random_rounds=${3:-$code_rounds}
step_rounds=${4:-2}
bench="$(dirname "$0")/../.venv/bin/mtpserve bench serve --no-progress --relaunch --input-len 256 --output-len 128"
fixed() { echo "k$1=--num-speculative-tokens $1 --speculative-adaptive false"; }
adaptive="adaptive=--num-speculative-tokens 3"
mkdir -p "$out"
$bench --launch "$(fixed 0)" "$(fixed 1)" "$(fixed 2)" "$(fixed 3)" "$adaptive" --rounds "$code_rounds" \
  --concurrency 1 4 16 64 --level-prompts 64 160 480 960 --out "$out/code.json"
$bench --launch "$(fixed 0)" "$adaptive" --rounds "$random_rounds" --dataset random --temperature 1.5 \
  --concurrency 1 4 16 64 --level-prompts 40 112 320 640 --out "$out/random.json"
$bench --launch "$(fixed 1)" "$adaptive" --rounds "$step_rounds" --step-load 1 64 --step-period 10 --duration 120 \
  --out "$out/step.json"
