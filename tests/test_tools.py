"""Tool use: the countdown_tools task and its warm-start traces in the chat template's tool format,
and the episode runner's turns, caps, masks, versions and error counts against a hand-built episode."""
import asyncio
import json
import re
from fractions import Fraction

import numpy as np
import pytest

from vcpo_jax import tasks
from vcpo_jax.job import batching, configuration, data
from vcpo_jax.model.tokenizer import build_tokenizer
from vcpo_jax.model.tokenizer import completion_text
from vcpo_jax.rollout import episodes, group_metrics, multiturn, rewards, types
from vcpo_jax.tasks.environments import calculator, tool_calls

TOK = build_tokenizer()
CALC = calculator.environment_of(max_turns=3, max_result_chars=24)
REPLY = TOK.chat_prompt.tool_reply  # tool-message content -> the text that follows a call
# A reply as an episode's text holds it: the end of the call's turn, the tool message, the next turn's start.
REPLY_RE = re.compile(r"<\|im_end\|>\n<\|im_start\|>user\n<tool_response>\n(.*?)\n</tool_response><\|im_end\|>\n"
                      r"<\|im_start\|>assistant\n", re.S)
CALL_RE = re.compile(r'<tool_call>\n(\{"name": "calculator", "arguments": \{"expression": "(.*?)"\}\})\n</tool_call>')


def plain(text: str) -> str:
  """What completion_text gives back for an episode's text: the chat tokens dropped."""
  return text.replace("<|im_end|>", "").replace("<|im_start|>", "")


def C(expression: str) -> str:  # noqa: N802 - a calculator call as the template renders it
  return calculator.call(expression)


# --- task -------------------------------------------------------------------------------------------------

def test_tool_task_traces_are_valid_calls_with_real_replies_and_scored_as_countdown():
  task = tasks.get_task("countdown_tools", num_numbers=3, max_number=10, max_target=100,
                        render_prompt=TOK.chat_prompt)
  assert task.environment().cls is calculator.Calculator
  assert tasks.get_task("countdown").environment() is None
  with pytest.raises(ValueError, match="render_prompt"):
    tasks.get_task("countdown_tools", render_prompt=tasks.get_task("countdown").render_prompt)
  rng = np.random.default_rng(0)
  corrected = 0
  for ex in task.sample(0, 60):
    user = task.user_text(ex["numbers"], ex["target"])
    assert ex["prompt"] == TOK.chat_prompt(user, tools=CALC.declarations())  # the tool declared to the template
    good, bad = task.sft_completion(ex, rng, 0.0), task.sft_completion(ex, rng, 1.0)
    assert task.reward(ex, good) == 1.0 and task.reward(ex, bad) == 0.0
    assert tasks.reward(ex, good) == tasks.countdown_reward(good, ex["numbers"], ex["target"]) == 1.0
    for trace in (good, bad):
      for body, expression in CALL_RE.findall(trace):  # every call parses and is answered with no error
        reply = task.environment().respond(C(expression))
        assert json.loads(body)["arguments"]["expression"] == expression and not reply.error
        assert C(expression) + reply.text in trace
    calls = CALL_RE.findall(good)
    assert calls and REPLY_RE.findall(good)[-1] == str(ex["target"])  # the last check hits the target
    corrected += len(calls) > 1  # a deliberately wrong first check, then the correction
  assert 10 < corrected < 50


def test_search_traces_check_candidates_in_order_until_the_reply_is_the_target():
  """search=True: the reference checks + - * / candidates (larger number first for - and /) in order, every reply
  the calculator's own, until one equals the target, and answers it; the wrong trace answers its first miss
  (skipping a first-place hit), so a trace stops after a miss only when it is wrong."""
  task = tasks.get_task("countdown_tools", num_numbers=2, max_number=25, max_turns=5, search=True,
                        render_prompt=TOK.chat_prompt)
  rng = np.random.default_rng(0)
  for ex in task.sample(0, 200):
    a, b = ex["numbers"]
    order = [f"{a}+{b}", f"{max(a, b)}-{min(a, b)}", f"{a}*{b}", f"{max(a, b)}/{min(a, b)}"]
    values = [Fraction(a + b), Fraction(abs(a - b)), Fraction(a * b), Fraction(max(a, b), min(a, b))]
    hit = values.index(ex["target"])
    good, bad = task.sft_completion(ex, rng, 0.0), task.sft_completion(ex, rng, 1.0)
    assert [e for _, e in CALL_RE.findall(good)] == order[:hit + 1]
    assert all(C(e) + task.environment().respond(C(e)).text in good for e in order[:hit + 1])
    assert REPLY_RE.findall(good)[-1] == str(ex["target"]) not in REPLY_RE.findall(good)[:-1]
    assert good.endswith(f"<answer>{order[hit]}</answer>") and task.reward(ex, good) == 1.0
    first_miss = next(i for i, v in enumerate(values) if v != ex["target"])
    assert [e for _, e in CALL_RE.findall(bad)] == [order[first_miss]]
    assert bad.endswith(f"<answer>{order[first_miss]}</answer>") and task.reward(ex, bad) == 0.0


@pytest.mark.parametrize("knobs,match", [(dict(num_numbers=3, max_turns=5), "num_numbers=2"),
                                         (dict(num_numbers=2, max_turns=4), "max_turns >= 5"),
                                         (dict(num_numbers=2, max_turns=5, search=1), "search must be a bool")])
def test_search_knobs_are_checked(knobs, match):
  with pytest.raises(ValueError, match=match):
    tasks.get_task("countdown_tools", **{"search": True, **knobs})


@pytest.mark.parametrize("variant", ["", "search"])
def test_tool_config_rows_fit_the_longest_trace(variant):
  from configs import countdown_tools
  c = countdown_tools.get_config(variant)
  task = configuration.build_task(c, render_prompt=TOK.chat_prompt)
  rng = np.random.default_rng(1)
  for ex in task.sample(1, 200):
    prompt = len(TOK.encode(ex["prompt"]))
    for error_rate in (0.0, 1.0):
      trace = len(TOK.encode(task.sft_completion(ex, rng, error_rate))) + 1
      assert prompt + trace <= c.model.max_seq_len
      assert trace <= c.rl.max_new_tokens
    assert prompt + c.rl.max_new_tokens <= c.model.max_seq_len - 2  # SGLang's context margin


# --- episodes against a scripted policy -----------------------------------------------------------------

class ScriptedPolicy:
  """Writes the given turn texts in order; records what each /generate-like call received. Token versions
  come from `versions` (one list per turn), like a server whose weights change between turns."""

  def __init__(self, turns, versions=None):
    self.turns, self.versions, self.calls = [TOK.encode(t) for t in turns], versions, []

  async def __call__(self, input_ids, params, n=1):
    assert n == 1
    t = len(self.calls)
    self.calls.append((list(input_ids), dict(params)))
    ids = self.turns[t][:params["max_new_tokens"]]
    vers = self.versions[t] if self.versions else [0] * len(ids)
    lps = [-0.1 * (1 + i % 3) for i in range(len(ids))]
    finish = "stop" if ids and (ids[-1] in TOK.stop_ids or "</tool_call>" in TOK.decode(ids)) else "length"
    return [types.Sample(prompt_ids=list(input_ids), output_ids=ids, output_logprobs=np.asarray(lps, np.float32),
                         token_versions=np.asarray(vers[:len(ids)], np.int64), finish_reason=finish,
                         server_url="scripted", num_resumes=1)]


def _runner(max_turns=3, max_new_tokens=80, context_length=None):
  return episodes.EpisodeRunner(calculator.environment_of(max_turns=max_turns), encode=TOK.encode,
                                decode=lambda ids: completion_text(TOK, ids), stop_ids=TOK.stop_ids,
                                max_new_tokens=max_new_tokens, context_length=context_length)


PROMPT_TEXT = TOK.chat_prompt("Using the numbers [2, 3], make 6.")
PROMPT = TOK.encode(PROMPT_TEXT)
END = "<|im_end|>"


def test_hand_built_episode_masks_logprobs_versions_and_lag():
  turn1, turn2 = C("2*3"), "<answer>2*3</answer>" + END
  v1, v2 = [5] * len(TOK.encode(turn1)), [6] * 5 + [7] * (len(TOK.encode(turn2)) - 5)  # turn 2 straddles
  policy = ScriptedPolicy([turn1, turn2], [v1, v2])
  (sample,) = asyncio.run(_runner().generate(policy, PROMPT, {"max_new_tokens": 80, "sampling_seed": 11}, n=1))
  ids1, tool, ids2 = TOK.encode(turn1), TOK.encode(REPLY("6")), TOK.encode(turn2)
  # Each turn is a generation on the growing input: prompt + earlier turns + tool outputs.
  assert [c[0] for c in policy.calls] == [PROMPT, PROMPT + ids1 + tool]
  assert [c[1]["max_new_tokens"] for c in policy.calls] == [80, 80 - len(ids1) - len(tool)]
  assert all(c[1]["stop"] == ["</tool_call>"] for c in policy.calls)
  seeds = [c[1]["sampling_seed"] for c in policy.calls]
  assert seeds[0] == 11 and seeds[1] != 11  # a later turn does not replay turn 0's random draws
  assert sample.output_ids == ids1 + tool + ids2
  want_mask = [1] * len(ids1) + [0] * len(tool) + [1] * len(ids2)
  np.testing.assert_array_equal(sample.output_mask, want_mask)
  assert (sample.num_turns, sample.tool_calls, sample.tool_errors, sample.finish_reason) == (2, 1, 0, "stop")
  assert sample.num_resumes == 2 and sample.min_version == 5

  group = types.Group(index=0, example={"prompt_ids": PROMPT}, start_version=5, deadline=7, samples=[sample])
  group.sample_lags = [types.sample_lag(sample, 8, group.start_version)]
  assert group.sample_lags == [3]  # learner version 8 - the oldest generated token's version 5
  asyncio.run(rewards.inline(lambda ex, text: 1.0, lambda ids: completion_text(TOK, ids)).score_group(group))
  assert group.completions[0] == plain(turn1 + REPLY("6") + "<answer>2*3</answer>")
  batch = batching.groups_to_batch([group], seq_len=len(PROMPT) + 80, pad_id=TOK.pad_id, num_rows=2)
  P, L = len(PROMPT), len(sample.output_ids)
  row_mask = np.zeros(P + 80)
  row_mask[P:P + L] = want_mask
  np.testing.assert_array_equal(batch.mask_BxT[0], row_mask)
  np.testing.assert_array_equal(batch.tokens_BxT[0, :P + L], PROMPT + sample.output_ids)
  tool_pos = np.arange(P + len(ids1), P + len(ids1) + len(tool))
  assert np.all(batch.sampler_logp_BxT[0, tool_pos] == 0) and np.all(batch.version_BxT[0, tool_pos] == -1)
  gen = row_mask > 0
  np.testing.assert_array_equal(batch.version_BxT[0][gen], v1 + v2)
  np.testing.assert_allclose(batch.sampler_logp_BxT[0][gen], sample.output_logprobs[np.asarray(want_mask) > 0])
  assert batch.lag_B[0] == 3 and batch.mask_BxT[1].sum() == 0


def test_max_turns_caps_the_episode():
  policy = ScriptedPolicy([C("1+1")] * 5)
  (sample,) = asyncio.run(_runner(max_turns=3, max_new_tokens=120).generate(policy, PROMPT, {"max_new_tokens": 1}))
  assert len(policy.calls) == 3 and sample.num_turns == 3
  assert sample.tool_calls == 2 and sample.turn_capped and sample.finish_reason == "length"
  assert completion_text(TOK, sample.output_ids) == plain((C("1+1") + REPLY("2")) * 2 + C("1+1"))


def test_failing_calls_continue_the_episode_and_are_counted():
  policy = ScriptedPolicy([C("1/0"), "<tool_call>\n{\"name\": \"python\"}\n</tool_call>",
                           "<tool_call>\nnot json\n</tool_call>", "<answer>1</answer>" + END])
  (sample,) = asyncio.run(_runner(max_turns=4, max_new_tokens=300).generate(policy, PROMPT, {"max_new_tokens": 1}))
  assert (sample.num_turns, sample.tool_calls, sample.tool_errors) == (4, 3, 3)
  assert sample.tool_error_kinds == {"tool": 1, "malformed": 1, "json": 1}
  text = completion_text(TOK, sample.output_ids)
  assert plain(REPLY("error: division by zero")) in text and plain(REPLY(tool_calls.ERROR_KINDS["json"])) in text
  metrics = group_metrics.episode_metrics([types.Group(0, {}, 0, 0, samples=[sample, sample])])
  assert metrics["tools/calls_per_episode"] == 3 and metrics["tools/error_rate"] == 1.0
  assert metrics["tools/turns_per_episode"] == 4 and metrics["tools/errors/json"] == 1
  assert metrics["tools/errors/unknown_tool"] == 0 and set(metrics) >= {f"tools/errors/{k}" for k in tool_calls.ERROR_KINDS}
  single_turn = types.Sample([1], [2], np.zeros(1), np.zeros(1), "stop", "")
  assert group_metrics.episode_metrics([types.Group(0, {}, 0, 0, samples=[single_turn])]) == {}


def test_episode_length_is_capped_and_a_reply_that_does_not_fit_ends_it():
  calls = C("1+1")
  n_call, n_reply = len(TOK.encode(calls)), len(TOK.encode(REPLY("2")))
  # Room for the call and its reply, but not for one more generated token: the reply is not appended.
  policy = ScriptedPolicy([calls] * 3)
  (sample,) = asyncio.run(_runner(max_new_tokens=n_call + n_reply).generate(policy, PROMPT, {"max_new_tokens": 1}))
  assert sample.output_ids == TOK.encode(calls) and sample.tool_calls == 0 and sample.finish_reason == "length"
  # A longer budget: the second turn is cut by the budget (max_new_tokens = what is left).
  policy = ScriptedPolicy([calls] * 3)
  budget = n_call + n_reply + 4
  (sample,) = asyncio.run(_runner(max_new_tokens=budget).generate(policy, PROMPT, {"max_new_tokens": 1}))
  assert len(sample.output_ids) == budget and policy.calls[1][1]["max_new_tokens"] == 4
  # The servers' context length caps every turn's input: no request that SGLang would refuse is sent.
  policy = ScriptedPolicy([calls] * 3)
  (sample,) = asyncio.run(_runner(context_length=len(PROMPT) + n_call + n_reply + 4).generate(
      policy, PROMPT, {"max_new_tokens": 1}))
  assert len(policy.calls) == 1 and sample.finish_reason == "length"


def test_a_marker_split_by_an_abort_resume_is_still_cut():
  # A resumed request's new segment alone lacks the stop string, so the server ran on past it: the runner
  # cuts the turn at the marker (the kept tokens' distribution is what stopping would have given).
  policy = ScriptedPolicy([C("2+2") + "garbage after", "<answer>4</answer>" + END])
  (sample,) = asyncio.run(_runner().generate(policy, PROMPT, {"max_new_tokens": 80}))
  assert completion_text(TOK, sample.output_ids) == plain(C("2+2") + REPLY("4") + "<answer>4</answer>")
  assert sample.tool_calls == 1 and sample.finish_reason == "stop"


def test_first_stop_finds_the_fewest_tokens():
  ids = TOK.encode("ab</tool_call>cd</tool_call>")
  assert multiturn.first_stop(ids, TOK.decode, ["</tool_call>"]) == 14
  assert multiturn.first_stop(TOK.encode(C("1") + "x"), TOK.decode, ["</tool_call>"]) == 3  # inside a piece
  assert multiturn.first_stop(ids, TOK.decode, ["zz"]) is None


# --- warm start: the SFT row of a trace is the episode's row, tool replies are not targets -----------------

def test_sft_row_of_a_hand_built_trace_targets_exactly_the_generated_tokens():
  turns = [C("2+3"), C("2*3"), "<answer>2*3</answer>"]
  replies = [REPLY("5"), REPLY("6")]
  trace = turns[0] + replies[0] + turns[1] + replies[1] + turns[2]
  tokens_T, mask_T = data.encode_sft_example(TOK, PROMPT_TEXT, trace, seq_len=len(PROMPT) + 100, env=CALC)
  gen = lambda t: (TOK.encode(t), [1.0] * len(TOK.encode(t)))  # noqa: E731
  tool = lambda t: (TOK.encode(t), [0.0] * len(TOK.encode(t)))  # noqa: E731
  parts = [gen(turns[0]), tool(replies[0]), gen(turns[1]), tool(replies[1]), gen(turns[2]), ([TOK.eos_id], [1.0])]
  want_ids, want_mask = sum((p[0] for p in parts), []), sum((p[1] for p in parts), [])
  P, L = len(PROMPT), len(want_ids)
  np.testing.assert_array_equal(tokens_T[:P + L], PROMPT + want_ids)
  np.testing.assert_array_equal(mask_T, [0.0] * P + want_mask + [0.0] * (len(mask_T) - P - L))
  # The same trace written turn by turn as an episode: the same tokens and the same mask.
  policy = ScriptedPolicy([turns[0], turns[1], turns[2] + END])
  (sample,) = asyncio.run(_runner().generate(policy, PROMPT, {"max_new_tokens": 80}))
  assert sample.output_ids == want_ids
  np.testing.assert_array_equal(sample.output_mask, want_mask)
  # Without an environment (single-turn tasks) the whole completion is the target.
  _, plain_T = data.encode_sft_example(TOK, PROMPT_TEXT, trace, seq_len=len(PROMPT) + 100)
  assert plain_T.sum() == L


@pytest.mark.parametrize("trace,match", [
    (C("2+3") + REPLY("7") + "<answer>5</answer>", "not its reply"),  # a forged reply
    (C("2+3") + " " + REPLY("5"), "not its reply"),
    ((C("1") + REPLY("1")) * 3 + "<answer>1</answer>", "max_turns=3"),  # an episode stops earlier
])
def test_traces_no_episode_could_hold_are_refused(trace, match):
  with pytest.raises(ValueError, match=match):
    data.encode_sft_example(TOK, PROMPT_TEXT, trace, seq_len=200, env=CALC)


def test_tool_task_sft_batches_mask_exactly_the_replies():
  task = tasks.get_task("countdown_tools", num_numbers=3, max_number=10, max_target=100, max_turns=3,
                        render_prompt=TOK.chat_prompt)
  batch = next(data.make_sft_iterator(task, TOK, seed=3, batch_size=16, seq_len=200, error_rate=0.5,
                                      shard_index=0, shard_count=1, prefetch=0))
  replies = 0
  for tokens_T, mask_T in zip(batch["tokens"], batch["mask"]):
    start, end = np.flatnonzero(mask_T)[[0, -1]]
    text = TOK.decode(tokens_T[start:end])
    want = [m.group(0) for m in REPLY_RE.finditer(text)]
    response_T, target_T = tokens_T[start:end + 1], mask_T[start:end + 1] > 0
    assert TOK.decode(response_T[~target_T]) == "".join(want)
    assert TOK.decode(response_T[target_T][:-1]) == REPLY_RE.sub("", text)
    replies += len(want)
  assert replies >= 8
