"""Launching runs: sweeps of local units (experiments/launch.py, run from here) and a whole fleet (fleet.py).

This folder shadows experiments/launch.py, so the package runs that file's code in its own namespace (with
that file's __file__) until it moves in here: `from experiments import launch` and `python -m
experiments.launch` keep working unchanged.
"""
import os as _os

_LEGACY = _os.path.join(_os.path.dirname(_os.path.dirname(_os.path.abspath(__file__))), "launch.py")
if _os.path.isfile(_LEGACY):
  _own_file = __file__
  __file__ = _LEGACY  # its REPO and paths are computed from where it lives
  with open(_LEGACY) as _f:
    exec(compile(_f.read(), _LEGACY, "exec"))  # noqa: S102  (the repository's own file)
  __file__ = _own_file
