"""experiments.stats.claims: seed-paired differences (only seeds both arms finished) and the stability rows."""
import math
import types

import pytest

from experiments.stats import claims


def _summary(final, base=0.3, done=True, collapse=None, min_ess=1.0, lr_scale=1.0):
  return {"final": final, "base": base, "done": done, "collapse": collapse, "min_ess": min_ess,
          "lr_scale": lr_scale}


def test_paired_uses_common_finished_seeds_in_order():
  a = {0: _summary(0.5), 1: _summary(0.4), 2: _summary(None)}
  b = {1: _summary(0.1), 0: _summary(0.2), 3: _summary(0.9)}
  assert claims.paired(a, b) == pytest.approx([0.3, 0.3])


def test_section_rows_from_groups():
  run = lambda arm, lag, seed: types.SimpleNamespace(name=f"{arm}-k{lag}-s{seed}", arm=arm, lag=lag, seed=seed)  # noqa: E731
  finals = {("sync", 0): [0.50, 0.60], ("vcpo", 64): [0.45, 0.50], ("no_correction", 64): [0.05, 0.40]}
  groups, summaries = {}, {}
  for (arm, lag), values in finals.items():
    for seed, v in enumerate(values):
      r = run(arm, lag, seed)
      groups.setdefault(lag, {}).setdefault(arm, []).append(r)
      summaries[r.name] = _summary(v, collapse=30 if v < 0.1 else None, min_ess=0.01 if lag else 1.0)
  text = "\n".join(claims.section(groups, summaries))
  assert "| C2 | VCPO at k vs sync | 2 | -7.5 ± " in text  # mean of -5 and -10 points
  assert "| C1 | no correction at k vs sync | 2 | -32.5 ± " in text
  assert "| no_correction | 64 | 2 | 1 | 5.0 | -25.0 | 0.01 | 1.00 |" in text
  assert "ESS scaling only" not in text  # arms without runs give no row


def test_no_stale_lag_no_section():
  assert claims.section({0: {}}, {}) == []


def test_focus_arms_take_sync_at_zero_and_the_rest_at_the_largest_lag():
  groups = {0: {"sync": ["s"], "no_correction": ["n0"]}, 16: {"vcpo": ["v16"]}, 64: {"vcpo": ["v64"]}}
  assert claims.focus_arms(groups) == {"sync (k=0)": ["s"], "vcpo (k=64)": ["v64"]}


# ---------------------------------------------------------------------------------- pre-registered verdicts
from experiments.stats import analysis, verdicts  # noqa: E402


def test_endpoint_is_the_mean_of_the_last_three_evaluations_after_the_base():
  assert analysis.endpoint([0, 25, 50, 75, 100], [0.2, 0.1, 0.3, 0.5, 0.4]) == pytest.approx(0.4)
  assert analysis.endpoint([100, 0, 50, 75], [0.4, 0.9, 0.3, 0.5]) == pytest.approx(0.4)  # sorted by step
  assert analysis.endpoint([0, 25, 50], [0.2, 0.3, 0.4]) is None  # two evaluations after the base: no endpoint
  m, lo, hi = analysis.interval([1.0, 2.0, 3.0])
  assert m == 2.0 and hi - m == pytest.approx(4.302653 / 3 ** 0.5, rel=1e-5) and lo == pytest.approx(2 * m - hi)


def _finder(table, steps=150):
  """table: {(arm, lag): [endpoint per seed] or [(endpoint, collapse step or None), ...]}; base 0.2."""
  def find(arm, lag):
    out = {}
    for seed, v in enumerate(table.get((arm, lag), [])):
      e, collapse = v if isinstance(v, tuple) else (v, None)
      n = steps(arm, lag) if callable(steps) else steps
      out[seed] = {"endpoint": e, "base": 0.2, "collapse": collapse, "ess_drop": None, "done": True, "steps": n}
    return out
  return find


SYNC = [0.50, 0.52, 0.48, 0.51, 0.49, 0.50]


def _by_claim(find):
  return {v.claim: v for v in verdicts.verdicts(find)}


def test_c2_holds_only_inside_the_margin_with_no_collapse():
  base = {("sync", 0): SYNC, ("no_correction", 8): [0.1, 0.2, 0.15, 0.1, 0.12, 0.1]}
  close = {**base, ("vcpo", 8): [s + d for s, d in zip(SYNC, (0.01, -0.01, 0.0, 0.01, -0.005, 0.0))]}
  assert _by_claim(_finder(close))["C2"].verdict == "reproduced"
  assert _by_claim(_finder(close))["C1"].verdict == "reproduced"
  collapsed = {**close, ("vcpo", 8): [*close[("vcpo", 8)][:5], (0.49, 100)]}
  assert _by_claim(_finder(collapsed))["C2"].verdict == "not reproduced (refuted)"
  worse = {**base, ("vcpo", 8): [s - 0.15 for s in SYNC]}
  assert _by_claim(_finder(worse))["C2"].verdict == "not reproduced (refuted)"
  noisy = {**base, ("vcpo", 8): [s + d for s, d in zip(SYNC, (0.1, -0.1, 0.05, -0.08, 0.0, 0.02))]}
  assert _by_claim(_finder(noisy))["C2"].verdict.startswith("not reproduced (undecided")


def test_c2_and_c3_are_not_testable_when_their_precondition_fails():
  fine = {("sync", 0): SYNC, ("no_correction", 8): SYNC, ("vcpo", 8): SYNC, ("seq_tis", 8): SYNC,
          ("ess_only", 8): SYNC, ("opob_only", 8): SYNC}
  got = _by_claim(_finder(fine))
  assert got["C1"].verdict == "not reproduced"
  assert got["C2"].verdict == "not testable here (no correction does not degrade (nothing to correct))"
  assert got["C3"].verdict == "not testable here (seq-TIS does not degrade (nothing for VCPO to fix))"
  flat = {k: [0.2] * 6 for k in fine}  # sync never left its base of 0.2
  assert "sync did not learn" in _by_claim(_finder(flat))["C2"].verdict


def test_c3_needs_vcpo_above_both_single_component_arms():
  tis = [s - 0.2 for s in SYNC]  # seq-TIS degrades: C3 is testable
  table = {("sync", 0): SYNC, ("seq_tis", 8): tis, ("vcpo", 8): SYNC,
           ("ess_only", 8): [s - 0.1 + 0.01 * i for i, s in enumerate(SYNC[:4])],
           ("opob_only", 8): [s - 0.05 - 0.01 * i for i, s in enumerate(SYNC[:4])]}
  assert _by_claim(_finder(table))["C3"].verdict == "reproduced"
  table[("opob_only", 8)] = [s + 0.05 + 0.01 * i for i, s in enumerate(SYNC[:4])]  # OPOB-only beats VCPO
  assert _by_claim(_finder(table))["C3"].verdict == "not reproduced (refuted)"


def test_c4_compares_with_the_sync_runs_of_the_same_length_and_needs_3k_steps():
  steps = lambda arm, lag: 384 if lag == 128 or arm == "sync_long" else 150  # noqa: E731
  table = {("sync", 0): SYNC[:3], ("sync_long", 0): [0.6, 0.62, 0.58],
           ("vcpo", 32): [0.49, 0.5, 0.47], ("vcpo", 128): [0.59, 0.6, 0.57]}
  got = _by_claim(_finder(table, steps))["C4"]
  assert got.verdict == "reproduced" and "vcpo@k=128 - sync_long@k=0: -1.3 " in got.numbers
  table[("vcpo", 128)] = [0.59, 0.6, (0.57, 300)]
  assert _by_claim(_finder(table, steps))["C4"].verdict == "not reproduced (refuted)"
  short = _by_claim(_finder(table, 150))["C4"]  # k = 128 runs of 150 steps < 3k
  assert short.verdict.startswith("not testable here (no runs of >= 3k steps at k = 128")


def _c5_run(lag, seed, times, accs, endpoint=None):
  return {"lag": lag, "seed": seed, "evals": list(zip(times, accs)),
          "endpoint": endpoint if endpoint is not None else sum(accs[-3:]) / 3}


def _c5(sync_times, async_times_by_k, async_reach=True):
  """Sync reaches 0.50 (target 0.48) at sync_times[s]; async runs reach it at their times (or never)."""
  runs = [_c5_run(0, s, [t / 2, t, t * 1.5, t * 2], [0.3, 0.5, 0.5, 0.5]) for s, t in enumerate(sync_times)]
  for k, times in async_times_by_k.items():
    accs = [0.3, 0.5, 0.5, 0.5] if async_reach else [0.3, 0.4, 0.4, 0.4]
    runs += [_c5_run(k, s, [t / 2, t, t * 1.5, t * 2], accs) for s, t in enumerate(times)]
  return verdicts.c5(runs)


def test_c5_target_time_and_paired_log_ratio():
  v = _c5([100, 110, 90], {2: [80, 85, 72], 4: [120, 100, 95]})
  assert v.verdict == "reproduced" and "target 48.0%" in v.numbers
  logs = [math.log(a / b) for a, b in zip([80, 85, 72], [100, 110, 90])]
  m, lo, hi = analysis.interval(logs)
  assert f"{m:+.2f} [{lo:+.2f}, {hi:+.2f}], n=3" in v.numbers and hi < 0


def test_c5_refuted_undecided_and_not_testable():
  assert _c5([100, 110, 90], {2: [120, 130, 110], 4: [130, 140, 120]}).verdict == "not reproduced (refuted)"
  assert _c5([100, 110, 90], {2: [80, 130, 95], 4: [110, 90, 100]}).verdict == \
      "not reproduced (undecided: an interval includes 0)"
  # one seed: no interval exists, and the label says so rather than "an interval includes 0"
  assert _c5([100], {2: [80], 4: [90]}).verdict == \
      "not reproduced (undecided: fewer than 2 paired seeds at k = 2, 4, so no interval)"
  assert _c5([100, 110, 90], {2: [80, 85, 72], 4: [80, 85, 72]}, async_reach=False).verdict == \
      "not reproduced (refuted)"
  assert _c5([100, 110, 90], {2: [80, 85, 72]}, async_reach=False).verdict == \
      "not reproduced (undecided: no runs at k = 4)"
  # a sync run that never reaches its own mean endpoint - 2 points: no target to time
  runs = [_c5_run(0, 0, [10, 20, 30], [0.9, 0.9, 0.9]), _c5_run(0, 1, [10, 20, 30], [0.1, 0.1, 0.1])]
  assert verdicts.c5(runs).verdict.startswith("not testable here")
  assert verdicts.c5([]).verdict.startswith("not testable here")
