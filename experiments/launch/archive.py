"""Saves finished study units' small files into the repository and restores them into a run root.

    python -m experiments.launch.archive save ROOT DEST       # every finished unit of ROOT -> DEST/<unit>/
    python -m experiments.launch.archive restore DEST ROOT    # DEST/<unit>/ -> ROOT/<unit>/ (the launcher skips them)

A unit's record (unit.json), the job's config.json and result.json and its metrics.jsonl are what the launcher's "done" check and experiments.stats.report read; checkpoints and weights stay out. A
study then resumes on a fresh machine: restore, relaunch (finished units are skipped), save.
"""
from __future__ import annotations

import argparse
import os
import shutil

from experiments.launch import workunit

# Not base/warm_start.json: the launcher shares a unit's warm start when that marker exists, and the weights
# beside it are not archived (a finished unit's base accuracy is in its result.json).
FILES = (workunit.RECORD, workunit.JOB_CONFIG, workunit.RESULT, "metrics.jsonl")


def finished_units(root: str) -> list[str]:
  return sorted(n for n in os.listdir(root) if os.path.isfile(os.path.join(root, n, workunit.RESULT)))


def copy_unit(src: str, dst: str) -> list[str]:
  """Copies FILES that exist from unit dir src to dst; returns the relative paths copied."""
  copied = []
  for rel in FILES:
    if os.path.isfile(os.path.join(src, rel)):
      os.makedirs(os.path.dirname(os.path.join(dst, rel)), exist_ok=True)
      shutil.copy2(os.path.join(src, rel), os.path.join(dst, rel))
      copied.append(rel)
  return copied


def save(root: str, dest: str) -> list[str]:
  names = finished_units(root)
  for name in names:
    copy_unit(os.path.join(root, name), os.path.join(dest, name))
  return names


def restore(dest: str, root: str) -> list[str]:
  """Archived units into root, never over a unit root already holds (a run there is newer or the same)."""
  restored = []
  for name in sorted(os.listdir(dest)) if os.path.isdir(dest) else []:
    if os.path.exists(os.path.join(root, name)):
      continue
    copy_unit(os.path.join(dest, name), os.path.join(root, name))
    restored.append(name)
  return restored


def main(argv=None) -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("action", choices=("save", "restore"))
  p.add_argument("src")
  p.add_argument("dst")
  a = p.parse_args(argv)
  names = save(a.src, a.dst) if a.action == "save" else restore(a.src, a.dst)
  print(f"{a.action}d {len(names)} units: {' '.join(names)}")


if __name__ == "__main__":
  main()
