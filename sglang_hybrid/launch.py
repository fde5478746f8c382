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
parameter (``request_hints.py``):

    POST /generate     {"text": ..., "sampling_params": {"custom_params":
                            {"checkpoint_hints": [512, 2048]}}}
    POST /v1/chat/completions   extra_body={"custom_params": {"checkpoint_hints": "messages"}}
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from importlib.metadata import entry_points
from typing import TYPE_CHECKING, Mapping, Sequence

from sglang_hybrid.compatibility import REQUIRED_MAMBA_STRATEGY, REQUIRED_PAGE_SIZE, unsupported_options
from sglang_hybrid.config import (
    ANCHOR_TEMPLATE_FAMILIES,
    CHECKPOINT_EVICTIONS,
    CHECKPOINT_PLANNERS,
    DEFAULT_CHECKPOINT_SLOTS,
    SemanticCacheConfig,
)
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


def select_semantic_backend(server_args: "ServerArgs") -> None:
    """Fill in the backend and the settings it needs where the user left SGLang's default.

    Runs on the unresolved record, as a command-line value would arrive: SGLang's resolution
    then treats them as the operator's input.
    """
    if server_args.disable_radix_cache:
        return
    server_args.radix_cache_backend = BACKEND_NAME
    server_args.mamba_radix_cache_strategy = REQUIRED_MAMBA_STRATEGY
    server_args.page_size = REQUIRED_PAGE_SIZE


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


def prepare_launch(argv: Sequence[str]) -> tuple["ServerArgs", SemanticCacheConfig]:
    """Parse and validate ``argv`` into the server record and our config; loads nothing.

    Argument syntax errors exit through argparse (status 2, usage on stderr), like SGLang's
    own launcher; configurations the cache cannot serve raise ``LaunchError``.
    """
    from sglang.srt.server_args import prepare_server_args

    argv = list(argv)
    if "--config" not in argv or "-h" in argv or "--help" in argv:
        # One pass over the combined parser reports a wrong or missing flag (ours or
        # SGLang's) under our program name, and answers --help. With --config the flags
        # SGLang needs may sit in the file, which only prepare_server_args merges in.
        build_parser().parse_args(argv)
    config, sglang_argv = split_argv(argv)
    server_args = prepare_server_args(sglang_argv)
    check_compatible(server_args)
    select_semantic_backend(server_args)
    check_plugin_loadable()
    if server_args.disable_radix_cache and config != SemanticCacheConfig():
        logger.warning("--disable-radix-cache: the semantic state cache flags have no effect")
    return server_args, config


def launch_main(argv: Sequence[str]) -> int:
    from sglang.launch_server import run_server
    from sglang.srt.plugins import load_plugins
    from sglang.srt.utils import kill_process_tree

    # Plugins load before the arguments are parsed, in SGLang's own launcher order, so
    # hooks they install on argument handling apply here too.
    load_plugins()
    try:
        server_args, config = prepare_launch(argv)
    except LaunchError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    # Scheduler processes are started after this and inherit the environment.
    os.environ.update(config.to_env())
    try:
        run_server(server_args)
    finally:
        kill_process_tree(os.getpid(), include_parent=False)
    return 0
