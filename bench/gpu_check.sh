#!/usr/bin/env bash
# GPU check of the state kernels: the kernel tests compiled on CUDA, then bench/gpu_check.py
# (figures against SGLang's own GDN and SSD prefill kernels, one "name: value" line each,
# one JSON). About 3-5 minutes on an H200, most of it Triton compiling and SGLang's autotuning.
#
# Needs a CUDA GPU with torch, triton, pytest, numpy; no sglang. SGLang's kernels come from
# the copy bench/gpu_ops.py makes (built here if sglang is importable, else it must be
# there already, e.g. carried to the GPU host):
#   python bench/gpu_ops.py --out build/gpu_ops      # where sglang is installed
#   bash bench/gpu_check.sh [--out results/bench/gpu_check.json]
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
python="${PYTHON:-python3}"
ops="${SGLANG_GPU_OPS:-$repo/build/gpu_ops}"
if [ ! -d "$ops/sglang_gpu_ops" ]; then
    "$python" "$repo/bench/gpu_ops.py" --out "$ops"
fi

# `sglang_hybrid.kernels` and `.patches` without installing the package (the rest of it
# needs sglang): a throwaway package holding just those two, as pyproject maps them.
shim="$(mktemp -d)"
trap 'rm -rf "$shim"' EXIT
mkdir -p "$shim/sglang_hybrid"
: > "$shim/sglang_hybrid/__init__.py"
ln -s "$repo/kernels" "$shim/sglang_hybrid/kernels"
ln -s "$repo/patches" "$shim/sglang_hybrid/patches"
export PYTHONPATH="$shim:$ops${PYTHONPATH:+:$PYTHONPATH}"

# Compiled kernels on CUDA (tests/test_kernels.py defaults to the CPU interpreter). From the
# shim, with an empty pytest.ini and --noconftest, so the repository's own package dir,
# pytest config and conftests (which import sglang) stay out of it.
export TRITON_INTERPRET=0
: > "$shim/pytest.ini"
cd "$shim"
set +e
timeout 240 "$python" -m pytest "$repo/tests/test_kernels.py" -q --noconftest -p no:cacheprovider \
    2>&1 | tee "$shim/pytest.log"
tests_rc=${PIPESTATUS[0]}
set -e
summary="$(grep -E '[0-9]+ (passed|failed)' "$shim/pytest.log" | tail -n 1 || true)"
echo "kernel_tests_rc: $tests_rc"
echo "kernel_tests: ${summary:-no summary (see above)}"

cd "$repo"
"$python" "$repo/bench/gpu_check.py" "$@"
exit "$tests_rc"
