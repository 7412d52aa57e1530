#!/usr/bin/env bash
# Run a command with $OUT pointing at a scratch folder, and keep $OUT/logs.tgz (one file) up to date every
# 15 s and at the end: a lease returns only a few files, and whatever a killed run had written still comes back.
#   bash benchmarks/h200/scripts/packed.sh 'FILES=... bash benchmarks/h200/scripts/h200_verify.sh parallel; ...'
real=$OUT; export OUT=/tmp/packed-out; rm -rf "$OUT"; mkdir -p "$OUT"
( while sleep 15; do tar czf "$real/logs.tgz.tmp" -C "$OUT" . 2>/dev/null && mv "$real/logs.tgz.tmp" "$real/logs.tgz"; done ) &
packer=$!
bash -c "$1"; rc=$?
kill $packer 2>/dev/null; tar czf "$real/logs.tgz" -C "$OUT" .; rm -f "$real/logs.tgz.tmp"
exit $rc
