"""Study units archived into the repository come back as finished units the launcher skips."""
import json
import os

from experiments.launch import archive, workunit


def _unit(root, name, done):
  d = os.path.join(root, name)
  os.makedirs(os.path.join(d, "base"))
  for rel, data in ((workunit.RECORD, {"name": name}), (workunit.JOB_CONFIG, {"seed": 0}),
                    (os.path.join("base", "warm_start.json"), {"eval/greedy_accuracy": 0.5})):
    with open(os.path.join(d, rel), "w") as f:
      json.dump(data, f)
  with open(os.path.join(d, "metrics.jsonl"), "w") as f:
    f.write('{"step": 1, "loss": 0.5}\n')
  if done:
    with open(os.path.join(d, workunit.RESULT), "w") as f:
      json.dump({"steps": 1}, f)


def test_save_takes_finished_units_and_restore_never_overwrites(tmp_path):
  root, dest, fresh = str(tmp_path / "runs"), str(tmp_path / "units"), str(tmp_path / "fresh")
  _unit(root, "a-k0-s0", done=True)
  _unit(root, "b-k8-s0", done=False)
  assert archive.save(root, dest) == ["a-k0-s0"]
  assert sorted(os.listdir(os.path.join(dest, "a-k0-s0"))) == sorted(
      [workunit.RECORD, workunit.JOB_CONFIG, workunit.RESULT, "metrics.jsonl"])  # no warm-start marker
  os.makedirs(os.path.join(fresh, "a-k0-s0"))  # a unit already in the root stays as it is
  assert archive.restore(dest, fresh) == []
  assert archive.restore(dest, str(tmp_path / "empty")) == ["a-k0-s0"]
  with open(tmp_path / "empty" / "a-k0-s0" / "metrics.jsonl") as f:
    assert f.read() == '{"step": 1, "loss": 0.5}\n'
