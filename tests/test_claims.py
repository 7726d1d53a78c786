"""experiments.claims: seed-paired differences (only seeds both arms finished) and the stability rows."""
import types

import pytest

from experiments import claims


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
