"""Tool use, rollout side with real components: episodes of a real model (in process, and through the
embedded server over HTTP with an abort + weight update mid-episode), the scheduler's lag bound for whole
episodes, and the tool task's job for 3 steps."""
import asyncio
import json
import os
import random

import numpy as np
import pytest

import embedded_tiny
import waits
from vcpo_jax.model import config as model_config
from vcpo_jax.model import sampling
from vcpo_jax.model.tokenizer import build_tokenizer
from vcpo_jax.model.tokenizer import completion_text
from vcpo_jax.rollout import episodes, multiturn, types
from vcpo_jax.rollout.client import client as client_lib, scheduler as sched_lib
from vcpo_jax.tasks.environments import calculator, tool_calls

TOK = build_tokenizer()
PROMPT = [5, 6, 7, 8]
REPLY = TOK.chat_prompt.tool_reply("42")  # the template's tool turn around a tool message


class MarkerEnv:
  """A tool environment whose call marker is a string the test's random model is known to write."""

  def __init__(self, marker: str, max_turns: int = 3):
    self.stop_strings, self.max_turns = (marker,), max_turns

  def start(self, example):
    return self  # no per-episode state

  def respond(self, turn_text):
    return tool_calls.ToolReply(REPLY, False, "42") if self.stop_strings[0] in turn_text else None


def _runner(marker, max_new_tokens=60):
  # No stop ids: the random model must not end episodes early by chance.
  return episodes.EpisodeRunner(MarkerEnv(marker), encode=TOK.encode, decode=lambda ids: completion_text(TOK, ids),
                                stop_ids=(), max_new_tokens=max_new_tokens)


def _marker(ids, at):
  """A one-char marker the model wrote at about position `at` (a plain character, not a special token)."""
  text = completion_text(TOK, ids)
  for ch in text[at:]:
    if ch.isalnum():
      return ch
  raise AssertionError(f"no plain character in {text!r}")


def _check_episode(sample, params_by_version):
  """Mask, versions and log-probs: every generated token's sampler log-prob equals the learner's recompute
  on the whole episode (tool outputs as context) under the params of the version it is tagged with."""
  mask = np.asarray(sample.output_mask)
  assert sample.tool_calls >= 1 and sample.num_turns == sample.tool_calls + 1
  tool = TOK.encode(REPLY)
  assert (mask == 0).sum() == sample.tool_calls * len(tool)
  assert np.all(sample.token_versions[mask == 0] == -1) and np.all(sample.output_logprobs[mask == 0] == 0)
  gen_versions = sample.token_versions[mask > 0]
  assert np.all(np.diff(gen_versions) >= 0)
  for version, params in params_by_version.items():
    ref = embedded_tiny.reference_logprobs(params, sample.prompt_ids, sample.output_ids)
    on = (mask > 0) & (sample.token_versions == version)
    np.testing.assert_allclose(sample.output_logprobs[on], ref[on], atol=2e-4, rtol=0)


@pytest.mark.slow  # sampler compiles for three turn shapes (~4 min on the loaded 2-core machine)
def test_local_episodes_continue_after_tool_outputs_with_the_learners_logprobs():
  params = embedded_tiny.tiny_params(0)
  cfg = model_config.ModelConfig(**embedded_tiny.TINY_MODEL)
  (first,) = sampling.generate(params, cfg, [PROMPT], max_new_tokens=60, temperature=1.0, seeds=[17])
  marker = _marker(first.output_ids, 8)
  runner = _runner(marker)
  (ep,) = runner.run_local(params, cfg, [PROMPT], [17], temperature=1.0)
  cut = multiturn.first_stop(first.output_ids, runner.decode, (marker,))
  assert ep.output_ids[:cut] == first.output_ids[:cut]  # turn 0 is the plain generation, cut at the marker
  assert ep.output_ids[cut:cut + len(TOK.encode(REPLY))] == TOK.encode(REPLY)
  _check_episode(ep.to_sample(PROMPT), {0: params})


# -- over HTTP, the real embedded server ------------------------------------------------------------------

@pytest.fixture(scope="module")
def embedded(tmp_path_factory):
  base = tmp_path_factory.mktemp("tools_e2e")
  model_dir = embedded_tiny.export_tiny(embedded_tiny.tiny_params(0), str(base / "weights" / "v0"))
  cache = os.environ["JAX_COMPILATION_CACHE_DIR"]  # the suite's (conftest.py): shared by every worker
  server = embedded_tiny.start_embedded(model_dir, str(base / "weights"), cache, str(base / "logs"))
  try:
    server.wait_healthy(300)
    yield server, str(base / "weights")
  finally:
    server.stop()


@pytest.mark.slow
@pytest.mark.integration
def test_http_episodes_span_an_abort_and_a_weight_update(embedded):
  """Each turn is a /generate on the growing input with the marker as a `stop` string; an abort inside a
  turn is resumed on the new weights; tokens keep their versions across turns, tool tokens have none."""
  from vcpo_jax.rollout.servers import publisher as publisher_lib
  server, weights = embedded
  vocab = embedded_tiny.TINY_MODEL["vocab_size"]
  params = {0: embedded_tiny.tiny_params(0), 1: embedded_tiny.tiny_params(1)}
  sp = {"max_new_tokens": 1, "temperature": 1.0, "sampling_seed": 29, "no_stop_trim": True}

  async def run():
    async with client_lib.RolloutClient([server.url], vocab_size=vocab) as client:
      (plain,) = await client.generate(PROMPT, dict(sp, max_new_tokens=200, ignore_eos=True), n=1)
      marker = _marker(plain.output_ids, 30)
      runner = _runner(marker, max_new_tokens=200)
      # Undisturbed: turn 0 is the plain generation up to the marker, where the server stopped it.
      (calm,) = await runner.generate(client.generate, PROMPT, dict(sp, ignore_eos=True), n=1)
      pub = publisher_lib.WeightPublisher(embedded_tiny.export_tiny, weights, client)
      turns = []

      async def held_second_turn(input_ids, params, n=1):
        # The second turn is sent to an engine paused in place, so it waits there until the abort below: a
        # turn that ends before a poll could see it in flight would leave the abort nothing to cut.
        turns.append(len(input_ids))
        if len(turns) == 2:
          await client.request_json(server.url, "POST", "/pause_generation", {"mode": "in_place"})
        return await client.generate(input_ids, params, n=n)

      try:
        before = client.stats["requests"]
        task = asyncio.create_task(runner.generate(held_second_turn, PROMPT, dict(sp, ignore_eos=True,
                                                                                  sampling_seed=31), n=1))

        async def second_turn_in_engine():
          if task.done():
            raise AssertionError(f"the episode ended after {len(turns)} turn(s), before its second was held")
          _, info = await client.request_json(server.url, "GET", "/get_model_info")
          return info["num_in_flight"] >= 1 and client.stats["requests"] >= before + 2

        await waits.async_wait_until(second_turn_in_engine, 300, "the episode's second turn in the engine")
        await client.request_json(server.url, "POST", "/pause_generation", {"mode": "abort"})
        await pub.publish(params[1], 1)
        (stormy,) = await waits.wait_for(task, 300, "the episode to finish after the abort and the update")
      finally:
        await client.request_json(server.url, "POST", "/continue_generation", {})  # never leave it held
        await pub.close()
      return plain, marker, runner, calm, stormy

  plain, marker, runner, calm, stormy = asyncio.run(run())
  cut = multiturn.first_stop(plain.output_ids, runner.decode, (marker,))
  assert calm.output_ids[:cut] == plain.output_ids[:cut]
  _check_episode(calm, {0: params[0]})
  assert set(stormy.token_versions.tolist()) == {-1, 0, 1}  # both versions among the generated tokens
  _check_episode(stormy, params)
  assert types.sample_lag(stormy, 2, 0) == 2  # the oldest generated token (v0), not a tool token's -1


# -- the scheduler's bound for whole episodes -----------------------------------------------------------

class VersionedPolicy:
  """Per-turn generation whose tokens take random event-loop turns and carry the live server version."""

  def __init__(self, rng):
    self.rng, self.version = rng, 0

  async def __call__(self, input_ids, params, n=1):
    ids, versions = [], []
    for _ in range(self.rng.randint(1, 4)):
      for _ in range(self.rng.randint(0, 15)):
        await asyncio.sleep(0)
      ids.append(TOK.token_to_id("1"))
      versions.append(self.version)
    if self.rng.random() < 0.6:  # a call
      call = TOK.encode(calculator.call("1+1"))
      ids += call
      versions += [self.version] * len(call)
    return [types.Sample(list(input_ids), ids, np.full(len(ids), -0.5, np.float32), np.asarray(versions, np.int64),
                         "stop", "sim")]


@pytest.mark.parametrize("k", [0, 1, 3])
def test_lag_bound_holds_for_whole_episodes(k):
  rng = random.Random(k)
  policy = VersionedPolicy(rng)
  runner = episodes.EpisodeRunner(calculator.environment_of(max_turns=4), encode=TOK.encode,
                                  decode=lambda ids: completion_text(TOK, ids), stop_ids=TOK.stop_ids,
                                  max_new_tokens=200)
  gen = lambda prompt, params, n: runner.generate(policy, prompt, params, n)  # noqa: E731
  prompts = ({"prompt_ids": [1, 2], "index": i} for i in range(10_000))
  sched = sched_lib.RolloutScheduler(gen, prompts, sampling_params={"max_new_tokens": 1}, group_size=2,
                                     batch_groups=3, max_lag=k)

  async def run():
    lags, turns = [], []
    for v in range(12):
      policy.version = v  # published before the batch is asked for
      for g in await sched.next_batch(v):
        for s, lag in zip(g.samples, g.sample_lags):
          assert lag == v - int(s.token_versions[s.output_mask > 0].min())
          lags.append(lag)
          turns.append(s.num_turns)
    await sched.close()
    return lags, turns

  lags, turns = asyncio.run(run())
  assert max(lags) <= k and sched.stats.get("lag_violations", 0) == 0 and max(turns) > 1
  if k:
    assert max(lags) >= 1  # episodes did span versions


def test_dynamic_sampling_filters_whole_episodes_within_the_bound():
  """rl.dynamic_sampling with a tool task: episodes are judged on their outcome, kept ones keep lag <= k, and the
  filter counts generated tokens only (not the calculator's replies)."""
  from vcpo_jax.rollout import dynamic_sampling
  rng, k = random.Random(11), 2
  policy = VersionedPolicy(rng)
  runner = episodes.EpisodeRunner(calculator.environment_of(max_turns=4), encode=TOK.encode,
                                  decode=lambda ids: completion_text(TOK, ids), stop_ids=TOK.stop_ids,
                                  max_new_tokens=200)
  gen = lambda prompt, params, n: runner.generate(policy, prompt, params, n)  # noqa: E731
  judged = []

  def score(group):  # a coin per episode: about half the groups of 2 agree
    group.rewards = [float(np.random.default_rng([group.index, i]).integers(2)) for i in range(len(group.samples))]
    judged.append(group)

  group_filter = dynamic_sampling.GroupFilter.from_section({"enabled": True, "max_drops_per_step": 100},
                                                           batch_groups=3)
  sched = sched_lib.RolloutScheduler(gen, ({"prompt_ids": [1, 2], "index": i} for i in range(10_000)),
                                     sampling_params={"max_new_tokens": 1}, group_size=2, batch_groups=3,
                                     max_lag=k, on_complete=score, group_filter=group_filter)

  async def run():
    kept = []
    for v in range(8):
      policy.version = v
      kept += await sched.next_batch(v)
    await sched.close()
    return kept

  kept = asyncio.run(run())
  assert len(kept) == 24 and all(max(g.rewards) != min(g.rewards) for g in kept)
  assert max(lag for g in kept for lag in g.sample_lags) <= k and sched.stats.get("lag_violations", 0) == 0
  assert group_filter.totals["groups_dropped_all_pass"] + group_filter.totals["groups_dropped_all_fail"] > 0
  tool_tokens = sum(int(np.sum(s.output_mask == 0)) for g in judged for s in g.samples)
  assert tool_tokens > 0 and group_filter.totals["tokens_generated"] == sum(
      int(np.sum(s.output_mask > 0)) for g in judged for s in g.samples)


# -- the job --------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_tool_task_job_runs_three_steps(tmp_path):
  from configs import countdown_tools
  from vcpo_jax.job import train
  c = countdown_tools.get_config("emulate")
  c.model.update(hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16)
  c.sft.update(steps=4, batch_size=8)
  c.rl.update(steps=3, prompts_per_step=2, group_size=2, max_lag=1)
  c.task.eval_size = 4
  c.algo.micro_batch_size = 0
  c.eval_every = 3
  c.checkpoint_every = 3
  result = train.train_and_evaluate(c, str(tmp_path))
  assert result["steps"] == 3
  with open(tmp_path / "metrics.jsonl") as f:
    scalars = [json.loads(line) for line in f]
  for s in scalars:
    assert s["lag/max"] <= 1
    for key in ("calls_per_episode", "errors_per_episode", "turns_per_episode", "error_rate", "errors/json"):
      assert f"tools/{key}" in s
    assert s["tools/turns_per_episode"] >= 1
