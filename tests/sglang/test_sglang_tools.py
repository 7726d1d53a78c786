"""Tool use against a real SGLang 0.5.23 server (CPU, float32): multi-turn episodes (a `stop` string
per turn, the growing input as input_ids), the countdown_tools job at k = 2 in the chat template's tool format
(>= 1 answered call per episode on average) and the code_tools job whose sandboxed python calls straddle weight
updates, every token checked against the weights its version tag names."""
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
from vcpo_jax.tasks import calculator

pytestmark = [pytest.mark.sglang, requires_sglang, pytest.mark.timeout(3600)]
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


# The code tool's job: every python call runs in the sandbox (no exact_prints shortcut), so a call takes a sandbox
# start-up (~65 ms) while the learner steps and publishes.
CODE = ("configs/code_tools.py", "--config.task.options.arithmetic_code.exact_prints=False", "--config.task.eval_size=8")


def turn_pairs(samples: list[dict]) -> list[tuple[dict, dict]]:
  """(turn, next turn) of the same episode from the sample log: the next turn's input is the turn's input and
  output followed by the tool's reply."""
  by_prefix = {tuple(s["prompt_ids"] + s["output_ids"]): s for s in samples}
  pairs = []
  for s in samples:
    for n in range(len(s["prompt_ids"]) - 1, 0, -1):
      prev = by_prefix.get(tuple(s["prompt_ids"][:n]))
      if prev is not None and n > len(prev["prompt_ids"]):
        pairs.append((prev, s))
        break
  return pairs


def test_code_tool_call_straddles_a_weight_update(tmp_path):
  from vcpo_jax.model import tokenizer
  config, *flags = CODE
  work = tmp_path / "w"
  _run("vcpo_jax.job.export_base", work, *flags, config=config)
  (server,) = start_servers(str(work / "base"), str(tmp_path), 1)
  try:
    _run("vcpo_jax.main", work, *flags, "--config.rl.steps=6", f"--config.rollout.server_urls={server.url}",
         config=config)
  finally:
    server.stop()
  rows = _metrics(str(work))
  assert [r["step"] for r in rows] == list(range(1, 7)) and all(r["lag/max"] <= 2 for r in rows)
  assert np.mean([r["tools/calls_per_episode"] for r in rows]) >= 0.5
  log = os.path.join(work, "samples.jsonl")
  with open(log) as f:
    samples = [json.loads(line) for line in f if line.strip()]
  tok = tokenizer.build_tokenizer()
  # A straddle: the turn that made the call ran under older weights than every token of the turn after the reply.
  straddles = [(a, b) for a, b in turn_pairs(samples) if max(a["versions"]) < min(b["versions"])]
  tags = verify_tags.worst_gap(log, os.path.join(work, "weights"))
  print(f"\ncode tool job: {len(straddles)} tool calls straddle a weight update; tags {tags}")
  assert straddles
  # Some straddling call's reply is the sandbox's printed number (not an error reply) in the template's tool turn.
  replies = [tok.decode(b["prompt_ids"][len(a["prompt_ids"]) + len(a["output_ids"]):]) for a, b in straddles]
  assert any(re.search(r"\d{4,}", r) and "error" not in r for r in replies), replies[:5]
  assert tags["worst"] < 1e-4  # every token of every turn, straddling ones included, under its tag's weights
