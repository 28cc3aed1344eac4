"""The benchmark's goals and its report: verdicts, medians of repeated runs, the tables."""

from __future__ import annotations

from typing import Any

TURN_WORKER_SIDE = "agentq, sent by a turn worker"
"""The cost stage's second agentq side: the call sent by a turn worker's step."""

GOALS: list[tuple[str, str, float, str]] = [
    ("overhead_ratio_p50", "<=", 1.2, "≤ 1.2 (bar 1.5)"),
    ("throughput_ratio", ">=", 0.8, "≥ 0.8"),
    ("abort_to_event_ms_p99", "<", 100, "< 100 ms"),
    ("timeout_overshoot_ms_p99", "<", 100, "< 100 ms"),
    ("watchdog_overshoot_ms_p99", "<", 50, "< 50 ms"),
    ("watchdog_keepalive_overshoot_ms_p99", "<", 50, "< 50 ms"),
    ("event_latency_ms_p50", "<", 2, "< 2 ms"),
    ("held_redis_clients_peak", "<=", 100, "≤ 100, whatever N"),
    ("held_turn_worker_kb_per_turn", "<=", 20, "≤ 20 KB"),
    ("held_abort_all_seconds", "<=", 10, "≤ 10 s"),
    ("io_turns_seconds", "<=", 15, "≤ 15 s (floor 9)"),
    ("io_turns_peak_rss_mb", "<", 1536, "< 1.5 GB"),
    ("io_turns_redis_commands_per_turn", "<=", 120, "≤ 120 Redis commands"),
    ("io_cpu_vs_raw_sdk", "<=", 1.0, "≤ 1.0 x a raw-SDK asyncio loop's CPU"),
    ("io_wall_vs_raw_sdk", "<=", 0.8, "≤ 0.8 x the raw-SDK loop's wall time"),
    ("shapes_worst_cpu_ratio", "<=", 1.0, "every workload shape ≤ 1.0 x the raw loop's CPU"),
    ("shapes_worst_wall_ratio", "<=", 0.8, "every workload shape ≤ 0.8 x its wall time"),
    (
        "shapes_worst_first_token_over_direct_ms_p50",
        "<=",
        20,
        "every workload shape: first token ≤ +20 ms over the SDK direct, p50",
    ),
    (
        "shapes_worst_first_token_over_direct_ms_p99",
        "<=",
        60,
        "every workload shape: first token ≤ +60 ms over the SDK direct, p99",
    ),
    ("first_token_over_direct_ms_p50", "<=", 20, "≤ +20 ms over the SDK direct, p50"),
    ("first_token_over_direct_ms_p99", "<=", 60, "≤ +60 ms over the SDK direct, p99"),
    ("redis_commands_ratio", "<=", 2.0, "≤ 2 x plain Celery's"),
    ("cpu_ratio", "<=", 1.5, "≤ 1.5 x plain Celery's (sent as a model turn sends it)"),
    ("capacity_not_finished", "<=", 0, "0: every turn finishes, every shape"),
    *[
        (f"capacity_{shape}_{mode}_{what}", "<=", target, text)
        for shape in ("window", "window_bare", "bucket", "bucket_refusals")
        for mode, what, target, text in (
            ("open", "floor_ratio", 1.3, "≤ 1.3 x the floor, nothing configured"),
            ("open", "refused_share", 0.15, "≤ 15% refused, nothing configured"),
            ("limited", "floor_ratio", 1.15, "≤ 1.15 x the floor, the limit configured"),
            ("limited", "refused_share", 0.03, "≤ 3% refused, the limit configured"),
        )
    ],
    ("capacity_limited_vs_open_worst", "<=", 1.0, "configured never slower than not"),
    ("capacity_fair_first_round_s_p99", "<=", 2.0, "≤ 2 s"),
    ("conversation_turn_ratio_p50", "<=", 1.1, "≤ 1.1: no measurable cost on an idle one"),
    ("conversation_handoff_ms_p99", "<=", 50, "≤ 50 ms from one turn's end to the next's start"),
    ("budgeted_turn_ratio_p50", "<=", 1.1, "≤ 1.1: a budget costs nothing measurable"),
]


def _median(xs: list[float]) -> float:
    s = sorted(xs)
    mid = len(s) // 2
    return s[mid] if len(s) % 2 else (s[mid - 1] + s[mid]) / 2


def merge_runs(outs: list[dict[str, Any]]) -> dict[str, Any]:
    """One stage run several times: each number its median, with every run's value kept
    under `<key>_runs` so the spread shows; anything else as the last run had it."""
    merged = dict(outs[-1])
    if len(outs) < 2:
        return merged
    for key in list(merged):
        vals = [o.get(key) for o in outs]
        if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in vals):
            nums = [float(v) for v in vals if v is not None]
            merged[key] = round(_median(nums), 3)
            merged[f"{key}_runs"] = nums
        elif all(isinstance(v, bool) for v in vals):
            merged[key] = all(vals)
    return merged


def spread(res: dict[str, Any], key: str) -> str:
    """`median (min to max, N runs)` where the stage ran more than once."""
    runs = res.get(f"{key}_runs")
    v = res.get(key)
    if not runs:
        return str(v)
    return f"{v} ({min(runs):g} to {max(runs):g}, {len(runs)} runs)"


def judge(res: dict[str, Any]) -> dict[str, Any]:
    verdicts: dict[str, Any] = {}
    for key, op, target, text in GOALS:
        v = res.get(key)
        ok = (
            None
            if v is None
            else (v <= target if op == "<=" else v >= target if op == ">=" else v < target)
        )
        verdicts[key] = {"value": v, "goal": text, "pass": ok}
    return verdicts


def render(res: dict[str, Any], to_stderr: bool) -> None:
    from rich.console import Console
    from rich.table import Table

    con = Console(stderr=to_stderr)
    m = res["machine"]
    con.print(
        f"[bold]agentq vs plain Celery[/] on {m['cpu']}, {m['cores']} cores, "
        f"{m['memory_gb']} GB, Python {m['python']}, Celery {m['celery']}, "
        f"Redis {m['redis_server']} ({'quick' if res['quick'] else 'full'} run, "
        f"{res['duration_s']} s); a fixed Python loop took "
        f"{m.get('python_loop_ms_at_start')} ms at the start, "
        f"{m.get('python_loop_ms_at_end')} ms at the end"
    )
    t = Table(title="Goals")
    for col in ("metric", "value", "goal", "result"):
        t.add_column(col)
    for key, v in res["goals"].items():
        status = "n/a" if v["pass"] is None else "[green]PASS[/]" if v["pass"] else "[red]MISS[/]"
        if key == "overhead_ratio_p50" and v["pass"] is False and (v["value"] or 9) <= 1.5:
            status = "[yellow]MISS (under the 1.5 bar)[/]"
        t.add_row(key, spread(res, key), v["goal"], status)
    con.print(t)
    rows = [
        (
            "per-call ms p50 / p99",
            "agentq_call_ms_p50",
            "agentq_call_ms_p99",
            "celery_call_ms_p50",
            "celery_call_ms_p99",
        ),
    ]
    d = Table(title="Measurements")
    for col in ("measurement", "agentq", "plain Celery", "ratio / note"):
        d.add_column(col)
    for label, a50, a99, c50, c99 in rows:
        d.add_row(
            label,
            f"{res.get(a50)} / {res.get(a99)}",
            f"{res.get(c50)} / {res.get(c99)}",
            f"{res.get('overhead_ratio_p50')} / {res.get('overhead_ratio_p99')} "
            f"(paired p50 {res.get('overhead_ratio_p50_paired')})",
        )
    d.add_row(
        f"throughput, calls/s ({res.get('throughput_calls')} per round)",
        str(res.get("agentq_calls_per_s")),
        str(res.get("celery_calls_per_s")),
        str(res.get("throughput_ratio")),
    )
    for label, key in (
        ("abort → turn_aborted ms", "abort_to_event_ms"),
        ("abort → tool process gone ms", "abort_to_process_gone_ms"),
        ("timeout overshoot ms (1 s limit)", "timeout_overshoot_ms"),
        ("watchdog overshoot ms (500 ms idle)", "watchdog_overshoot_ms"),
        ("watchdog overshoot ms, keep-alives only", "watchdog_keepalive_overshoot_ms"),
        ("event latency ms (publish → subscriber)", "event_latency_ms"),
        ("SSE latency ms (publish → SSE client)", "sse_latency_ms"),
    ):
        d.add_row(
            label + " p50 / p99", f"{res.get(key + '_p50')} / {res.get(key + '_p99')}", "", ""
        )
    d.add_row(
        "scale: turns, all settled, seconds (floor)",
        f"{res.get('scale_turns')}, {res.get('scale_all_settled')}, "
        f"{res.get('scale_seconds')} ({res.get('scale_floor_seconds')})",
        "",
        f"max active {res.get('scale_max_active')}",
    )
    if res.get("held_turns") is not None:
        d.add_row(
            "held: turns, held at once, s to hold",
            f"{res.get('held_turns')}, {spread(res, 'held_at_once')}, "
            f"{spread(res, 'held_seconds_to_hold')}",
            "",
            f"not ended after abort: {res.get('held_not_ended')}",
        )
        d.add_row(
            "held: Redis clients all before / held fleet peak, KB per held turn, abort all s",
            f"{res.get('held_redis_clients_before')} / {spread(res, 'held_redis_clients_peak')} "
            "(held fleet), "
            f"{spread(res, 'held_turn_worker_kb_per_turn')}, "
            f"{spread(res, 'held_abort_all_seconds')}",
            "",
            "",
        )
    for prefix, label in (("io_turns", "io: async tool"), ("old_path", "io: sync tool, prefork")):
        if res.get(f"{prefix}_turns") is not None:
            d.add_row(
                f"{label}: turns, all settled, s (floor), peak RSS MB",
                f"{res.get(prefix + '_turns')}, {res.get(prefix + '_all_settled')}, "
                f"{spread(res, prefix + '_seconds')} ({res.get(prefix + '_floor_seconds')}), "
                f"{spread(res, prefix + '_peak_rss_mb')}",
                "",
                f"{res.get(f'{prefix}_statuses')}; CPU s: {res.get(f'{prefix}_cpu_s_by_process')}",
            )
            phases = res.get(f"{prefix}_phase_ms") or {}
            if phases:
                # Where the time above the floor goes: when the last turns reached each step.
                d.add_row(
                    f"{label}: s to each step (p50/max)",
                    ", ".join(
                        f"{name} {ms[0] / 1000:.1f}/{ms[2] / 1000:.1f}"
                        for name, ms in phases.items()
                    ),
                    "",
                    "",
                )
    for prefix, label in (
        (f"capacity_{shape}_{mode}", f"capacity {shape}: {what}")
        for shape in res.get("capacity_shapes") or ()
        for mode, what in (("open", "nothing configured"), ("limited", "the limit configured"))
    ):
        if res.get(f"{prefix}_turns") is not None:
            d.add_row(
                f"{label}: turns, finished, s (floor), ratio",
                f"{res.get(prefix + '_turns')}, {spread(res, prefix + '_finished')}, "
                f"{spread(res, prefix + '_seconds')} ({res.get(prefix + '_floor_seconds')}), "
                f"{spread(res, prefix + '_floor_ratio')}",
                "",
                f"{res.get(prefix + '_statuses')}",
            )
            d.add_row(
                f"{label}: requests admitted / refused (share), most in 1 s, llm_queued",
                f"{res.get(prefix + '_requests_admitted')} / "
                f"{res.get(prefix + '_requests_refused')} "
                f"({res.get(prefix + '_refused_share')}), "
                f"{res.get(prefix + '_most_in_one_second')}, "
                f"{res.get(prefix + '_llm_queued')} "
                f"in {res.get(prefix + '_llm_queued_turns')} turns",
                "",
                f"busy rounds seen {res.get(prefix + '_busy_rounds_seen')}, "
                f"retries used {res.get(prefix + '_llm_retries')}",
            )
            secs = res.get(f"{prefix}_per_second") or []
            d.add_row(
                f"{label}: admitted/refused in each second",
                " ".join(f"{a}/{r}" for a, r in secs),
                "",
                "",
            )
    if res.get("capacity_fair_bulk_turns") is not None:
        d.add_row(
            "capacity: fairness, interactive first round s p50 / p99 / max",
            f"{res.get('capacity_fair_first_round_s_p50')} / "
            f"{spread(res, 'capacity_fair_first_round_s_p99')} / "
            f"{res.get('capacity_fair_first_round_s_max')}",
            "",
            f"turn_started → served p99 {res.get('capacity_fair_from_turn_started_s_p99')}; "
            f"{res.get('capacity_fair_interactive_turns')} interactive behind "
            f"{res.get('capacity_fair_bulk_queued_at_start')} queued background rounds "
            f"of {res.get('capacity_fair_bulk_turns')} turns",
        )
    if res.get("cluster_turns") is not None:
        d.add_row(
            "cluster: turns, finished, s; Redis CPU ms / commands per turn",
            f"3 masters: {res.get('cluster_turns')}, {res.get('cluster_all_finished')}, "
            f"{res.get('cluster_seconds')}; {res.get('cluster_redis_cpu_ms_per_turn')} / "
            f"{res.get('cluster_redis_commands_per_turn')} "
            f"(+ broker {res.get('cluster_broker_cpu_ms_per_turn')} / "
            f"{res.get('cluster_broker_commands_per_turn')})",
            f"one Redis: {res.get('one_redis_turns')}, {res.get('one_redis_all_finished')}, "
            f"{res.get('one_redis_seconds')}; {res.get('one_redis_redis_cpu_ms_per_turn')} / "
            f"{res.get('one_redis_redis_commands_per_turn')}",
            f"per master CPU ms {res.get('cluster_masters_cpu_ms_per_turn')}, busiest share "
            f"{res.get('cluster_busiest_master_share')}; one Redis core: "
            f"{res.get('one_redis_turns_per_s_per_core')} turns/s",
        )
    for what in ("rss", "pss"):
        mem = res.get(f"{what}_mb") or {}
        d.add_row(
            f"peak {what.upper()} MB (worker + its pool)",
            ", ".join(f"{k_} {mem[k_]}" for k_ in ("turns", "tools", "llm", "redis") if k_ in mem),
            f"celery {mem.get('celery')}",
            f"{res.get('turn_worker_kb_per_turn')} KB/turn held" if what == "rss" else "",
        )
    cost = res.get("cost_per_call") or {}
    if cost:

        def cpu(side: str) -> str:
            return ", ".join(f"{k_} {v}" for k_, v in cost[side]["cpu_ms_per_call"].items())

        def cmds(side: str) -> str:
            return ", ".join(
                f"{k_} {v['total']}"
                for k_, v in cost[side]["redis_commands_per_call"].items()
                if v["total"] >= 0.5
            )

        d.add_row(
            "CPU ms per call, by process", cpu("agentq"), cpu("celery"), str(res.get("cpu_ratio"))
        )
        d.add_row(
            "Redis commands per call, by process",
            cmds("agentq"),
            cmds("celery"),
            str(res.get("redis_commands_ratio")),
        )
        if TURN_WORKER_SIDE in cost:
            d.add_row(
                "CPU ms per call, sent by a turn worker",
                cpu(TURN_WORKER_SIDE),
                "",
                str(res.get("cpu_ratio_turn_worker")),
            )
            d.add_row(
                "Redis commands per call, sent by a turn worker",
                cmds(TURN_WORKER_SIDE),
                "",
                str(res.get("redis_commands_ratio_turn_worker")),
            )
    con.print(d)
    if res.get("shapes"):
        sh = Table(
            title="io on workload shapes: the fleet (+ Redis) and plain Celery tasks (+ Redis) "
            "against a raw-SDK loop"
        )
        cols: tuple[str, ...] = ("shape", "turns", "floor s", "fleet s", "Celery s", "raw s")
        cols += ("CPU ratio", "wall ratio", "Celery's CPU ratio", "fleet CPU / Celery's")
        for col in (*cols, "first token over the SDK direct, ms p50 / p99"):
            sh.add_column(col)
        for r in res["shapes"]:
            i = r.get("index")
            sh.add_row(
                r["shape"],
                str(r["turns"]),
                str(r["floor_s"]),
                str(r["fleet_s"]),
                str(r.get("celery_s")),
                str(r["raw_s"]),
                spread(res, f"shape_{i}_cpu_ratio"),
                spread(res, f"shape_{i}_wall_ratio"),
                spread(res, f"shape_{i}_celery_cpu_ratio"),
                spread(res, f"shape_{i}_cpu_vs_celery"),
                f"{spread(res, f'shape_{i}_first_token_over_direct_ms_p50')} / "
                f"{spread(res, f'shape_{i}_first_token_over_direct_ms_p99')}",
            )
        con.print(sh)
    for note in res.get("notes", []):
        con.print(f"[yellow]note:[/] {note}")
