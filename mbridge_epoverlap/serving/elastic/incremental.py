"""The incremental re-solve: start from the placement in force and change only the slots the balance needs.

A solve from scratch (`eplb.rebalance_over_survivors`) packs replicas heaviest-first into whichever worker is
lightest, so the worker a replica lands on has nothing to do with where it is now: even when the load hardly
changed, many expert copies move. Here the placement in force is the start, and each change is one of

- replace: a slot holding a replica of an expert with more than one gives it up to another expert (one copy
  moves, to that slot's worker);
- swap: two slots on different workers exchange experts (two copies move),

never putting a second replica of an expert on a worker that holds one (it would protect nothing against a
loss). Each round takes the change that lowers the most loaded worker's load the most (then the sum of squared
worker loads, then the fewer copies), and the solve stops when max/mean load reaches `goal` (the balance a
solve from scratch gets) or no change helps. It is a function of its inputs only, with a fixed candidate order,
so every attention worker that calls it with the same placement and load gets the same table.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

EMPTY = -1  # `eplb.EMPTY_SLOT`: a slot on a dead worker
_EPS = 1e-12


class _State:
    """Rows of slots per live worker, replica counts and worker loads, updated change by change."""

    def __init__(self, slots: Sequence[int], workers: int, alive: Iterable[int], load: Sequence[float]) -> None:
        self.per = len(slots) // workers
        self.alive = sorted(alive)
        self.rows = {w: list(slots[w * self.per:(w + 1) * self.per]) for w in self.alive}
        self.load = [float(x) for x in load]
        self.count = [0] * len(self.load)
        for row in self.rows.values():
            for e in row:
                self.count[e] += 1
        self.loads = {w: self._worker_load(w) for w in self.alive}

    def share(self, expert: int, count: int | None = None) -> float:
        c = self.count[expert] if count is None else count
        return self.load[expert] / c if c else 0.0

    def _worker_load(self, w: int) -> float:
        return sum(self.share(e) for e in self.rows[w])

    def after_replace(self, w: int, i: int, new: int) -> dict[int, float]:
        """The loads of the workers that change when slot `i` of worker `w` switches to expert `new`."""
        old = self.rows[w][i]
        old_share, old_next = self.share(old), self.share(old, self.count[old] - 1)
        new_share, new_next = self.share(new), self.share(new, self.count[new] + 1)
        changed = {}
        for u in self.alive:
            row = self.rows[u]
            n_old, n_new = row.count(old), row.count(new)
            if u == w:
                delta = (n_old - 1) * old_next - n_old * old_share + (n_new + 1) * new_next - n_new * new_share
            elif n_old or n_new:
                delta = n_old * (old_next - old_share) + n_new * (new_next - new_share)
            else:
                continue
            changed[u] = self.loads[u] + delta
        return changed

    def after_swap(self, w: int, i: int, v: int, j: int) -> dict[int, float]:
        a, b = self.rows[w][i], self.rows[v][j]
        da = self.share(b) - self.share(a)
        return {w: self.loads[w] + da, v: self.loads[v] - da}

    def score(self, changed: dict[int, float]) -> tuple[float, float]:
        """(max load, sum of squared loads) once the workers in `changed` take their new loads."""
        loads = [changed.get(w, self.loads[w]) for w in self.alive]
        return max(loads), sum(x * x for x in loads)

    def apply_replace(self, w: int, i: int, new: int) -> None:
        old = self.rows[w][i]
        self.rows[w][i] = new
        self.count[old] -= 1
        self.count[new] += 1
        self.loads = {u: self._worker_load(u) for u in self.alive}

    def apply_swap(self, w: int, i: int, v: int, j: int) -> None:
        self.rows[w][i], self.rows[v][j] = self.rows[v][j], self.rows[w][i]
        self.loads = {u: self._worker_load(u) for u in self.alive}


def incremental_slots(slots: Sequence[int], workers: int, alive: Iterable[int], load: Sequence[float],
                      goal: float) -> tuple[int, ...]:
    """The placement `slots` changed slot by slot until max/mean load over `alive` reaches `goal`.

    Args:
        slots: the placement in force (`phy2log` of one table, `EMPTY` on dead workers); every expert has a
            replica on a live worker.
        workers: workers the slots are laid out over.
        alive: the live workers (their slots may change; the others stay empty).
        load: `[experts]` measured load (token counts).
        goal: the max/mean to reach (e.g. a solve from scratch's); the solve stops there or when no change
            lowers the load of the most loaded worker (or, at equal maximum, the spread of the loads).

    Returns:
        The new placement, as a tuple of the same length.
    """
    state = _State(slots, workers, alive, load)
    if not state.alive or sum(state.load) <= 0:
        return tuple(slots)
    mean = sum(state.load) / len(state.alive)
    experts = range(len(state.load))
    for _ in range(2 * len(slots)):
        current = state.score({})
        if current[0] / mean <= goal + _EPS:
            break
        hot = max(state.alive, key=lambda w: (state.loads[w], -w))
        hot_experts = set(state.rows[hot])
        best: tuple[tuple[float, float, int], tuple] | None = None

        def consider(key: tuple[float, float, int], change: tuple) -> None:
            nonlocal best
            if best is None or key < best[0]:
                best = (key, change)

        for w in state.alive:
            row = state.rows[w]
            for i, old in enumerate(row):
                if state.count[old] < 2:
                    continue  # its last replica
                # Only changes that touch the hottest worker can lower the maximum: a slot there, or a replica
                # added elsewhere of an expert it holds.
                targets = experts if w == hot else sorted(hot_experts)
                for new in targets:
                    if new == old or new in row:
                        continue
                    consider((*state.score(state.after_replace(w, i, new)), 1), ("replace", w, i, new))
        for i, a in enumerate(state.rows[hot]):
            for v in state.alive:
                if v == hot:
                    continue
                for j, b in enumerate(state.rows[v]):
                    if a == b or b in hot_experts or a in state.rows[v]:
                        continue
                    consider((*state.score(state.after_swap(hot, i, v, j)), 2), ("swap", hot, i, v, j))
        if best is None or not (best[0][0] < current[0] - _EPS
                                or (best[0][0] <= current[0] + _EPS and best[0][1] < current[1] - _EPS)):
            break
        change = best[1]
        if change[0] == "replace":
            state.apply_replace(*change[1:])
        else:
            state.apply_swap(*change[1:])
    out = [EMPTY] * len(slots)
    for w, row in state.rows.items():
        out[w * state.per:(w + 1) * state.per] = row
    return tuple(out)
