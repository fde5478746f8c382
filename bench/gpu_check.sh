#!/usr/bin/env bash
# GPU check of the Triton state kernels: compiled kernel tests, then the bandwidth and
# timing figures of bench/gpu_check.py, one "name: value" line each.  About 2-4 minutes.
#
# Needs a CUDA GPU and these Python packages (no sglang):
#   torch, triton, pytest, numpy
#
# Usage: bash bench/gpu_check.sh   (from anywhere; extra args go to gpu_check.py)
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

# Make `sglang_hybrid.kernels` importable without installing the package (and without
# importing the rest of sglang_hybrid, which needs sglang): a throwaway package whose
# only content is the kernels directory, as pyproject's package-dir mapping does.
shim="$(mktemp -d)"
trap 'rm -rf "$shim"' EXIT
mkdir -p "$shim/sglang_hybrid"
: > "$shim/sglang_hybrid/__init__.py"
ln -s "$repo/kernels" "$shim/sglang_hybrid/kernels"
export PYTHONPATH="$shim${PYTHONPATH:+:$PYTHONPATH}"

# Compiled kernels on CUDA (tests/test_kernels.py defaults to the CPU interpreter).
export TRITON_INTERPRET=0

# Run from the shim: `python -m pytest` puts the working directory first on sys.path, and
# the repository's own sglang_hybrid/ has no kernels subpackage.  An empty pytest.ini and
# --noconftest keep the repository's pytest config and conftests (which may import
# sglang) out of it.
: > "$shim/pytest.ini"
cd "$shim"
set +e
timeout 180 python -m pytest "$repo/tests/test_kernels.py" -q --noconftest -p no:cacheprovider \
    2>&1 | tee "$shim/pytest.log"
tests_rc=${PIPESTATUS[0]}
set -e
summary="$(grep -E '[0-9]+ (passed|failed)' "$shim/pytest.log" | tail -n 1 || true)"
echo "kernel_tests_rc: $tests_rc"
echo "kernel_tests: ${summary:-no summary (see above)}"

timeout 150 python "$repo/bench/gpu_check.py" "$@"
exit "$tests_rc"
