#!/usr/bin/env bash
# The GPU path's device check in one run (< 8 minutes) on a fresh CUDA machine without network.
#
#   evals/gpu_check/gpu_check.sh OUT_DIR [extra evals/gpu_check/check.py options]
#
# 1. installs the wheels carried in .whl/ (flashinfer-python 0.6.x and apache-tvm-ffi; see
#    docs/gpu.md for how to fetch them) into a private folder, without network;
# 2. runs python -m specdec.evals.gpu_check under a time budget; it writes OUT_DIR/gpu_check_*.json after
#    every stage and prints the table of targets last;
# 3. if time is left, runs the CUDA-marked unit tests of the GPU path.
# OUT_DIR also receives gpu_check.log, nvidia_smi.csv, gpu_check_table.txt and pytest_gpu.log.
set -uo pipefail

out="${1:?usage: evals/gpu_check/gpu_check.sh OUT_DIR [options for evals/gpu_check/check.py]}"
shift
cd "$(dirname "$0")/.." || exit 2
mkdir -p "$out"
PY="${PYTHON:-python3}"
LIMIT_S=470  # the whole script, leaving margin under 8 minutes

site=/tmp/specdec-site
wheels="${SPECDEC_WHEELS_DIR:-.whl}"
if compgen -G "$wheels/*.whl" >/dev/null; then
  echo "installing carried wheels: $(ls "$wheels")"
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$site" "$wheels"/*.whl || { echo "wheel install failed"; exit 3; }
  export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
else
  echo "no wheels in $wheels/: FlashInfer must already be installed, or the check reports why not"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

# Kernels compiled by an earlier run (its OUT_DIR/flashinfer_jit.tgz.part-*, carried back in
# .jitcache/) go where FlashInfer looks for ahead-of-time builds, so they load without a compile.
jit_cache="${SPECDEC_JIT_CACHE_DIR:-.jitcache}"
if compgen -G "$jit_cache/flashinfer_jit.tgz.part-*" >/dev/null; then
  aot="$("$PY" -c 'import flashinfer.jit.env as e; print(e.FLASHINFER_AOT_DIR)' 2>/dev/null)"
  if [ -n "$aot" ]; then
    mkdir -p "$aot" && cat "$jit_cache"/flashinfer_jit.tgz.part-* | tar -xz -C "$aot" \
      && echo "restored prebuilt kernels into $aot: $(ls "$aot" | tr '\n' ' ')"
  fi
fi

# FlashInfer's JIT calls `ninja` and `nvcc`: put the interpreter's bin folder and the ninja
# package's binary on PATH, build for this GPU only, with every core.
bin_dir="$("$PY" -c 'import os, sys; print(os.path.dirname(sys.executable))')"
ninja_dir="$("$PY" -c 'import ninja; print(ninja.BIN_DIR)' 2>/dev/null || true)"
export PATH="$bin_dir${ninja_dir:+:$ninja_dir}:$PATH:/usr/local/cuda/bin"
export MAX_JOBS="${MAX_JOBS:-$(nproc)}"
export PYTHONUNBUFFERED=1

nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem \
  --format=csv >"$out/nvidia_smi.csv" 2>&1 || true

check_s=$((LIMIT_S - SECONDS - 60))
timeout "$check_s" "$PY" -m evals.gpu_check "$out" --budget-s $((check_s - 30)) "$@" 2>&1 \
  | tee "$out/gpu_check.log"
status=${PIPESTATUS[0]}

left=$((LIMIT_S - SECONDS))
if [ "$left" -gt 25 ]; then
  timeout "$left" "$PY" -m pytest -q -m gpu -p no:cacheprovider tests/test_flashinfer_indices.py \
    >"$out/pytest_gpu.log" 2>&1
  echo "gpu unit tests: exit $? (log in $out/pytest_gpu.log)"
  tail -n 3 "$out/pytest_gpu.log"
fi
# Bring the compiled kernels back (NAME/NAME.so per module, from the JIT folder and the
# ahead-of-time folder the jit stage copies them to; split under the 16 MiB file limit) so a
# later run can skip the JIT build.
dirs="$("$PY" -c 'import flashinfer.jit.env as e; print(e.FLASHINFER_JIT_DIR, e.FLASHINFER_AOT_DIR)' 2>/dev/null)"
if [ -n "$dirs" ]; then
  stage=/tmp/specdec-jit-out && rm -rf "$stage" && mkdir -p "$stage"
  for d in $dirs; do
    [ -d "$d" ] && (cd "$d" && find . -mindepth 2 -maxdepth 2 -name '*.so' -exec cp --parents {} "$stage" \;)
  done
  (cd "$stage" && tar -czf - . | split -b 15M - "$out/flashinfer_jit.tgz.part-")
  ls -l "$out"/flashinfer_jit.tgz.part-* 2>/dev/null
fi
echo "total ${SECONDS}s, check exit ${status}"
cat "$out/gpu_check_table.txt" 2>/dev/null
exit "$status"
