"""``sglang-hybrid launch``: SGLang's own HTTP server, serving with the semantic state cache.

    sglang-hybrid launch --model-path Qwen/Qwen3-Next-80B-A3B-Instruct \\
        --state-checkpoint-slots 128 [any other SGLang server flag]

Every SGLang server flag is accepted as ``sglang serve`` / ``python -m
sglang.launch_server`` accept it (SGLang's own parser reads them, ``--config`` included);
ours are added beside them. The launcher

* selects the radix cache backend ``semantic`` and the settings it needs
  (``--mamba-radix-cache-strategy no_buffer``, ``--page-size 1``) unless given;
* refuses, before any model weight is read, SGLang options the backend cannot serve;
* hands our flags to the scheduler processes in ``SGLANG_HYBRID_CONFIG``, where the
  plugin's backend factory reads them when it builds the cache;
* then runs SGLang's ``launch_server.run_server`` in this process, as SGLang's own entry
  point does.

``--disable-radix-cache`` serves the uncached baseline: no backend is selected and our
flags have no effect.

Clients ask for checkpoints per request through SGLang's ``custom_params`` sampling
parameter (``request_validation.py``):

    POST /generate     {"text": ..., "sampling_params": {"custom_params":
                            {"checkpoint_hints": [512, 2048]}}}
    POST /v1/chat/completions   extra_body={"custom_params": {"checkpoint_hints": "messages"}}
"""

from __future__ import annotations

import argparse
import functools
import logging
import os
import sys
from importlib.metadata import entry_points
from typing import TYPE_CHECKING, Mapping, Optional, Sequence

from sglang_hybrid.compatibility import REQUIRED_MAMBA_STRATEGY, REQUIRED_PAGE_SIZE, unsupported_options
from sglang_hybrid.config import (
    ANCHOR_TEMPLATE_FAMILIES,
    CHECKPOINT_EVICTIONS,
    CHECKPOINT_PLANNERS,
    DEFAULT_CHECKPOINT_SLOTS,
    SemanticCacheConfig,
)
from sglang_hybrid.cpu_parallel import cpu_parallel_env, server_ranks, usable_cpus
from sglang_hybrid.engine.tiny_model_dirs import TINY_SERVER_MODELS, tiny_model_dir
from sglang_hybrid.plugin import BACKEND_NAME

if TYPE_CHECKING:
    from sglang.srt.server_args import ServerArgs

logger = logging.getLogger(__name__)

PROG = "sglang-hybrid launch"
# The name of our entry point in the ``sglang.srt.plugins`` group (pyproject.toml); it is
# what SGLANG_PLUGINS must list if a deployment restricts which plugins load.
PLUGIN_NAME = "sglang_hybrid"


class LaunchError(ValueError):
    """A launch configuration the semantic cache cannot serve; the message says why."""


def add_semantic_cache_args(parser: argparse.ArgumentParser) -> None:
    """Our flags, in their own help group, with SGLang's conventions (dashes, help text)."""
    defaults = SemanticCacheConfig()
    group = parser.add_argument_group(
        "semantic state cache (sglang-hybrid)",
        "Recurrent-state checkpoints kept at semantic anchors, in a pool of their own beside "
        "the live request states. These flags travel to the scheduler processes in "
        "SGLANG_HYBRID_CONFIG.",
    )
    sizing = group.add_mutually_exclusive_group()
    sizing.add_argument(
        "--state-checkpoint-slots",
        type=int,
        default=None,
        help="Number of checkpoint slots; each holds one full recurrent state (every "
        "Mamba/GDN layer's conv and temporal state). "
        f"Default: {DEFAULT_CHECKPOINT_SLOTS} unless --state-checkpoint-memory-gib "
        "is given.",
    )
    sizing.add_argument(
        "--state-checkpoint-memory-gib",
        type=float,
        default=None,
        help="GPU memory for checkpoints in GiB, per tensor-parallel rank; the slot count "
        "is this budget divided by the model's per-state size.",
    )
    group.add_argument(
        "--state-checkpoint-host-slots",
        type=int,
        default=defaults.state_checkpoint_host_slots,
        help="Checkpoint slots in host memory below the GPU pool: a checkpoint evicted from "
        "the GPU is moved there, and copied back when a request restores from it. "
        f"Default: {defaults.state_checkpoint_host_slots} (no host tier).",
    )
    group.add_argument(
        "--checkpoint-planner",
        choices=CHECKPOINT_PLANNERS,
        default=defaults.checkpoint_planner,
        help="Which checkpoints a request gets besides its end-of-request state: "
        "'adaptive' learns where each session's history edits land, 'messages' takes one at "
        "every message start while slots last, 'none' takes no extra ones. "
        f"Default: {defaults.checkpoint_planner}.",
    )
    group.add_argument(
        "--checkpoint-eviction",
        choices=CHECKPOINT_EVICTIONS,
        default=None,
        help="Which checkpoint is evicted first when the pool is full: 'lru' the least "
        "recently restored, 'expected-saving' the one the adaptive planner expects to save "
        "the fewest recomputed tokens (needs --checkpoint-planner adaptive). "
        "Default: expected-saving with the adaptive planner, lru otherwise.",
    )
    group.add_argument(
        "--anchor-template-family",
        choices=ANCHOR_TEMPLATE_FAMILIES,
        default=defaults.anchor_template_family,
        help="Chat-template family whose special tokens mark message, turn and tool-result "
        "boundaries. 'auto' picks it from the model's tokenizer and config; 'none' anchors "
        "only at prompt and generation ends. "
        f"Default: {defaults.anchor_template_family}.",
    )


def add_launcher_args(parser: argparse.ArgumentParser) -> None:
    """The launcher's own flags, which configure neither SGLang nor the cache."""
    group = parser.add_argument_group("sglang-hybrid launcher")
    group.add_argument(
        "--tiny-model",
        choices=tuple(TINY_SERVER_MODELS),
        default=None,
        help="Serve a tiny random-weight model of this architecture, generated offline on "
        "first use (with a character-level chat tokenizer), instead of --model-path: a "
        "server to try on any machine, CPU-only included. Its outputs are random text.",
    )


def build_parser() -> argparse.ArgumentParser:
    """SGLang's server parser with our flags added: what ``--help`` shows."""
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Launch SGLang's HTTP server with the semantic recurrent-state cache "
        f"(--radix-cache-backend {BACKEND_NAME}).",
    )
    ServerArgs.add_cli_args(parser)
    add_semantic_cache_args(parser)
    add_launcher_args(parser)
    return parser


def _semantic_cache_parser() -> argparse.ArgumentParser:
    # Abbreviations off: an SGLang flag must never be taken for a prefix of one of ours.
    parser = argparse.ArgumentParser(prog=PROG, add_help=False, allow_abbrev=False)
    add_semantic_cache_args(parser)
    return parser


def split_argv(argv: Sequence[str]) -> tuple[SemanticCacheConfig, list[str]]:
    """Our flags as a validated config, and the rest of ``argv`` for SGLang's parser."""
    ours, sglang_argv = _semantic_cache_parser().parse_known_args(list(argv))
    try:
        config = SemanticCacheConfig(**vars(ours))
    except ValueError as exc:
        raise LaunchError(str(exc)) from None
    return config, sglang_argv


def check_compatible(server_args: "ServerArgs") -> None:
    """Refuse SGLang options the semantic backend cannot serve, before the model loads.

    The backend factory checks the same table (``compatibility.py``) again inside the
    scheduler, with what is only known after the model is read; here the user gets the answer
    in a second.
    """
    if server_args.disable_radix_cache:
        if server_args.radix_cache_backend is not None:
            raise LaunchError(
                "--disable-radix-cache serves without any prefix cache (the uncached "
                f"baseline); drop --radix-cache-backend {server_args.radix_cache_backend}"
            )
        return
    backend = server_args.radix_cache_backend
    if backend not in (None, BACKEND_NAME):
        raise LaunchError(
            f"{PROG} serves with --radix-cache-backend {BACKEND_NAME}; got {backend!r}. "
            "Use sglang serve for other backends."
        )
    refusals = unsupported_options(server_args)
    if refusals:
        raise LaunchError(f"{PROG} cannot serve with {refusals[0]}")


# What the semantic backend needs on every host (SGLang field -> value). no_buffer keeps
# states only where the cache puts them; it needs page size 1 and the overlap scheduler off
# (the forward must see what the scheduler planned for it). The cache report makes OpenAI
# responses carry restored prompt tokens as usage.prompt_tokens_details.cached_tokens.
BACKEND_SETTINGS: tuple[tuple[str, object], ...] = (
    ("radix_cache_backend", BACKEND_NAME),
    ("mamba_radix_cache_strategy", REQUIRED_MAMBA_STRATEGY),
    ("page_size", REQUIRED_PAGE_SIZE),
    ("disable_overlap_schedule", True),
    ("enable_cache_report", True),
)
# Filled in where the user left SGLang's default. On CUDA FlashInfer serves attention and the
# Triton GDN prefill kernel writes the anchor states (patches/0002).
CUDA_HOST_DEFAULTS: tuple[tuple[str, object], ...] = (
    ("attention_backend", "flashinfer"),
    ("linear_attn_prefill_backend", "triton"),
)
# Pool sizes on a CPU host. SGLang sizes both pools from free RAM there: hundreds of
# thousands of live-state slots (allocating them dominates start-up) and, for the tiny
# model, 28M tokens of KV (15 GB, which the OOM killer then takes back mid-run).
CPU_LIVE_STATE_SLOTS = 64
CPU_KV_TOKENS = 65536
# Without CUDA: torch-native attention and sampling, our CPU fallbacks for the recurrent
# kernels, no grammar backend (xgrammar needs CUDA), no CUDA graphs, and a scheduler that
# sleeps when idle instead of busy-polling a core.
CPU_HOST_DEFAULTS: tuple[tuple[str, object], ...] = (
    ("device", "cpu"),
    ("attention_backend", "torch_native"),
    ("sampling_backend", "pytorch"),
    ("grammar_backend", "none"),
    ("disable_cuda_graph", True),
    ("sleep_on_idle", True),
    ("max_mamba_cache_size", CPU_LIVE_STATE_SLOTS),
    ("max_total_tokens", CPU_KV_TOKENS),
)
# Triton kernels without a kernel of ours or a fallback run in its interpreter; it must be
# set before any kernel is decorated, in this process and the schedulers it starts. A fixed
# mmap threshold: every prefill allocates activations of a new size, and glibc's adaptive
# threshold moves such blocks onto the heap, where they fragment it (a scheduler grew by
# ~360 MiB per 1,000 agent requests, bench/soak.py); the schedulers read it when they start.
CPU_HOST_ENV = {"TRITON_INTERPRET": "1", "MALLOC_MMAP_THRESHOLD_": "131072"}


def apply_launch_settings(server_args: "ServerArgs", cuda_available: bool) -> list[str]:
    """Set what the semantic backend needs and the host's defaults where the user left
    SGLang's; return each setting made, as the flag a user would have typed.

    Runs on the unresolved record, as a command-line value would arrive: SGLang's resolution
    then treats them as the operator's input.
    """
    if server_args.disable_radix_cache:
        return []
    applied = []
    for name, value in BACKEND_SETTINGS:
        if getattr(server_args, name) != value:
            setattr(server_args, name, value)
            applied.append(_as_flag(name, value))
    defaults = _sglang_defaults()
    for name, value in CUDA_HOST_DEFAULTS if cuda_available else CPU_HOST_DEFAULTS:
        if getattr(server_args, name) == defaults[name] != value:
            setattr(server_args, name, value)
            applied.append(_as_flag(name, value))
    return applied


def _as_flag(name: str, value: object) -> str:
    flag = "--" + name.replace("_", "-")
    return flag if value is True else f"{flag} {value}"


@functools.cache
def _sglang_defaults() -> dict[str, object]:
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    return {name: parser.get_default(name) for name, _ in (*CUDA_HOST_DEFAULTS, *CPU_HOST_DEFAULTS)}


def check_plugin_loadable(environ: Mapping[str, str] = os.environ) -> None:
    """The scheduler processes load our backend through the plugin entry point; make sure
    they will, rather than failing there with 'backend not registered' after the model
    loaded."""
    from sglang.srt.plugins import GENERAL_PLUGINS_GROUP

    installed = entry_points(group=GENERAL_PLUGINS_GROUP, name=PLUGIN_NAME)
    if not installed:
        raise LaunchError(
            f"the {GENERAL_PLUGINS_GROUP} entry point {PLUGIN_NAME!r} is not installed, so SGLang's "
            "scheduler processes cannot register the semantic backend; install the package "
            "(pip install -e .)"
        )
    allowed = environ.get("SGLANG_PLUGINS", "")
    if allowed and PLUGIN_NAME not in {name.strip() for name in allowed.split(",")}:
        raise LaunchError(
            f"SGLANG_PLUGINS={allowed!r} leaves out {PLUGIN_NAME!r}, so SGLang's scheduler "
            f"processes would not register the semantic backend; add {PLUGIN_NAME} to it"
        )


def prepare_launch(
    argv: Sequence[str], cuda_available: Optional[bool] = None
) -> tuple["ServerArgs", SemanticCacheConfig]:
    """Parse and validate ``argv`` into the server record and our config; reads no weights
    (a ``--tiny-model`` is written to its cache directory on first use).

    Argument syntax errors exit through argparse (status 2, usage on stderr), like SGLang's
    own launcher; configurations the cache cannot serve raise ``LaunchError``.
    ``cuda_available`` (default: what torch finds) picks the host's defaults.
    """
    from sglang.srt.server_args import prepare_server_args

    argv = _with_tiny_model_path(list(argv))
    if "--config" not in argv or "-h" in argv or "--help" in argv:
        # One pass over the combined parser reports a wrong or missing flag (ours or
        # SGLang's) under our program name, and answers --help. With --config the flags
        # SGLang needs may sit in the file, which only prepare_server_args merges in.
        build_parser().parse_args(argv)
    config, sglang_argv = split_argv(argv)
    server_args = prepare_server_args(sglang_argv)
    check_compatible(server_args)
    if cuda_available is None:
        import torch

        cuda_available = torch.cuda.is_available()
    applied = apply_launch_settings(server_args, cuda_available)
    if applied:
        logger.info(
            "%s: %s host, the semantic state cache runs with %s",
            PROG,
            "CUDA" if cuda_available else "CPU-only",
            " ".join(applied),
        )
    check_plugin_loadable()
    if server_args.disable_radix_cache and config != SemanticCacheConfig():
        logger.warning("--disable-radix-cache: the semantic state cache flags have no effect")
    return server_args, config


def _with_tiny_model_path(argv: list[str]) -> list[str]:
    """``argv`` with ``--tiny-model NAME`` replaced by the ``--model-path`` of its directory."""
    parser = argparse.ArgumentParser(prog=PROG, add_help=False, allow_abbrev=False)
    add_launcher_args(parser)
    known, rest = parser.parse_known_args(argv)
    if known.tiny_model is None:
        return argv
    if any(arg == "--model-path" or arg.startswith("--model-path=") for arg in rest):
        raise LaunchError("--tiny-model serves a generated model; drop --model-path")
    return ["--model-path", str(tiny_model_dir(known.tiny_model)), *rest]


def prepare_cpu_parallel(server_args: "ServerArgs", cuda_available: bool) -> None:
    """On a host without CUDA, set what several ranks need there (``cpu_parallel.py``) and
    say what was set."""
    num_ranks = server_ranks(server_args)
    added = cpu_parallel_env(num_ranks, os.environ, cuda_available=cuda_available, cpus=usable_cpus())
    if added:
        os.environ.update(added)
        settings = " ".join(f"{name}={value!r}" for name, value in added.items())
        print(f"{PROG}: {num_ranks} ranks on a host without CUDA (gloo groups): {settings}", file=sys.stderr)


def launch_main(argv: Sequence[str]) -> int:
    import torch

    cuda_available = torch.cuda.is_available()
    if not cuda_available:
        # Before any SGLang module decorates a Triton kernel (load_plugins imports some).
        for name, value in CPU_HOST_ENV.items():
            os.environ.setdefault(name, value)

    from sglang.launch_server import run_server
    from sglang.srt.plugins import load_plugins
    from sglang.srt.utils import kill_process_tree

    # Plugins load before the arguments are parsed, in SGLang's own launcher order, so
    # hooks they install on argument handling apply here too.
    load_plugins()
    try:
        server_args, config = prepare_launch(argv, cuda_available)
    except LaunchError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    # Scheduler processes are started after this and inherit the environment.
    os.environ.update(config.to_env())
    prepare_cpu_parallel(server_args, cuda_available)
    try:
        run_server(server_args)
    finally:
        kill_process_tree(os.getpid(), include_parent=False)
    return 0
