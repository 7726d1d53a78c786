"""A study driver's parts: its command line, its jobs (each launched once and resumed until it finishes, wall
minutes summed in timing.json) and its page (results.json and README.md)."""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time


def driver_parser(doc: str, *, root: str, out: str) -> argparse.ArgumentParser:
  """The flags every study driver has: where its runs go, where its page goes, and whether to only summarize."""
  p = argparse.ArgumentParser(description=doc.splitlines()[0])
  p.add_argument("--root", default=root, help="the study's runs")
  p.add_argument("--out", default=out, help="the page's folder (results.json, README.md)")
  p.add_argument("--report_only", action="store_true", help="skip running; summarize the finished runs")
  return p


def parse_driver(parser: argparse.ArgumentParser, argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
  """(the driver's flags, the jobs' config overrides after a lone `--`)."""
  own, overrides = split_overrides(sys.argv[1:] if argv is None else argv)
  return parser.parse_args(own), overrides


def driver_command(module: str, flags: list[str], overrides: list[str]) -> str:
  """The command that regenerates a page (written into it)."""
  return " ".join(["python -m " + module, *flags] + (["--", *overrides] if overrides else []))


def write_page(out: str, summary: dict, readme: str) -> None:
  """A study's page: the summary as results.json and the text as README.md, in `out`."""
  os.makedirs(out, exist_ok=True)
  with open(os.path.join(out, "results.json"), "w") as f:
    json.dump(summary, f, indent=2)
  with open(os.path.join(out, "README.md"), "w") as f:
    f.write(readme)


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
