#!/usr/bin/env bash
# The test suite (the README's test command): two pytest processes side by side.
#   bash scripts/test.sh            # every test but the GPU ones
#   bash scripts/test.sh -k resume  # more pytest arguments go to both processes
# One process runs the tests that start Ray clusters, one after another: `ray_address: auto` joins
# any cluster running on the machine, so two of them at once could meet. They are mostly processes
# booting and waiting on each other, which leaves CPU for the other process: everything else.
# Each process writes a log; both are printed when both have ended, and the exit status is the
# first failing one's.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
RAY_TESTS=(tests/runtime tests/ui/test_real_run.py)
logs=$(mktemp -d)
trap 'kill $(jobs -p) 2>/dev/null; exit 130' INT TERM

$PY -m pytest -q -m "not gpu" --timeout 900 "${RAY_TESTS[@]}" "$@" >"$logs/ray.txt" 2>&1 &
ray_pid=$!
$PY -m pytest -q -m "not gpu" --timeout 900 "${RAY_TESTS[@]/#/--ignore=}" "$@" >"$logs/rest.txt" 2>&1 &
rest_pid=$!

wait "$rest_pid"
rest=$?
wait "$ray_pid"
ray=$?
echo "=== tests without Ray clusters (exit $rest)"
cat "$logs/rest.txt"
echo "=== tests that start Ray clusters: ${RAY_TESTS[*]} (exit $ray)"
cat "$logs/ray.txt"
rm -rf "$logs"
# pytest exits 5 when an argument selects nothing in one of the two halves: that half passed
for code in "$rest" "$ray"; do
  if [ "$code" != 0 ] && [ "$code" != 5 ]; then exit "$code"; fi
done
[ "$rest" = 5 ] && [ "$ray" = 5 ] && exit 5
exit 0
