"""A tiny version of the main job for tests and smoke runs: same structure, everything shrunk."""
import ml_collections

from configs import countdown


def get_config(arg: str = "") -> ml_collections.ConfigDict:
  """`arg` is passed to configs/countdown.py ('', 'sync' or 'emulate')."""
  c = countdown.get_config(arg)
  c.model.update(hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16,
                 max_seq_len=80)
  c.sft.update(steps=4, batch_size=8)
  c.rl.update(steps=3, prompts_per_step=2, group_size=2, max_new_tokens=8)
  c.rl.max_lag = min(c.rl.max_lag, 1)
  c.task.eval_size = 8
  c.algo.micro_batch_size = 0
  c.eval_every = 2
  c.checkpoint_every = 1
  return c
