"""Your rows with an environment: the python tool as an option, a user's environment class, the demo job."""
import asyncio
import json
import os
import subprocess
import sys

import pytest

from configs import dataset as dataset_config
from tests import xla_env
from tests.scripted_policy import ScriptedPolicy
from test_dataset import ROOT, TOK, _write_jsonl
from vcpo_jax import tasks
from vcpo_jax.job import configuration
from vcpo_jax.model.tokenizer import completion_text
from vcpo_jax.rollout import episodes
from vcpo_jax.tasks.files import reading as dataset_files


USER_ENV = '''
from vcpo_jax.tasks.environments import base

class Notes(base.Environment):
  """A user's environment, named 'user_notes:Notes' and never registered."""

  def __init__(self, prefix: str = "noted"):
    self.prefix = prefix

  def note(self, text: str) -> str:
    """Writes a note down.

    Args:
      text: what to note.
    """
    return f"{self.prefix}: {text}"

class NotAnEnvironment:
  pass
'''


def _plain_rows(tmp_path):
  rows = [{"question": f"What is {i} + {i}?", "answer": str(2 * i)} for i in range(1, 9)]
  return _write_jsonl(tmp_path / "rows.jsonl", rows)


def test_the_dataset_task_takes_the_python_tool_as_an_option(tmp_path):
  """`environment=python` on the file task: prompts declare the tool, the episodes' factory calls in the pool
  the task was given, and an exact print is answered without a process (the unit tier starts none)."""
  rows = _plain_rows(tmp_path)
  pool = episodes.tool_pool(episodes.tools_config({"pool": "inline"}))
  task = tasks.get_task("dataset", train_files=rows, eval_files=rows, verifier="numeric", environment="python",
                        environment_options="exact_prints=true,wall_seconds=5", max_turns=3, tool_pool=pool,
                        render_prompt=TOK.chat_prompt)
  ex = task.train_examples()[0]
  assert "<tools>python</tools>" in ex["prompt"] and ex["prompt"].endswith("<|im_start|>assistant\n")
  env = task.environment()
  assert env.pool is pool and env.max_turns == 3 and [t.name for t in env.tools] == ["python"]
  reply = env.respond('<tool_call>{"name": "python", "arguments": {"code": "print(21*2)"}}</tool_call>')
  assert (reply.content, reply.error) == ("42", False)
  runner = episodes.runner_for(task, TOK, max_new_tokens=40)
  assert runner.pool is pool
  plain = tasks.get_task("dataset", train_files=rows, eval_files=rows, verifier="numeric")
  assert plain.environment() is None and "<tools>" not in plain.train_examples()[0]["prompt"]


def test_the_job_config_sets_the_environment_with_one_flag(tmp_path):
  rows = _plain_rows(tmp_path)
  config = dataset_config.get_config()
  config.task.options.dataset.update(train_files=rows, eval_files=rows, verifier="numeric", environment="python")
  configuration.validate_config(config)
  task = configuration.build_task(config)
  try:
    assert task.environment().pool.kind == "thread"  # the config section `tools`, passed to the constructor
  finally:
    task.environment().pool.close()
  config.task.options.dataset.environment = "pythn"
  with pytest.raises(ValueError, match=r"task\.options\.dataset=.*environment='pythn': unknown environment"):
    configuration.validate_config(config)
  config.task.options.dataset.update(environment="", environment_options="exact_prints=true")
  with pytest.raises(ValueError, match=r"environment_options='exact_prints=true' needs an environment"):
    configuration.validate_config(config)


def test_a_users_environment_is_named_as_module_colon_class(tmp_path, monkeypatch):
  (tmp_path / "user_notes.py").write_text(USER_ENV)
  monkeypatch.syspath_prepend(str(tmp_path))
  rows = _plain_rows(tmp_path)
  for name, options in (("dataset", dict(train_files=rows, eval_files=rows, verifier="numeric")),
                        ("arithmetic", {})):  # any task, the file task and a generated one
    task = tasks.get_task(name, environment="user_notes:Notes", environment_options="prefix=seen", **options)
    reply = task.environment().respond('<tool_call>{"name": "note", "arguments": {"text": "hi"}}</tool_call>')
    assert reply.content == "seen: hi"
    assert "<tools>note</tools>" in task.sample(0, 1)[0]["prompt"]
  for spec, match in (("user_notes:Nope", "module 'user_notes' has no attribute 'Nope'"),
                      ("no_such_module_xyz:Notes", "cannot import module 'no_such_module_xyz'"),
                      ("user_notes:NotAnEnvironment", "is not a subclass of")):
    with pytest.raises(ValueError, match=f"environment={spec!r}: .*{match}"):
      tasks.get_task("arithmetic", environment=spec)
  with pytest.raises(ValueError, match=r"unknown option\(s\) \['colour'\]"):
    tasks.get_task("arithmetic", environment="user_notes:Notes", environment_options="colour=red")


@pytest.mark.integration
@pytest.mark.slow
def test_an_episode_on_your_rows_calls_the_sandboxed_python_tool(tmp_path):
  """The file task with environment=python: a call runs in the sandbox (a process), its stdout is the reply,
  the answer is scored by the row's verifier."""
  rows = _plain_rows(tmp_path)
  pool = episodes.tool_pool(episodes.tools_config(dict(pool="thread", workers=1, timeout_s=20.0)))
  task = tasks.get_task("dataset", train_files=rows, eval_files=rows, verifier="numeric", environment="python",
                        environment_options="wall_seconds=10", max_turns=3, tool_pool=pool,
                        render_prompt=TOK.chat_prompt)
  ex = task.train_examples()[2]  # What is 3 + 3?
  runner = episodes.runner_for(task, TOK, max_new_tokens=200)
  call = '<tool_call>{"name": "python", "arguments": {"code": "import os; print(3 + 3, os.getcwd() != \'/\')"}}</tool_call>'
  try:
    sample = asyncio.run(runner.generate(ScriptedPolicy([call, "\\boxed{6}<|im_end|>"]), TOK.encode(ex["prompt"]),
                                         {"max_new_tokens": 1}, example=ex))[0]
  finally:
    pool.close()
  text = completion_text(TOK, sample.output_ids)
  assert "<tool_response>\n6 True\n</tool_response>" in text
  assert (sample.tool_calls, sample.tool_error_kinds, sample.num_turns) == (1, {}, 2)
  assert task.reward(ex, text) == 1.0


@pytest.mark.integration
@pytest.mark.slow
def test_the_demo_job_runs_end_to_end_on_your_files_with_the_python_tool_from_one_flag(tmp_path):
  """`configs/dataset.py:demo_jsonl` end to end (the demo's files written, warm start, RL, the evaluations'
  pass@k keys in result.json and metrics.jsonl) with `--config.task.options.dataset.environment=python`: the
  episodes are multi-turn with the sandboxed tool (its tools/ metrics are logged), no code written. One job
  checks both (the demo alone and the tool alone each started one before)."""
  env = dict(os.environ, VCPO_PROGRESS="0", VCPO_WORD_PROBLEMS=str(tmp_path / "data"))
  env["XLA_FLAGS"] = xla_env.xla_flags()
  tiny = ["--config.rl.steps=2", "--config.sft.steps=2", "--config.sft.batch_size=4", "--config.task.eval_size=4",
          "--config.task.eval_samples=2", "--config.rl.prompts_per_step=2", "--config.rl.group_size=2",
          "--config.rl.mode=emulate", "--config.model.num_layers=1", "--config.model.hidden_size=32",
          "--config.model.intermediate_size=64", "--config.model.num_heads=2", "--config.model.num_kv_heads=1",
          "--config.model.head_dim=16", "--config.algo.micro_batch_size=0", "--config.model.max_seq_len=320",
          "--config.task.options.dataset.environment=python", "--config.task.options.dataset.max_turns=2"]
  workdir = tmp_path / "run"
  out = subprocess.run([sys.executable, "-m", "vcpo_jax.main", "--config=configs/dataset.py:demo_jsonl",
                        f"--workdir={workdir}", *tiny], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=900)
  assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
  assert sorted(os.listdir(tmp_path / "data")) == ["test.jsonl", "test.parquet", "train.jsonl", "train.parquet"]
  result = json.loads((workdir / "result.json").read_text())
  keys = {"eval/greedy_accuracy", "eval/sampled_accuracy", "eval/greedy/pass@1", "eval/avg@2", "eval/pass@1",
          "eval/pass@2", "eval/word_problems/avg@2", "eval/word_problems/pass@2",
          "eval/word_problems/greedy/pass@1"}
  assert keys <= set(result["base"]) and keys <= set(result["final"])
  last = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()][-1]
  assert keys <= set(last)
  assert {"tools/turns_per_episode", "tools/calls_per_episode", "tools/turn_capped_fraction"} <= set(last)
  assert "skipped" in out.stderr  # the rows longer than the context are counted and logged


def test_the_job_reads_your_files_once(tmp_path, monkeypatch):
  """The job's start (validation, then the task it trains on) reads each file once."""
  from vcpo_jax.job import warm_start  # noqa: PLC0415
  rows = _plain_rows(tmp_path)
  reads, real = [], dataset_files.read_records
  monkeypatch.setattr(dataset_files, "read_records", lambda *a, **k: reads.append(k["field"]) or real(*a, **k))
  config = dataset_config.get_config()
  config.task.options.dataset.update(train_files=rows, eval_files=rows, verifier="numeric")
  config.task.eval_size = 4
  task = warm_start.starting_point(config)[2]
  assert reads == ["task.options.dataset.train_files", "task.options.dataset.eval_files"]
  assert len(task.train_examples()) == 8
