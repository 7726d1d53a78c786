"""Multi-turn tool use with a Python code tool: products of 4-6 digit numbers, computed by a sandboxed `python` call.

The main job's config (configs/countdown.py) with the arithmetic_code task: every rollout is an episode of up to
task.options.arithmetic_code.max_turns model turns; a `<tool_call>{"name": "python", "arguments": {"code":
...}}</tool_call>` runs the code in the sandbox (tasks/environments/sandbox.py) and its stdout comes back as a
`<tool_response>` tool turn with mask 0. Async VCPO at k = 2 (rl.max_lag, the http backend), warm-started from
traces that call the tool. Sized like configs/countdown_tools.py:search for 2 CPU cores.
"""
import ml_collections

from configs import countdown


def get_config(arg: str = "") -> ml_collections.ConfigDict:
  """`arg`: as in configs/countdown.py: '' (async, embedded server), 'sync' or 'emulate'."""
  c = countdown.get_config(arg)
  c.task.name = "arithmetic_code"
  # a * b with 4-6 digit operands (a 3-layer model cannot multiply them; it can copy them into print(a*b) and
  # copy the reply into its answer). max_turns 3: a call, and one retry after a failed one. The sandbox's
  # limits per call: 2 s wall, 1 s CPU, 256 MB. exact_prints answers `print(<integer literals with + - *>)`
  # from its syntax tree (the same text Python prints) instead of starting the sandbox: a sandboxed call costs
  # about 65 ms of CPU (two interpreter start-ups), which the warm start's traces (one call each) and ~10k
  # rollout episodes cannot afford on 2 cores; any other code the model writes runs in the sandbox
  # (--config.task.options.arithmetic_code.exact_prints=False sends every call there).
  c.task.options.arithmetic_code.update(
      min_digits=4, max_digits=6, ops="*", eval_fraction=0.1, max_turns=3, wall_seconds=2.0, cpu_seconds=1,
      memory_mb=256, exact_prints=True)
  # A prompt (with the tools' system turn) is <= 66 tokens; a warm-start trace <= 127 + the stop token
  # (tests/test_python_tool.py checks both over many draws).
  c.model.max_seq_len = 256
  c.rl.max_new_tokens = 160  # a call, its reply and the answer (~128), or a failed call and part of a retry
  # 60% of the warm-start traces are wrong in one systematic way (wrong_kinds=slip, tasks/arithmetic_code.py):
  # the code copies the second operand with its first digit one higher, and the reply, a wrong product, is
  # answered faithfully. The slip competes with the right copy at one token, so the warm start's greedy answer
  # follows it on many problems (greedy 28-45% over 3 seeds), and RL on the reward removes it (docs/results/tool-use.md).
  # At 0.5 the warm starts' greedy accuracy spread wider (19-47%), and so did the gains
  # (docs/results/code_tools_slip50/). The mixed random kinds (the task's default) only spread the sampled mass:
  # their warm start was already 69-85% right greedy (docs/results/code_tools_mixed/).
  # 400 warm-start steps: at 300 one seed in three sampled almost no right answer (2% held-out at T = 1, rollout
  # reward ~0.03), too little signal for RL. RL gains most in its first ~20 steps: 60 RL steps keep a whole run
  # within ~20 minutes on 2 cores.
  c.task.options.arithmetic_code.wrong_kinds = "slip"
  c.sft.update(steps=400, batch_size=32, error_rate=0.6)
  c.rl.update(steps=60, prompts_per_step=16, group_size=8)
  c.task.eval_size = 256
  c.eval_every = 20
  c.checkpoint_every = 20
  # The tools pool's per-call timeout is a second line of defence above the sandbox's own wall limit.
  c.tools.timeout_s = 10.0
  return c
