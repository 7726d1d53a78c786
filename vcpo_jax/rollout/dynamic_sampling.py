"""Dynamic sampling: drop groups whose verifier outcome has zero spread (they carry no advantage) and count them.

What is judged is the task's reward as the rewarder gives it (`Group.rewards`: the verifier's or the
environment's outcome, 1 or 0 for every built-in verifier), before any shaping: the overlong penalty
(rollout/overlong.py) is added later, to the kept groups' rows only. Judged on a shaped score, an all-fail group
whose samples differ only by their length penalty would have a tiny spread that a std-normalised advantage
blows up into a full-size gradient towards shorter wrong answers (docs/dynamic-sampling.md).

The backends call `GroupFilter.judge` as each group is scored; a dropped group is never handed to the learner,
its slot is freed at once and its prompt counted (per prompt, so hard prompts starving are visible).
"""
from __future__ import annotations

import collections
import dataclasses
from typing import Any, Mapping, Optional, Sequence

import numpy as np

from vcpo_jax.calls.settings import Rule, int_at_least, is_number, read_section, setting
from vcpo_jax.rollout import types

SECTION = "rl.dynamic_sampling"
DEFAULT_TOLERANCE = 1e-6  # slime's: a float64 std above it is a spread
CAP_PER_BATCH_GROUP = 10
PASS = 0.5  # a dropped group's common outcome at or above this is counted all-pass, else all-fail  # max_drops_per_step 0: this many drops per group of the step's batch


@dataclasses.dataclass(frozen=True)
class DynamicSamplingConfig:
  """The config section rl.dynamic_sampling (dynamic_sampling_config builds it, checked)."""
  enabled: bool = setting(False, Rule(lambda v: isinstance(v, bool), "must be True or False"))
  # A group is dropped when the float64 population std of its outcomes is <= tolerance.
  tolerance: float = setting(DEFAULT_TOLERANCE, Rule(is_number(lambda v: v >= 0), "must be a number >= 0"))
  # Groups dropped while one step's batch fills beyond which the job stops with one line.
  max_drops_per_step: int = setting(0, int_at_least(0, f" (0: {CAP_PER_BATCH_GROUP} x rl.prompts_per_step)"))


def dynamic_sampling_config(section: Optional[Mapping[str, Any]] = None) -> DynamicSamplingConfig:
  """The section typed; an unknown field or a bad value is an error naming rl.dynamic_sampling.<field>."""
  return read_section(DynamicSamplingConfig, SECTION, section)


class DropCapExceeded(RuntimeError):
  """More groups were dropped while one step's batch filled than rl.dynamic_sampling.max_drops_per_step."""


def verdict(outcomes_N: Sequence[float], tolerance: float) -> str:
  """'keep' when the outcomes spread (float64 population std > tolerance), else 'all_pass' (their common value is
  >= PASS, a pass for the built-in verifiers' 1 / 0) or 'all_fail'."""
  o_N = np.asarray(list(outcomes_N), np.float64)
  if o_N.size and float(o_N.std()) > tolerance:
    return "keep"
  return "all_pass" if o_N.size and float(o_N.mean()) >= PASS else "all_fail"


def prompt_key(group: Any) -> str:
  """The prompt a group was generated from: its example's 'index' (stable across epochs), else the group's."""
  return str(group.example.get("index", group.index))


class GroupFilter:
  """Judges groups, counts drops (per step, in total, per prompt) and enforces the per-step cap. A "step" is the
  window between two batches handed to the learner (close_step); in an asynchronous run, drops of groups meant
  for later batches count towards the window they happen in."""

  def __init__(self, cfg: DynamicSamplingConfig, *, batch_groups: int):
    self.tolerance = cfg.tolerance
    self.cap = cfg.max_drops_per_step or CAP_PER_BATCH_GROUP * batch_groups
    self.cap_field = (f"{SECTION}.max_drops_per_step={cfg.max_drops_per_step}"
                      + ("" if cfg.max_drops_per_step else f" ({self.cap} = {CAP_PER_BATCH_GROUP} x {batch_groups})"))
    self.totals: collections.Counter = collections.Counter()  # kept, all_pass, all_fail groups; samples; tokens
    self.window: collections.Counter = collections.Counter()  # the same since the last batch
    self.prompt_drops: collections.Counter = collections.Counter()  # prompt_key -> drops
    self.last: dict[str, float] = {}  # the metrics of the last closed step

  @classmethod
  def from_section(cls, section: Optional[Mapping[str, Any]], *, batch_groups: int) -> Optional["GroupFilter"]:
    """The filter of a config section, or None when it is off."""
    cfg = dynamic_sampling_config(section)
    return cls(cfg, batch_groups=batch_groups) if cfg.enabled else None

  def judge(self, group: Any) -> bool:
    """True to keep a scored group; a dropped one is counted (by kind, per prompt, its samples and tokens)."""
    kind = verdict(group.rewards, self.tolerance)
    samples, tokens = len(group.samples), sum(generated_tokens(s) for s in group.samples)
    for counts in (self.totals, self.window):
      counts["groups_" + ("kept" if kind == "keep" else f"dropped_{kind}")] += 1
      counts["samples_generated"] += samples
      counts["tokens_generated"] += tokens
      if kind != "keep":
        counts["tokens_dropped"] += tokens
    if kind == "keep":
      return True
    self.prompt_drops[prompt_key(group)] += 1
    return False

  def dropped_in_window(self) -> int:
    return self.window["groups_dropped_all_pass"] + self.window["groups_dropped_all_fail"]

  def check_cap(self, step: int) -> None:
    """Raises DropCapExceeded (one line naming the field) once the step's drops pass the cap."""
    dropped = self.dropped_in_window()
    if dropped > self.cap:
      raise DropCapExceeded(
          f"{self.cap_field}: {dropped} groups dropped while filling the batch of step {step} "
          f"({self.window['groups_dropped_all_pass']} all-pass, {self.window['groups_dropped_all_fail']} "
          f"all-fail): the prompts are too easy or too hard for the policy; raise the cap, change the data, or "
          f"turn the filter off")

  def close_step(self) -> dict[str, float]:
    """The step's metrics (dynamic_sampling/...), kept for stats(); starts the next step's window."""
    t, w = self.totals, self.window
    drops_P = np.asarray(list(self.prompt_drops.values()) or [0], np.int64)
    self.last = {
        "dynamic_sampling/dropped_all_pass": float(w["groups_dropped_all_pass"]),
        "dynamic_sampling/dropped_all_fail": float(w["groups_dropped_all_fail"]),
        "dynamic_sampling/groups_kept": float(w["groups_kept"]),
        # Samples (and tokens) generated per sample kept, over the whole run: the filter's price.
        "dynamic_sampling/samples_per_kept_sample": _ratio(t["groups_kept"] + t["groups_dropped_all_pass"]
                                                           + t["groups_dropped_all_fail"], t["groups_kept"]),
        "dynamic_sampling/tokens_generated_total": float(t["tokens_generated"]),
        "dynamic_sampling/tokens_dropped_total": float(t["tokens_dropped"]),
        "dynamic_sampling/dropped_total": float(t["groups_dropped_all_pass"] + t["groups_dropped_all_fail"]),
        # Hard (or easy) prompts starving: how often the most-dropped prompt was dropped, how many were dropped
        # once, twice, three times or more.
        "dynamic_sampling/prompt_drops_max": float(drops_P.max()),
        "dynamic_sampling/prompts_dropped_1": float(np.sum(drops_P == 1)),
        "dynamic_sampling/prompts_dropped_2": float(np.sum(drops_P == 2)),
        "dynamic_sampling/prompts_dropped_3plus": float(np.sum(drops_P >= 3)),
    }
    self.window = collections.Counter()
    return dict(self.last)

  def top_prompts(self, n: int = 10) -> list[tuple[str, int]]:
    """The n most-dropped prompts (key, drops), most first; ties by key."""
    return sorted(self.prompt_drops.items(), key=lambda kv: (-kv[1], kv[0]))[:n]

  def state_dict(self) -> dict:
    return {"totals": dict(self.totals), "window": dict(self.window), "prompt_drops": dict(self.prompt_drops),
            "last": dict(self.last)}

  def load_state_dict(self, state: Mapping[str, Any]) -> None:
    self.totals = collections.Counter(state.get("totals", {}))
    self.window = collections.Counter(state.get("window", {}))
    self.prompt_drops = collections.Counter({str(k): int(v) for k, v in state.get("prompt_drops", {}).items()})
    self.last = dict(state.get("last", {}))


def generated_tokens(sample: Any) -> int:
  """Tokens the model generated in a sample (an episode's tool-output tokens, mask 0, excluded)."""
  return len(types.generated_versions(sample))


def _ratio(num: float, den: float) -> float:
  return float(num) / float(den) if den else float("nan")
