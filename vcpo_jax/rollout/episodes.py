"""Multi-turn episodes: generate until a tool call or the end, append the tool's reply as mask-0 tokens, repeat.

Every turn is one ordinary generation on the growing input (prompt + earlier turns + tool outputs): over HTTP
a `/generate` with the same wire format as single-turn rollouts (the call marker as a `stop` string), so the
client's retries and abort-resume work inside a turn; in process, a batch of sampler rows per turn (the rows
run on past the marker and are cut there afterwards, which leaves the kept tokens' distribution unchanged).
Per-token versions are kept across turns, so an episode's lag is the learner version minus the oldest version
among all its generated tokens. Tool outputs, turns and the episode's length are capped. Each episode gets its
own environment (`env.start(example)`), and its calls and its episode reward run in the tools pool (a
calls.offload.CallPool with a per-call timeout), never on the event loop that generates the other episodes
and publishes weights: a call past the timeout is the error reply of kind 'timeout' and the episode goes on.
"""
from __future__ import annotations

import asyncio
import dataclasses
from typing import Any, Awaitable, Callable, Mapping, Optional, Sequence

import jax.numpy as jnp
import numpy as np

from vcpo_jax.model import sampling
from vcpo_jax.model.tokenizer import completion_text
from vcpo_jax.calls import offload
from vcpo_jax.calls.settings import int_at_least, number_above, one_of, read_section, setting
from vcpo_jax.rollout import multiturn, protocol, types


def _as_reward(outcome: offload.Outcome) -> tuple[Optional[float], bool]:
  """(episode reward or None: the task's, failed): a failed call, or a value that is not a finite number, is
  reward 0 and a failure."""
  if not outcome.ok:
    return 0.0, True
  value = outcome.value
  if value is None:
    return None, False
  if isinstance(value, bool) or not isinstance(value, (int, float)) or not np.isfinite(float(value)):
    return 0.0, True
  return float(value), False


class EpisodeRunner:
  """Drives episodes of one environment. max_new_tokens caps an episode's response (generated + tool tokens),
  so episodes fit the rows single-turn samples use; context_length (the servers') caps every turn's input.
  pool: where starts, tool calls and episode rewards run (default: inline, on the calling thread)."""

  def __init__(self, env: multiturn.Environment, *, encode: Callable[[str], list[int]],
               decode: Callable[[Sequence[int]], str], stop_ids: Sequence[int], max_new_tokens: int,
               context_length: Optional[int] = None, pool: Optional[offload.CallPool] = None):
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
      raise ValueError(f"max_new_tokens must be a positive int, got {max_new_tokens!r}")
    self.env, self.encode, self.decode = env, encode, decode
    self.stop_ids = frozenset(int(t) for t in stop_ids)
    self.max_new_tokens, self.context_length = max_new_tokens, context_length
    self.pool = pool if pool is not None else offload.CallPool("inline", name="tools")

  def room(self, prompt_len: int, ep: multiturn.Episode) -> int:
    """Tokens the next turn may generate (0: the episode cannot continue)."""
    room = self.max_new_tokens - len(ep.output_ids)
    if self.context_length is not None:
      room = protocol.fit_max_new_tokens(prompt_len + len(ep.output_ids), room, self.context_length)
    return max(room, 0)

  def record_turn(self, ep: multiturn.Episode, ids: Sequence[int], logprobs: Sequence[float], versions: Sequence[int],
                  finish_reason: str) -> Optional[str]:
    """Records one turn; its text when it made a call the environment is to answer, else None (it ends)."""
    ids = list(ids)
    cut = multiturn.first_stop(ids, self.decode, self.env.stop_strings)
    if cut is not None:  # also when a resumed request ran past a marker split by the abort
      ids, logprobs, versions = ids[:cut], list(logprobs)[:cut], list(versions)[:cut]
    ep.add_generated(ids, logprobs, versions)
    ep.turns += 1
    if cut is None or (bool(ids) and ids[-1] in self.stop_ids):
      ep.finish_reason = finish_reason if finish_reason in ("stop", "length") else "length"
      return None
    ep.finish_reason = "length"  # unless a later turn ends it with a stop token
    if ep.turns >= self.env.max_turns:
      ep.turn_capped = True
      return None
    return self.decode(ids)

  def add_reply(self, ep: multiturn.Episode, reply: Any, prompt_len: int) -> bool:
    """Appends the environment's reply to the call; True when the episode goes on."""
    if reply is None:  # the environment found no call in the turn
      return False
    tool_ids = self.encode(reply.text)
    if self.room(prompt_len, multiturn.Episode(output_ids=ep.output_ids + tool_ids)) < 1:
      return False  # no room to read the reply and answer: the episode ends at the call
    ep.add_tool(tool_ids)
    ep.tool_calls += 1
    ep.tool_errors += int(bool(reply.error))
    kind = getattr(reply, "kind", None)
    if reply.error and kind:
      ep.error_kinds[kind] = ep.error_kinds.get(kind, 0) + 1
    return True

  @staticmethod
  def reply_of(episode_env: Any, outcome: offload.Outcome) -> Any:
    """The reply a pool outcome stands for: the environment's own, or the fixed reply of a timed-out call
    (kind 'timeout') or of a crash outside the tool's own error handling (kind 'tool')."""
    if outcome.ok:
      return outcome.value
    return episode_env.error_reply("timeout" if outcome.error == "timeout" else "tool")

  def _started(self, outcome: offload.Outcome, example: Optional[dict]) -> Any:
    if not outcome.ok:  # reset sees no model text: a failure is the environment's bug, not a sample's
      raise RuntimeError(f"the environment failed to start an episode ({outcome.error}: {outcome.detail}) "
                         f"for example {str(example)[:200]}")
    return outcome.value

  def _rewarded(self, ep: multiturn.Episode, outcome: offload.Outcome) -> None:
    ep.env_reward, failed = _as_reward(outcome)
    if failed:
      ep.error_kinds["reward"] = ep.error_kinds.get("reward", 0) + 1

  # -- over HTTP (or any per-sample generate) ----------------------------------------------------------
  async def run(self, generate_one: Callable[..., Awaitable[Sequence[types.Sample]]], prompt_ids: Sequence[int],
                params: dict, example: Optional[dict] = None) -> multiturn.Episode:
    """One episode; generate_one(input_ids, sampling_params, n=1) is e.g. RolloutClient.generate. The
    environment's start, calls and reward are awaited in the pool: the event loop runs on meanwhile."""
    ep, prompt_ids = multiturn.Episode(), [int(t) for t in prompt_ids]
    episode_env = self._started(await self.pool.call(self.env.start, example), example)
    stops = list(dict.fromkeys(list(params.get("stop", [])) + list(self.env.stop_strings)))
    while True:
      room = self.room(len(prompt_ids), ep)
      if room < 1:
        ep.finish_reason = "length"
        break
      turn_params = dict(params, max_new_tokens=room, stop=stops)
      seed = multiturn.turn_seed(params.get("sampling_seed"), ep.turns)
      if seed is not None:
        turn_params["sampling_seed"] = seed
      (s,) = await generate_one(prompt_ids + ep.output_ids, turn_params, n=1)
      ep.num_resumes += s.num_resumes
      ep.server_url = s.server_url
      call = self.record_turn(ep, s.output_ids, s.output_logprobs, s.token_versions, s.finish_reason)
      if call is None:
        break
      reply = self.reply_of(episode_env, await self.pool.call(episode_env.respond, call))
      if not self.add_reply(ep, reply, len(prompt_ids)):
        break
    if getattr(episode_env, "reward", None) is not None:
      self._rewarded(ep, await self.pool.call(episode_env.reward, self.decode(ep.output_ids)))
    return ep

  async def generate(self, generate_one: Callable[..., Awaitable[Sequence[types.Sample]]],
                     prompt_ids: Sequence[int], sampling_params: dict, n: int = 1,
                     example: Optional[dict] = None) -> list[types.Sample]:
    """n independent episodes (the scheduler's generate signature, plus the group's prompt example each
    episode's environment starts from); episode i uses sampling_seed + i."""
    seed = sampling_params.get("sampling_seed")
    per = [dict(sampling_params, sampling_seed=seed + i) if seed is not None else sampling_params
           for i in range(n)]
    episodes = await asyncio.gather(*(self.run(generate_one, prompt_ids, p, example) for p in per))
    return [ep.to_sample(prompt_ids) for ep in episodes]

  # -- in process (lag emulation, evaluation) --------------------------------------------------------
  def run_local(self, params, cfg, prompts: Sequence[Sequence[int]], seeds: Sequence[int], *, temperature: float,
                version: int = 0, examples: Optional[Sequence[dict]] = None) -> list[multiturn.Episode]:
    """Episodes for every prompt with the in-process sampler: one batch of rows per turn; each turn's calls
    run in the pool side by side (examples: each prompt's example, its environment's start)."""
    eps = [multiturn.Episode(server_url="in-process") for _ in prompts]
    starts = self.pool.map_blocking(self.env.start, [(None if examples is None else examples[i],)
                                                     for i in range(len(prompts))])
    envs = [self._started(o, None if examples is None else examples[i]) for i, o in enumerate(starts)]
    # The sampler's rows hold prompt + output within the model's max_seq_len.
    room = lambda i: min(self.room(len(prompts[i]), eps[i]),  # noqa: E731
                         cfg.max_seq_len - len(prompts[i]) - len(eps[i].output_ids))
    active = [i for i in range(len(prompts)) if room(i) >= 1]
    while active:
      rows = [sampling.RowSpec(prompt=tuple(int(t) for t in prompts[i]) + tuple(eps[i].output_ids),
                               max_new_tokens=room(i), temperature=temperature,
                               stop_token_ids=tuple(sorted(self.stop_ids)),
                               seed=multiturn.turn_seed(int(seeds[i]), eps[i].turns)) for i in active]
      batch = sampling.start_batch(params, cfg, rows)
      while not bool(jnp.all(batch.state.done_B)):
        sampling.decode_chunk(params, batch, 64)
      calls = {}
      for i, r in zip(active, sampling.results(batch)):
        n = len(r.output_ids)
        call = self.record_turn(eps[i], r.output_ids, r.logprobs, [version] * n, r.finish_reason or "length")
        if call is not None:
          calls[i] = call
      outcomes = self.pool.map_blocking(_respond, [(envs[i], text) for i, text in calls.items()])
      active = [i for i, outcome in zip(calls, outcomes)
                if self.add_reply(eps[i], self.reply_of(envs[i], outcome), len(prompts[i])) and room(i) >= 1]
    scored = [i for i in range(len(eps)) if getattr(envs[i], "reward", None) is not None]
    for i, outcome in zip(scored, self.pool.map_blocking(_reward, [(envs[i], self.decode(eps[i].output_ids))
                                                                    for i in scored])):
      self._rewarded(eps[i], outcome)
    return eps


def _respond(episode_env: Any, text: str) -> Any:
  return episode_env.respond(text)


def _reward(episode_env: Any, completion: str) -> Any:
  return episode_env.reward(completion)


def runner_for(task, tokenizer, *, max_new_tokens: int, context_length: Optional[int] = None
               ) -> Optional[EpisodeRunner]:
  """The episode runner of a task with a tool environment (None for single-turn tasks), calling in the
  environment's pool (the job's tools pool, passed to the task; inline when None)."""
  env = task.environment()
  if env is None:
    return None
  return EpisodeRunner(env, encode=tokenizer.encode, decode=lambda ids: completion_text(tokenizer, ids),
                       stop_ids=tokenizer.stop_ids, max_new_tokens=max_new_tokens,
                       context_length=context_length, pool=env.pool)


@dataclasses.dataclass(frozen=True)
class ToolsConfig:
  """The config section `tools`: the pool of tool calls and episode rewards (tools_config builds it, checked)."""
  pool: str = setting("thread", one_of("inline", "thread", why=" (an episode's environment lives in this process)"))
  workers: int = setting(8, int_at_least(1))  # concurrent tool calls
  timeout_s: float = setting(30.0, number_above(0, " (seconds)"))  # per call


def tools_config(section: Optional[Mapping[str, Any]] = None) -> ToolsConfig:
  """The `tools` section typed; an unknown field or a bad value is an error naming tools.<field>."""
  return read_section(ToolsConfig, "tools", section)


def tool_pool(settings: ToolsConfig = ToolsConfig()) -> offload.CallPool:
  """The job's tools pool, as the config section `tools` sets it."""
  if not isinstance(settings, ToolsConfig):  # a plain dict would skip the section's checks
    raise TypeError(f"settings must be a ToolsConfig (episodes.tools_config(section)), got {type(settings)}")
  return offload.CallPool(settings.pool, workers=settings.workers, timeout_s=settings.timeout_s, name="tools")
