#!/usr/bin/env bash
# Runs GPU jobs in sequence, each under its own cap; everything they write comes back as one archive
# ($OUT/jobs.tgz: the device returns at most 8 files), with the summaries in $OUT/all.txt.
set -u
cd "$(dirname "$0")/.."
real_out=$OUT
export OUT=/tmp/jobs_out
rm -rf "$OUT"; mkdir -p "$OUT"
start=$(date +%s)
for job in ${JOBS:-enc-host floor-paged floor-bench floor-wake}; do
  t0=$(date +%s)
  timeout "${JOB_CAP:-200}" bash "gpu_jobs/$job.sh" > "$OUT/$job.stdout" 2>&1
  echo "$job rc=$? $(( $(date +%s) - t0 ))s" | tee -a "$real_out/all.txt"
done
echo "total $(( $(date +%s) - start ))s" | tee -a "$real_out/all.txt"
for f in "$OUT"/*/summary.txt "$OUT"/*/digest.txt; do [ -f "$f" ] && { echo "=== $f"; cat "$f"; } >> "$real_out/all.txt"; done
tar czf "$real_out/jobs.tgz" -C "$OUT" --exclude=caches . 2>/dev/null
head -c 6000 "$real_out/all.txt"
