#!/bin/sh
# Builds native/test/decode-bench.c against two builds of native/src/matmul.c at the avx512 level:
# "old" from git revision $BASE (default HEAD) and "new" from the work tree, and runs it:
#   [BASE=rev] sh native/test/decode-bench.sh [bf16|q8_0|q4_0|f16|f32] [rounds] [steps a round]
set -e
root=$(cd "$(dirname "$0")/../.." && pwd)
out=${TMPDIR:-/tmp}/kvfence-decode-bench-$(id -u)-$$
mkdir -p "$out/old"
trap 'rm -rf "$out"' EXIT
cc=${CC:-gcc}
flags="-std=gnu11 -O3 -I$root/native/include -mavx512f -mavx512bw -mavx512vl -mavx512dq -mavx512vnni -mfma -mf16c -mavx2"
git -C "$root" show "${BASE:-HEAD}:native/src/matmul.c" > "$out/old/matmul.c"
git -C "$root" show "${BASE:-HEAD}:native/src/kquants.c" > "$out/old/kquants.c"
git -C "$root" show "${BASE:-HEAD}:native/src/kquants.h" > "$out/old/kquants.h"
$cc $flags -DKF_ISA=old -c "$out/old/matmul.c" -o "$out/old-matmul.o" &
$cc $flags -DKF_ISA=old -c "$out/old/kquants.c" -o "$out/old-kquants.o" &
$cc $flags -DKF_ISA=avx512 -c "$root/native/src/matmul.c" -o "$out/new-matmul.o" &
$cc $flags -DKF_ISA=avx512 -c "$root/native/src/kquants.c" -o "$out/new-kquants.o" &
wait
$cc -std=gnu11 -O2 -I"$root/native/include" "$root/native/test/decode-bench.c" "$out"/*.o -lpthread -o "$out/decode-bench"
"$out/decode-bench" "$@"
