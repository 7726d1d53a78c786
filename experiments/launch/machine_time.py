"""Machine time of launched sweeps from their units' logs: `python -m experiments.launch.machine_time ROOT [ROOT ...]`.

A root's busy time is the union of the moments some unit under it was logging: its units' absl log lines
(ROOT/*/log.txt) are merged in time order and every gap shorter than --gap_min minutes counts as busy, so time
between launches (a stopped study, a session's end) is left out while parallel units are not counted twice.
absl stamps carry month and day but no year; the year is the log file's modification year.
"""
from __future__ import annotations

import argparse
import datetime
import glob
import os
import re
import sys

_STAMP = re.compile(r"[IWEF](\d\d)(\d\d) (\d\d):(\d\d):(\d\d)")


def stamps(text: str, year: int) -> list[datetime.datetime]:
  out = []
  for line in text.splitlines():
    m = _STAMP.match(line)
    if m:
      month, day, hour, minute, second = map(int, m.groups())
      out.append(datetime.datetime(year, month, day, hour, minute, second))
  return out


def busy_seconds(times: list[datetime.datetime], gap_s: float) -> float:
  """Sum of the gaps between consecutive moments that are shorter than gap_s."""
  times = sorted(times)
  return sum(d for d in ((b - a).total_seconds() for a, b in zip(times, times[1:])) if d < gap_s)


def root_times(root: str) -> list[datetime.datetime]:
  times = []
  for path in sorted(glob.glob(os.path.join(root, "*", "log.txt"))):
    year = datetime.datetime.fromtimestamp(os.path.getmtime(path)).year
    with open(path, errors="replace") as f:
      times += stamps(f.read(), year)
  return times


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  p.add_argument("roots", nargs="+", help="sweep roots (one workdir per unit, each with log.txt)")
  p.add_argument("--gap_min", type=float, default=10.0, help="longer silences are not machine time")
  args = p.parse_args(argv)
  print(f"| root | units | first log line | last log line | machine time h (gaps < {args.gap_min:g} min) |")
  print("|---|---|---|---|---|")
  total = 0.0
  for root in args.roots:
    times = root_times(root)
    if not times:
      print(f"error: no unit logs (*/log.txt) under {root}", file=sys.stderr)
      return 1
    busy = busy_seconds(times, args.gap_min * 60) / 3600
    total += busy
    units = len(glob.glob(os.path.join(root, "*", "log.txt")))
    print(f"| {root} | {units} | {min(times):%Y-%m-%d %H:%M} | {max(times):%Y-%m-%d %H:%M} | {busy:.2f} |")
  print(f"| total | | | | {total:.2f} |")
  return 0


if __name__ == "__main__":
  sys.exit(main())
