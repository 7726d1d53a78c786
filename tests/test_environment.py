"""The environment interface (tasks/environments/base.py): tools from typed methods, one instance per episode, episode
rewards, the config's choice, the task tokenizer with new tools, each episode's example, tool tasks' chat formats."""
import asyncio
import json
import pathlib
import re

import pytest

from tests.scripted_policy import ScriptedPolicy
from vcpo_jax import tasks
from vcpo_jax.model.tokenizer import build_tokenizer, completion_text
from vcpo_jax.rollout import episodes, multiturn, rewards, types
from vcpo_jax.tasks.environments import base as environment, calculator, tool_calls

TOK = build_tokenizer()
END = "<|im_end|>"
DOC = pathlib.Path(__file__).resolve().parents[1] / "docs" / "tool-use.md"


def _doc_example() -> dict:
  """Runs the worked example of docs/tool-use.md (the section's first python block), which registers it."""
  section = DOC.read_text().split("## Write an environment", 1)[1]
  code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
  namespace: dict = {}
  exec(compile(code, str(DOC), "exec"), namespace)  # noqa: S102 - the project's own docs
  return namespace


KV = _doc_example()["KeyValueStore"]


def _runner(env, pool=None, max_new_tokens=600):
  return episodes.EpisodeRunner(env, encode=TOK.encode, decode=lambda ids: completion_text(TOK, ids),
                                stop_ids=TOK.stop_ids, max_new_tokens=max_new_tokens, pool=pool)


def _replies(sample) -> list[str]:
  return re.findall(r"<tool_response>\n(.*?)\n</tool_response>", completion_text(TOK, sample.output_ids), re.S)


C = tool_calls.call_text
PROMPT = TOK.encode(TOK.chat_prompt("Store 2 and 3, then add them."))


# --- tools from methods -------------------------------------------------------------------------------

def test_the_worked_example_declares_its_methods_with_their_docstrings():
  env = environment.make("key_value_store", max_turns=6)
  put, get = env.declarations()
  assert put == {"type": "function", "function": {
      "name": "put", "description": "Stores an integer under a key.",
      "parameters": {"type": "object", "properties": {
          "key": {"type": "string", "description": "where to store it."},
          "value": {"type": "integer", "description": "the integer."}}, "required": ["key", "value"]}}}
  assert get["function"]["name"] == "get" and get["function"]["parameters"]["required"] == ["key"]
  assert json.dumps(put, separators=(", ", ": ")) in DOC.read_text().replace("\n", " ")  # as the page shows it
  assert environment.ENVIRONMENTS.get("key_value_store").option_names() == ["max_keys"]
  with pytest.raises(ValueError, match="max_keys"):
    environment.make("key_value_store", max_kes=2)
  with pytest.raises(ValueError, match="known: .*calculator"):
    environment.make("no_such_environment")


def test_each_episode_has_its_own_instance_and_reward():
  env = environment.make("key_value_store", max_turns=6)
  turns = [C("put", key="a", value=2), C("put", key="b", value=3), C("get", key="a"), C("get", key="z"),
           C("put", key="a", value="2"), "<answer>5</answer>" + END]
  (first,) = asyncio.run(_runner(env).generate(ScriptedPolicy(turns), PROMPT, {"max_new_tokens": 1}))
  assert _replies(first) == ["ok", "ok", "2", "error: no such key", "error: bad arguments; put takes key (string), "
                             "value (integer)"]
  assert first.tool_error_kinds == {"tool": 1, "bad_arguments": 1} and first.env_reward == 1.0
  # A second episode starts from an empty store: the first one's state is not shared.
  (second,) = asyncio.run(_runner(env).generate(ScriptedPolicy([C("get", key="a"), "<answer>5</answer>" + END]),
                                                PROMPT, {"max_new_tokens": 1}))
  assert _replies(second) == ["error: no such key"] and second.env_reward == 0.0
  # The episode reward replaces the task's (which would score both 0 here).
  group = types.Group(0, {"prompt_ids": PROMPT}, 0, 0, samples=[first, second])
  asyncio.run(rewards.inline(lambda ex, text: 0.5, lambda ids: completion_text(TOK, ids)).score_group(group))
  assert group.rewards == [1.0, 0.0]


def test_reset_gets_the_example_and_options_reach_the_instance():
  seen = []

  class Recorder(environment.Environment):
    def __init__(self, limit: int = 1):
      self.limit = limit

    def reset(self, example):
      seen.append((example.get("key"), self.limit))

    def ping(self) -> str:
      """Answers pong."""
      return "pong"

  env = environment.EnvironmentFactory(Recorder, {"limit": 3})
  (s,) = asyncio.run(_runner(env).generate(ScriptedPolicy([C("ping"), "done" + END]), PROMPT, {"max_new_tokens": 1},
                                           example={"key": "k7"}))
  assert seen == [("k7", 3)] and _replies(s) == ["pong"] and s.env_reward is None


def test_explicit_schemas_failures_and_json_values():
  class Tools(environment.Environment):
    tool_schemas = {"add": {"description": "Adds.", "parameters": {"type": "object", "properties": {
        "a": {"type": "integer"}, "b": {"type": "integer", "minimum": 0}}, "required": ["a"]}}}

    def add(self, a: int, b: int = 0) -> dict:
      return {"sum": a + b}

    def boom(self, why: str) -> str:
      """Fails."""
      if why == "readable":
        raise tool_calls.ToolError("cannot do that")
      raise RuntimeError(f"secret {why}")  # never shown to the model

  env = environment.EnvironmentFactory(Tools).start({})
  assert env.declarations()[0]["function"] == {"name": "add", **Tools.tool_schemas["add"]}
  ask = lambda name, **args: env.respond(C(name, **args))  # noqa: E731
  assert ask("add", a=2, b=3).content == '{"sum": 5}' and ask("add", a=2).content == '{"sum": 2}'
  assert ask("add", b=1).kind == "bad_arguments" and "a (integer), b (integer, optional)" in ask("add", b=1).content
  assert (ask("boom", why="readable").content, ask("boom", why="readable").kind) == ("error: cannot do that", "tool")
  assert ask("boom", why="<|im_end|>").content == "error: tool failed"


@pytest.mark.parametrize("body,match", [
    ("def f(self, x): return ''", "needs an annotation"),
    ("def f(self, x: set) -> str: return ''", "needs an annotation"),
    ("def f(self, *xs: str) -> str: return ''", r"\*args"),
    ("def _private(self) -> str: return ''", "has no tools"),
])
def test_bad_tool_declarations_fail_at_definition(body, match):
  namespace = {"environment": environment}
  exec(f"class Bad(environment.Environment):\n  {body}\n", namespace)  # noqa: S102
  with pytest.raises(TypeError, match=match):
    environment.tools_of(namespace["Bad"])


# --- tokenizer and config -----------------------------------------------------------------------------

def test_new_tools_tokenize_with_the_task_tokenizer_and_the_calculator_keeps_its_pieces():
  calc = TOK.encode(calculator.call("2*3"))
  assert len(calc) == 5  # the call's boilerplate is two pieces (model/tokenizer.py TOOL_WORDS)
  for text in (C("put", key="total", value=5), C("get", key='q"uote'), C("calculator", expression="1", x=2)):
    ids = TOK.encode(text)
    assert TOK.decode(ids) == text and completion_text(TOK, ids) == text
    assert len(ids) > len(calc)
  reply = environment.make("key_value_store").respond(C("get", key="a"))
  assert TOK.decode(TOK.encode(reply.text)) == reply.text


def test_the_config_chooses_the_environment():
  task = tasks.get_task("countdown_tools", num_numbers=2, max_number=9, environment="key_value_store",
                        render_prompt=TOK.chat_prompt)
  ex = task.sample(0, 1)[0]
  assert "<tools>put,get</tools>" in ex["prompt"] and task.environment().cls is KV
  assert "<tools>calculator</tools>" in tasks.get_task("countdown_tools", render_prompt=TOK.chat_prompt).sample(
      0, 1)[0]["prompt"]
  with pytest.raises(ValueError, match="unknown environment"):
    tasks.get_task("countdown_tools", environment="nope")


def test_the_job_builds_the_tools_pool_from_its_config():
  from configs import countdown_tools
  from vcpo_jax.job import configuration
  c = countdown_tools.get_config("")
  c.tools.update(workers=3, timeout_s=1.5)
  pool = configuration.build_task(c).environment().pool
  assert (pool.kind, pool.workers, pool.timeout_s) == ("thread", 3, 1.5)
  for field, value, match in (("pool", "process", "tools.pool"), ("workers", 0, "tools.workers")):
    bad = countdown_tools.get_config("")
    bad.tools[field] = value
    with pytest.raises(ValueError, match=match):
      configuration.validate_config(bad)


def test_the_scheduler_and_the_emulator_hand_each_episode_its_groups_example():
  from vcpo_jax.rollout.client import scheduler
  from vcpo_jax.rollout.emulation import emulator
  seen = []

  class Keyed(environment.Environment):
    def reset(self, example):
      self.key = example["key"]
      seen.append(self.key)

    def whoami(self) -> str:
      """The episode's example key."""
      return self.key

  runner = _runner(environment.EnvironmentFactory(Keyed))
  policy = lambda: ScriptedPolicy([C("whoami"), "<answer>1</answer>" + END])  # noqa: E731
  generate = lambda prompt, params, n, example: runner.generate(policy(), prompt, params, n, example)  # noqa: E731
  prompts = ({"prompt_ids": PROMPT, "key": f"k{i}", "index": i} for i in range(100))
  sched = scheduler.RolloutScheduler(generate, prompts, sampling_params={"max_new_tokens": 1}, group_size=1,
                                     batch_groups=2, max_lag=0, pass_example=True)

  async def run():
    try:
      return await sched.next_batch(0)
    finally:
      await sched.close()

  groups = asyncio.run(run())
  assert [_replies(g.samples[0]) for g in groups] == [[g.example["key"]] for g in groups]

  assert sorted(seen) == sorted(g.example["key"] for g in groups)
  # The lag emulator hands its generate each row's example (run_local(..., examples=...) starts from them).
  local = lambda params, prompts, seeds, examples: [  # noqa: E731
      multiturn.Episode(server_url=e["key"]) for e in examples]
  emu = emulator.LagEmulator(local, max_lag=0, group_size=2, seed=0, pass_examples=True)
  emu.push(0, None)
  out = emu.rollout(0, [{"prompt_ids": PROMPT, "key": "a"}, {"prompt_ids": PROMPT, "key": "b"}])
  assert [s.server_url for g in out for s in g.samples] == ["a", "a", "b", "b"]


@pytest.mark.parametrize("name", ["countdown_tools", "arithmetic_code"])
def test_a_tool_task_refuses_a_chat_format_without_tool_replies(name):
  with pytest.raises(ValueError, match=f"{name} needs a chat format with tool support"):
    tasks.get_task(name).use_chat_template(lambda user_text: user_text)
