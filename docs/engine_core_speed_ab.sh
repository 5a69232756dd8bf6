#!/usr/bin/env bash
# Issue 24 no-regression, many short alternated runs: old engine (2f1fce4, /tmp/old_engine) vs HEAD.
# Order alternates old/new and new/old per pair so drift does not favour one side.
set -u
export ADAFLASH_HF_CACHE=/tmp/abcache
OUT=/work/main/outputs/noregress2
PY=/work/main/.venv/bin/python
DRAFTER=/work/main/adaflash_hf/checkpoints/smollm2-135m-instruct-drafter
PAIRS=${PAIRS:-6}
run_serving() {  # ver idx
  local dir=/tmp/new_engine; [ $1 = old ] && dir=/tmp/old_engine
  (cd $dir && $PY -m adaflash_hf.cli bench-serving --drafter $DRAFTER --concurrency 16 --max-requests 16 \
    --max-new-tokens 48 --methods plain_batched,engine_plain,adaptive,hybrid --threads 2 --quiet \
    --json $OUT/$1_serving_$2.json > $OUT/$1_serving_$2.log 2>&1)
  echo "$(date +%T) serving $1 $2 rc=$?"
}
run_bench() {
  local dir=/tmp/new_engine; [ $1 = old ] && dir=/tmp/old_engine
  (cd $dir && $PY -m adaflash_hf.cli bench --drafter $DRAFTER --max-prompts 2 --max-new-tokens 64 \
    --methods plain,adaflash,drafter_only --threads 2 --quiet --json $OUT/$1_bench_$2.json > $OUT/$1_bench_$2.log 2>&1)
  echo "$(date +%T) bench $1 $2 rc=$?"
}
for i in $(seq ${START:-1} $PAIRS); do
  if [ $((i % 2)) = 1 ]; then first=old; second=new; else first=new; second=old; fi
  run_${KIND:-serving} $first $i
  run_${KIND:-serving} $second $i
done
