"""Evaluation as the field reports it: greedy pass@1, avg@n and the unbiased pass@k (Chen et al. 2021), overall
and per data_source."""
from __future__ import annotations

import collections
from typing import Hashable, Iterable

# A sample counts as correct for pass@k when its reward reaches this (rewards in [0, 1]: fully correct).
CORRECT_AT = 1.0


def pass_at_k(n: int, c: int, k: int) -> float:
  """P(at least one of k samples drawn without replacement from n, c of them correct, is correct) =
  1 - C(n - c, k) / C(n, k), as the running product 1 - prod_{i = n-c+1}^{n} (1 - k / i) (no factorials)."""
  for name, v in (("n", n), ("c", c), ("k", k)):
    if isinstance(v, bool) or not isinstance(v, int):
      raise ValueError(f"{name} must be an int, got {v!r}")
  if not (n >= 1 and 0 <= c <= n and 1 <= k <= n):
    raise ValueError(f"need n >= 1, 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
  if n - c < k:
    return 1.0
  miss = 1.0
  for i in range(n - c + 1, n + 1):
    miss *= 1.0 - k / i
  return 1.0 - miss


def k_values(n: int) -> list[int]:
  """The k reported for n samples per problem: powers of two below n, and n."""
  ks, k = [], 1
  while k < n:
    ks.append(k)
    k *= 2
  return ks + [n]


def aggregate(rows: Iterable[tuple[str | None, Hashable, float]], *, greedy: bool = False,
              prefix: str = "eval") -> dict[str, float]:
  """(data_source, problem id, reward) rows -> a flat metrics dict.

  greedy: `<prefix>/greedy/pass@1` (the mean reward of one greedy answer per problem).
  sampled: `<prefix>/avg@n` (mean reward over n samples per problem) and `<prefix>/pass@k` for k in
    k_values(n), n the fewest samples any problem has; a problem's pass@k uses its own n and c.
  Each again as `<prefix>/<data_source>/...` when rows name a data source (None: overall only).
  """
  by_problem: dict[tuple, list[float]] = collections.defaultdict(list)
  for source, problem, reward in rows:
    by_problem[(source, problem)].append(float(reward))
  if not by_problem:
    return {}
  groups: dict[str | None, list[list[float]]] = collections.defaultdict(list)
  for (source, _), rewards in by_problem.items():
    groups[None].append(rewards)
    if source is not None:
      groups[source].append(rewards)
  out = {}
  for source, problems in groups.items():
    name = prefix if source is None else f"{prefix}/{source}"
    out.update(_metrics(problems, greedy, name))
  return out


def _metrics(problems: list[list[float]], greedy: bool, name: str) -> dict[str, float]:
  mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
  if greedy:
    return {f"{name}/greedy/pass@1": mean([mean(r) for r in problems])}
  n = min(len(r) for r in problems)
  out = {f"{name}/avg@{n}": mean([mean(r) for r in problems])}
  for k in k_values(n):
    out[f"{name}/pass@{k}"] = mean([pass_at_k(len(r), sum(x >= CORRECT_AT for x in r), k) for r in problems])
  return out
