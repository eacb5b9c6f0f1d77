"""Diagnosis of a simulated order that cannot finish: what every stuck rank waits for (torch-free)."""

from __future__ import annotations

from autopp.schedule.sim_state import SimState, producer

__all__ = ["deadlock_message"]


def deadlock_message(sim: SimState) -> str:
    """Name what every stuck rank waits for; root causes (missing or self-blocked producers) come first."""
    where = {a: (r, i) for r, acts in enumerate(sim.order) for i, a in enumerate(acts)}
    parts: list[tuple[bool, str]] = []
    for r, acts in enumerate(sim.order):
        if sim.position[r] == len(acts):
            continue
        head = acts[sim.position[r]]
        need = producer(head, sim)
        if need not in where:
            root, why = True, "not scheduled on any rank"
        else:
            q, i = where[need]
            root = q == r
            why = f"rank {q} has it at position {i} but is stuck at position {sim.position[q]}"
        parts.append((not root, f"rank {r} waits for {need} before {head} at position {sim.position[r]} ({why})"))
    return "deadlock: " + "; ".join(text for _, text in sorted(parts))
