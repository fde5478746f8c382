"""Copy SGLang's GDN and SSD Triton kernels into a package that runs without sglang.

The GPU check measures our capture kernels against SGLang's own prefill kernels, but a GPU
host may have torch and Triton and no sglang (its kernel wheels are over 1.7 GB). SGLang's
fla (Gated DeltaNet) and Mamba2 SSD Triton files need nothing of sglang beyond their own
package and two small helpers, so this script, run where sglang is installed, copies the
files those two entry points import into ``--out``/``sglang_gpu_ops`` with the imports
rewritten, and applies patches/ to them exactly as the plugin does at run time (``chunk`` is
then SGLang's patched ``chunk_gated_delta_rule``). Nothing of it is committed: the output
goes under build/ (ignored) and travels with the GPU check.

    python bench/gpu_ops.py --out build/gpu_ops
    PYTHONPATH=build/gpu_ops python -c "from sglang_gpu_ops.fla.chunk import chunk_gated_delta_rule"
"""

from __future__ import annotations

import argparse
import re
import shutil
from pathlib import Path

from sglang_hybrid import patches

PACKAGE = "sglang_gpu_ops"
# (sglang package of the family, entry module, subpackage of the copy)
FAMILIES = (
    ("sglang.kernels.ops.attention.fla", "chunk", "fla"),
    ("sglang.kernels.ops.mamba.triton_ops", "ssd_combined", "mamba"),
)
# The only sglang imports outside the two families, replaced by _compat.
COMPAT_IMPORTS = {
    "from sglang.srt.utils.common import torch_release": f"from {PACKAGE}._compat import torch_release",
    "from sglang.kernels.jit.utils import is_arch_support_pdl": f"from {PACKAGE}._compat import is_arch_support_pdl",
}
COMPAT_SOURCE = '''"""What the copied kernels import from outside their own files."""

import torch
from packaging import version

torch_release = version.parse(torch.__version__).release


def is_arch_support_pdl() -> bool:
    return torch.version.hip is None and torch.cuda.get_device_capability()[0] >= 9
'''


def _imports(source: str, family: str) -> set[tuple[str, str]]:
    """(family, module) of every module of a family that ``source`` (of ``family``) imports."""
    found = {(family, name) for name in re.findall(r"^\s*from \.(\w+) import", source, re.MULTILINE)}
    for other, _, _ in FAMILIES:
        for name in re.findall(rf"^\s*from {re.escape(other)}\.(\w+) import", source, re.MULTILINE):
            found.add((other, name))
    return found


def build(out: Path) -> Path:
    sglang_root = patches._installed_sglang_root()
    patched = patches.patched_sources(lambda path: (sglang_root / path).read_text())
    package = out / PACKAGE
    if package.exists():
        shutil.rmtree(package)
    package.mkdir(parents=True)
    (package / "__init__.py").write_text('"""SGLang\'s Triton kernels, copied by bench/gpu_ops.py."""\n')
    (package / "_compat.py").write_text(COMPAT_SOURCE)
    subpackages = {family: subpackage for family, _, subpackage in FAMILIES}
    for subpackage in subpackages.values():
        (package / subpackage).mkdir()
        (package / subpackage / "__init__.py").write_text("")
    pending = [(family, entry) for family, entry, _ in FAMILIES]
    copied: set[tuple[str, str]] = set()
    while pending:
        family, name = pending.pop()
        if (family, name) in copied:
            continue
        copied.add((family, name))
        path = f"{family.replace('.', '/')}/{name}.py"
        source = patched.get(path) or (sglang_root / path).read_text()
        pending.extend(_imports(source, family) - copied)
        for other, subpackage in subpackages.items():
            source = source.replace(f"from {other}.", f"from {PACKAGE}.{subpackage}.")
        for original, replacement in COMPAT_IMPORTS.items():
            source = source.replace(original, replacement)
        # Imports left are indented ones under `if is_intel:` / TYPE_CHECKING, which never
        # run on an NVIDIA host; one at module level would fail there.
        unguarded = [line for line in source.splitlines() if re.match(r"(from|import) sglang\b", line)]
        if unguarded:
            raise RuntimeError(f"{path} imports sglang outside the copied families: {unguarded}")
        (package / subpackages[family] / f"{name}.py").write_text(source)
    return package


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("build/gpu_ops"))
    package = build(parser.parse_args().out)
    files = sorted(p.relative_to(package).as_posix() for p in package.rglob("*.py"))
    print(f"{package}: {len(files)} files, {sum(p.stat().st_size for p in package.rglob('*.py')) // 1024} KiB")


if __name__ == "__main__":
    main()
