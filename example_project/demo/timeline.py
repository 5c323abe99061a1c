"""The demo's timeline picture: tasks per second, faults, takeovers, dead letters (matplotlib)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only, no display

import matplotlib.pyplot as plt
from matplotlib.axes import Axes

TASK_COLOURS = {"charge": "#1f77b4", "reserve": "#2ca02c", "invoice": "#17becf"}
TASK_LABELS = {
    "charge": "charge_payment",
    "reserve": "reserve_stock",
    "invoice": "send_invoice",
}
FAULT_COLOURS = {"SIGKILL": "#d62728", "SIGSTOP": "#ff7f0e", "SIGCONT": "#2ca02c"}


def _per_second(times: list[float], seconds: int) -> list[int]:
    counts = [0] * seconds
    for t in times:
        if 0 <= t < seconds:
            counts[int(t)] += 1
    return counts


def _panel(ax: Axes, report: Any, seconds: int, title: str) -> None:
    timeline = report.timeline
    xs = list(range(seconds))
    bottom = [0] * seconds
    for task in ("charge", "reserve", "invoice"):
        counts = _per_second(timeline.get("completions", {}).get(task, []), seconds)
        ax.bar(
            xs,
            counts,
            bottom=bottom,
            width=1.0,
            align="edge",
            color=TASK_COLOURS[task],
            label=f"{TASK_LABELS[task]} done",
        )
        bottom = [b + c for b, c in zip(bottom, counts, strict=True)]
    repeats = _per_second(timeline.get("repeats", []), seconds)
    if any(repeats):
        ax.bar(
            xs,
            repeats,
            bottom=bottom,
            width=1.0,
            align="edge",
            color="#e377c2",
            hatch="//",
            label="ran AGAIN (a second charge, reservation, invoice)",
        )
        bottom = [b + r for b, r in zip(bottom, repeats, strict=True)]
    top = max([*bottom, 1]) * 1.35
    ax.set_ylim(0, top)
    for fault in timeline.get("faults", []):
        colour = FAULT_COLOURS.get(fault["kind"], "black")
        ax.axvline(fault["at"], color=colour, linewidth=2, linestyle="--")
        ax.text(
            fault["at"] + 0.2,
            top * 0.97,
            f"{fault['kind']} {fault['worker'].split('@')[0]}",
            color=colour,
            fontsize=8,
            va="top",
            rotation=90,
        )
    markers = (
        ("recovered", "^", "#9467bd", 0.86, "task a fault interrupted, completed"),
        ("dead_letters", "X", "black", 0.78, "dead-lettered (poison pill)"),
        ("poison_crashes", "x", "#8c564b", 0.70, "pool process killed by a poison pill"),
        ("unavailable", "|", "#ff7f0e", 0.62, "provider answered 503 (retried)"),
        ("refused_stale", "D", "#d62728", 0.54, "provider refused a stale fencing token"),
    )
    for name, marker, colour, height, label in markers:
        times = timeline.get(name, [])
        if times:
            ax.scatter(
                times,
                [top * height] * len(times),
                marker=marker,
                color=colour,
                s=28,
                label=f"{label} ({len(times)})",
                zorder=3,
            )
    ax.set_title(title, fontsize=10, loc="left")
    ax.set_ylabel("tasks per second")
    ax.set_xlim(0, seconds)
    ax.legend(loc="upper left", bbox_to_anchor=(1.005, 1.0), fontsize=7, framealpha=0.9)
    ax.grid(axis="y", alpha=0.3)


def draw(path: Path, guarded: Any, plain: Any | None) -> None:
    """Write the timeline of one or both legs to ``path`` (PNG)."""
    reports = [guarded] + ([plain] if plain is not None else [])
    seconds = math.ceil(max(r.timeline.get("seconds", 1) for r in reports)) + 1
    figure, axes = plt.subplots(
        len(reports), 1, figsize=(15, 4.2 * len(reports)), sharex=True, squeeze=False
    )
    _panel(
        axes[0][0],
        guarded,
        seconds,
        f"GuardedTask: {guarded.orders} orders, {guarded.messages} messages; every task done once, "
        f"{guarded.charged['twice_or_more']} double charges",
    )
    if plain is not None:
        _panel(
            axes[1][0],
            plain,
            seconds,
            f"plain Celery, same scenario: {plain.charged['twice_or_more']} orders charged twice "
            f"or more; {(plain.plain or {}).get('parked_in_unacked', 0)} messages stuck with the "
            "killed worker; poison pills never stop",
        )
    axes[-1][0].set_xlabel("seconds since the first order")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
