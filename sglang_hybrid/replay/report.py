"""report.md and plots for a replay: a table per policy, the budget sweep, the cost profile."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from .cost_model import CostProfile, MIB


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f}"


def plot_hit_rate_vs_budget(path: Path, sweep: dict[str, dict[str, dict[str, Any]]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    budgets = sorted(int(b) for b in sweep)
    fig, ax = plt.subplots(figsize=(6, 4))
    for name in next(iter(sweep.values())):
        ax.plot(budgets, [sweep[str(b)][name]["hit_rate"] for b in budgets], marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_xticks(budgets, [str(b) for b in budgets])
    ax.set_xlabel("checkpoint budget (slots)")
    ax.set_ylabel("token hit rate (state + KV reused)")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_ttft_cdf(path: Path, ttft_s: dict[str, list[float]], xlabel: str = "TTFT (ms, cost model)") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for name, values in ttft_s.items():
        xs = np.sort(np.asarray(values)) * 1e3
        ax.plot(xs, np.arange(1, len(xs) + 1) / len(xs), label=name)
    ax.set_xscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel("fraction of requests")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _host_tier_lines(results: dict[str, Any], profile: CostProfile) -> list[str]:
    """The semantic policy's host tier, when the replay gave it one."""
    host_slots = results.get("host_slots", 0)
    semantic = results["policies"].get("semantic")
    if not host_slots or semantic is None:
        return []
    return ["", f"The semantic policy has a host tier of {host_slots} slots "
            f"({host_slots * profile.checkpoint_bytes / MIB / 1024:.2f} GiB of host memory) below its device pool; "
            f"{semantic['host_restores']:,} of its {semantic['requests']:,} requests restored from it."]


def write_report(out: Path, results: dict[str, Any], sweep: dict[str, dict[str, dict[str, Any]]],
                 ttft_s: dict[str, list[float]], profile: CostProfile, trace_meta: dict[str, Any]) -> None:
    plot_hit_rate_vs_budget(out / "hit_rate_vs_budget.png", sweep)
    plot_ttft_cdf(out / "ttft_cdf.png", ttft_s)
    lines = [
        f"# Replay: {results['trace']}",
        "",
        f"backend `{results['backend']}`, profile `{results['profile']}`, budget {results['budget_slots']} "
        f"checkpoint slots ({results['budget_slots'] * profile.checkpoint_bytes / MIB / 1024:.2f} GiB).",
        "",
        "| policy | requests | prompt tok | cached tok | recomputed tok | hit rate | ckpts taken | slots peak "
        "| TTFT mean ms | p50 | p95 | p99 |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, row in results["policies"].items():
        t = row["ttft_s"]
        lines.append(
            f"| {name} | {row['requests']} | {row['prompt_tokens']:,} | {row['cached_tokens']:,} | "
            f"{row['recomputed_tokens']:,} | {row['hit_rate']:.3f} | {row['checkpoints_taken']:,} | "
            f"{row['checkpoint_slots_peak']:,} | {_ms(t['mean'])} | {_ms(t['p50'])} | {_ms(t['p95'])} | {_ms(t['p99'])} |"
        )
    lines += _host_tier_lines(results, profile)
    budgets = sorted(sweep, key=int)
    lines += ["", "## Hit rate by checkpoint budget", "", "| policy | " + " | ".join(budgets) + " |",
              "|---|" + "---:|" * len(budgets)]
    for name in results["policies"]:
        lines.append(f"| {name} | " + " | ".join(f"{sweep[b][name]['hit_rate']:.3f}" for b in budgets) + " |")
    lines += [
        "",
        "![hit rate vs budget](hit_rate_vs_budget.png) ![TTFT CDF](ttft_cdf.png)",
        "",
        "## Cost profile",
        "",
        f"- model `{profile.model.name}` on `{profile.hardware.name}`; one checkpoint "
        f"{profile.checkpoint_bytes / MIB:.1f} MiB, KV {profile.model.kv_bytes_per_token:,} B/token",
        f"- checkpoint copy (device) {profile.checkpoint_copy_s() * 1e6:.0f} us; restore from host "
        f"{profile.host_restore_s() * 1e3:.2f} ms; recompute of 1k tokens at context 0 / 32k: "
        f"{_ms(profile.recompute_s(0, 1000))} / {_ms(profile.recompute_s(32_000, 1000))} ms",
        "- TTFT = restore copy (if a checkpoint is used; from the host tier, plus its PCIe copy) + recompute "
        "of the rest of the prompt, request alone",
        "",
        "## Trace",
        "",
        "```json",
        json.dumps(trace_meta, indent=2, default=str),
        "```",
        "",
    ]
    (out / "report.md").write_text("\n".join(lines))
