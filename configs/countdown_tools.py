"""Multi-turn tool use: Countdown with a calculator (`<calc>expr</calc>` -> `<result>value</result>`).

The main job's config (configs/countdown.py) with the countdown_tools task: every rollout is an episode of up
to task.kwargs.max_turns model turns; tool outputs are tokens with mask 0 inside the response.
"""
import ml_collections

from configs import countdown


def get_config(arg: str = "") -> ml_collections.ConfigDict:
  """`arg` as in configs/countdown.py: '' (async, embedded server), 'sync' or 'emulate'."""
  c = countdown.get_config(arg)
  c.task.name = "countdown_tools"
  # CPU-sized: three numbers in [1, 10] (the task's defaults are the paper's 3-4 numbers in [1, 99], which
  # need longer rows). max_turns caps model turns per episode, so at most max_turns - 1 calls are answered;
  # a reply's value is capped at max_result_chars.
  c.task.kwargs = ml_collections.ConfigDict(dict(
      num_numbers=3, max_number=10, max_target=100, eval_fraction=0.2,
      max_turns=3, max_result_chars=24, correction_rate=0.5))
  # A prompt is <= 83 tokens; a warm-start trace (a failed check, its correction, the answer) <= 111 + the
  # stop token (tests/test_tools.py checks both over many draws).
  c.model.max_seq_len = 200
  # The episode's whole response, generated and tool tokens together (prompt + response <= max_seq_len - 2).
  c.rl.max_new_tokens = 112
  # A short run (minutes on a loaded 2-core CPU machine): rows here are twice the main job's length.
  c.sft.update(steps=100, batch_size=16)
  c.rl.update(steps=12, prompts_per_step=4, group_size=8)
  c.task.eval_size = 32
  c.eval_every = 12
  c.checkpoint_every = 6
  return c
