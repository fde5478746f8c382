"""patches/: the diffs apply to the installed sglang, load patched, and do what they say.

The last test runs SGLang's own (patched) fla GDN prefill under the Triton interpreter and
has it write the states at anchor positions: the exactness claim of in-prefill checkpoints
(a captured state is the state a separate prefill of the prefix ends with). The interpreter
computes fp16 but not bf16 matrix products correctly, so the inputs are fp16.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F

from sglang_hybrid import patches
from sglang_hybrid.cpu_fallbacks import install_cpu_fallbacks
from sglang_hybrid.kernels import CaptureIndex
from sglang_hybrid.kernels.reference import gdn_states_reference


def test_patch_check_cli_reports_every_diff():
    result = subprocess.run(
        [sys.executable, "-m", "sglang_hybrid.cli", "patch", "--check"],
        capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0, result.stderr
    names = [p.name for p in patches.load_series()]
    assert names == sorted(names) and len(names) >= 2
    for name in names:
        assert f"{name}: applies" in result.stdout
    assert all(p.why for p in patches.load_series()), "every diff says why in its header"


def test_a_diff_that_no_longer_fits_is_an_error_naming_it(tmp_path):
    original = (patches.PATCH_DIR / "0001-gdn-triton-forwards-track-state.diff").read_text()
    # A context line that is not in the installed source: the hunk must not apply anywhere.
    broken = original.replace("     inplace_update: bool = True,\n+    track_state", "     inplace_update: bool = False,\n+    track_state", 1)
    assert broken != original
    (tmp_path / "0001-broken.diff").write_text(broken)
    root = patches._installed_sglang_root()
    with pytest.raises(patches.PatchError, match="0001-broken.diff does not apply to sglang/kernels/ops/attention/fla/chunk.py"):
        patches.patched_sources(lambda path: (root / path).read_text(), patches.load_series(tmp_path))


def test_installed_modules_load_from_the_patched_source():
    # A fresh interpreter: the modules are imported after install(), as in a server.
    code = textwrap.dedent("""
        import inspect
        from sglang_hybrid import patches
        patches.install()
        from sglang.kernels.ops.attention.fla import chunk, chunk_delta_h
        from sglang.srt.layers.attention.linear.kernels.gdn_triton import TritonGDNKernel
        assert "snapshot_states" in inspect.signature(chunk.chunk_gated_delta_rule).parameters
        assert "snapshot_rows" in inspect.signature(TritonGDNKernel.extend).parameters
        assert TritonGDNKernel.supports_position_snapshots
        kernel = chunk_delta_h.chunk_gated_delta_rule_fwd_kernel_h_blockdim64
        while not inspect.isfunction(kernel):  # autotuner -> jit / interpreted -> function
            kernel = kernel.fn
        assert "SNAPSHOTS" in inspect.getsource(kernel)
        assert chunk.chunk_gated_delta_rule_fwd_h is chunk_delta_h.chunk_gated_delta_rule_fwd_h
        print("ok")
    """)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stderr[-3000:]


@pytest.fixture(scope="module")
def patched_fla():
    """SGLang's fla GDN prefill, patched, runnable under the interpreter."""
    patches.install()
    install_cpu_fallbacks()
    import triton.language as tl

    from sglang.kernels.ops.attention.fla import chunk

    # fla binds tl.exp & co. to module names at import; the interpreter only patches
    # builtins reached through ``tl``, so route those names through it.
    for name, module in list(sys.modules.items()):
        if name.startswith("sglang.kernels.ops.attention.fla"):
            for builtin in ("exp", "exp2", "log", "log2"):
                if getattr(module, builtin, None) is getattr(tl, builtin):
                    setattr(module, builtin, _through_tl(builtin))
    return chunk.chunk_gated_delta_rule


def _through_tl(name):
    import triton.language as tl

    # Looked up per call: the interpreter swaps tl's attributes while a kernel runs.
    return lambda *args, **kwargs: getattr(tl, name)(*args, **kwargs)


def _relative_error(got, expected):
    return ((got.float() - expected.float()).abs().max() / expected.float().abs().max()).item()


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter path; bench/gpu_check.sh covers CUDA")
def test_patched_scan_writes_states_at_positions_as_a_prefill_ending_there_would(patched_fla):
    torch.manual_seed(0)
    lens, heads, k_heads, dim = [150, 70], 4, 2, 32
    total = sum(lens)
    q = torch.randn(1, total, k_heads, dim).half()
    k = (torch.randn(1, total, k_heads, dim) * 2).half()
    v = torch.randn(1, total, heads, dim).half()
    g = F.logsigmoid(torch.randn(1, total, heads) + 3.0)
    beta = torch.rand(1, total, heads)
    initial = torch.randn(len(lens), heads, dim, dim) * 0.1
    cu = torch.tensor([0, lens[0], total])
    # Chunk starts and ends, mid-chunk, several in one chunk, a sequence's first and last.
    seqs, positions = [0, 0, 0, 0, 0, 1, 1, 1], [0, 17, 30, 64, 150, 1, 64, 70]
    slots = [3, 9, 1, 7, 5, 2, 8, 4]
    index = CaptureIndex.build(lens, [True, True], seqs, positions, slots, "cpu")

    pool = torch.cat([torch.zeros(1, heads, dim, dim), initial])
    snapshots = torch.full((10, heads, dim, dim), float("nan"))
    patched_fla(
        q, k, v, g, beta, initial_state=pool, initial_state_indices=torch.tensor([1, 2]),
        cu_seqlens=cu, use_qk_l2norm_in_kernel=True,
        snapshot_states=snapshots, snapshot_chunk_ptr=index.snapshot_chunk_ptr,
        snapshot_offsets=index.snapshot_offsets, snapshot_rows=index.snapshot_rows,
        snapshots_per_chunk=index.snapshots_per_chunk,
    )
    unwritten = sorted(set(range(10)) - set(slots))
    assert snapshots[unwritten].isnan().all(), "only the named rows are written"

    expected = gdn_states_reference(k, v, g, beta, cu, initial, torch.tensor(seqs), torch.tensor(positions))
    for q_index, (seq, pos, slot) in enumerate(zip(seqs, positions, slots)):
        # A separate prefill of the same prefix, its final state written back in FP32.
        start = int(cu[seq])
        alone = initial[seq:seq + 1].clone()
        if pos > 0:
            patched_fla(
                q[:, start:start + pos], k[:, start:start + pos], v[:, start:start + pos],
                g[:, start:start + pos], beta[:, start:start + pos],
                initial_state=alone, initial_state_indices=torch.tensor([0]),
                cu_seqlens=torch.tensor([0, pos]), use_qk_l2norm_in_kernel=True,
            )
        captured = snapshots[slot]
        assert torch.equal(captured, alone[0]), (seq, pos)
        assert _relative_error(captured, expected[q_index]) <= 2e-3, (seq, pos)
