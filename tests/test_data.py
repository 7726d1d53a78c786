"""Tests for the grain pipelines: determinism, resumable state (JSON and orbax), sharding, SFT batches."""
import grain
import numpy as np
import orbax.checkpoint as ocp
import pytest

from vcpo_jax import tasks
from vcpo_jax.job import data
from vcpo_jax.model.tokenizer import build_tokenizer

TOK = build_tokenizer()
COUNTDOWN = tasks.get_task("countdown")
ARITH = tasks.get_task("arithmetic")


def _take(it, n, field="index"):
  return [next(it)[field] for _ in range(n)]


def _continue_after_restore(make, skip: int = 7, take: int = 5):
  """Take `skip`, save the state, take `take` (expected); restore into a fresh iterator, take `take`."""
  it = make()
  for _ in range(skip):
    next(it)
  state = it.get_state()
  expected = [next(it) for _ in range(take)]
  fresh = make()
  fresh.set_state(state)
  return expected, [next(fresh) for _ in range(take)]


@pytest.mark.parametrize("batch_size", [None, 3])
def test_resume_from_state_continues_the_same_order(batch_size):
  make = lambda: data.make_prompt_iterator(COUNTDOWN, seed=11, batch_size=batch_size, shard_index=0,
                                           shard_count=1)
  expected, resumed = _continue_after_restore(make)
  assert resumed == expected


def test_resume_through_json_file(tmp_path):
  it = data.make_prompt_iterator(ARITH, seed=2, shard_index=1, shard_count=3)
  _take(it, 7)
  data.save_iterator_state(it, tmp_path / "iter.json")
  expected = _take(it, 5, "key")
  fresh = data.restore_iterator_state(data.make_prompt_iterator(ARITH, seed=2, shard_index=1, shard_count=3),
                                      tmp_path / "iter.json")
  assert _take(fresh, 5, "key") == expected
  with pytest.raises(ValueError, match="does not exist"):
    data.restore_iterator_state(fresh, tmp_path / "missing.json")


def test_resume_through_orbax_checkpoint_manager_with_grain_handler(tmp_path):
  it = data.make_prompt_iterator(COUNTDOWN, seed=5, shard_index=0, shard_count=1)
  _take(it, 7)
  with ocp.CheckpointManager(tmp_path / "ckpt") as mgr:
    mgr.save(7, args=ocp.args.Composite(data_iter=grain.checkpoint.CheckpointSave(it)))
    mgr.wait_until_finished()
    expected = _take(it, 5, "key")
    fresh = data.make_prompt_iterator(COUNTDOWN, seed=5, shard_index=0, shard_count=1)
    restored = mgr.restore(7, args=ocp.args.Composite(data_iter=grain.checkpoint.CheckpointRestore(fresh)))
  assert _take(restored["data_iter"], 5, "key") == expected


def test_order_is_seeded_and_examples_are_a_function_of_their_index():
  a = data.make_prompt_iterator(COUNTDOWN, seed=1, problem_seed=0, shard_index=0, shard_count=1)
  b = data.make_prompt_iterator(COUNTDOWN, seed=2, problem_seed=0, shard_index=0, shard_count=1)
  ex_a = [next(a) for _ in range(40)]
  ex_b = [next(b) for _ in range(40)]
  assert [e["index"] for e in ex_a] != [e["index"] for e in ex_b]
  by_index = {e["index"]: e for e in ex_a}
  shared = [e for e in ex_b if e["index"] in by_index]
  for e in shared:
    assert e == by_index[e["index"]]
  again = data.make_prompt_iterator(COUNTDOWN, seed=1, problem_seed=0, shard_index=0, shard_count=1)
  assert [next(again) for _ in range(40)] == ex_a
  assert all(COUNTDOWN.split_of(e) == "train" for e in ex_a)


def test_epochs_are_permutations_reshuffled_each_epoch():
  it = data.make_prompt_iterator(ARITH, seed=0, num_examples=20, shard_index=0, shard_count=1)
  first, second = _take(it, 20), _take(it, 20)
  assert sorted(first) == sorted(second) == list(range(20))
  assert first != second and first != list(range(20))
  finite = data.make_prompt_iterator(ARITH, seed=0, num_examples=20, num_epochs=2, shard_index=0,
                                     shard_count=1)
  assert len(list(finite)) == 40


def test_shards_are_disjoint_and_cover_the_data():
  seen = []
  for shard in range(4):
    it = data.make_prompt_iterator(ARITH, seed=3, num_examples=50, num_epochs=1, shard_index=shard,
                                   shard_count=4)
    seen.append([e["index"] for e in it])
  flat = [i for s in seen for i in s]
  assert sorted(flat) == list(range(50))
  assert all(len(s) in (12, 13) for s in seen)


def test_default_shard_is_this_jax_process():
  it = data.make_prompt_iterator(ARITH, seed=3, num_examples=10, num_epochs=1)
  assert sorted(e["index"] for e in it) == list(range(10))  # one process: the whole data set


def test_prompt_ids_and_batches():
  it = data.make_prompt_iterator(COUNTDOWN, seed=0, batch_size=4, tokenizer=TOK, shard_index=0,
                                 shard_count=1)
  batch = next(it)
  assert isinstance(batch, list) and len(batch) == 4
  for ex in batch:
    assert ex["prompt_ids"] == TOK.encode(ex["prompt"])
    assert TOK.decode(ex["prompt_ids"]) == ex["prompt"]


def test_eval_split_is_the_fixed_distinct_eval_set():
  it = data.make_prompt_iterator(COUNTDOWN, seed=9, split="eval", num_examples=30, shard_index=0,
                                 shard_count=1)
  got = list(it)
  assert [{k: v for k, v in e.items() if k != "index"} for e in got] == COUNTDOWN.eval_set(30, seed=9)
  assert all(COUNTDOWN.split_of(e) == "eval" for e in got)


def test_bad_arguments_name_the_field():
  for kwargs, field in [({"split": "test"}, "split"), ({"batch_size": 0}, "batch_size"),
                        ({"shard_index": 2, "shard_count": 2}, "shard_index"),
                        ({"shard_count": 0}, "shard_count"), ({"num_examples": -5}, "num_examples"),
                        ({"problem_seed": -1}, "problem_seed")]:
    with pytest.raises(ValueError, match=field):
      data.make_prompt_iterator(ARITH, seed=0, **kwargs)
  with pytest.raises(ValueError, match="seed"):
    data.make_prompt_iterator(ARITH, seed=2 ** 32)
  with pytest.raises(ValueError, match="error_rate"):
    data.make_sft_iterator(ARITH, TOK, seed=0, batch_size=2, seq_len=64, error_rate=-0.1)
  with pytest.raises(ValueError, match="seq_len=8"):
    data.encode_sft_example(TOK, "<|im_start|>user\nCompute 1 + 2.", "<answer>3</answer>", seq_len=8)


# --- SFT ---------------------------------------------------------------------------------------------------

def test_encode_sft_example_layout():
  prompt = COUNTDOWN.sample(0, 1)[0]["prompt"]
  completion = "<answer>1 + 2</answer>"
  tokens_T, mask_T = data.encode_sft_example(TOK, prompt, completion, seq_len=80)
  n_prompt, n_resp = len(TOK.encode(prompt)), len(TOK.encode(completion)) + 1
  assert tokens_T.dtype == np.int32 and mask_T.dtype == np.float32 and tokens_T.shape == mask_T.shape == (80,)
  assert TOK.decode(tokens_T[:n_prompt + n_resp]) == prompt + completion + "<|im_end|>"
  assert (tokens_T[n_prompt + n_resp:] == TOK.pad_id).all()
  assert (mask_T[:n_prompt] == 0).all() and (mask_T[n_prompt:n_prompt + n_resp] == 1).all()
  assert (mask_T[n_prompt + n_resp:] == 0).all()


@pytest.mark.parametrize("error_rate", [0.0, 1.0])
def test_sft_batches_carry_correct_or_wrong_completions(error_rate):
  it = data.make_sft_iterator(ARITH, TOK, seed=4, batch_size=8, seq_len=48, error_rate=error_rate,
                              shard_index=0, shard_count=1)
  batch = next(it)
  assert batch["tokens"].shape == batch["mask"].shape == (8, 48) and batch["reward"].shape == (8,)
  for tokens_T, mask_T, reward in zip(batch["tokens"], batch["mask"], batch["reward"]):
    text = TOK.decode(tokens_T, skip_special_tokens=False)
    prompt_end = text.index("<|im_start|>assistant\n") + len("<|im_start|>assistant\n")
    response_ids = tokens_T[mask_T == 1]
    assert response_ids[-1] == TOK.eos_id
    completion = TOK.decode(response_ids[:-1])
    assert text.startswith(text[:prompt_end] + completion)
    a, op, b = text[len("<|im_start|>user\nCompute "):].split(".")[0].split(" ")
    example = {"task": "arithmetic", "a": int(a), "op": op, "b": int(b)}
    assert tasks.reward(example, completion) == reward == 1.0 - error_rate


def test_sft_iterator_resumes():
  make = lambda: data.make_sft_iterator(COUNTDOWN, TOK, seed=1, batch_size=2, seq_len=96, error_rate=0.5,
                                        shard_index=0, shard_count=1)
  expected, resumed = _continue_after_restore(make)
  for want, got in zip(expected, resumed):
    for k in want:
      np.testing.assert_array_equal(got[k], want[k])
