"""Tests for tasks' rewards: adversarial Countdown and arithmetic completions, answer extraction, tolerances."""
import pytest

from vcpo_jax import tasks
from vcpo_jax.tasks import countdown


# --- countdown reward: adversarial -----------------------------------------------------------------------

CD = {"task": "countdown", "numbers": [2, 3, 5, 7], "target": 29}  # 7 * 5 - 3 * 2


def _cd(text, example=CD):
  return tasks.reward(example, text)


@pytest.mark.parametrize("completion,expected", [
    ("<answer>7*5 - 3*2</answer>", 1.0),
    ("<answer>\n 7 * 5 -\n3 * 2 \n</answer>", 1.0),
    ("think first... <answer>(5 * 7) - (2 * 3)</answer><|im_end|>", 1.0),
    ("<answer>7*5 - 3*3</answer>", 0.0),            # reused 3, missing 2
    ("<answer>7*5 - 6</answer>", 0.0),              # missing numbers
    ("<answer>7*5 - 3*2 + 0</answer>", 0.0),        # extra number
    ("<answer>7*5 - 3*2*1</answer>", 0.0),          # extra number that does not change the value
    ("<answer>7*5 - 3 - 2</answer>", 0.0),          # right numbers, wrong value
    ("<answer>7*5 - 3*2/0</answer>", 0.0),
    ("<answer>7**5 - 3*2</answer>", 0.0),
    ("<answer>" + "9" * 500 + "</answer>", 0.0),
    ("<answer>" + "9" * 100 + "</answer>", 0.0),
    ("<answer>__import__('os').system('true')</answer>", 0.0),
    ("<answer>7*5 - 3*2; 1</answer>", 0.0),
    ("<answer>(lambda: 29)()</answer>", 0.0),
    ("<answer>7*5 - 3*2 if 1 else 0</answer>", 0.0),
    ("<answer>x = 7*5 - 3*2</answer>", 0.0),
    ("<answer>7*5 - 3*2 = 29</answer>", 0.0),       # '=' is not in the allowed set
    ("<answer></answer>", 0.0),
    ("<answer>   </answer>", 0.0),
    ("7*5 - 3*2", 0.0),                             # no answer block at all
    ("<answer>7*5 - 3*2", 0.0),                     # unclosed (truncated) block
    ("\\boxed{7*5 - 3 - 2} then \\boxed{7*5 - 3*2}", 1.0),   # last boxed wins
    ("\\boxed{7*5 - 3*2} then \\boxed{7*5 - 3 - 2}", 0.0),
    ("<answer>7*5 - 3*2</answer> \\boxed{7*5 - 3 - 2}", 0.0),  # boxed beats answer blocks
    ("\\boxed{7*5 - 3*2} <answer>7*5 - 3 - 2</answer>", 1.0),
    ("<answer>7*5 - 3*2</answer> \\boxed{7*5 - 3*2", 1.0),    # unclosed boxed: fall back to answer
    ("<answer>2+3</answer> <answer>7*5 - 3*2</answer>", 1.0),  # last answer block wins
    ("<answer>7*5 - 3*2</answer> <answer>2+3</answer>", 0.0),
    ("<answer>7*5 - 3*2 <answer>2 + 3</answer>", 0.0),        # innermost last block is the answer
    ("<answer>7.0*5 - 3*2.00</answer>", 1.0),                  # decimal literals equal to the numbers
    ("<answer>7*5 - 3*2.5</answer>", 0.0),
    ("<answer>-(2*3) + 7*5</answer>", 1.0),                    # unary minus is allowed
    ("<answer>+7*5 - 3*2</answer>", 0.0),                      # unary plus is not
])
def test_countdown_reward_adversarial(completion, expected):
  assert _cd(completion) == expected


def test_countdown_reward_length_limit():
  body = "7*5 - 3*2"
  ok = "<answer>" + body + " " * (countdown.MAX_ANSWER_CHARS - len(body)) + "</answer>"
  too_long = "<answer>" + body + " " * (countdown.MAX_ANSWER_CHARS - len(body) + 1) + "</answer>"
  assert _cd(ok) == 1.0
  assert _cd(too_long) == 0.0


def test_answer_extraction_edge_cases():
  assert tasks.extract_answer("\\boxed{\\boxed{1 + 2}}") == "1 + 2"
  assert tasks.extract_answer("\\boxed{{1} + 2} x") == "{1} + 2"
  assert tasks.extract_answer("\\boxed{" * 5000 + "<answer>7*5 - 3*2</answer>") == "7*5 - 3*2"
  assert tasks.extract_answer("<answer>1</answer> \\boxed{" + "1" * 2000 + "}") == "1"  # over-long boxed
  assert tasks.extract_answer("no answer here") is None
  assert _cd("\\boxed{" * 5000 + "<answer>7*5 - 3*2</answer>") == 1.0


def test_countdown_reward_float_tolerance_and_exactness():
  assert _cd("<answer>10 / 3 * 3</answer>", {"task": "countdown", "numbers": [10, 3, 3], "target": 10}) == 1
  # 10.000001 is within 1e-5 of 10; 10.00001 is not (strict inequality).
  near = {"task": "countdown", "numbers": [10000001, 1000000], "target": 10}
  assert _cd("<answer>10000001 / 1000000</answer>", near) == 1.0
  edge = {"task": "countdown", "numbers": [1000001, 100000], "target": 10}
  assert _cd("<answer>1000001 / 100000</answer>", edge) == 0.0


def test_countdown_reward_duplicates_and_huge_chains():
  dup = {"task": "countdown", "numbers": [5, 5, 3], "target": 22}
  assert _cd("<answer>5 * 5 - 3</answer>", dup) == 1.0
  assert _cd("<answer>5 * 5 - 3 + 0 * 5</answer>", dup) == 0.0
  huge = {"task": "countdown", "numbers": [99999] * 4, "target": 99999 ** 4}
  assert _cd("<answer>99999 * 99999 * 99999 * 99999</answer>", huge) == 0.0  # intermediate > 1e12


# --- arithmetic reward -------------------------------------------------------------------------------------

AR = {"task": "arithmetic", "a": 12, "b": 17, "op": "-"}


@pytest.mark.parametrize("completion,expected", [
    ("<answer>-5</answer>", 1.0), ("<answer> -5\n</answer>", 1.0), ("\\boxed{-5}", 1.0),
    ("<answer>-005</answer>", 1.0), ("<answer>5</answer>", 0.0), ("<answer>-5.0</answer>", 0.0),
    ("<answer>+-5</answer>", 0.0), ("<answer>12 - 17</answer>", 0.0), ("<answer>-5</answer><answer>4</answer>", 0.0),
    ("<answer>-4</answer> \\boxed{-5}", 1.0), ("-5", 0.0), ("<answer></answer>", 0.0),
    ("<answer>" + "9" * 500 + "</answer>", 0.0)])
def test_arithmetic_reward(completion, expected):
  assert tasks.reward(AR, completion) == expected
