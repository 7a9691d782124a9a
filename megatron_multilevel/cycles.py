"""The shape of a cycle over the levels: the order of its visits and how each visit is reached.

Pure (standard library only), so that the config's checks and the schedule's phases read one
source: the config asks which levels a cycle grows (``arrivals``), the schedule builds a phase per
visit from the same functions (``ode_arrivals`` for the ODE strategy's phases).
"""

from typing import Literal, Optional

Arrival = Literal["fresh", "coalesce", "decoalesce", "grow", "restrict", "prolong", "continue"]
CYCLES = ("v", "w", "f", "grow")


def visit_order(cycle: str, num_levels: int) -> list[int]:
    """The level of every visit of ``cycle`` over ``num_levels`` levels (0 = fine), in order."""
    assert cycle in CYCLES, cycle
    coarsest = num_levels - 1

    def v(level: int) -> list[int]:
        return [level] if level == coarsest else [level, *v(level + 1), level]

    def w(level: int) -> list[int]:
        return [level] if level == coarsest else [level, *w(level + 1), level, *w(level + 1), level]

    if cycle == "v":
        return v(0)
    if cycle == "w":
        return w(0)
    if cycle == "f":
        return [coarsest] + [visit for level in reversed(range(coarsest)) for visit in v(level)]
    return list(reversed(range(num_levels)))


def arrivals(order: list[int]) -> list[Arrival]:
    """How each visit of ``order`` is reached: ``fresh`` (the first), ``coalesce`` (from the finer
    level), ``decoalesce`` (from the coarser level, back to a level whose model from before it was
    coalesced is kept) or ``grow`` (from the coarser level, to a level with no such model)."""
    coalesced: set[int] = set()  # the levels whose model from before coalescing is kept
    return [_arrival(order[i - 1] if i else None, level, coalesced) for i, level in enumerate(order)]


def _arrival(previous: Optional[int], level: int, coalesced: set) -> Arrival:
    if previous is None:
        return "fresh"
    assert abs(previous - level) == 1, (previous, level)
    if level > previous:
        assert previous not in coalesced, f"level {previous} is coalesced twice without being rebuilt"
        coalesced.add(previous)
        return "coalesce"
    if level in coalesced:
        coalesced.remove(level)
        return "decoalesce"
    return "grow"


def ode_arrivals(levels: list[int]) -> list[Arrival]:
    """How each phase of the ODE strategy (at ``levels``, 0 fine, 1 coarse) is reached: ``fresh``
    (the first), ``restrict`` (fine to coarse), ``prolong`` (coarse to fine) or ``continue`` (the
    same level in a new phase)."""
    return ["fresh" if i == 0 else "restrict" if level > levels[i - 1] else "prolong" if level < levels[i - 1]
            else "continue" for i, level in enumerate(levels)]
