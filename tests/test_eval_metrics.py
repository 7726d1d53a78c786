"""pass@k against its closed form and brute force over subsets; the aggregator's keys and values."""
import itertools
import math
from fractions import Fraction

import pytest

from vcpo_jax.job import eval_metrics


def _closed_form(n, c, k) -> float:
  return float(1 - Fraction(math.comb(n - c, k), math.comb(n, k)))


def _brute_force(n, c, k) -> float:
  """The fraction of k-subsets of n samples (the first c correct) holding at least one correct sample."""
  subsets = list(itertools.combinations(range(n), k))
  return sum(any(i < c for i in s) for s in subsets) / len(subsets)


@pytest.mark.parametrize("n", [1, 2, 3, 5, 8, 10])
def test_pass_at_k_equals_the_closed_form_and_brute_force(n):
  for c in range(n + 1):
    for k in range(1, n + 1):
      got = eval_metrics.pass_at_k(n, c, k)
      assert got == pytest.approx(_closed_form(n, c, k), abs=1e-12), (n, c, k)
      assert got == pytest.approx(_brute_force(n, c, k), abs=1e-12), (n, c, k)


def test_pass_at_k_large_n_stays_accurate():
  # Factorials of 200 overflow float64; the running product does not need them.
  for c, k in ((1, 1), (3, 16), (50, 100), (0, 7), (199, 2)):
    assert eval_metrics.pass_at_k(200, c, k) == pytest.approx(_closed_form(200, c, k), rel=1e-12, abs=1e-15)
  assert eval_metrics.pass_at_k(200, 7, 1) == pytest.approx(7 / 200, rel=1e-12)


@pytest.mark.parametrize("n,c,k", [(0, 0, 1), (4, 5, 1), (4, -1, 1), (4, 2, 0), (4, 2, 5), (4.0, 2, 1),
                                   (4, True, 1)])
def test_pass_at_k_rejects_bad_arguments(n, c, k):
  with pytest.raises(ValueError):
    eval_metrics.pass_at_k(n, c, k)


def test_k_values():
  assert eval_metrics.k_values(1) == [1]
  assert eval_metrics.k_values(4) == [1, 2, 4]
  assert eval_metrics.k_values(6) == [1, 2, 4, 6]


def test_aggregate_sampled_overall_and_per_source():
  # source a: problem 0 has 2/4 correct, problem 1 has 0/4; source b: problem 2 has 4/4.
  rewards = {("a", 0): [1, 0, 1, 0], ("a", 1): [0, 0, 0, 0], ("b", 2): [1, 1, 1, 1]}
  rows = [(s, p, r) for (s, p), rs in rewards.items() for r in rs]
  got = eval_metrics.aggregate(rows)
  pass2 = {key: _closed_form(4, sum(rs), 2) for key, rs in rewards.items()}
  want = {
      "eval/avg@4": (0.5 + 0 + 1) / 3, "eval/pass@1": (0.5 + 0 + 1) / 3,
      "eval/pass@2": sum(pass2.values()) / 3, "eval/pass@4": 2 / 3,
      "eval/a/avg@4": 0.25, "eval/a/pass@1": 0.25, "eval/a/pass@2": (pass2[("a", 0)] + 0) / 2,
      "eval/a/pass@4": 0.5,
      "eval/b/avg@4": 1.0, "eval/b/pass@1": 1.0, "eval/b/pass@2": 1.0, "eval/b/pass@4": 1.0,
  }
  assert got.keys() == want.keys()
  for key, value in want.items():
    assert got[key] == pytest.approx(value, abs=1e-12), key


def test_aggregate_greedy_and_rows_without_a_source():
  rows = [(None, 0, 1.0), (None, 1, 0.0), (None, 2, 1.0), (None, 3, 1.0)]
  assert eval_metrics.aggregate(rows, greedy=True) == {"eval/greedy/pass@1": 0.75}
  assert eval_metrics.aggregate([]) == {}


def test_partial_rewards_count_in_avg_but_not_as_correct():
  rows = [("s", 0, 0.5), ("s", 0, 1.0)]
  got = eval_metrics.aggregate(rows)
  assert got["eval/avg@2"] == 0.75
  assert got["eval/pass@1"] == 0.5 and got["eval/pass@2"] == 1.0
