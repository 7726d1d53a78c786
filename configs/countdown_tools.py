"""Multi-turn tool use: Countdown with a calculator, called in the chat template's tool format.

The main job's config (configs/countdown.py) with the countdown_tools task: every rollout is an episode of up
to task.options.countdown_tools.max_turns model turns; a `<tool_call>{"name": "calculator", ...}</tool_call>`
is answered by a `<tool_response>` tool turn, whose tokens have mask 0 inside the response.
"""
import ml_collections

from configs import countdown


def get_config(arg: str = "") -> ml_collections.ConfigDict:
  """`arg`: comma-separated; 'search' picks the search traces (below), the rest is as in configs/countdown.py:
  '' (async, embedded server), 'sync' or 'emulate'."""
  parts = [p for p in arg.split(",") if p]
  search = "search" in parts
  c = countdown.get_config(",".join(p for p in parts if p != "search"))
  c.task.name = "countdown_tools"
  # The main job's problems (two numbers in [1, 25], + - * /; the task's defaults are the paper's 3-4 numbers in
  # [1, 99], which need a pretrained model), with a calculator. A 3-layer model warm-started here on three
  # numbers miscopies them (pilot runs: 3-14% held-out). eval_fraction 0.3 leaves ~320 distinct held-out
  # problems (0.2: 229), so eval_size can be 256. max_turns caps model turns per episode, so at most
  # max_turns - 1 calls are answered; a reply's value is capped at max_result_chars.
  c.task.options.countdown_tools.update(
      num_numbers=2, max_number=25, max_target=999, ops="+-*/", eval_fraction=0.3,
      max_turns=3, max_result_chars=24, correction_rate=0.2)
  # A prompt (with the tools' system turn) is <= 93 tokens; a warm-start trace (a failed check, its
  # correction, the answer) <= 81 + the stop token (tests/test_tools.py checks both over many draws).
  c.model.max_seq_len = 192
  # The episode's whole response, generated and tool tokens together (prompt + response <= max_seq_len - 2).
  c.rl.max_new_tokens = 92
  # Every warm-start trace calls the calculator: 30% check a wrong candidate and answer it anyway, 20% of the
  # others first check a wrong one and correct it (the task's correction_rate). Chosen by pilot runs
  # (docs/results/tool-use.md): the main job's RL batch (16 prompts x 8) for 80 steps.
  c.sft.update(steps=200, batch_size=32, error_rate=0.3)
  c.rl.update(steps=80, prompts_per_step=16, group_size=8)
  c.task.eval_size = 256
  c.eval_every = 20
  c.checkpoint_every = 20
  if search:
    # Search traces: check + - * / in order (one call each) until the reply is the target, then answer it;
    # 60% of warm-start traces stop at the first miss and answer it, so the warm start's likeliest move after
    # a miss is to stop: going on is what RL has to learn from the replies. A trace is <= 147 tokens + stop.
    # 500 warm-start steps: after 200 the model copies the checked expression into its answer only ~60% of
    # the time and its rare second calls almost never succeed, so RL has nothing to reinforce
    # (docs/results/tool-use.md).
    c.task.options.countdown_tools.update(search=True, max_turns=5)
    c.model.max_seq_len = 256
    c.rl.max_new_tokens = 152
    c.sft.update(steps=500, error_rate=0.6)
  return c
