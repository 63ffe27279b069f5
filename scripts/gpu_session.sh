#!/usr/bin/env bash
# One call on a lent GPU node, a few minutes: the three figures that show a change is no slower
# (scripts/bench/session.py: tensor N = 8 at 7^3, the demo bank's separable kernel, the demo end
# to end in float32) into $OUT/session-after-R.json for R = 1..ROUNDS (default 2), with their
# benchmarks' own JSON beside. Needs .whl/ and data/mni152_t1_256.nii carried.
#   OUT=/tmp/out bash scripts/gpu_session.sh [BEFORE]
# BEFORE: another checkout holding scripts/bench/ (e.g. `git worktree add before REV`, carried
# as untracked files), run alternately with this one in the same call: session-before-R.json.
# TESTS="tensor engine separable pipeline cli" then runs tests/test_NAME.py on the NVIDIA device
# (gpu-tests.log). DEVICE (default nvidia) names the device.
set -u
source scripts/gpu_env.sh
before="${1:-}"
step() { echo "== $1 ($(date +%T))"; }
nvidia-smi -L 2>/dev/null
python3 -m compileall -q volconv > /dev/null  # as an installed package has them
python3 -m volconv devices --probe > /dev/null 2>&1  # the probe cached, as a user's node has it
if [ -n "$before" ]; then
  [ -e "$before/data" ] || ln -s "$PWD/data" "$before/data"
  (cd "$before" && python3 -m compileall -q volconv > /dev/null)
fi
session() {  # TREE TAG R: the session of the checkout in TREE, its own volconv on the path
  step "session $2, round $3"
  (cd "$1" && PYTHONPATH="/tmp/site:$PWD" timeout 420 python3 scripts/bench/run.py session \
    --device "${DEVICE:-nvidia}" --json "$OUT/session-$2-$3.json" 2>&1 \
    | grep -v -i "warn\|lambda: self" | tee "$OUT/session-$2-$3.log" | tail -12)
}
for r in $(seq 1 "${ROUNDS:-2}"); do  # turns: neither tree always goes first
  if [ -n "$before" ] && [ $((r % 2)) = 1 ]; then session "$before" before "$r"; fi
  session "$PWD" after "$r"
  if [ -n "$before" ] && [ $((r % 2)) = 0 ]; then session "$before" before "$r"; fi
done
if [ -n "${TESTS:-}" ]; then
  files=(); for name in $TESTS; do files+=("tests/test_$name.py"); done
  step "tests: $TESTS"
  VOLCONV_TEST_DEVICE="${DEVICE:-nvidia}" timeout 400 python3 -m pytest -q -p no:cacheprovider \
    "${files[@]}" > "$OUT/gpu-tests.log" 2>&1
  echo "tests exit $?"; tail -3 "$OUT/gpu-tests.log"
fi
exit 0
