"""Local search on a plan under the memory model: the solver prices units one by one, but a layer with
recomputed units is one region whose bytes depend on the layer's whole plan (`CostTable.held_by_layer`).
From a plan that fits, single-unit changes that the model says still fit and save the most time are
taken one at a time until none is left; then the pair of changes that saves the most (one unit faster,
paid for by the bytes another unit's slower option frees: the swaps the solver's one-by-one pricing
misses), and the single changes again, until no change or pair fits and saves time. Each change is priced on its own layer only (its option's
bytes and the layer's region bytes), so a pass costs units x options x layer size, not a model per
candidate. A whole recomputed layer's region saving is credited only where every unit of the layer
recomputes (the runtime's own test is wider), so the search errs towards fitting.
"""

from __future__ import annotations

from hilore_verl.planner.costs import CostTable, in_layers, layer_of
from hilore_verl.planner.solver import Option
from hilore_verl.runtime.plan import RECOMPUTE, UnitPlan

MAX_MOVES = 1000  # a bound on the loop; each move saves time, so it ends long before on real plans


def refine(costs: CostTable, options: list[list[Option]], plan: dict[str, UnitPlan], tokens: int, room: float,
           risk2_budget: float) -> dict[str, UnitPlan]:
    """`options`: per unit of `costs.units`, the solver's options; `room`: bytes the units may hold more
    than `plan` holds now under the model (the limit less the plan's predicted peak, >= 0)."""
    units = costs.units
    by_layer: dict[str, list[int]] = {}
    for i, u in enumerate(units):
        by_layer.setdefault(layer_of(u.name), []).append(i)
    chosen = [next(k for k, o in enumerate(opts) if o.plan == plan[u.name]) for u, opts in zip(units, options)]
    k = costs.scale(tokens)
    kept = [costs.options(u, tokens)[0].memory for u in units]  # KEEP comes first
    saving = costs.region_saving_bytes * k

    def layer_bytes(members: list[int], picks: dict[int, int]) -> float:
        """What a layer's units hold under `picks` (member -> option index): options plus region bytes."""
        held, share = 0.0, {}
        for i in members:
            o = options[i][picks[i]]
            if o.plan == RECOMPUTE:
                held += units[i].held_bytes * costs.scale(tokens, units[i])
                continue
            held += o.memory
            share[units[i].name] = costs.stored_share(units[i], o.plan, kept[i], o.memory)
        if not in_layers(units[members[0]].name) or len(share) == len(members):
            return held
        whole = not share
        return held + costs.region_bytes([units[i] for i in members], share, k) - (saving if whole else 0.0)

    risk2 = sum(options[i][c].risk ** 2 for i, c in enumerate(chosen))
    for _ in range(MAX_MOVES):
        best = None  # (time saved, unit, option, bytes more, risk^2 more)
        for members in by_layer.values():
            picks = {i: chosen[i] for i in members}
            now = layer_bytes(members, picks)
            for i in members:
                current = options[i][chosen[i]]
                for j, o in enumerate(options[i]):
                    gain = current.time - o.time
                    if j == chosen[i] or gain <= 0 or (best is not None and gain <= best[0]):
                        continue
                    more_risk = o.risk ** 2 - current.risk ** 2
                    if risk2 + more_risk > risk2_budget * (1 + 1e-12):
                        continue
                    more = layer_bytes(members, {**picks, i: j}) - now
                    if more <= room:
                        best = (gain, i, j, more, more_risk)
        if best is not None:
            _, i, j, more, more_risk = best
            chosen[i], room, risk2 = j, room - more, risk2 + more_risk
            continue
        pair = _best_pair(by_layer, options, chosen, layer_bytes, room, risk2, risk2_budget)
        if pair is None:
            break
        (i, j), (i2, j2), more, more_risk = pair
        chosen[i], chosen[i2], room, risk2 = j, j2, room - more, risk2 + more_risk
    return {u.name: options[i][c].plan for i, (u, c) in enumerate(zip(units, chosen))}


def _best_pair(by_layer, options, chosen, layer_bytes, room: float, risk2: float, risk2_budget: float):
    """Where no single change fits and saves time: the pair of changes that saves the most time and fits,
    a faster option for one unit paid for by bytes another unit's slower option frees (two units of one
    layer are priced together: its region bytes depend on both). ((unit, option), (unit, option), bytes
    more, risk^2 more), or None."""
    moves, now = [], {}  # (time saved, bytes more, risk^2 more, unit, option, layer); layer -> its bytes
    for layer, members in by_layer.items():
        picks = {i: chosen[i] for i in members}
        now[layer] = layer_bytes(members, picks)
        for i in members:
            current = options[i][chosen[i]]
            for j, o in enumerate(options[i]):
                if j != chosen[i]:
                    moves.append((current.time - o.time, layer_bytes(members, {**picks, i: j}) - now[layer],
                                  o.risk ** 2 - current.risk ** 2, i, j, layer))
    takes = sorted((m for m in moves if m[0] > 0), key=lambda m: -m[0])
    releases = sorted((m for m in moves if m[1] < 0), key=lambda m: -m[0])
    best, best_gain = None, 0.0
    for t in takes:
        for r in releases:
            gain = t[0] + r[0]
            if gain <= best_gain * (1 + 1e-12):
                break  # releases by time lost, least first: none after this one does better
            if r[3] == t[3] or risk2 + t[2] + r[2] > risk2_budget * (1 + 1e-12):  # the single moves' test
                continue
            if r[5] == t[5]:  # one layer: priced together
                members = by_layer[t[5]]
                picks = {i: chosen[i] for i in members}
                more = layer_bytes(members, {**picks, t[3]: t[4], r[3]: r[4]}) - now[t[5]]
            else:
                more = t[1] + r[1]
            if more <= room:
                best, best_gain = ((t[3], t[4]), (r[3], r[4]), more, t[2] + r[2]), gain
    return best
