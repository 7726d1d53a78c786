"""experiments/studies/tools/run.py: the per-seed and over-seed numbers, the page and the figure from finished runs."""
import json

import pytest

from experiments.studies.tools import run as tools_learning

pytest.importorskip("matplotlib")


def _fake_run(workdir, base, final, calls):
  workdir.mkdir(parents=True)
  (workdir / "result.json").write_text(json.dumps({
      "base": {"eval/greedy_accuracy": base, "eval/sampled_accuracy": base / 2},
      "final": {"eval/greedy_accuracy": final, "eval/sampled_accuracy": final / 2}, "steps": 4}))
  rows = [{"step": s, "reward/mean": 0.1 * s, "tools/calls_per_episode": calls + s,
           "tools/error_rate": 0.1, "tools/turns_per_episode": 2.0, "tools/errors/json": 0.0,
           "tools/errors/tool": 0.5} for s in range(1, 5)]
  rows[0]["tools/errors/tool/syntax_error"] = 0.5  # a tool's own kind, logged only where seen
  rows[-1].update({"eval/greedy_accuracy": final, "eval/sampled_accuracy": final / 2})
  (workdir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
  (workdir / "config.json").write_text(json.dumps({"task": {"eval_size": 256}}))
  (workdir / "timing.json").write_text(json.dumps({"minutes": 10.0, "launches": 1}))


def test_report_from_finished_runs(tmp_path, monkeypatch):
  monkeypatch.setattr(tools_learning, "WINDOW", 2)
  for seed, (base, final) in enumerate([(0.2, 0.4), (0.3, 0.4), (0.25, 0.5)]):
    _fake_run(tmp_path / "runs" / f"seed{seed}", base, final, calls=1.0)
  out = tmp_path / "out"
  tools_learning.main([f"--root={tmp_path / 'runs'}", "--seeds=0,1,2", f"--out={out}", "--report_only",
                       "--", "--config.rl.steps=4"])
  summary = json.loads((out / "results.json").read_text())
  assert summary["eval_size"] == 256
  assert summary["seeds"]["1"]["gain_greedy_accuracy"] == pytest.approx(0.1)
  gain = summary["over_seeds"]["gain_greedy_accuracy"]
  assert gain["mean"] == pytest.approx(0.55 / 3) and gain["ci95"][0] < gain["mean"] < gain["ci95"][1]
  assert summary["seeds"]["0"]["start_calls_per_episode"] == pytest.approx(2.5)  # steps 1-2
  assert summary["seeds"]["0"]["end_calls_per_episode"] == pytest.approx(4.5)  # steps 3-4
  page = (out / "README.md").read_text()
  assert "-- --config.rl.steps=4" in page and "| 1 | 30.0 | 40.0 | +10.0 |" in page
  assert (out / "curve.png").stat().st_size > 0
  assert summary["error_kinds"] == ["json", "tool", "tool/syntax_error"]
  assert summary["seeds"]["0"]["start_errors/tool/syntax_error"] == pytest.approx(0.25)  # steps 1-2, 0 at 2
  assert summary["seeds"]["0"]["end_errors/tool/syntax_error"] == 0.0
  assert summary["along"]["1"]["calls_per_episode"] == pytest.approx(2.0)
  assert summary["along"]["4"]["calls_per_episode"] == pytest.approx(4.5)  # the WINDOW steps up to 4
  assert "| `tool/syntax_error` | 0.250" in page and "| `json` |" not in page


def test_report_of_a_job_without_tools(tmp_path, monkeypatch):
  """A dataset job logs no tools/* metrics: the page has the reward row, no NaN rows, and the given title."""
  monkeypatch.setattr(tools_learning, "WINDOW", 2)
  for seed, (base, final) in enumerate([(0.2, 0.4), (0.3, 0.4), (0.25, 0.5)]):
    _fake_run(tmp_path / "runs" / f"seed{seed}", base, final, calls=1.0)
    path = tmp_path / "runs" / f"seed{seed}" / "metrics.jsonl"
    rows = [{k: v for k, v in json.loads(line).items() if not k.startswith("tools/")}
            for line in path.read_text().splitlines()]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
  out = tmp_path / "out"
  tools_learning.main([f"--root={tmp_path / 'runs'}", "--seeds=0,1,2", f"--out={out}", "--report_only",
                       "--title=Word problems: does RL help?"])
  page = (out / "README.md").read_text()
  assert page.startswith("# Word problems: does RL help?") and "--title='Word problems: does RL help?'" in page
  assert "nan" not in page and "| `reward/mean` |" in page and "tools/calls_per_episode" not in page


def test_tool_behaviour_counts_search_episodes():
  """experiments.studies.tools.behaviour.count on the task's own search traces and on a hand-written one."""
  import numpy as np
  from experiments.studies.tools import behaviour as tool_behaviour
  from vcpo_jax import tasks
  from vcpo_jax.model.tokenizer import build_tokenizer
  tok = build_tokenizer()
  task = tasks.get_task("countdown_tools", num_numbers=2, max_number=25, max_turns=5, search=True,
                        render_prompt=tok.chat_prompt)
  rng = np.random.default_rng(0)
  seen = {"hit": 0, "miss": 0}
  for ex in task.sample(0, 50):
    good, bad = task.sft_completion(ex, rng, 0.0), task.sft_completion(ex, rng, 1.0)
    g, b = tool_behaviour.count(task, ex, good), tool_behaviour.count(task, ex, bad)
    assert g["right"] == 1 and g["answer_is_last_checked"] == 1 and g["first_hit"] + g["first_miss"] == 1
    if g["first_hit"]:
      seen["hit"] += 1
      assert g["first_hit_answered_at_once"] == 1
    else:
      seen["miss"] += 1
      assert g["first_miss_went_on"] == g["first_miss_went_on_in_order"] == g["first_miss_went_on_right"] == 1
    assert b["right"] == 0 and b["first_miss"] == 1 and b["first_miss_went_on"] == 0
  assert seen["hit"] and seen["miss"]
  ex = task.make_example([3, 4], 7)  # checks 3*4 (a miss, out of order), then 3+4 (the hit), answers 3*4
  text = (task._check("3*4") + task._check("3+4") + "<answer>3*4</answer>")
  c = tool_behaviour.count(task, ex, text)
  assert (c["first_miss"], c["first_miss_went_on"], c["first_miss_went_on_in_order"], c["right"],
          c["answer_is_last_checked"]) == (1, 1, 0, 0, 0)
