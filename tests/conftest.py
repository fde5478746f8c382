"""Test-session setup shared by every test module.

Triton fixes interpreter mode when a kernel is decorated, at import. Whichever test module
imports the package first decides it for the whole session, so it is set here, before any
test module is imported: on a host without CUDA every Triton kernel (ours and SGLang's) runs
under the interpreter, in whatever order the modules are collected.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
