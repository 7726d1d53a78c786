"""One job of a study, launched once and resumed until it finishes, its wall minutes summed in timing.json."""
from __future__ import annotations

import json
import math
import os
import subprocess
import time


def split_overrides(argv: list[str]) -> tuple[list[str], list[str]]:
  """(the driver's own flags, the job's config overrides): everything after a lone `--` goes to every job."""
  if "--" not in argv:
    return list(argv), []
  cut = argv.index("--")
  return argv[:cut], argv[cut + 1:]


def run(workdir: str, argv: list[str]) -> str:
  """Runs (or resumes) argv unless workdir holds result.json; stdout and stderr go to workdir/log.txt, the wall
  minutes of every launch add up in workdir/timing.json."""
  if os.path.exists(os.path.join(workdir, "result.json")):
    return workdir
  os.makedirs(workdir, exist_ok=True)
  timing_path = os.path.join(workdir, "timing.json")
  timing = json.load(open(timing_path)) if os.path.exists(timing_path) else {"minutes": 0.0, "launches": 0}
  t0 = time.time()
  with open(os.path.join(workdir, "log.txt"), "a") as log:
    subprocess.run(argv, stdout=log, stderr=subprocess.STDOUT, check=True, env=dict(os.environ, VCPO_PROGRESS="0"))
  with open(timing_path, "w") as f:
    json.dump({"minutes": timing["minutes"] + (time.time() - t0) / 60, "launches": timing["launches"] + 1}, f)
  return workdir


def minutes(workdir: str) -> float:
  """The job's wall minutes over every launch (NaN when it was never timed)."""
  timing_path = os.path.join(workdir, "timing.json")
  return json.load(open(timing_path))["minutes"] if os.path.exists(timing_path) else math.nan
