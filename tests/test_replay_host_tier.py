"""The semantic policy with a host checkpoint tier in the replay: which restores come from host,
what they cost in TTFT, and the --host-slots flag.

The hand-built trace interleaves three append-only sessions that share no prefix under a
three-slot device pool (what one request holds at once: the checkpoint it restores, its prompt
tail and its final state): each second turn restores its session's previous final state,
which the other sessions' final states pushed to host memory in between.
A host tier large enough to keep everything must then reuse exactly what a device pool large
enough to keep everything does.
"""

from __future__ import annotations

import json

import pytest

from sglang_hybrid.planning.state import Purpose
from sglang_hybrid.cache.planning import Tier
from sglang_hybrid.replay.cli_replay import replay_main
from sglang_hybrid.replay.cost_model import get_profile
from sglang_hybrid.replay.policies import drive
from sglang_hybrid.replay.policies.semantic import SemanticPolicy, tiny_state_spec
from sglang_hybrid.replay.sim import run_replay, simulate
from sglang_hybrid.replay.trace import Request, Trace, write_trace
from test_planner import message, request, text

PROFILE = get_profile("qwen3.5-35b-a3b@rtx4090")
DEVICE = 3
ROOMY = 16  # device or host slots: more than the trace ever takes


def session_turns(session: str, tag: int) -> list[Request]:
    # A session-specific first token: the sessions share no prefix, so nothing but their own
    # states can serve them.
    system, user = [*text(tag, 1), *message("system", text(tag, 60))], message("user", text(tag + 1, 20))
    first = request([system, user], text(tag + 2, 8))
    follow_up = request([system, user, message("assistant", text(tag + 2, 8)), message("tool", text(tag + 3, 30))],
                        text(tag + 4, 6))
    return [Request(session, turn, 0.0, prompt, output) for turn, (prompt, output) in enumerate([first, follow_up])]


def interleaved_trace() -> list[Request]:
    a, b, c = session_turns("a", 10), session_turns("b", 20), session_turns("c", 30)
    requests = [a[0], b[0], c[0], a[1], b[1], c[1]]
    for clock, r in enumerate(requests):
        r.arrival_s = float(clock)
    return requests


def policy(device_slots: int, host_slots: int) -> SemanticPolicy:
    return SemanticPolicy(device_slots, PROFILE, host_slots=host_slots,
                          spec=tiny_state_spec(kv_tokens=1 << 15, max_context=1 << 12))


def test_demoted_final_states_are_restored_from_host_as_the_roomy_device_pool_restores_them():
    requests = interleaved_trace()
    tiered = [o for _, (o,) in drive(requests, [policy(DEVICE, ROOMY)])]
    roomy = [o for _, (o,) in drive(requests, [policy(ROOMY, 0)])]
    final_states = [len(r.input_ids) + len(r.output_ids) - 1 for r in requests[:3]]
    expected = [0, 0, 0, *final_states]
    assert [o.restored_depth for o in roomy] == expected
    assert [o.restored_depth for o in tiered] == expected
    assert [o.recomputed_tokens for o in tiered] == [o.recomputed_tokens for o in roomy]
    assert [o.restored_from_host for o in tiered] == [False] * 3 + [True] * 3
    assert not any(o.restored_from_host for o in roomy)


def test_a_final_state_keeps_its_planner_record_through_the_host_tier_and_back():
    requests = interleaved_trace()
    tiered = policy(DEVICE, ROOMY)
    planner = tiered.planner
    steps = drive(requests, [tiered])
    for _ in range(3):
        next(steps)
    # a's final state was demoted while b and c ran: the planner still values it, under its
    # host key, as the state a's next turn continues from.
    final_depth = len(requests[0].input_ids) + len(requests[0].output_ids) - 1
    [(host_key, record)] = [(key, r) for key, r in planner.records.items()
                            if r.session == "a" and r.purpose is Purpose.CONTINUATION]
    assert host_key.tier is Tier.HOST and host_key in planner.sessions["a"].on_path
    assert planner.value(host_key, final_depth) > 0.0
    _, (outcome,) = next(steps)
    assert outcome.restored_from_host and outcome.restored_depth == final_depth
    # Promoted back to a device slot, the record followed it and counted the restore.
    [device_key] = [key for key, r in planner.records.items() if r is record]
    assert device_key.tier is Tier.DEVICE and record.uses == 1


def test_without_a_host_tier_the_small_pool_loses_final_states_the_tier_keeps():
    outcomes = [o for _, (o,) in drive(interleaved_trace(), [policy(DEVICE, 0)])]
    assert [o.restored_depth for o in outcomes[:3]] == [0] * 3
    # Three final states and the prompt tails of later requests outnumber three slots.
    assert [o.restored_depth for o in outcomes[3:]].count(0) >= 2
    assert not any(o.restored_from_host for o in outcomes)


def test_a_host_restore_costs_the_pcie_copy_in_ttft():
    trace = Trace(interleaved_trace())
    tiered = simulate(trace, ["semantic"], [DEVICE], PROFILE, progress=False, host_slots=ROOMY)[DEVICE]["semantic"]
    roomy = simulate(trace, ["semantic"], [ROOMY], PROFILE, progress=False)[ROOMY]["semantic"]
    assert (tiered.host_restores, roomy.host_restores) == (3, 0)
    differences = [t - r for t, r in zip(tiered.ttft_s, roomy.ttft_s)]
    assert differences[:3] == [0.0] * 3
    assert differences[3:] == pytest.approx([PROFILE.host_restore_s()] * 3, rel=1e-9)
    assert PROFILE.host_restore_s() == PROFILE.checkpoint_bytes / PROFILE.hardware.pcie_bytes_per_s


def test_a_host_restore_without_a_restored_depth_is_refused():
    with pytest.raises(ValueError, match="restored depth > 0"):
        PROFILE.ttft_s(0, 100, restored_from_host=True)


def test_results_add_the_host_budget_and_restores_only_with_a_tier(tmp_path):
    path = write_trace(tmp_path / "t.jsonl", interleaved_trace())
    plain = run_replay(path, ["oracle", "semantic"], budget_slots=DEVICE, profile=PROFILE.name,
                       sweep_budgets=(ROOMY,), out_dir=tmp_path / "plain", progress=False)
    assert "host_slots" not in plain and all("host_restores" not in row for row in plain["policies"].values())
    tiered = run_replay(path, ["oracle", "semantic"], budget_slots=DEVICE, profile=PROFILE.name, host_slots=ROOMY,
                        sweep_budgets=(ROOMY,), out_dir=tmp_path / "tiered", progress=False)
    assert tiered["host_slots"] == ROOMY
    assert tiered["policies"]["semantic"]["host_restores"] == 3
    assert tiered["policies"]["semantic"]["recomputed_tokens"] < plain["policies"]["semantic"]["recomputed_tokens"]
    # The peers have no host tier: the flag leaves them as they were.
    assert tiered["policies"]["oracle"] == {**plain["policies"]["oracle"], "host_restores": 0}
    sweep = json.loads((tmp_path / "tiered" / "budget_sweep.json").read_text())
    assert all("host_restores" in row for rows in sweep.values() for row in rows.values())
    assert "restored from it" in (tmp_path / "tiered" / "report.md").read_text()


def test_host_tier_is_refused_outside_the_sim_backend(tmp_path):
    with pytest.raises(ValueError, match="backend 'sim' only"):
        run_replay(tmp_path / "unused.jsonl", ["semantic"], backend="engine", host_slots=4, out_dir=tmp_path)


def test_cli_host_slots_reach_the_semantic_policy(tmp_path, capsys):
    path = write_trace(tmp_path / "t.jsonl", interleaved_trace())
    out = tmp_path / "out"
    assert replay_main([str(path), "--policies", "semantic,none", "--budget-slots", str(DEVICE), "--host-slots", str(ROOMY),
                        "--profile", PROFILE.name, "--out", str(out)]) == 0
    results = json.loads((out / "results.json").read_text())
    assert results["host_slots"] == ROOMY
    assert results["policies"]["semantic"]["host_restores"] == 3
    assert results["policies"]["none"]["host_restores"] == 0


@pytest.mark.parametrize("argv, message_part", [
    (["--host-slots", "-1"], "--host-slots must be >= 0"),
    (["--host-slots", "many"], "invalid int value"),
    (["--host-slots", "4", "--backend", "engine"], "--host-slots applies to --backend sim only"),
])
def test_cli_refuses_bad_host_slots(tmp_path, capsys, argv, message_part):
    with pytest.raises(SystemExit) as exit_info:
        replay_main([*argv, "--out", str(tmp_path)])
    assert exit_info.value.code == 2
    assert message_part in capsys.readouterr().err


def test_cli_help_says_only_the_semantic_policy_has_a_host_tier(capsys):
    with pytest.raises(SystemExit):
        replay_main(["--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "only the semantic policy has a host tier, the other policies ignore it" in help_text
