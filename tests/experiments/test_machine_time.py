"""experiments.launch.machine_time: parallel units counted once, long silences left out, absl stamps parsed."""
import datetime
import os

from experiments.launch import machine_time


def _log(path, lines):
  os.makedirs(os.path.dirname(path), exist_ok=True)
  with open(path, "w") as f:
    f.write("\n".join(lines) + "\n")


def test_overlapping_units_count_once_and_silences_are_left_out(tmp_path, capsys):
  # Unit a logs 10:00-10:05, unit b 10:02-10:06 (overlapping: 6 min busy), then b again at 11:00-11:01
  # after a 54-minute silence (not machine time): 7 minutes in all.
  _log(str(tmp_path / "a" / "log.txt"), ["I1125 10:00:00.000001 1 x.py:1] start", "noise without a stamp",
                                         "W1125 10:05:00.5 1 x.py:2] end"])
  _log(str(tmp_path / "b" / "log.txt"), ["I1125 10:02:00.0 1 x.py:1] start", "E1125 10:06:00.0 1 x.py:1] x",
                                         "I1125 11:00:00.0 1 x.py:1] resumed", "I1125 11:01:00.0 1 x.py:1] end"])
  times = machine_time.root_times(str(tmp_path))
  assert len(times) == 6 and min(times).month == 11 and min(times).day == 25
  assert machine_time.busy_seconds(times, gap_s=600) == 7 * 60
  assert machine_time.main([str(tmp_path), "--gap_min=10"]) == 0
  assert capsys.readouterr().out.splitlines()[-1] == "| total | | | | 0.12 |"


def test_busy_seconds_of_sorted_moments():
  t0 = datetime.datetime(2026, 1, 1)
  times = [t0 + datetime.timedelta(seconds=s) for s in (0, 30, 60, 1000, 1010)]
  assert machine_time.busy_seconds(times, gap_s=100) == 70


def test_a_root_without_logs_is_an_error(tmp_path, capsys):
  assert machine_time.main([str(tmp_path)]) == 1
  assert "no unit logs" in capsys.readouterr().err


def test_the_ledger_keeps_earlier_roots_and_updates_the_same_run(tmp_path, capsys):
  ledger = tmp_path / "machine_time.json"
  ledger.write_text('[{"root": "/old", "units": 3, "first": "2026-01-01 10:00", "last": "2026-01-01 12:00", '
                    '"hours": 2.0}]')
  root = tmp_path / "root"
  _log(str(root / "a" / "log.txt"), ["I1125 10:00:00.0 1 x.py:1] start", "I1125 10:06:00.0 1 x.py:1] end"])
  assert machine_time.main([str(root), "--ledger", str(ledger)]) == 0
  assert capsys.readouterr().out.splitlines()[-1] == "| total | | | | 2.10 |"
  # The same run published again after it went on: its row is replaced, not added.
  _log(str(root / "b" / "log.txt"), ["I1125 10:06:00.0 1 x.py:1] start", "I1125 10:12:00.0 1 x.py:1] end"])
  assert machine_time.main([str(root), "--ledger", str(ledger)]) == 0
  out = capsys.readouterr().out.splitlines()
  assert out[-1] == "| total | | | | 2.20 |" and len(out) == 5 and out[2].startswith("| /old | 3 |")
  year = datetime.date.today().year  # absl stamps carry no year: the log file's modification year
  assert out[3].endswith(f"| 2 | {year}-11-25 10:00 | {year}-11-25 10:12 | 0.20 |")


def test_a_ledger_that_is_not_rows_is_an_error_naming_it(tmp_path, capsys):
  _log(str(tmp_path / "r" / "a" / "log.txt"), ["I1125 10:00:00.0 1 x.py:1] start"])
  (tmp_path / "bad.json").write_text('{"root": "/x"}')
  assert machine_time.main([str(tmp_path / "r"), "--ledger", str(tmp_path / "bad.json")]) == 1
  assert "bad.json" in capsys.readouterr().err and (tmp_path / "bad.json").read_text() == '{"root": "/x"}'
