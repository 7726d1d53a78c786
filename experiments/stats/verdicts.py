"""The claims study's pre-registered verdict rules (docs/results/study/README.md) as code: C1-C4 decided from
seed-paired endpoint differences, collapse counts and each claim's precondition.

The rules were fixed before any run of the study (experiments/studies/claims/sweeps/claims_k8.py) and are not tuned after.
Every difference is a - b of the endpoint (mean of the last 3 held-out greedy evaluations), paired by seed
(both units of a seed share its warm start), with a 95% Student-t interval over seeds, in points.
A claim is "not testable here" when its precondition fails; a rule that is not met is "not reproduced",
split into "refuted" (the interval excludes what the claim says) and "undecided" (the interval is too wide).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Callable, Optional

from experiments.stats import analysis

K_MAIN = 8                   # C1-C3: the paper's C2 floor
C4_LAGS = (32, 128)
C4_MIN_STEPS_PER_LAG = 3     # C4 runs last >= 3k steps
EQUIVALENCE_PTS = 5.0        # C2: VCPO - sync inside +-5 points
C4_MARGIN_PTS = 10.0         # C4: VCPO - sync above -10 points
C5_LAGS = (2, 4)
C5_TARGET_BELOW_SYNC_PTS = 2.0   # C5: the target is the sync runs' mean endpoint minus 2 points
KEY = "endpoint"

Summary = dict  # loader.run_summary's dict (+ "steps": the run's RL steps)
Finder = Callable[[str, int], dict]  # (arm, lag) -> {seed: summary} of finished runs


@dataclasses.dataclass
class Diff:
  """a - b in points over the seeds both finished."""
  label: str
  per_seed: list[float]
  unit: str = "pts"

  @property
  def n(self) -> int:
    return len(self.per_seed)

  @property
  def bounds(self) -> tuple[float, float, float]:
    return analysis.interval(self.per_seed)

  def text(self) -> str:
    if not self.per_seed:
      return f"{self.label}: no paired seeds"
    m, lo, hi = self.bounds
    f = "{:+.1f}" if self.unit == "pts" else "{:+.2f}"
    ci = f"[{f.format(lo)}, {f.format(hi)}]" if math.isfinite(lo) else "[no interval: 1 seed]"
    unit = f" {self.unit}" if self.unit else ""
    return f"{self.label}: {f.format(m)} {ci}{unit}, n={self.n}"


def diff(find: Finder, a: tuple[str, int], b: tuple[str, int]) -> Diff:
  ra, rb = find(*a), find(*b)
  d = [100 * (ra[s][KEY] - rb[s][KEY]) for s in sorted(set(ra) & set(rb))
       if ra[s].get(KEY) is not None and rb[s].get(KEY) is not None]
  return Diff(f"{a[0]}@k={a[1]} - {b[0]}@k={b[1]}", d)


def collapses(find: Finder, arm: str, k: int) -> tuple[int, int]:
  runs = find(arm, k)
  return sum(r["collapse"] is not None for r in runs.values()), len(runs)


def _below(d: Diff, x: float) -> bool:
  return d.n >= 2 and d.bounds[2] < x


def _above(d: Diff, x: float) -> bool:
  return d.n >= 2 and d.bounds[1] > x


def sync_learned(find: Finder) -> tuple[bool, str]:
  """Precondition of C2-C4: sync's endpoint is above its base, 95% interval over seeds excluding 0."""
  runs = [r for r in find("sync", 0).values() if r.get(KEY) is not None and r.get("base") is not None]
  d = Diff("sync endpoint - base", [100 * (r[KEY] - r["base"]) for r in runs])
  return _above(d, 0.0), d.text()


def degrades(find: Finder, arm: str, k: int) -> tuple[bool, str]:
  """`arm` at lag k degrades: its seed-paired interval vs sync lies below 0, or it collapsed in >= 1 seed."""
  d = diff(find, (arm, k), ("sync", 0))
  c, n = collapses(find, arm, k)
  return _below(d, 0.0) or c > 0, f"{d.text()}; {arm} collapsed {c}/{n}"


@dataclasses.dataclass
class Verdict:
  claim: str
  rule: str
  numbers: str
  verdict: str


RULES = {
    "C1": f"no correction at k={K_MAIN} degrades: its endpoint - sync's (seed-paired) has a 95% interval below 0, "
          "or it collapses in >= 1 seed. Reported with it: in how many collapsed runs the ESS drop came first.",
    "C2": f"precondition: sync learned and no correction degrades at k={K_MAIN}. Holds if VCPO - sync has a 95% "
          f"interval inside +-{EQUIVALENCE_PTS:g} points and 0 of the VCPO runs collapse; refuted if a VCPO run "
          f"collapses or the interval lies outside +-{EQUIVALENCE_PTS:g}.",
    "C3": f"precondition: sync learned and seq-TIS degrades at k={K_MAIN}. Holds if VCPO beats ESS-only (OPOB's "
          "share) and OPOB-only (ESS scaling's share), each with a 95% interval above 0; refuted if either "
          "interval lies below 0.",
    "C4": f"precondition: sync learned; runs at k in {C4_LAGS} last >= {C4_MIN_STEPS_PER_LAG}k steps. Holds if at "
          f"every such k 0 VCPO runs collapse and VCPO - sync (sync runs of the same length) has a 95% interval "
          f"above -{C4_MARGIN_PTS:g} points; "
          f"refuted if a VCPO run collapses or the interval lies below -{C4_MARGIN_PTS:g}.",
    "C5": f"precondition: every sync run reaches the target (sync's mean endpoint - {C5_TARGET_BELOW_SYNC_PTS:g} "
          f"points; time = wall-clock seconds from the start of RL to the first evaluation at or above it). Holds "
          f"if for k = {' or k = '.join(map(str, C5_LAGS))} every async run reaches the target and the seed-paired "
          "log(time async / time sync) has a 95% interval below 0; refuted if for every k an async run never "
          "reaches it or the interval lies above 0.",
}


def c1(find: Finder, k: int = K_MAIN, ess_leads: Optional[str] = None) -> Verdict:
  if not find("no_correction", k) or not find("sync", 0):
    return Verdict("C1", RULES["C1"], "no runs", "not testable here (no runs)")
  holds, numbers = degrades(find, "no_correction", k)
  if ess_leads:
    numbers += f"; {ess_leads}"
  return Verdict("C1", RULES["C1"], numbers, "reproduced" if holds else "not reproduced")


def c2(find: Finder, k: int = K_MAIN, arm: str = "vcpo") -> Verdict:
  learned, learned_text = sync_learned(find)
  stale, stale_text = degrades(find, "no_correction", k)
  d = diff(find, (arm, k), ("sync", 0))
  c, n = collapses(find, arm, k)
  numbers = f"{d.text()}; {arm} collapsed {c}/{n}; {learned_text}; {stale_text}"
  if not n:
    return Verdict("C2", RULES["C2"], numbers, "not testable here (no runs)")
  if not (learned and stale):
    why = "sync did not learn" if not learned else "no correction does not degrade (nothing to correct)"
    return Verdict("C2", RULES["C2"], numbers, f"not testable here ({why})")
  return Verdict("C2", RULES["C2"], numbers, equivalence(d, c))


def equivalence(d: Diff, collapsed: int) -> str:
  """C2's decision: d inside +-EQUIVALENCE_PTS with 0 collapses, refuted by a collapse or d outside."""
  if collapsed == 0 and _above(d, -EQUIVALENCE_PTS) and _below(d, EQUIVALENCE_PTS):
    return "reproduced"
  if collapsed > 0 or _below(d, -EQUIVALENCE_PTS) or _above(d, EQUIVALENCE_PTS):
    return "not reproduced (refuted)"
  return "not reproduced (undecided: interval wider than the margin)"


def c3(find: Finder, k: int = K_MAIN, arm: str = "vcpo") -> Verdict:
  learned, learned_text = sync_learned(find)
  stressed, stressed_text = degrades(find, "seq_tis", k)
  shares = [diff(find, (arm, k), (other, k)) for other in ("ess_only", "opob_only")]
  numbers = "; ".join([*(d.text() for d in shares), stressed_text, learned_text])
  if not all(d.n for d in shares):
    return Verdict("C3", RULES["C3"], numbers, "not testable here (no runs)")
  if not (learned and stressed):
    why = "sync did not learn" if not learned else "seq-TIS does not degrade (nothing for VCPO to fix)"
    return Verdict("C3", RULES["C3"], numbers, f"not testable here ({why})")
  if all(_above(d, 0.0) for d in shares):
    return Verdict("C3", RULES["C3"], numbers, "reproduced")
  if any(_below(d, 0.0) for d in shares):
    return Verdict("C3", RULES["C3"], numbers, "not reproduced (refuted)")
  return Verdict("C3", RULES["C3"], numbers, "not reproduced (undecided: an interval includes 0)")


SYNC_ARMS = ("sync", "sync_long")  # sync_long: C4's sync reference for runs longer than the k = 8 study's


def reference_sync(find: Finder, steps: set) -> str:
  """The sync arm whose runs last as many steps as the compared runs (C4 compares runs of equal length)."""
  for name in SYNC_ARMS:
    if {r["steps"] for r in find(name, 0).values()} == steps:
      return name
  return "sync"


def c4(find: Finder, lags=C4_LAGS, arm: str = "vcpo") -> Verdict:
  learned, learned_text = sync_learned(find)
  parts, ok, refuted, missing = [learned_text], True, False, []
  for k in lags:
    runs = find(arm, k)
    long_enough = [r for r in runs.values() if r.get("steps", 0) >= C4_MIN_STEPS_PER_LAG * k]
    if not runs or len(long_enough) < len(runs):
      missing.append(k)
      continue
    d = diff(find, (arm, k), (reference_sync(find, {r["steps"] for r in runs.values()}), 0))
    c, n = collapses(find, arm, k)
    tis_c, tis_n = collapses(find, "seq_tis", k)
    parts.append(f"{d.text()}; {arm} collapsed {c}/{n} (seq_tis {tis_c}/{tis_n})")
    ok = ok and c == 0 and _above(d, -C4_MARGIN_PTS)
    refuted = refuted or c > 0 or _below(d, -C4_MARGIN_PTS)
  numbers = "; ".join(parts)
  if missing:
    return Verdict("C4", RULES["C4"], numbers, f"not testable here (no runs of >= {C4_MIN_STEPS_PER_LAG}k steps at "
                                               f"k = {', '.join(map(str, missing))})")
  if not learned:
    return Verdict("C4", RULES["C4"], numbers, "not testable here (sync did not learn)")
  if ok:
    return Verdict("C4", RULES["C4"], numbers, "reproduced")
  return Verdict("C4", RULES["C4"], numbers, "not reproduced (refuted)" if refuted else
                 "not reproduced (undecided: interval wider than the margin)")


def time_to(evals: list[tuple[float, float]], target: float) -> Optional[float]:
  """Seconds of the first (seconds, accuracy) evaluation at or above target; None if none is."""
  return next((t for t, acc in evals if acc >= target), None)


def log_time_ratio(k: int, t_k: dict, t_sync: dict) -> Diff:
  """Seed-paired log(time to target at lag k / sync's) over the seeds where both reached it."""
  return Diff(f"log(time k={k} / time sync)", [math.log(t_k[s] / t_sync[s]) for s in sorted(t_k)
                                               if t_k[s] and t_sync.get(s)], unit="")


def c5(runs: list[dict], lags=C5_LAGS) -> Verdict:
  """runs: {'lag', 'seed', 'endpoint', 'evals': [(seconds since RL start, greedy accuracy)]}; lag 0 = sync."""
  sync = {r["seed"]: r for r in runs if r["lag"] == 0}
  ends = [r["endpoint"] for r in sync.values() if r["endpoint"] is not None]
  if not ends:
    return Verdict("C5", RULES["C5"], "no finished sync runs", "not testable here (no runs)")
  target = sum(ends) / len(ends) - C5_TARGET_BELOW_SYNC_PTS / 100
  t_sync = {s: time_to(r["evals"], target) for s, r in sync.items()}
  fmt = lambda t: "never" if t is None else f"{t:.0f} s"  # noqa: E731
  parts = [f"target {100 * target:.1f}% (sync endpoint {100 * (target + C5_TARGET_BELOW_SYNC_PTS / 100):.1f}% "
           f"over {len(ends)} seeds); sync time to target: {', '.join(fmt(t_sync[s]) for s in sorted(t_sync))}"]
  ok, refuted, thin = [], [], []
  for k in lags:
    t = {r["seed"]: time_to(r["evals"], target) for r in runs if r["lag"] == k}
    never = sorted(s for s, v in t.items() if v is None)
    d = log_time_ratio(k, t, t_sync)
    parts.append(f"k={k}: time to target {', '.join(fmt(t[s]) for s in sorted(t)) or 'no runs'}; {d.text()}")
    if d.n < 2:
      thin.append(str(k))
    ok.append(bool(t) and not never and _below(d, 0.0))
    refuted.append(bool(never) or _above(d, 0.0))
  numbers = "; ".join(parts)
  if any(v is None for v in t_sync.values()):
    return Verdict("C5", RULES["C5"], numbers, "not testable here (a sync run never reached the target)")
  if any(ok):
    return Verdict("C5", RULES["C5"], numbers, "reproduced")
  if all(refuted):
    return Verdict("C5", RULES["C5"], numbers, "not reproduced (refuted)")
  missing = [str(k) for k in lags if not any(r["lag"] == k for r in runs)]
  why = (f"no runs at k = {', '.join(missing)}" if missing else
         f"fewer than 2 paired seeds at k = {', '.join(thin)}, so no interval" if thin else "an interval includes 0")
  return Verdict("C5", RULES["C5"], numbers, f"not reproduced (undecided: {why})")


def ess_leads_text(find: Finder, k: int = K_MAIN) -> str:
  runs = [r for r in find("no_correction", k).values() if r["collapse"] is not None]
  first = sum(r["ess_drop"] is not None and r["ess_drop"] <= r["collapse"] for r in runs)
  return f"ESS drop at or before the collapse in {first}/{len(runs)} collapsed runs"


def verdicts(find: Finder) -> list[Verdict]:
  """C1-C4, and C2 for the is_weight=truncated variant (reported, not deciding)."""
  variant = c2(find, arm="vcpo_truncated")
  variant.claim = "C2 (variant is_weight=truncated; not deciding)"
  return [c1(find, ess_leads=ess_leads_text(find)), c2(find), variant, c3(find), c4(find)]


def section(find: Finder) -> list[str]:
  """Markdown: the pre-registered rule, the numbers and the verdict per claim (C5: experiments.studies.wallclock.page)."""
  lines = ["| claim | pre-registered rule | numbers | verdict |", "|---|---|---|---|"]
  for v in verdicts(find):
    lines.append(f"| {v.claim} | {v.rule} | {v.numbers} | **{v.verdict}** |")
  return lines
