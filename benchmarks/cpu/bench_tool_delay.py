"""Delay a slow tool call adds to the other episodes and to a weight publish on the rollout event loop.

Episodes run through the real EpisodeRunner on one asyncio loop with a stand-in for /generate (each turn
awaits `turn_ms`, as a server request does, then writes a call or the answer); episode 0's first call runs a
tool that sleeps `slow_s`. A weight publish stand-in (20 awaited steps of 5 ms) runs beside them, and a
ticker measures how late the loop wakes. The delay added is each figure minus the same run with a 0 s tool,
for the tools pool the job uses ('thread') and for calling on the loop ('inline', what episodes did before).

  python -m benchmarks.cpu.bench_tool_delay                     # thread vs inline, 2 s tool, 16 episodes
  python -m benchmarks.cpu.bench_tool_delay --slow_s 2 --episodes 16 --repeats 3 --json /tmp/tool_delay.json
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time

import numpy as np

from vcpo_jax.model.tokenizer import build_tokenizer, completion_text
from vcpo_jax.calls import offload
from vcpo_jax.rollout import episodes, types
from vcpo_jax.tasks.environments import base as environment, tool_calls

TOK = build_tokenizer()


class Sleeper(environment.Environment):
  """One tool that sleeps (a slow tool: a code interpreter, a web request)."""

  def wait(self, seconds: float) -> str:
    """Sleeps, then answers ok."""
    time.sleep(seconds)
    return "ok"


def _policy(slow_s: float, turn_s: float, calls: int):
  """Per-turn generate: episode 0 (sampling_seed 0) first calls wait(slow_s), every episode then makes
  `calls` quick calls and answers."""
  async def generate(input_ids, params, n=1):
    await asyncio.sleep(turn_s)  # the server's time for the turn
    turn = TOK.decode(input_ids).count("</tool_call>")  # calls so far
    if turn == 0 and params["sampling_seed"] == 0:
      text = tool_calls.call_text("wait", seconds=slow_s)
    elif turn < calls:
      text = tool_calls.call_text("wait", seconds=0.0)
    else:
      text = "<answer>1</answer><|im_end|>"
    ids = TOK.encode(text)
    return [types.Sample(list(input_ids), ids, np.zeros(len(ids), np.float32), np.zeros(len(ids), np.int64),
                         "stop", "bench")]
  return generate


async def _one_run(pool: offload.CallPool, *, slow_s: float, episodes_n: int, turn_s: float, calls: int) -> dict:
  env = environment.EnvironmentFactory(Sleeper, max_turns=calls + 2, max_call_chars=256)
  runner = episodes.EpisodeRunner(env, encode=TOK.encode, decode=lambda ids: completion_text(TOK, ids),
                                  stop_ids=TOK.stop_ids, max_new_tokens=2000, pool=pool)
  generate, prompt = _policy(slow_s, turn_s, calls), TOK.encode(TOK.chat_prompt("go"))
  late, stop = [], asyncio.Event()

  async def ticker(period=0.005):
    while not stop.is_set():
      t = time.perf_counter()
      await asyncio.sleep(period)
      late.append(time.perf_counter() - t - period)

  async def publish(steps=20, step_s=0.005):
    t = time.perf_counter()
    for _ in range(steps):
      await asyncio.sleep(step_s)  # export, HTTP update_weights_from_disk: awaited I/O
    return time.perf_counter() - t

  async def episode(seed):
    await runner.run(generate, prompt, {"max_new_tokens": 1, "sampling_seed": seed})
    return time.perf_counter()

  tick = asyncio.create_task(ticker())
  await asyncio.sleep(0.02)
  t0 = time.perf_counter()
  pub = asyncio.create_task(publish())
  done = await asyncio.gather(*(episode(s) for s in range(episodes_n)))
  publish_s = await pub
  stop.set()
  await tick
  return {"others_s": max(done[1:]) - t0, "slow_episode_s": done[0] - t0, "publish_s": publish_s,
          "loop_max_late_s": max(late)}


def measure(kind: str, *, slow_s: float, episodes_n: int, turn_s: float, calls: int, repeats: int) -> dict:
  out = {}
  for label, tool_s in (("slow", slow_s), ("baseline", 0.0)):
    runs = []
    for _ in range(repeats):
      pool = offload.CallPool(kind, workers=8, timeout_s=max(10.0, 3 * slow_s), name="tools")
      try:
        runs.append(asyncio.run(_one_run(pool, slow_s=tool_s, episodes_n=episodes_n, turn_s=turn_s,
                                         calls=calls)))
      finally:
        pool.close()
    out[label] = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
  s, b = out["slow"], out["baseline"]
  return {"pool": kind, "others_added_ms": 1e3 * (s["others_s"] - b["others_s"]),
          "publish_added_ms": 1e3 * (s["publish_s"] - b["publish_s"]),
          "loop_max_late_ms": 1e3 * s["loop_max_late_s"], "baseline_loop_max_late_ms": 1e3 * b["loop_max_late_s"],
          "slow_episode_s": s["slow_episode_s"], "runs": out}


def main(argv=None) -> list[dict]:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--slow_s", type=float, default=2.0)
  p.add_argument("--episodes", type=int, default=16)
  p.add_argument("--turn_ms", type=float, default=20.0)
  p.add_argument("--calls", type=int, default=3, help="quick calls per episode")
  p.add_argument("--repeats", type=int, default=3)
  p.add_argument("--pools", default="thread,inline")
  p.add_argument("--json", default="")
  a = p.parse_args(argv)
  results = [measure(kind, slow_s=a.slow_s, episodes_n=a.episodes, turn_s=a.turn_ms / 1e3, calls=a.calls,
                     repeats=a.repeats) for kind in a.pools.split(",")]
  for r in results:
    print(f"pool={r['pool']:7s} tool sleeps {a.slow_s:g} s: other episodes +{r['others_added_ms']:.1f} ms, "
          f"publish +{r['publish_added_ms']:.1f} ms, loop wakes up to {r['loop_max_late_ms']:.1f} ms late "
          f"(baseline {r['baseline_loop_max_late_ms']:.1f} ms); slow episode {r['slow_episode_s']:.2f} s")
  if a.json:
    with open(a.json, "w") as f:
      json.dump({"args": vars(a), "results": results}, f, indent=2)
  return results


if __name__ == "__main__":
  main()
