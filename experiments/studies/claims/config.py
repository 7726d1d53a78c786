"""The calibration pilot's and the claims study's base config: the main job's model and warm start
on two-number Countdown in [1, 40], lag emulation with the pipeline lag model.

- Task: two numbers in [1, 40] (the main job: [1, 25]) so that the held-out split has >= 512 distinct problems
  (544 at eval_fraction 0.2; [1, 25] has 229). Three numbers would give longer responses (~15 tokens instead
  of ~10) but the 200-step warm start reaches 0.8% greedy on them (measured): nothing to learn from. No task
  option gives the >= 64-token responses of the paper's regime (see docs/results/study/README.md).
- Lag: `pipeline` at speed_ratio 2 (generation twice as fast as learning): every group's lag ramps 0..k over
  the first k steps and then sits at k (speed_ratio >= 1.5 does; at 1.0 with 64 server rows the sampler never
  gets ahead and lags stay at 2-3 for k = 8).
- `task.num_numbers` is set here because the command line cannot set an `int | None` option.

`arg` = "trace": the long-response variant (the regime the paper is about): every warm-start solution first
checks 5 other candidates, one `expr = value` line each (task option trace_checks), so responses are ~60
tokens instead of ~10 and a sequence's log-weight sums ~60 token log-ratios; 104 new tokens at most, and 400
warm-start steps (at 200 the base model reaches ~4% greedy on these traces).
"""
import ml_collections

from configs import countdown


def get_config(arg: str = "") -> ml_collections.ConfigDict:
  if arg not in ("", "trace"):
    raise ValueError(f"unknown config variant {arg!r}; known: '', 'trace'")
  c = countdown.get_config("emulate")
  c.task.options.countdown.update(num_numbers=2, max_number=40, eval_fraction=0.2)
  c.task.eval_size = 512
  c.rl.emulation.update(lag_model="pipeline", speed_ratio=2.0)
  if arg == "trace":
    c.task.options.countdown.trace_checks = 5
    c.model.max_seq_len = 168   # prompt (<= 62 tokens) + 104 new tokens + 2
    c.rl.max_new_tokens = 104
    c.sft.steps = 400
  return c
