"""Start-up errors: a config or data error is one line, `error: <field>: <reason>`, and exit status 2."""
import os
import subprocess
import sys

import pytest

from vcpo_jax.job import startup_errors
from vcpo_jax.job.startup_errors import ConfigError, one_line

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("error,line", [
    (ConfigError("rl.max_lag", -1, "must be an int >= 0"), "error: rl.max_lag: must be an int >= 0 (got -1)"),
    (ConfigError("task.name", "x" * 200, "unknown task"), f"error: task.name: unknown task (got '{'x' * 76}...)"),
    # A whole section's value is never printed: the field inside it that the reason names is.
    (ConfigError("task.options.dataset", {"train_files": "a.jsonl", "schema": "auto"},
                 "task.options.dataset.train_files: dataset file 'a.jsonl' does not exist"),
     "error: task.options.dataset.train_files: dataset file 'a.jsonl' does not exist"),
    (ConfigError("task.options.dataset", {"schema": "csv"}, "schema='csv': must be one of ('auto',)"),
     "error: task.options.dataset.schema: must be one of ('auto',) (got 'csv')"),
    (ConfigError("task.options.dataset", {"train_files": "a.jsonl"}, "a.jsonl: row 2: not JSON\n(at column 3)"),
     "error: task.options.dataset: a.jsonl: row 2: not JSON (at column 3)"),
    # The same for the `invalid config: ...` ValueErrors that modules outside the validation raise.
    (ValueError("invalid config: rl.mode='x': must be one of ['a', 'b']"),
     "error: rl.mode: must be one of ['a', 'b'] (got 'x')"),
    (ValueError("invalid config: rollout.num_servers is missing (Foo reads it)"),
     "error: config: rollout.num_servers is missing (Foo reads it)"),
])
def test_config_errors_read_as_one_line(error, line):
  assert one_line(error) == line


@pytest.mark.parametrize("error", [ValueError("math domain error"), RuntimeError("invalid config: x=1: y"),
                                   KeyError("rl")])
def test_other_errors_keep_their_traceback(error):
  """Not a config error: main.py re-raises it (a traceback, exit status 1)."""
  assert one_line(error) is None
  startup_errors.exit_if_config_error(error, traceback_wanted=False)  # returns: nothing printed, no exit


def _main(*overrides, **env):
  return subprocess.run([sys.executable, "-m", "vcpo_jax.main", "--config=configs/dataset.py",
                         "--workdir=unused", *overrides], capture_output=True, text=True, timeout=600, cwd=ROOT,
                        env={**os.environ, **env})


@pytest.mark.integration
def test_the_job_prints_one_line_and_exits_2(tmp_path):
  missing = str(tmp_path / "no such dir" / "train.jsonl")
  r = _main(f"--config.task.options.dataset.train_files={missing}", f"--workdir={tmp_path / 'w'}")
  assert r.returncode == 2, r.stderr[-3000:]
  assert r.stderr.strip().splitlines() == [
      f"error: task.options.dataset.train_files: dataset file '{missing}' does not exist"], r.stderr[-3000:]
  assert not os.path.exists(tmp_path / "w")  # nothing started


@pytest.mark.integration
def test_the_traceback_when_asked_for(tmp_path):
  r = _main("--config.rl.max_lag=-1", f"--workdir={tmp_path / 'w'}", VCPO_TRACEBACK="1")
  assert r.returncode == 1
  assert "Traceback (most recent call last)" in r.stderr
  assert "ConfigError: invalid config: rl.max_lag=-1: must be an int >= 0" in r.stderr


@pytest.mark.integration
@pytest.mark.parametrize("args,line", [
    (["--config=configs/countdown.py", "--config.rl.max_lagg=1"],
     'error: rl.max_lagg: not a config field; did you mean "max_lag"?'),
    (["--config=configs/countdown.py", "--config.rl.max_lag=abc"],
     "error: rl.max_lag: invalid literal for int() with base 10: 'abc'"),
    (["--config=configs/countdown.py", "--config.rl.dynamic_sampling=true"],  # a section given a value
     "error: rl.dynamic_sampling: a section, not a value (got 'true'): to switch it on, "
     "--config.rl.dynamic_sampling.enabled=true"),
    (["--config=configs/countdown.py", "--config.rl.overlong=3"],
     "error: rl.overlong: a section, not a value (got '3'): set its fields (cache_length, mask_truncated, "
     "max_length, penalty)"),
    (["--config=configs/no_such_config.py"],
     "error: config: cannot load the config file: [Errno 2] No such file or directory: "
     "'configs/no_such_config.py'"),
])
def test_bad_flags_and_config_files_are_one_line(tmp_path, args, line):
  r = subprocess.run([sys.executable, "-m", "vcpo_jax.main", f"--workdir={tmp_path / 'w'}", *args],
                     capture_output=True, text=True, timeout=600, cwd=ROOT)
  assert (r.returncode, r.stderr.strip().splitlines()) == (2, [line]), r.stderr[-3000:]
