"""Tool use against a real SGLang 0.5.23 server (CPU, float32): multi-turn episodes (a `stop` string
per turn, the growing input as input_ids), the countdown_tools job at k = 2 in the chat template's tool format
(>= 1 answered call per episode on average) and the code_tools model's episodes whose sandboxed python calls
straddle a weight update, every token checked against the weights its version tag names."""
import asyncio
import json
import os
import re

import numpy as np
import pytest

from tests.sglang import verify_tags
from tests.sglang.conftest import requires_sglang, start_servers
from tests.sglang.test_sglang_job import _env, _metrics  # noqa: F401  (the same job environment)
from vcpo_jax.rollout import episodes
from vcpo_jax.rollout.client import client as client_lib
from vcpo_jax.tasks.environments import calculator

pytestmark = [pytest.mark.sglang, requires_sglang, pytest.mark.integration, pytest.mark.timeout(3600)]
CONFIG = "configs/countdown_tools.py"
SMALL = ["--config.rl.prompts_per_step=4", "--config.rl.group_size=4", "--config.algo.micro_batch_size=16",
         "--config.sft.steps=200", "--config.task.eval_size=8", "--config.eval_every=1000",
         "--config.checkpoint_every=1000", "--config.rl.max_lag=2", "--config.rollout.keep_versions=100"]


def _run(module, workdir, *flags, timeout=1800, config=CONFIG):
  import subprocess
  import sys
  from tests.sglang.conftest import REPO
  argv = [sys.executable, "-m", module, f"--config={config}", f"--workdir={workdir}", *SMALL, *flags]
  with open(str(workdir) + ".log", "w") as log:
    rc = subprocess.run(argv, cwd=REPO, env=_env(str(workdir)), stdout=log, stderr=subprocess.STDOUT,
                        timeout=timeout).returncode
  assert rc == 0, open(str(workdir) + ".log").read()[-5000:]


@pytest.fixture(scope="module")
def tools_server(tmp_path_factory):
  root = tmp_path_factory.mktemp("tools")
  work = root / "w"
  _run("vcpo_jax.job.export_base", work)
  (server,) = start_servers(str(work / "base"), str(root), 1)
  try:
    yield work, server
  finally:
    server.stop()


class MarkerEnv:
  """Calls marked by pieces the served model writes in every turn (the warm start's turns start with a call or
  an answer), so every episode calls whatever it writes after them; replies are the real calculator's, rendered
  as the template's tool turn."""

  def __init__(self, markers=("<tool_call>", "<answer>")):
    self.stop_strings, self.max_turns = tuple(markers), 3

  def start(self, example):
    return self  # no per-episode state

  def respond(self, turn_text):
    calc = calculator.environment_of()
    return calc.respond(calculator.call("6*7")) if any(m in turn_text for m in self.stop_strings) else None


def test_episode_turns_on_a_real_server(tools_server):
  from vcpo_jax.model import hf
  from vcpo_jax.model import tokenizer
  from vcpo_jax.model import transformer as model
  from vcpo_jax.model.tokenizer import completion_text
  work, server = tools_server
  params, cfg = hf.import_hf(str(work / "base"))
  tok = tokenizer.build_tokenizer()
  prompt = tok.encode(tok.chat_prompt("Using the numbers [2, 3, 7], make 42.",
                                      tools=calculator.environment_of().declarations()))
  sp = {"max_new_tokens": 1, "temperature": 1.0, "no_stop_trim": True, "ignore_eos": True}

  async def run():
    async with client_lib.RolloutClient([server.url], vocab_size=cfg.vocab_size,
                                        context_length=cfg.max_seq_len) as client:
      runner = episodes.EpisodeRunner(MarkerEnv(), encode=tok.encode,
                                      decode=lambda ids: completion_text(tok, ids), stop_ids=(),
                                      max_new_tokens=100, context_length=cfg.max_seq_len)
      return await runner.generate(client.generate, prompt, sp, n=4)

  samples = asyncio.run(run())
  import jax.numpy as jnp
  for s in samples:
    mask = np.asarray(s.output_mask)
    assert s.tool_calls >= 1 and (mask == 0).sum() == s.tool_calls * len(tok.encode(tok.chat_prompt.tool_reply("42")))
    seq = s.prompt_ids + s.output_ids
    tokens = jnp.asarray(np.array([seq + [0] * (cfg.max_seq_len - len(seq))], np.int32))
    ref = np.asarray(model.token_logprobs(params, cfg, tokens, jnp.ones_like(tokens)))[0, len(s.prompt_ids):len(seq)]
    gap = np.abs(s.output_logprobs[mask > 0] - ref[mask > 0]).max()
    print(f"\nepisode: {s.num_turns} turns, {s.tool_calls} calls, worst log-prob gap {gap:.2e}")
    assert gap < 1e-4


def test_tools_job_k2_on_a_real_server(tools_server):
  work, server = tools_server
  _run("vcpo_jax.main", work, "--config.rl.steps=4", f"--config.rollout.server_urls={server.url}")
  rows = _metrics(str(work))
  assert [r["step"] for r in rows] == [1, 2, 3, 4]
  assert all("tools/turns_per_episode" in r and r["lag/max"] <= 2 for r in rows)
  with open(os.path.join(work, "result.json")) as f:
    assert json.load(f)["steps"] == 4
  # Every turn's /generate is logged as a sample (input = prompt + earlier turns + tool outputs).
  tags = verify_tags.worst_gap(os.path.join(work, "samples.jsonl"), os.path.join(work, "weights"))
  calls = [r["tools/calls_per_episode"] for r in rows]
  print(f"\ntools job: {calls} calls/episode, {[r['tools/error_rate'] for r in rows]} error rate, tags {tags}")
  assert tags["worst"] < 1e-4
  assert np.mean(calls) >= 1.0  # the warm-started model calls the tool in the template's format


# The code tool: every python call runs in the sandbox (no exact_prints shortcut).
CODE = ("configs/code_tools.py", "--config.task.options.arithmetic_code.exact_prints=False")


class HeldCalls:
  """The code task's environment whose episodes, after their sandboxed call returns, wait until `release` is set:
  every call is in flight while the test publishes new weights, so every call straddles the update."""

  def __init__(self, factory):
    import threading
    self.factory, self.stop_strings, self.max_turns = factory, factory.stop_strings, factory.max_turns
    self.arrived, self.release, self.replies = threading.Semaphore(0), threading.Event(), []

  def start(self, example):
    episode, outer = self.factory.start(example), self

    class Held:
      def __getattr__(self, name):
        return getattr(episode, name)

      def respond(self, turn_text):
        reply = episode.respond(turn_text)
        if reply is not None:
          outer.replies.append(reply)
          outer.arrived.release()
          assert outer.release.wait(300), "the publish never came"
        return reply
    return Held()


def test_code_tool_call_straddles_a_weight_update(tmp_path):
  """Episodes of the warm-started code model on a real server; while every episode's sandboxed call is in
  flight, new weights are published; each episode's tokens before the call are v0's, after it v1's, and every
  token's log-prob is the learner's under the weights of its tag."""
  import jax
  import jax.numpy as jnp
  from configs import code_tools
  from vcpo_jax.job import warm_start
  from vcpo_jax.model import hf, hf_export
  from vcpo_jax.model import transformer as model
  from vcpo_jax.rollout.servers import publisher as publisher_lib
  config, *flags = CODE
  work = tmp_path / "w"
  _run("vcpo_jax.job.export_base", work, *flags, config=config)
  c = code_tools.get_config("")
  c.sft.steps, c.task.eval_size, c.task.options.arithmetic_code.exact_prints = 200, 8, False
  c.tools.timeout_s = 600.0  # a held call waits for the publish; the pool must not time it out first
  cfg, tok, task, examples = warm_start.starting_point(c)
  params = {0: hf.import_hf(str(work / "base"))[0]}
  # v1: the same weights, every matrix moved by a little noise (its log-probs differ from v0's by > 1e-2).
  leaves, tree = jax.tree.flatten(params[0])
  keys = jax.random.split(jax.random.PRNGKey(1), len(leaves))
  params[1] = jax.tree.unflatten(tree, [x + 0.02 * jax.random.normal(k, x.shape, x.dtype) if x.ndim == 2 else x
                                        for x, k in zip(leaves, keys)])
  runner = episodes.runner_for(task, tok, max_new_tokens=c.rl.max_new_tokens, context_length=cfg.max_seq_len)
  runner.env = held = HeldCalls(runner.env)
  sp = {"temperature": 1.0, "sampling_seed": 0}
  (server,) = start_servers(str(work / "base"), str(tmp_path), 1)

  async def run():
    async with client_lib.RolloutClient([server.url], vocab_size=cfg.vocab_size,
                                        context_length=cfg.max_seq_len) as client:
      pub = publisher_lib.WeightPublisher(lambda p, d: hf_export.export_hf(p, cfg, d, tok), str(tmp_path / "weights"),
                                          client)
      try:
        groups = [asyncio.create_task(runner.generate(client.generate, tok.encode(ex["prompt"]), sp, n=2,
                                                      example=ex)) for ex in examples[:4]]
        loop = asyncio.get_running_loop()
        # The first call in flight; then the episodes that call at all have reached theirs (or finished).
        assert await loop.run_in_executor(None, held.arrived.acquire, True, 600)
        await asyncio.sleep(5.0)
        try:
          await pub.publish(params[1], 1)
        finally:
          held.release.set()
        return [s for g in await asyncio.gather(*groups) for s in g]
      finally:
        await pub.close()

  try:
    samples = asyncio.run(run())
  finally:
    server.stop()
  worst, straddled = 0.0, 0
  for s in samples:
    seq = s.prompt_ids + s.output_ids
    tokens = jnp.asarray(np.array([seq + [0] * (cfg.max_seq_len - len(seq))], np.int32))
    mask, versions = np.asarray(s.output_mask), np.asarray(s.token_versions)
    for v in sorted(set(versions[mask > 0].tolist())):
      lp = np.asarray(model.token_logprobs(params[v], cfg, tokens, jnp.ones_like(tokens)))[0]
      ref = lp[len(s.prompt_ids):len(seq)]
      at = (versions == v) & (mask > 0)
      worst = max(worst, float(np.abs(s.output_logprobs[at] - ref[at]).max()))
    if s.tool_calls:
      first_reply = int(np.argmax(mask == 0))
      before, after = versions[:first_reply], versions[first_reply:][mask[first_reply:] > 0]
      straddled += int(set(before.tolist()) == {0} and after.size > 0 and set(after.tolist()) == {1})
  texts = [r.content for r in held.replies if not r.error]
  print(f"\ncode tool: {straddled} of {len(samples)} episodes' calls straddle the update, worst |lp gap| "
        f"{worst:.2e}; replies {[r.content for r in held.replies][:4]}")
  # The sandbox ran the model's code: some reply is a printed product (>= 7 digits for 4-digit operands).
  assert straddled >= 1 and any(re.fullmatch(r"-?\d{7,}", t.strip()) for t in texts)
  assert worst < 1e-4
