"""The LoRA study's sweep (the launcher's dry run resolves and validates it), its pilot's pick rule and its page,
on synthetic unit directories (no job runs)."""
import json

import numpy as np
import pytest

from experiments.launch import local as launch
from experiments.stats import analysis
from experiments.studies.lora import page, pilot, sweep

SWEEP = "experiments/studies/lora/sweep.py"


def _dry_run(tmp_path, arg, capsys):
  code = launch.main([f"--config={sweep.CONFIG}", f"--sweep={SWEEP}:{arg}", f"--root={tmp_path / 'root'}", "--dry_run"])
  return code, capsys.readouterr()


def _units(arg):
  return launch.prepare_sweep(sweep.CONFIG, f"{SWEEP}:{arg}", "/nonexistent", [])[0]


def test_dry_run_resolves_and_validates_both_parts(tmp_path, capsys):
  code, out = _dry_run(tmp_path, "part=pilot", capsys)
  assert code == 0 and "6 units: 0 done, 6 to run" in out.out
  code, out = _dry_run(tmp_path, "part=main,lr=0.002,rank=16", capsys)
  assert code == 0 and "10 units: 0 done, 10 to run" in out.out
  assert not (tmp_path / "root").exists()  # a dry run writes nothing
  code, out = _dry_run(tmp_path, "part=main", capsys)
  assert code == 2 and "part=main needs the pilot's pick" in out.err


def test_pilot_grid_and_main_arms_seeds_and_shared_warm_starts():
  grid = _units("part=pilot")
  assert [(u.config["optim"]["learning_rate"], u.config["model"]["lora"]["rank"]) for u in grid] == \
      [(lr, r) for lr in sweep.PILOT_LRS for r in sweep.PILOT_RANKS]
  assert {(u.config["seed"], u.config["rl"]["steps"], u.config["eval_every"], u.labels["arm"]) for u in grid} == \
      {(0, sweep.PILOT_STEPS, 20, pilot.ARM)}
  main = _units("part=main,lr=0.002,rank=16")
  assert [u.name for u in main[:4]] == ["full-s0", "lora-s0", "full-s1", "lora-s1"]  # seed-major: whole pairs
  for u in main:
    c = u.config
    full = u.labels["arm"] == "full"
    assert (c["optim"]["learning_rate"], c["model"]["lora"]["rank"]) == ((2e-4, 0) if full else (0.002, 16))
    assert c["model"]["lora"]["alpha"] == 32.0 and c["rl"]["steps"] == sweep.MAIN_STEPS
    assert (c["rl"]["mode"], c["rl"]["max_lag"], c["algo"]["policy_loss"]) == ("emulate", 2, "vcpo")
  assert sorted({u.config["seed"] for u in main}) == list(range(sweep.SEEDS))
  # The warm start is full fine-tuning: LoRA and full units of a seed (pilot's too) share it; seeds differ.
  assert len({u.warm_start_key for u in grid + main if u.config["seed"] == 0}) == 1
  assert len({u.warm_start_key for u in main}) == sweep.SEEDS
  extended = _units(f"part=pilot,lrs=0.0005+0.002+0.008+{pilot.EXTEND_ABOVE}")
  assert [u.name for u in extended[:6]] == [u.name for u in grid]  # the planned units keep their names
  assert _units("part=main,lr=0.002,rank=4,first_seed=5")[0].name == "full-s5"
  for arg, match in (("part=main,lr=0.002,rank=4,seeds=2", ">= 3 seeds"), ("part=pilot,ranks=0", "ranks="),
                     ("part=pilot,lrs=-1", "lrs="), ("part=full", "part=")):
    with pytest.raises(ValueError, match=match):
      sweep.get_sweep(arg)


def _row(lr, rank, score, excluded=""):
  return {"name": f"u{lr}-{rank}", "lr": lr, "rank": rank, "score": score, "excluded": excluded, "acc": {}}


def test_pick_rule_ties_collapse_exclusion_and_one_edge_extension():
  grid = [_row(lr, r, 0.3) for lr in sweep.PILOT_LRS for r in sweep.PILOT_RANKS]
  grid[3]["score"] = 0.5                                     # lr 2e-3, rank 16
  assert pilot.pick(grid, extended=False) == ("pick", 2e-3, 16)
  grid[2]["score"] = 0.5                                     # lr 2e-3, rank 4: a tie goes to the smaller rank
  assert pilot.pick(grid, extended=False) == ("pick", 2e-3, 4)
  grid[0]["score"] = 0.5                                     # lr 5e-4, rank 4: ties go to the smaller lr, an edge
  assert pilot.pick(grid, extended=False) == ("extend", pilot.EXTEND_BELOW, None)
  grid[5].update(score=0.9, excluded="collapsed at step 80")  # the best score, but collapsed: never picked
  assert pilot.pick(grid, extended=False)[0] == "extend" and pilot.EXTEND_BELOW == pytest.approx(1.25e-4)
  more = grid + [_row(pilot.EXTEND_BELOW, 4, 0.4), _row(pilot.EXTEND_BELOW, 16, 0.4)]
  assert pilot.extended(more) and not pilot.extended(grid)
  assert pilot.pick(more, extended=True) == ("pick", 5e-4, 4)  # after the extension an edge pick stands
  top = [_row(lr, r, lr) for lr in sweep.PILOT_LRS for r in sweep.PILOT_RANKS]
  assert pilot.pick(top, extended=False) == ("extend", pilot.EXTEND_ABOVE, None)
  assert pilot.pick([_row(2e-3, 4, None, "not finished")], extended=False) == ("none", None, None)


def _unit(root, name, arm, seed, acc, *, lr=2e-4, rank=0, finished=True, step_s=2.0):
  """A unit directory as the launcher and the job leave it: unit.json, config.json, metrics.jsonl, result.json."""
  d = root / name
  d.mkdir(parents=True)
  last = max(acc)
  config = {"rl": {"max_lag": 2, "steps": last}, "seed": seed, "optim": {"learning_rate": lr},
            "model": {"lora": {"rank": rank}}}
  (d / "unit.json").write_text(json.dumps({"labels": {"arm": arm}, "config": config}))
  (d / "config.json").write_text(json.dumps(config))
  rows = [{"step": s, "throughput/step_seconds": step_s, "skipped_updates": 0.0} for s in range(1, last + 1)]
  rows += [{"step": s, "eval/greedy_accuracy": a} for s, a in sorted(acc.items()) if s > 0]
  (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
  if finished:
    (d / "result.json").write_text(json.dumps({"base": {"eval/greedy_accuracy": acc[0]},
                                               "final": {"eval/greedy_accuracy": acc[last]}, "steps": last}))


def _evals(end, steps=200):
  return {0: 0.25, **{s: end - 0.1 * (steps - s) / steps for s in range(20, steps + 1, 20)}}


def test_pilot_command_extends_once_then_picks(tmp_path, capsys):
  for i, lr in enumerate(sweep.PILOT_LRS):
    for rank in sweep.PILOT_RANKS:
      top = 0.6 - 0.1 * i + 0.01 * (rank == 16)  # best: the smallest lr, rank 16
      _unit(tmp_path, f"pilot_lora-s0-lr{lr:g}-rank{rank}", pilot.ARM, 0, _evals(top, 100), lr=lr, rank=rank)
  assert pilot.main([str(tmp_path)]) == 3 and capsys.readouterr().out.strip() == f"extend {pilot.EXTEND_BELOW:g}"
  for rank in sweep.PILOT_RANKS:
    acc = {0: 0.25, 20: 0.6, 40: 0.05, 60: 0.04, 80: 0.03, 100: 0.02}  # high, then collapsed: excluded
    _unit(tmp_path, f"pilot_lora-s0-lr{pilot.EXTEND_BELOW:g}-rank{rank}", pilot.ARM, 0, acc, lr=pilot.EXTEND_BELOW,
          rank=rank)
  assert pilot.main([str(tmp_path)]) == 0 and capsys.readouterr().out.strip() == "lr=0.0005,rank=16"


def test_page_renders_the_verdict_curves_and_pilot_from_archived_units(tmp_path):
  units = tmp_path / "units"
  gaps = {0: -0.01, 1: 0.02, 2: 0.0, 3: -0.02, 4: 0.01}  # lora - full endpoint per seed
  for s, gap in gaps.items():
    _unit(units, f"full-s{s}", "full", s, _evals(0.5 + 0.02 * s), step_s=2.0)
    _unit(units, f"lora-s{s}", "lora", s, _evals(0.5 + 0.02 * s + gap), lr=2e-3, rank=16, step_s=1.5)
  for rank in sweep.PILOT_RANKS:
    _unit(units, f"pilot_lora-s0-lr0.002-rank{rank}", pilot.ARM, 0, _evals(0.5, 100), lr=2e-3, rank=rank)
  (tmp_path / "machine_time.md").write_text("| root | units |\n|---|---|\n| /runs/lora | 12 |")
  text = page.write(str(units), str(tmp_path / "out"), str(tmp_path / "machine_time.md"), plots=True)
  m, lo, hi = analysis.interval([100 * g for g in gaps.values()])
  assert -page.MARGIN_PTS < lo and hi < page.MARGIN_PTS
  assert "**LoRA learns like full fine-tuning**" in text
  assert f"lora - full: {m:+.1f} [{lo:+.1f}, {hi:+.1f}] pts, n=5" in text
  assert "lora 0/5" in text and "| /runs/lora | 12 |" in text and (tmp_path / "out" / "accuracy.png").exists()
  assert "RL wall-clock seconds to the last step, lora / full, seed-paired (geometric mean [95% interval]" in text
  assert "0.75 [0.75, 0.75]" in text  # 1.5 s against 2.0 s a step in every seed
  assert "| lora | 200 | 300 | " in text and "| full | 200 | 400 | " in text  # accuracy against RL seconds
  assert "Pick: **lr 0.002, rank 4**." in text  # equal scores at one lr: the smaller rank
  saved = json.loads((tmp_path / "out" / "results.json").read_text())
  assert saved["pairs"] == 5 and np.allclose(saved["per_seed_pts"], [100 * g for g in gaps.values()])


def test_decision_rule_and_the_not_run_page(tmp_path, capsys):
  from experiments.stats import verdicts  # noqa: PLC0415
  d = lambda xs: verdicts.Diff("lora - full", xs)  # noqa: E731
  assert page.decide(d([-1.0, 0.5, 0.0]), True, 0) == "LoRA learns like full fine-tuning"
  assert page.decide(d([-1.0, 0.5, 0.0]), True, 1) == "undecided"  # a collapsed LoRA run rules out "like"
  assert page.decide(d([-12.0, -9.0, -10.0]), True, 0) == "LoRA learns worse"
  assert page.decide(d([9.0, 10.0, 11.0]), True, 0) == "LoRA learns better"
  assert page.decide(d([-9.0, 8.0, 0.0]), True, 0) == "undecided"
  assert page.decide(d([-1.0, 0.5, 0.0]), False, 0).startswith("not testable here")
  assert page.decide(d([-1.0, 0.5]), True, 0).startswith("not decided yet (2 paired seeds")
  page.main([str(tmp_path / "none"), "--out", str(tmp_path / "out"), "--no_plots", "--machine_time", ""])
  assert "**Status: not run.**" in (tmp_path / "out" / "results.md").read_text()
  assert capsys.readouterr().out.strip() == f"wrote {tmp_path / 'out' / 'results.md'}"


def _stub_python(tmp_path, launch_code: int = 0):
  """A stand-in interpreter for run.sh: logs each module it is asked to run; the pilot's first answer asks for
  the edge extension, the second picks."""
  log, stub, asked = tmp_path / "calls.txt", tmp_path / "py", tmp_path / "asked"
  stub.write_text(f"""#!/usr/bin/env bash
echo "$2 $4" >> {log}
if [ "$2" = experiments.studies.lora.pilot ]; then
  if [ -e {asked} ]; then echo "lr=0.008,rank=4"; exit 0; fi
  touch {asked}; echo "extend 0.032"; exit 3
fi
exit {launch_code}
""")
  stub.chmod(0o755)
  return stub, log


def _run_sh(stub, root):
  import os  # noqa: PLC0415
  import subprocess  # noqa: PLC0415
  return subprocess.run(["bash", "experiments/studies/lora/run.sh", str(root)], env={**os.environ, "PY": str(stub)},
                        capture_output=True, text=True, timeout=60)


@pytest.mark.integration  # runs run.sh (bash and a stand-in interpreter) as processes
def test_run_sh_extends_once_keeps_its_pick_and_stops_when_a_launch_is_stopped(tmp_path):
  stub, log = _stub_python(tmp_path)
  root = tmp_path / "root"
  assert _run_sh(stub, root).returncode == 0
  sweeps = [line.split(":", 1)[1] for line in log.read_text().splitlines() if "--sweep" in line]
  assert sweeps == ["part=pilot,first_seed=0", "part=pilot,lrs=0.0005+0.002+0.008+0.032,first_seed=0",
                    "part=main,lr=0.008,rank=4,first_seed=0"]
  assert "+".join(f"{lr:g}" for lr in sweep.PILOT_LRS) == "0.0005+0.002+0.008"  # run.sh's copy of the grid
  assert (root / "pilot_pick.txt").read_text().strip() == "lr=0.008,rank=4"
  log.unlink()
  assert _run_sh(stub, root).returncode == 0  # a relaunch keeps the pick: no pilot, no new pick
  assert [line.split(":", 1)[1] for line in log.read_text().splitlines()] == ["part=main,lr=0.008,rank=4,first_seed=0"]
  (tmp_path / "stopped").mkdir()
  stopped, log = _stub_python(tmp_path / "stopped", launch_code=130)
  result = _run_sh(stopped, tmp_path / "root2")
  assert result.returncode == 130 and not (tmp_path / "root2" / "pilot_pick.txt").exists()
  assert len(log.read_text().splitlines()) == 1  # the stopped pilot launch, then nothing
