"""The calculator on the environment interface gives the same tokens as before it: the countdown_tools configs'
prompts, warm-start rows and scripted episodes (valid and failing calls) against a recording made with the
calculator as it was (tests/data/countdown_tools_golden.json; `python tests/test_calculator_golden.py` rewrites
it, which only a deliberate change of behaviour should do)."""
import asyncio
import json
import pathlib
import sys

import numpy as np
import pytest

from vcpo_jax.job import configuration, data
from vcpo_jax.model.tokenizer import build_tokenizer, completion_text
from vcpo_jax.rollout import episodes, multiturn, types

GOLDEN = pathlib.Path(__file__).parent / "data" / "countdown_tools_golden.json"
TOK = build_tokenizer()
END = "<|im_end|>"
CALL = '<tool_call>\n{{"name": "{name}", "arguments": {args}}}\n</tool_call>'
# Turns that fail in every way the calculator and the call parser know, then an answer.
BAD_TURNS = [CALL.format(name="calculator", args='{"expression": "1/0"}'),
             CALL.format(name="calculator", args='{"expression": "7/2"}'),
             CALL.format(name="python", args='{"code": "1"}'),
             "<tool_call>\nnot json\n</tool_call>",
             CALL.format(name="calculator", args='{"expr": "1"}'),
             CALL.format(name="calculator", args='{"expression": "' + "9" * 20 + '*' + "9" * 20 + '"}'),
             CALL.format(name="calculator", args='{"expression": "2**3"}'),
             '<tool_call>\n{"name": "calculator"}\n</tool_call>',
             "<answer>1</answer>" + END]


class ScriptedPolicy:
  """Writes the given turn texts in order, as a /generate-like function (n=1)."""

  def __init__(self, turns):
    self.turns, self.calls = [TOK.encode(t) for t in turns], 0

  async def __call__(self, input_ids, params, n=1):
    ids = self.turns[self.calls][:params["max_new_tokens"]]
    self.calls += 1
    return [types.Sample(prompt_ids=list(input_ids), output_ids=ids, output_logprobs=np.zeros(len(ids), np.float32),
                         token_versions=np.zeros(len(ids), np.int64), finish_reason="stop", server_url="scripted")]


def _episode(runner, prompt_ids, turns, example):
  (s,) = asyncio.run(runner.generate(ScriptedPolicy(turns), prompt_ids, {"max_new_tokens": 1, "sampling_seed": 3},
                                     n=1, example=example))
  return {"ids": s.output_ids, "mask": "".join(str(int(m)) for m in s.output_mask), "turns": s.num_turns,
          "calls": s.tool_calls, "errors": s.tool_errors, "kinds": dict(sorted(s.tool_error_kinds.items())),
          "finish": s.finish_reason}


def _variant(variant: str) -> dict:
  from configs import countdown_tools
  c = countdown_tools.get_config(variant)
  task = configuration.build_task(c, render_prompt=TOK.chat_prompt)
  env = task.environment()
  runner = episodes.runner_for(task, TOK, max_new_tokens=800, context_length=c.model.max_seq_len + 800)
  out = []
  for i, ex in enumerate(task.sample(7, 6)):
    prompt_ids = TOK.encode(ex["prompt"])
    rec = {"prompt_ids": prompt_ids, "rows": [], "episodes": []}
    for error_rate in (0.0, 1.0):
      completion = task.sft_completion(ex, np.random.default_rng([i, int(error_rate)]), error_rate)
      tokens_T, mask_T = data.encode_sft_example(TOK, ex["prompt"], completion, 400, env=env, example=ex)
      n = int((tokens_T != TOK.pad_id).sum())
      rec["rows"].append({"tokens": tokens_T[:n].tolist(), "mask": "".join(str(int(m)) for m in mask_T[:n]),
                          "reward": task.reward(ex, completion)})
      # The trace's own turns, played back by a scripted policy through the episode runner.
      turns = [t for t, is_tool in multiturn.trace_segments(env, completion, ex) if not is_tool]
      turns[-1] += END
      rec["episodes"].append(_episode(runner, prompt_ids, turns, ex))
    calls_per_episode = env.max_turns - 1
    for start in range(0, len(BAD_TURNS) - 1, calls_per_episode) if i < 2 else ():
      bad = _episode(runner, prompt_ids, BAD_TURNS[start:start + calls_per_episode] + BAD_TURNS[-1:], ex)
      bad["reward"] = task.reward(ex, completion_text(TOK, bad["ids"]))
      rec["episodes"].append(bad)
    out.append(rec)
  return {"declarations": env.declarations(), "records": out}


def record() -> dict:
  return {variant or "plain": _variant(variant) for variant in ("", "search")}


@pytest.mark.parametrize("variant", ["plain", "search"])
def test_countdown_tools_tokens_match_the_recording(variant):
  want = json.loads(GOLDEN.read_text())[variant]
  got = json.loads(json.dumps(_variant("" if variant == "plain" else variant)))
  assert got["declarations"] == want["declarations"]
  for g, w in zip(got["records"], want["records"], strict=True):
    assert g["prompt_ids"] == w["prompt_ids"]
    assert g["rows"] == w["rows"]
    assert g["episodes"] == w["episodes"]
  kinds = {k for r in got["records"] for e in r["episodes"] for k in e["kinds"]}
  assert kinds == {"tool", "unknown_tool", "json", "bad_arguments", "malformed"}  # the recording covers them


if __name__ == "__main__":
  GOLDEN.parent.mkdir(exist_ok=True)
  GOLDEN.write_text(json.dumps(record(), separators=(",", ":")) + "\n")
  print(f"wrote {GOLDEN} ({GOLDEN.stat().st_size} bytes)", file=sys.stderr)
