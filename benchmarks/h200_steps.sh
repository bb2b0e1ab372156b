# Step runner shared by the H200 scripts (sourced): `has NAME` tests whether STEPS lists NAME; `step NAME SECONDS
# COMMAND...` runs COMMAND with a time limit that ends before DEADLINE seconds of the script, logs to $OUT/NAME.log,
# appends its exit code to $OUT/summary.txt and sets status=1 on a failure.
has() { [[ " $STEPS " == *" $1 "* ]]; }
status=0
step() {
  local name=$1 limit=$2; shift 2
  local left=$((DEADLINE - SECONDS))
  [ $left -lt $limit ] && limit=$left
  if [ $limit -lt 20 ]; then echo "== $name: skipped, no time left" | tee -a "$OUT/summary.txt"; status=1; return; fi
  local start=$SECONDS
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  echo "== $name: exit $rc in $((SECONDS - start)) s" | tee -a "$OUT/summary.txt"
  tail -15 "$OUT/$name.log"
  [ $rc -eq 0 ] || status=1
}
