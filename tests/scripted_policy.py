"""A policy that writes given turn texts in order (n=1) with zero log-probs, as a server would, for episode tests."""
import asyncio

import numpy as np

from vcpo_jax.model import tokenizer
from vcpo_jax.rollout import types

TOK = tokenizer.build_tokenizer()  # the task tokenizer, as the tests that use this build it


class ScriptedPolicy:
  """Writes the given turns in order (n=1), after `delay` s of awaited 'generation' each."""

  def __init__(self, turns, delay=0.0):
    self.turns, self.delay, self.calls = [TOK.encode(t) for t in turns], delay, 0

  async def __call__(self, input_ids, params, n=1):
    if self.delay:
      await asyncio.sleep(self.delay)
    ids = self.turns[self.calls]
    self.calls += 1
    return [types.Sample(list(input_ids), ids, np.zeros(len(ids), np.float32), np.zeros(len(ids), np.int64),
                         "stop", "scripted")]
