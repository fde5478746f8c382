"""The SGLang options the semantic backend cannot serve, and why: one table for the launcher
(before any weight is read) and the backend factory (inside each scheduler).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from sglang.srt.server_args import ServerArgs

# The only values of these SGLang options the backend can serve, and the ones the launcher
# fills in when the user leaves them at SGLang's "decide for me" default.
REQUIRED_MAMBA_STRATEGY = "no_buffer"
REQUIRED_PAGE_SIZE = 1


@dataclass(frozen=True)
class UnsupportedOption:
    is_set: Callable[["ServerArgs"], bool]
    reason: Callable[["ServerArgs"], str]  # starts with the option as the user gave it


UNSUPPORTED_OPTIONS: tuple[UnsupportedOption, ...] = (
    UnsupportedOption(
        lambda args: args.enable_int8_mamba_checkpoint,
        lambda args: "--enable-int8-mamba-checkpoint: the semantic backend keeps its own "
        "checkpoint pool, sized with --state-checkpoint-slots / --state-checkpoint-memory-gib",
    ),
    UnsupportedOption(
        lambda args: args.enable_hierarchical_cache,
        lambda args: "--enable-hierarchical-cache: SGLang's host offload does not know "
        "checkpoint slots; --state-checkpoint-host-slots gives checkpoints a host tier of their own",
    ),
    UnsupportedOption(
        lambda args: args.enable_session_radix_cache,
        lambda args: "--enable-session-radix-cache: session references are not supported by "
        "the semantic backend",
    ),
    UnsupportedOption(
        lambda args: args.enable_lmcache,
        lambda args: "--enable-lmcache: LMCache builds a tree cache of its own, which the "
        "semantic backend would replace",
    ),
    UnsupportedOption(
        lambda args: args.mamba_max_states_per_path != -1,
        lambda args: "--mamba-max-states-per-path: it prunes states by depth; the semantic "
        "backend bounds checkpoints with --state-checkpoint-slots instead",
    ),
    UnsupportedOption(
        lambda args: args.mamba_radix_cache_strategy not in ("auto", REQUIRED_MAMBA_STRATEGY),
        lambda args: f"--mamba-radix-cache-strategy {args.mamba_radix_cache_strategy}: the "
        f"semantic backend needs {REQUIRED_MAMBA_STRATEGY}, since checkpoints sit at anchor "
        "positions that a tracking grid would round away",
    ),
    UnsupportedOption(
        lambda args: args.page_size not in (None, REQUIRED_PAGE_SIZE),
        lambda args: f"--page-size {args.page_size}: the semantic backend needs --page-size "
        f"{REQUIRED_PAGE_SIZE}, since checkpoints sit at token positions a page would round away",
    ),
)


def unsupported_options(server_args: "ServerArgs") -> list[str]:
    """Why each option set in ``server_args`` cannot be served, in the table's order."""
    return [option.reason(server_args) for option in UNSUPPORTED_OPTIONS if option.is_set(server_args)]
