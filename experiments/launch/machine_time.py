"""Machine time of launched sweeps from their units' logs: `python -m experiments.launch.machine_time ROOT [ROOT ...]`.

`--ledger FILE.json` keeps the rows of earlier runs: a study resumed in a new root (from archived units, which
carry no logs) adds a row beside the earlier roots' instead of replacing them. A row is keyed by its root and first
log line, so publishing the same run again updates its row.

A root's busy time is the union of the moments some unit under it was logging: its units' absl log lines
(ROOT/*/log.txt) are merged in time order and every gap shorter than --gap_min minutes counts as busy, so time
between launches (a stopped study, a session's end) is left out while parallel units are not counted twice.
absl stamps carry month and day but no year; the year is the log file's modification year.
"""
from __future__ import annotations

import argparse
import datetime
import glob
import json
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


def root_row(root: str, gap_s: float) -> dict | None:
  times = root_times(root)
  if not times:
    return None
  return {"root": root, "units": len(glob.glob(os.path.join(root, "*", "log.txt"))),
          "first": f"{min(times):%Y-%m-%d %H:%M}", "last": f"{max(times):%Y-%m-%d %H:%M}",
          "hours": round(busy_seconds(times, gap_s) / 3600, 2)}


def merge(ledger: list[dict], rows: list[dict]) -> list[dict]:
  """The ledger's rows with `rows` replacing those of the same root and first log line, in first-line order."""
  key = lambda r: (r["root"], r["first"])  # noqa: E731
  kept = {key(r): r for r in ledger}
  kept.update({key(r): r for r in rows})
  return sorted(kept.values(), key=lambda r: (r["first"], r["root"]))


def table(rows: list[dict], gap_min: float) -> str:
  lines = [f"| root | units | first log line | last log line | machine time h (gaps < {gap_min:g} min) |",
           "|---|---|---|---|---|"]
  lines += [f"| {r['root']} | {r.get('units', '')} | {r['first']} | {r.get('last', '')} | {r['hours']:.2f} |"
            for r in rows]
  lines.append(f"| total | | | | {sum(r['hours'] for r in rows):.2f} |")
  return "\n".join(lines)


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  p.add_argument("roots", nargs="+", help="sweep roots (one workdir per unit, each with log.txt)")
  p.add_argument("--gap_min", type=float, default=10.0, help="longer silences are not machine time")
  p.add_argument("--ledger", default="", help="JSON file of earlier runs' rows: read, updated, written back")
  args = p.parse_args(argv)
  rows = []
  for root in args.roots:
    row = root_row(root, args.gap_min * 60)
    if row is None:
      print(f"error: no unit logs (*/log.txt) under {root}", file=sys.stderr)
      return 1
    rows.append(row)
  if args.ledger:
    ledger = []
    if os.path.exists(args.ledger):
      with open(args.ledger) as f:
        ledger = json.load(f)
      if not isinstance(ledger, list) or not all(isinstance(r, dict) and {"root", "first", "hours"} <= r.keys()
                                                 for r in ledger):
        print(f"error: --ledger {args.ledger}: not a list of rows with root, first and hours", file=sys.stderr)
        return 1
    rows = merge(ledger, rows)
    with open(args.ledger, "w") as f:
      json.dump(rows, f, indent=1)
      f.write("\n")
  print(table(rows, args.gap_min))
  return 0


if __name__ == "__main__":
  sys.exit(main())
