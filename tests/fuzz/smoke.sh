#!/bin/sh
# smoke.sh FUZZER CORPUS WORKDIR BUDGET [DICT]
# Replays the committed CORPUS with the libFuzzer binary FUZZER, then fuzzes from a copy of it
# in WORKDIR/corpus (new inputs land there, never in CORPUS; crash inputs land in
# WORKDIR/artifacts), and prints one summary line. Non-zero exit on any crash, leak, timeout
# or out-of-memory, and when the committed corpus replays badly.
# BUDGET is `runs:N`: N executions from seed 1 with address-space randomisation off (the
# harnesses' hash maps are keyed by host addresses, so the layout steers coverage): as much
# work however loaded the machine, nearly the same inputs each time (the environment still
# moves a few addresses); or `seconds:S`: S seconds unseeded, a search for new inputs.
set -eu

fuzzer=$1
corpus=$2
work=$3
budget=$4
dict=${5:-}
name=$(basename "$fuzzer")

[ -x "$fuzzer" ] || { echo "fuzz-smoke: $fuzzer is not built" >&2; exit 1; }
[ -d "$corpus" ] || { echo "fuzz-smoke: no corpus at $corpus" >&2; exit 1; }

rm -rf "$work"
mkdir -p "$work/corpus" "$work/artifacts"
common="-timeout=25 -rss_limit_mb=2048 -artifact_prefix=$work/artifacts/"
[ -n "$dict" ] && common="$common -dict=$dict"

count_files() { find "$1" -type f | wc -l | tr -d ' '; }
count_bytes() { find "$1" -type f -exec cat {} + | wc -c | tr -d ' '; }

# Replay: every committed input once, nothing written.
echo "== $name: replaying $corpus ($(count_files "$corpus") files)"
# shellcheck disable=SC2086
if ! "$fuzzer" $common -runs=0 "$corpus" >"$work/replay.log" 2>&1; then
  tail -n 40 "$work/replay.log" >&2
  echo "fuzz-smoke: $name failed on the committed corpus (log: $work/replay.log)" >&2
  exit 1
fi

# Fuzz from a copy of the corpus.
cp "$corpus"/* "$work/corpus/"
fixed=
case $budget in
  runs:*)
    limit="-seed=1 -runs=${budget#runs:}"
    if setarch "$(uname -m)" -R true >/dev/null 2>&1; then fixed="setarch $(uname -m) -R"; fi
    echo "== $name: ${budget#runs:} executions from seed 1$([ -n "$fixed" ] && echo ", address-space randomisation off") (new inputs in $work/corpus)"
    ;;
  seconds:*)
    limit="-max_total_time=${budget#seconds:}"
    echo "== $name: fuzzing for ${budget#seconds:}s, unseeded (new inputs in $work/corpus)"
    ;;
  *) echo "fuzz-smoke: BUDGET is runs:N or seconds:S, not '$budget'" >&2; exit 1 ;;
esac
start=$(date +%s)
# shellcheck disable=SC2086
if ! $fixed "$fuzzer" $common $limit -print_final_stats=1 "$work/corpus" >"$work/fuzz.log" 2>&1; then
  tail -n 60 "$work/fuzz.log" >&2
  echo "fuzz-smoke: $name FAILED (log: $work/fuzz.log, inputs: $work/artifacts/)" >&2
  exit 1
fi
end=$(date +%s)

stat_of() { sed -n "s/^stat::$1: *//p" "$work/fuzz.log" | tail -n 1; }
last=$(grep -E '^#[0-9]+' "$work/fuzz.log" | tail -n 1)
cov=$(printf '%s\n' "$last" | sed -n 's/.*cov: \([0-9]*\).*/\1/p')
ft=$(printf '%s\n' "$last" | sed -n 's/.*ft: \([0-9]*\).*/\1/p')
printf '%s: %s executions in %ss (%s exec/s), coverage %s edges / %s features, %s new inputs, corpus %s files / %s bytes (committed %s files / %s bytes), peak RSS %s MB\n' \
  "$name" "$(stat_of number_of_executed_units)" "$((end - start))" "$(stat_of average_exec_per_sec)" \
  "${cov:-?}" "${ft:-?}" "$(stat_of new_units_added)" \
  "$(count_files "$work/corpus")" "$(count_bytes "$work/corpus")" \
  "$(count_files "$corpus")" "$(count_bytes "$corpus")" "$(stat_of peak_rss_mb)"
