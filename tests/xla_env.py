"""XLA_FLAGS for a process a test starts: the suite's compile flags (conftest.py), its own fake device count."""
import os


def xla_flags(devices: int = 0) -> str:
  """The test process's flags without its 8 fake devices; `devices` > 0: that many fake CPU devices instead."""
  flags = [f for f in os.environ.get("XLA_FLAGS", "").split()
           if not f.startswith("--xla_force_host_platform_device_count")]
  return " ".join(flags + ([f"--xla_force_host_platform_device_count={devices}"] if devices else []))
