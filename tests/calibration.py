"""The host's speed: a fixed pure-Python loop timed where the suite runs (printed at its start and end)."""
import time

ITERATIONS = 10_000_000  # ~0.5 s on an idle 2-core machine of this project


def loop_seconds(iterations: int = ITERATIONS) -> float:
  """Wall seconds for `iterations` rounds of integer arithmetic (no allocation, no I/O): wall, not process time,
  since a slow host (a busy hypervisor) shows in the one and not always in the other."""
  t0 = time.perf_counter()
  x = 0
  for i in range(iterations):
    x = (x + i * 7) & 0xFFFF
  return time.perf_counter() - t0


if __name__ == "__main__":  # python tests/calibration.py
  print(f"calibration: {loop_seconds():.2f} s ({ITERATIONS:,}-iteration Python loop)")
