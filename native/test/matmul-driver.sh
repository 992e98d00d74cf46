#!/bin/sh
# Builds native/src/matmul.c at every ISA level (the flags of native/include/kvfence-kernels.h) with
# the standalone driver native/test/matmul-driver.c and runs it: sh native/test/matmul-driver.sh
# [check|bench|all] [level|-] [format|-] [rows in out]. SANITIZE=1 builds with ASan + UBSan (every buffer is malloc'd at its
# exact size, so a read past one is reported).
set -e
root=$(cd "$(dirname "$0")/../.." && pwd)
out=${TMPDIR:-/tmp}/kvfence-matmul-driver-$(id -u)-$$
trap 'rm -rf "$out"' EXIT
mkdir -p "$out"
opt="-O3"
[ "${SANITIZE:-0}" = 1 ] && opt="-O1 -g -fsanitize=address,undefined -fno-omit-frame-pointer"
cc=${CC:-gcc}
common="-std=gnu11 -Wall -Wextra -Wno-unused-parameter -I$root/native/include $opt"
$cc $common -DKF_ISA=avx512 -mavx512f -mavx512bw -mavx512vl -mavx512dq -mavx512vnni -mfma -mf16c -mavx2 \
  -c "${MATMUL_C:-$root/native/src/matmul.c}" -o "$out/avx512.o"
$cc $common -DKF_ISA=avx512 -mavx512f -mavx512bw -mavx512vl -mavx512dq -mavx512vnni -mfma -mf16c -mavx2 \
  -c "$root/native/src/kquants.c" -o "$out/avx512-kq.o"
$cc $common -DKF_ISA=avxvnni -mavx2 -mfma -mf16c -mavxvnni -c "${MATMUL_C:-$root/native/src/matmul.c}" -o "$out/avxvnni.o"
$cc $common -DKF_ISA=avxvnni -mavx2 -mfma -mf16c -mavxvnni -c "$root/native/src/kquants.c" -o "$out/avxvnni-kq.o"
$cc $common -DKF_ISA=avx2 -mavx2 -mfma -mf16c -c "${MATMUL_C:-$root/native/src/matmul.c}" -o "$out/avx2.o"
$cc $common -DKF_ISA=avx2 -mavx2 -mfma -mf16c -c "$root/native/src/kquants.c" -o "$out/avx2-kq.o"
$cc $common -DKF_ISA=generic -c "${MATMUL_C:-$root/native/src/matmul.c}" -o "$out/generic.o"
$cc $common -DKF_ISA=generic -c "$root/native/src/kquants.c" -o "$out/generic-kq.o"
$cc $common -mf16c "$root/native/test/matmul-driver.c" "$out"/*.o \
  -lm -lpthread -o "$out/matmul-driver"
"$out/matmul-driver" "$@"
