"""Multi-turn tool use: Countdown with a calculator, called in the chat template's tool format.

The main job's config (configs/countdown.py) with the countdown_tools task: every rollout is an episode of up
to task.options.countdown_tools.max_turns model turns; a `<tool_call>{"name": "calculator", ...}</tool_call>`
is answered by a `<tool_response>` tool turn, whose tokens have mask 0 inside the response.
"""
import ml_collections

from configs import countdown


def get_config(arg: str = "") -> ml_collections.ConfigDict:
  """`arg` as in configs/countdown.py: '' (async, embedded server), 'sync' or 'emulate'."""
  c = countdown.get_config(arg)
  c.task.name = "countdown_tools"
  # CPU-sized: three numbers in [1, 6] with + - * (the task's defaults are the paper's 3-4 numbers in [1, 99]
  # with division, which need longer rows and a pretrained model). max_turns caps model turns per episode, so
  # at most max_turns - 1 calls are answered; a reply's value is capped at max_result_chars.
  c.task.options.countdown_tools.update(
      num_numbers=3, max_number=6, max_target=100, ops="+-*", eval_fraction=0.2,
      max_turns=3, max_result_chars=24, correction_rate=0.5)
  # A prompt (with the tools' system turn) is <= 92 tokens; a warm-start trace (a failed check, its
  # correction, the answer) <= 84 + the stop token (tests/test_tools.py checks both over many draws).
  c.model.max_seq_len = 192
  # The episode's whole response, generated and tool tokens together (prompt + response <= max_seq_len - 2).
  c.rl.max_new_tokens = 92
  # A short run on a 2-core CPU machine. The warm start is the expensive part (a 3-layer model learning
  # 3-number Countdown from scratch); 30% of its traces end in a wrong answer (the main job: 60%).
  c.sft.update(steps=300, batch_size=32, error_rate=0.3)
  c.rl.update(steps=12, prompts_per_step=4, group_size=8)
  c.task.eval_size = 32
  c.eval_every = 12
  c.checkpoint_every = 6
  return c
