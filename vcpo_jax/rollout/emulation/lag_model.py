"""Lag models for the emulator: 'fixed' (lag min(t, k)) or 'pipeline' (the async pipeline's lags, simulated)."""
from __future__ import annotations

import bisect
import collections
import dataclasses
import heapq
from typing import Any

import numpy as np

from vcpo_jax.rollout.client import scheduler as scheduler_lib

LAG_MODELS = ("fixed", "pipeline")


@dataclasses.dataclass(frozen=True)
class PipelineOptions:
  """The simulated pipeline. Time unit: one learner step's own time (learn + publish + logging, no waiting).

  server_rows: rows the servers generate at once (the embedded server's --max-batch is max(64, batch rows));
    groups beyond server_rows / group_size wait in admission order and take the server version current when
    they start, which is what spreads lags below k (0: unbounded, then every steady-state lag is k).
  speed_ratio: generation / learning speed: batches (rl.prompts_per_step groups) the busy servers complete
    per learner step. A group's mean generation time is so concurrency / (speed_ratio * B) steps.
  duration_cv: spread of a group's generation time (coefficient of variation of a gamma law; 0: constant).
  first_token_fraction: when a group's first token appears, as a fraction of its generation time: its oldest
    token's version is the one published then (0: prefill is instant; near 1: servers stalled, e.g. compiling,
    so publishes that abort the request before any token make the group fresher).
  """
  speed_ratio: float = 1.0
  duration_cv: float = 0.5
  server_rows: int = 64
  first_token_fraction: float = 0.0

  def __post_init__(self):
    for name, low in (("speed_ratio", None), ("duration_cv", 0.0)):
      v = getattr(self, name)
      if isinstance(v, bool) or not isinstance(v, (int, float)) or not (v > 0 if low is None else v >= low) \
          or v == float("inf"):
        raise ValueError(f"invalid config: rl.emulation.{name}={v!r}: must be a number "
                         f"{'> 0' if low is None else '>= 0'}")
    f = self.first_token_fraction
    if isinstance(f, bool) or not isinstance(f, (int, float)) or not 0 <= f <= 1:
      raise ValueError(f"invalid config: rl.emulation.first_token_fraction={f!r}: must be a number in [0, 1]")
    if isinstance(self.server_rows, bool) or not isinstance(self.server_rows, int) or self.server_rows < 0:
      raise ValueError(f"invalid config: rl.emulation.server_rows={self.server_rows!r}: must be an int >= 0 "
                       f"(0: unbounded)")


@dataclasses.dataclass
class _SimGroup:
  index: int
  start_version: int
  deadline: int
  duration: float
  started: float = 0.0
  token_version: int = -1  # the version published when its first token appears (its oldest token's version)


class PipelineLagModel:
  """Group lags a real async run at bound k would give, from a deterministic event simulation of the
  scheduler's rule (rollout/client/scheduler.py): capacity B * (v + k - next_step + 1) unconsumed groups, a group
  admitted at learner version u has deadline u + k, a batch is the B earliest-deadline completed groups taken
  only while the groups left stay feasible. The trainer publishes v, asks for batch v, learns for one time unit.

  lags(step) -> list of B lags in [0, min(step, k)], the same for every call with the same seed.
  """

  def __init__(self, *, max_lag: int, batch_groups: int, group_size: int, options: PipelineOptions, seed: int):
    self.k, self.B, self.o = max_lag, batch_groups, options
    # Groups generated at once (0: unbounded); at least one, as a server always takes a whole request.
    self.concurrency = max(1, options.server_rows // group_size) if options.server_rows else 0
    self.mean_duration = (self.concurrency or batch_groups) / (options.speed_ratio * batch_groups)
    self._rng = np.random.default_rng([seed, 0x1A6])
    self._batches: list[list[int]] = []
    self._groups: dict[int, _SimGroup] = {}  # unconsumed, by admission index
    self._ready: set[int] = set()
    self._events: list[tuple[float, int]] = []  # (completion time, index) of running groups
    self._waiting: collections.deque = collections.deque()  # admitted, not started (concurrency bound)
    self._running = 0
    self._next_index, self._time = 0, 0.0
    self._publish_times: list[float] = []  # [v]: when version v went live on the servers
    self.generation_busy = 0.0  # total group-generation time simulated (for reports)

  def _duration(self) -> float:
    mean, cv = self.mean_duration, self.o.duration_cv
    if cv == 0:
      return mean
    shape = 1.0 / cv**2  # gamma with the given mean and coefficient of variation
    return float(self._rng.gamma(shape, mean / shape))

  def _start(self, g: _SimGroup, now: float) -> None:
    g.started = now
    self._running += 1
    heapq.heappush(self._events, (now + g.duration, g.index))

  def _admit(self, version: int, next_step: int) -> None:
    while len(self._groups) < self.B * (version + self.k - next_step + 1):
      g = _SimGroup(self._next_index, version, version + self.k, self._duration())
      self._next_index += 1
      self._groups[g.index] = g
      self.generation_busy += g.duration
      if self.concurrency and self._running >= self.concurrency:
        self._waiting.append(g)
      else:
        self._start(g, self._time)

  def _advance(self, until: float) -> bool:
    """Completes the next running group if it ends by `until`; False when none does."""
    if not self._events or self._events[0][0] > until:
      return False
    self._time, index = heapq.heappop(self._events)
    self._running -= 1
    g = self._groups[index]
    # Every publish up to its completion is known by now (the learner's next publish is later).
    first_token = g.started + self.o.first_token_fraction * g.duration
    g.token_version = bisect.bisect_right(self._publish_times, first_token) - 1
    self._ready.add(index)
    if self._waiting:
      self._start(self._waiting.popleft(), self._time)
    return True

  def _try_batch(self, version: int):
    ready = sorted((self._groups[i] for i in self._ready), key=lambda g: (g.deadline, g.index))[:self.B]
    taken = {g.index for g in ready}
    left = [g.deadline for i, g in self._groups.items() if i not in taken]
    if len(ready) == self.B and scheduler_lib.batch_is_feasible(left, version + 1, self.B):
      return ready
    return None

  def _simulate_step(self, version: int) -> None:
    self._publish_times.append(self._time)  # published before the trainer asks for batch `version`
    self._admit(version, next_step=version)
    batch = self._try_batch(version)
    while batch is None:
      if not self._advance(float("inf")):
        raise RuntimeError(f"pipeline model: no feasible batch at version {version}")  # a broken invariant
      batch = self._try_batch(version)
    lags = []
    for g in batch:
      lags.append(version - g.token_version)
      del self._groups[g.index]
      self._ready.discard(g.index)
    self._batches.append(lags)
    self._admit(version, next_step=version + 1)  # the consumed batch frees slots at the same version
    end = self._time + 1.0  # the learner's step; generation goes on meanwhile
    while self._advance(end):
      pass
    self._time = end

  def lags(self, step: int) -> list[int]:
    while len(self._batches) <= step:
      self._simulate_step(len(self._batches))
    return list(self._batches[step])


def make_lag_model(name: str, *, max_lag: int, batch_groups: int, group_size: int, seed: int,
                   options: Any = None):
  """None for 'fixed' (the emulator's lag min(t, k)), else the pipeline model; errors name field and value."""
  if name not in LAG_MODELS:
    raise ValueError(f"invalid config: rl.emulation.lag_model={name!r}: must be one of {list(LAG_MODELS)}")
  if name == "fixed":
    return None
  opts = options if isinstance(options, PipelineOptions) else PipelineOptions(**dict(options or {}))
  return PipelineLagModel(max_lag=max_lag, batch_groups=batch_groups, group_size=group_size, options=opts,
                          seed=seed)


def total_variation(p_K: np.ndarray, q_K: np.ndarray) -> float:
  """Total-variation distance between two histograms over the same bins: half the L1 distance."""
  return 0.5 * float(np.abs(np.asarray(p_K, np.float64) - np.asarray(q_K, np.float64)).sum())
