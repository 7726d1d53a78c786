"""XLA_FLAGS for a process a test starts: the suite's compile flags (conftest.py), its own fake device count."""
import os

from vcpo_jax.parallel import placement


def xla_flags(devices: int = 0) -> str:
  """The test process's flags without its 8 fake devices; `devices` > 0: that many fake CPU devices instead."""
  return placement.xla_flags(os.environ.get("XLA_FLAGS", ""), devices)
