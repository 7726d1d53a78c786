"""The project's performance goals, the figures that measure them, and the check of a value against a goal."""
from __future__ import annotations

import dataclasses
import math


@dataclasses.dataclass(frozen=True)
class Goal:
  """A performance goal and the figure that measures it."""
  text: str
  keys: tuple[str, ...]          # figure keys that measure it, first found wins
  needs: str                     # "any" (measurable on this CPU) or "gpu" (the goal is set for an H100)


GOALS = (
    Goal("compile of the VCPO step at 24 layers <= 10 s (0.5B shape, abstract inputs)", ("compile_vcpo_seconds",),
         "any"),
    Goal("XLA temporaries <= 0.1 MB per token (0.5B shape, VCPO step; B=8 x T=1024, all / tokens)",
         ("compile_vcpo_temp_mb_per_token",), "any"),
    Goal("XLA temporaries <= 0.1 MB per token (as above, per extra token: fit over B, fixed part apart)",
         ("compile_vcpo_temp_mb_per_extra_token",), "any"),
    Goal("GRPO-step MFU >= 45% (H100, 0.5B shape)", ("grpo_mfu",), "gpu"),
    Goal("VCPO / GRPO step time <= 1.05x (H100, 0.5B shape)", ("learner_vcpo_over_grpo",), "gpu"),
    Goal("decode at B=256 >= 50% of the memory floor (H100, 0.5B shape)",
         ("decode_floor_fraction_b256",), "gpu"),
    Goal("wire publish of the 0.5B shape <= 0.5 s per update (NCCL; gloo where NCCL cannot form on one GPU)",
         ("wire_publish_nccl", "wire_publish_gloo"), "gpu"),
)


# What the GPU check (benchmarks/gpu/gpu_check.py) reports as goal / measured / met, on the GPU it runs on.
# Its own list, not GOALS filtered: it measures against its own run (peak, bandwidth, path), so most wording differs.
GPU_CHECK_GOALS = (
    Goal("GRPO-step MFU >= 45% of the bf16 matmul peak measured in the same run (0.5B shape, B=64 x T=512)",
         ("grpo_mfu",), "gpu"),
    Goal("VCPO / GRPO step time <= 1.1x, book-keeping path (0.5B shape)", ("vcpo_book_keeping_over_grpo",), "gpu"),
    Goal("VCPO / GRPO step time <= 1.1x, bounded path (0.5B shape)", ("vcpo_bounded_over_grpo",), "gpu"),
    Goal("decode at B=256 >= 50% of the memory floor at the bandwidth measured in the same run (0.5B shape, bf16)",
         ("decode_floor_fraction_b256",), "gpu"),
    Goal("wire publish of the 0.5B shape <= 0.5 s per update (NCCL; gloo where NCCL cannot form on one GPU)",
         ("wire_publish_nccl", "wire_publish_gloo"), "gpu"),
)


def goal_met(value: float | None, goal: str | None) -> bool | None:
  """Checks a value against a goal written as '<= x', '< x', '>= x' or '> x'; None if not checkable."""
  if value is None or not goal or not math.isfinite(value):
    return None
  op, _, rhs = goal.strip().partition(" ")
  try:
    bound = float(rhs)
  except ValueError as e:
    raise ValueError(f"goal must look like '<= 1.3', got goal={goal!r}") from e
  checks = {"<=": value <= bound, "<": value < bound, ">=": value >= bound, ">": value > bound}
  if op not in checks:
    raise ValueError(f"goal must start with one of {sorted(checks)}, got goal={goal!r}")
  return checks[op]
