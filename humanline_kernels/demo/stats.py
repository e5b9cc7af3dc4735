"""The statistics: each arm at its best learning rate (chosen on the held-out prompts only), its rule rate on the
reported prompts as mean +- standard error over seeds, and the comparisons in standard errors of the difference:
above or below at ``SIGNIFICANT`` (2) or more, else not significant."""
from __future__ import annotations

import math

# a comparison is called above or below at this many standard errors of the difference, else not significant
SIGNIFICANT = 2.0


def mean_se(xs):
    """Mean and standard error of the mean (NaN for one value)."""
    xs = [float(x) for x in xs]
    m = sum(xs) / len(xs)
    if len(xs) < 2:
        return m, float("nan")
    var = sum((x - m) ** 2 for x in xs) / (len(xs) - 1)
    return m, math.sqrt(var / len(xs))


def select_best(runs):
    """Per arm, the learning rate with the best mean held-out rule rate (ties: the smaller learning rate).

    Only ``heldout`` decides; the returned rows summarise that learning rate's runs on the reported set."""
    best = {}
    for arm in dict.fromkeys(r["arm"] for r in runs):
        mine = [r for r in runs if r["arm"] == arm]
        lrs = sorted({r["lr"] for r in mine})
        score = {lr: mean_se([r["heldout"] for r in mine if r["lr"] == lr])[0] for lr in lrs}
        lr = max(lrs, key=lambda x: (score[x], -x))
        chosen = [r for r in mine if r["lr"] == lr]
        rate, se = mean_se([r["report"] for r in chosen])
        clip = [r["clip_frac"] for r in chosen if r["clip_frac"] is not None]
        best[arm] = {"arm": arm, "lr": lr, "rule_rate": rate, "se": se, "heldout": score[lr],
                     "clip_frac": sum(clip) / len(clip) if clip else None,
                     "syncs": chosen[0]["syncs"], "wall_s": mean_se([r["wall_s"] for r in chosen])[0],
                     "sample_s": mean_se([r["sample_s"] for r in chosen])[0], "runs": chosen}
    return best


def difference(a, b):
    """``a``'s rule rate minus ``b``'s and the standard error of that difference (of two independent means)."""
    return a["rule_rate"] - b["rule_rate"], math.hypot(a["se"], b["se"])


def conclusion(a, b):
    """``"above"`` or ``"below"`` when ``a``'s rule rate is at least ``SIGNIFICANT`` standard errors of the
    difference from ``b``'s, else ``"not significant"``."""
    diff, se = difference(a, b)
    if diff and (not se > 0 or abs(diff) >= SIGNIFICANT * se):
        return "above" if diff > 0 else "below"
    return "not significant"


def size(a, b):
    """How far ``a``'s rule rate is from ``b``'s: ``1.6 s.e. above`` (``equal``; ``above`` without a s.e.)."""
    diff, se = difference(a, b)
    side = "equal" if not diff else "above" if diff > 0 else "below"
    return f"{abs(diff) / se:.1f} s.e. {side}" if se > 0 and diff else side


def versus(a, b):
    """``a``'s rule rate against ``b``'s, as the table words it: ``4.3 s.e. above`` when significant, else ``not
    significant (1.6 s.e. above)``."""
    return size(a, b) if conclusion(a, b) != "not significant" else f"not significant ({size(a, b)})"


def pace(hl, on):
    """offline+humanline's wall time against online's: ``2.7x faster`` or ``1.2x slower``."""
    speed = on["wall_s"] / hl["wall_s"] if hl["wall_s"] > 0 else float("inf")
    return f"{speed:.1f}x faster" if speed >= 1 else f"{1 / speed:.1f}x slower"


def verdict(best, objective):
    """One plain sentence from the numbers: offline+humanline against online (rate and time) and offline."""
    hl, on, off = best["offline+humanline"], best["online"], best["offline"]

    def compare(a, b, name):
        diff, se = difference(a, b)
        rate = f"{b['rule_rate']:.3f} +- {b['se']:.3f}"
        by = f"{abs(diff):.3f}" + (f" = {abs(diff) / se:.1f} s.e." if se > 0 else "")
        said = conclusion(a, b)
        if said != "not significant":
            return f"{said} {name} ({rate}) by {by}"
        return (f"not significantly different from {name} ({rate}; "
                + (f"{by} {'above' if diff > 0 else 'below'})" if diff else "equal)"))
    line = (f"verdict: offline+humanline {objective.upper()} reaches a rule rate of {hl['rule_rate']:.3f} +- "
            f"{hl['se']:.3f}, {compare(hl, on, 'online')} and {pace(hl, on)} than online; "
            f"{compare(hl, off, 'plain offline')}")
    return line.rstrip(".") + "."
