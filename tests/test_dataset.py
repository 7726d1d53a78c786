"""The dataset task: verl-schema and plain rows from JSONL and parquet, the grain order (shuffle, shards, resume),
prompts through the chat template, warm-start targets, context fitting, and every bad input's error."""
import json
import os
import re

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from configs import dataset as dataset_config
from vcpo_jax.tasks.files import word_problems as make_word_problems
from vcpo_jax import tasks
from vcpo_jax.job import configuration, data, startup_errors
from vcpo_jax.model import tokenizer as tokenizer_lib
from vcpo_jax.tasks.files import reading as dataset_files

TOK = tokenizer_lib.build_tokenizer()
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def word_problems(tmp_path_factory):
  return make_word_problems.write(str(tmp_path_factory.mktemp("wp")), train_size=40, test_size=12, seed=3)


def _task(files, split_files=None, **options):
  train, test = split_files or (files["train.parquet"], files["test.parquet"])
  return tasks.get_task("dataset", train_files=train, eval_files=test, verifier="gsm8k", **options)


def _write_jsonl(path, rows):
  path.write_text("".join(json.dumps(r) + "\n" for r in rows))
  return str(path)


def _verl_row(i, **over):
  row = {"data_source": "openai/gsm8k", "prompt": [{"role": "system", "content": "Be brief."},
                                                    {"role": "user", "content": f"What is {i} + {i}?"}],
         "ability": "math", "reward_model": {"style": "rule", "ground_truth": str(2 * i)},
         "extra_info": {"split": "train", "index": i}}
  row.update(over)
  return row


# --------------------------------------------------------------------------------------------- schemas
def test_verl_parquet_round_trip(tmp_path):
  rows = [_verl_row(i) for i in range(5)]
  path = str(tmp_path / "train.parquet")
  pq.write_table(pa.Table.from_pylist(rows), path)
  assert [r for _, r in dataset_files.read_rows(path)] == rows   # pyarrow gives back exactly what was written
  task = tasks.get_task("dataset", train_files=path, eval_files=path, verifier="gsm8k")
  examples = task.train_examples()
  assert [e["messages"] for e in examples] == [r["prompt"] for r in rows]
  assert [e["ground_truth"] for e in examples] == [r["reward_model"]["ground_truth"] for r in rows]
  assert [e["extra_info"] for e in examples] == [r["extra_info"] for r in rows]
  assert {e["data_source"] for e in examples} == {"openai/gsm8k"}
  # A verl message list is rendered as it is (system turn included), in the task's ChatML.
  assert examples[1]["prompt"] == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 1 + 1?"
                                   "<|im_end|>\n<|im_start|>assistant\n")
  assert task.reward(examples[1], "#### 2") == 1.0 and task.reward(examples[1], "#### 3") == 0.0


def test_plain_rows_with_configured_keys_system_prompt_and_instruction(tmp_path):
  rows = [{"q": f"Add {i} and {i}.", "a": 2 * i, "work": f"{i}+{i}\n\\boxed{{{2 * i}}}", "level": i % 2}
          for i in range(4)]
  path = _write_jsonl(tmp_path / "plain.jsonl", rows)
  task = tasks.get_task("dataset", train_files=path, eval_files=path, question_key="q", answer_key="a",
                        solution_key="work", system_prompt="Think.", instruction="Answer in \\boxed{}.",
                        verifier="numeric")
  ex = task.train_examples()[3]
  assert ex["messages"] == [{"role": "system", "content": "Think."},
                            {"role": "user", "content": "Add 3 and 3. Answer in \\boxed{}."}]
  assert ex["ground_truth"] == "6" and ex["data_source"] == "plain"       # the file's stem by default
  assert ex["extra_info"] == {"level": 1}                                  # other columns travel along
  assert task.reference_solution(ex) == rows[3]["work"]
  assert task.reward(ex, task.reference_solution(ex)) == 1.0


def test_prompts_use_a_pretrained_tokenizers_chat_template(tmp_path, word_problems):
  transformers = pytest.importorskip("transformers")
  model_dir = tmp_path / "tok"
  TOK.save(model_dir)                                    # a tokenizer directory with a chat template
  theirs = transformers.AutoTokenizer.from_pretrained(str(model_dir))
  ours = tokenizer_lib.load_pretrained(str(model_dir))
  rows = [_verl_row(i) for i in range(2)] + [{"question": "Why?", "answer": "1"}]
  verl_path, plain_path = _write_jsonl(tmp_path / "v.jsonl", rows[:2]), _write_jsonl(tmp_path / "p.jsonl", rows[2:])
  task = tasks.get_task("dataset", train_files=[verl_path, plain_path], eval_files=verl_path,
                        render_prompt=ours.chat_prompt, instruction="Be exact.")
  for ex in task.train_examples():
    assert ex["prompt"] == theirs.apply_chat_template(ex["messages"], tokenize=False, add_generation_prompt=True)
  assert task.train_examples()[2]["messages"] == [{"role": "user", "content": "Why? Be exact."}]


def test_verifier_per_data_source(tmp_path):
  rows = [_verl_row(1, data_source="a"), _verl_row(2, data_source="b")]
  path = _write_jsonl(tmp_path / "mixed.jsonl", rows)
  task = tasks.get_task("dataset", train_files=path, eval_files=path, verifier="gsm8k",
                        verifier_by_source="b=exact")
  a, b = task.train_examples()
  assert task.reward(a, "#### 2") == 1.0 and task.reward(b, "#### 4") == 0.0   # exact wants "4" itself
  assert task.reward(b, "\\boxed{4}") == 1.0


# --------------------------------------------------------------------------------------- grain order
def _batches(it, n):
  return [next(it) for _ in range(n)]


def test_jsonl_and_parquet_give_identical_batches(word_problems):
  from_parquet = _task(word_problems)
  from_jsonl = _task(word_problems, (word_problems["train.jsonl"], word_problems["test.jsonl"]))
  for t in (from_parquet, from_jsonl):
    t.use_chat_template(TOK.chat_prompt).fit_context(TOK, 144, 40)
  kw = dict(seed=5, batch_size=4, tokenizer=TOK, shard_index=0, shard_count=1, prefetch=0)
  a = _batches(data.make_prompt_iterator(from_parquet, **kw), 15)     # 60 > 40 rows: crosses an epoch
  b = _batches(data.make_prompt_iterator(from_jsonl, **kw), 15)
  assert a == b
  assert from_parquet.eval_set(100) == from_jsonl.eval_set(100) and len(from_parquet.eval_set(100)) == 12
  sft_kw = dict(seed=5, batch_size=4, seq_len=144, error_rate=0.5, shard_index=0, shard_count=1, prefetch=0)
  sa = _batches(data.make_sft_iterator(from_parquet, TOK, **sft_kw), 12)
  sb = _batches(data.make_sft_iterator(from_jsonl, TOK, **sft_kw), 12)
  for x, y in zip(sa, sb):
    for key in x:
      np.testing.assert_array_equal(x[key], y[key])
  rewards = np.concatenate([x["reward"] for x in sa])
  assert 0 < rewards.mean() < 1                         # error_rate 0.5: right and wrong targets both


def test_rows_are_shuffled_by_epoch_and_sharded_by_process(word_problems):
  task = _task(word_problems)
  n = len(task.train_examples())
  it = data.make_prompt_iterator(task, seed=1, shard_index=0, shard_count=1, prefetch=0)
  epochs = [[next(it)["index"] for _ in range(n)] for _ in range(2)]
  assert sorted(epochs[0]) == sorted(epochs[1]) == list(range(n))
  assert epochs[0] != epochs[1] and epochs[0] != list(range(n))
  shards = [data.make_prompt_iterator(task, seed=1, shard_index=i, shard_count=2, prefetch=0) for i in range(2)]
  halves = [[next(s)["index"] for _ in range(n // 2)] for s in shards]
  assert sorted(halves[0] + halves[1]) == list(range(n))
  other_seed = data.make_prompt_iterator(task, seed=2, shard_index=0, shard_count=1, prefetch=0)
  assert [next(other_seed)["index"] for _ in range(n)] != epochs[0]


def test_a_resumed_iterator_continues_the_exact_data_order(word_problems, tmp_path):
  task = _task(word_problems)
  kw = dict(seed=7, batch_size=3, tokenizer=TOK, shard_index=0, shard_count=1)
  it = data.make_prompt_iterator(task, **kw)
  _batches(it, 11)
  data.save_iterator_state(it, tmp_path / "state.json")
  want = _batches(it, 20)                               # past the end of an epoch (40 rows)
  resumed = data.restore_iterator_state(data.make_prompt_iterator(_task(word_problems), **kw),
                                        tmp_path / "state.json")
  assert _batches(resumed, 20) == want


# ---------------------------------------------------------------------------------- context and SFT
def test_rows_longer_than_the_context_are_skipped_and_counted(tmp_path, caplog):
  rows = [{"question": "x" * n, "answer": "1", "solution": "y" * s} for n, s in ((5, 5), (60, 5), (5, 60), (5, 5))]
  path = _write_jsonl(tmp_path / "lengths.jsonl", rows)
  task = tasks.get_task("dataset", train_files=path, eval_files=path, verifier="exact")
  prompt_ids = len(TOK.encode(task.train_examples()[0]["prompt"]))      # the 5-char question's prompt
  with caplog.at_level("INFO"):
    counts = task.fit_context(TOK, max_seq_len=prompt_ids + 30, max_new_tokens=20)
  assert counts == {"dataset/skipped_train_rows": 1, "dataset/skipped_eval_rows": 1, "dataset/skipped_sft_rows": 1}
  assert "skipped" in caplog.text
  assert [e["solution"] for e in task.train_examples()] == ["y" * 5, "y" * 60, "y" * 5]
  assert [e["solution"] for e in task.sft_examples()] == ["y" * 5, "y" * 5]
  assert len(task.eval_set(10)) == 3
  with pytest.raises(ValueError, match=r"task.options.dataset.train_files: no row fits max_seq_len=10"):
    task.fit_context(TOK, max_seq_len=10, max_new_tokens=5)


def test_warm_start_targets_right_and_wrong(word_problems):
  task = _task(word_problems)
  rng = np.random.default_rng(0)
  for ex in task.train_examples():
    assert task.reward(ex, task.reference_solution(ex)) == 1.0
    wrong = task.wrong_completion(ex, rng)
    assert task.reward(ex, wrong) == 0.0 and "\\boxed{" in wrong
    # One systematic slip: the last step's result is one more, in the work and in the box alike.
    slip = str(int(ex["ground_truth"]) + 1)
    assert wrong.endswith(f"= {slip}\n\\boxed{{{slip}}}") and wrong == task.wrong_completion(ex, rng)


def test_a_slip_without_a_box_is_boxed_on_the_slipped_work(tmp_path):
  # The last step's `= N` is the only place N appears: the slip goes there, and the appended box carries it too.
  rows = [{"question": f"What is 3 + {i}?", "answer": str(3 + i), "solution": f"3 + {i} = {3 + i}"}
          for i in range(1, 4)]
  path = _write_jsonl(tmp_path / "rows.jsonl", rows)
  task = tasks.get_task("dataset", train_files=path, eval_files=path, verifier="gsm8k")
  for ex in task.train_examples():
    n = int(ex["ground_truth"])
    wrong = task.wrong_completion(ex, np.random.default_rng(0))
    assert wrong == f"3 + {n - 3} = {n + 1}\nThe final answer is \\boxed{{{n + 1}}}."
    assert task.reward(ex, wrong) == 0.0


def test_prompt_the_task_tokenizer_cannot_encode_is_an_error(tmp_path):
  path = _write_jsonl(tmp_path / "u.jsonl", [{"question": "ok", "answer": "1"}, {"question": "café", "answer": "1"}])
  task = tasks.get_task("dataset", train_files=path, eval_files=path)
  with pytest.raises(ValueError, match=r"u.jsonl: row 2: field 'prompt' cannot be encoded.*'é'"):
    task.fit_context(TOK, 500, 10)


# ------------------------------------------------------------------------------------------ bad input
def _bad_files(tmp_path, rows=None, raw=None, name="bad.jsonl", **options):
  path = tmp_path / name
  if raw is not None:
    path.write_bytes(raw)
  elif rows is not None:
    _write_jsonl(path, rows)
  good = _write_jsonl(tmp_path / "good.jsonl", [{"question": "q", "answer": "1"}])
  return dict(train_files=str(path), eval_files=good, **options)


def _bad(tmp_path, **kwargs):
  return tasks.get_task("dataset", **_bad_files(tmp_path, **kwargs))


# Every bad input docs/data.md lists ("Bad input"), and the error each gives.
BAD_INPUTS = [
    (dict(), r"task.options.dataset.train_files: dataset file '.*bad.jsonl' does not exist"),
    (dict(raw=b""), r"bad.jsonl' has no rows"),
    (dict(raw=b"\n\n"), r"bad.jsonl' has no rows"),
    (dict(rows=[{"question": "q", "answer": "1"}, {"question": "q"}]),
     r"bad.jsonl: row 2: field 'answer' \(the ground truth\) is missing"),
    (dict(rows=[{"question": "q", "answer": ""}]), r"bad.jsonl: row 1: field 'answer' \(the ground truth\)"),
    (dict(rows=[{"q": "q", "answer": "1"}]), r"bad.jsonl: row 1: no column 'question' \(the configured key\); "
                                             r"columns: \['answer', 'q'\]"),
    (dict(rows=[{"question": "q", "answer": "1"}], answer_key="label"), r"row 1: no column 'label'"),
    (dict(rows=[{"question": 7, "answer": "1"}]), r"row 1: field 'question' must be text or a list of chat messages"),
    (dict(rows=[{"question": [{"role": "user"}], "answer": "1"}]), r"row 1: field 'question' must be text or a list"),
    (dict(rows=[_verl_row(1), _verl_row(2, prompt={"role": "user", "content": "x"})]),
     r"bad.jsonl: row 2: field 'prompt' must be text or a list of chat messages"),
    (dict(rows=[_verl_row(1, reward_model={"style": "rule"})]),
     r"row 1: field 'reward_model.ground_truth' \(the ground truth\) is missing"),
    (dict(raw=b'{"question": "q", "answer": "1"}\n{"question": "caf\xe9", "answer": "1"}\n'),
     r"bad.jsonl: row 2: line is not UTF-8 \(byte 0xe9 at column 18\)"),
    (dict(raw=b'{"question": "q", "answer": "1"}\n{"question": \n'), r"bad.jsonl: row 2: not JSON"),
    (dict(raw=b'[1, 2]\n'), r"bad.jsonl: row 1: a row must be a JSON object"),
    (dict(raw=b"a,b\n", name="bad.csv"), r"bad.csv': unknown format"),
    (dict(raw=b"not parquet", name="bad.parquet"), r"bad.parquet: cannot read as parquet"),
    (dict(rows=[{"question": "q", "answer": "1"}], verifier="maths"),
     r"task.options.dataset.verifier='maths': unknown verifier"),
    (dict(rows=[{"question": "q", "answer": "1"}], verifier="nope_module:f"),
     r"task.options.dataset.verifier='nope_module:f': cannot import module"),
    (dict(rows=[{"question": "q", "answer": "1"}], verifier_by_source="openai/gsm8k=gsm8k"),
     r"verifier_by_source='openai/gsm8k=gsm8k': no row has data_source \['openai/gsm8k'\]"),
    (dict(rows=[{"question": "q", "answer": "1"}], verifier_by_source="bad=nothing"),
     r"verifier_by_source\['bad'\]='nothing': unknown verifier"),
    (dict(rows=[{"question": "q", "answer": "1"}], schema="csv"), r"schema='csv': must be one of"),
]


@pytest.mark.parametrize("kwargs,message", BAD_INPUTS)
def test_bad_input_is_an_error_naming_file_row_and_field(tmp_path, kwargs, message):
  with pytest.raises(ValueError, match=message):
    _bad(tmp_path, **kwargs)


@pytest.mark.parametrize("kwargs,message", BAD_INPUTS)
def test_bad_input_in_the_job_config_is_one_line_and_exit_status_2(tmp_path, capsys, kwargs, message):
  """What `python -m vcpo_jax.main` prints for it (main.py calls exit_if_config_error): one line naming the
  deepest field, the file and the row, never the whole options section, and exit status 2."""
  config = dataset_config.get_config()
  config.task.options.dataset.update(_bad_files(tmp_path, **kwargs))
  with pytest.raises(ValueError) as raised:
    configuration.validate_config(config)
  with pytest.raises(SystemExit) as exited:
    startup_errors.exit_if_config_error(raised.value, traceback_wanted=False)
  assert exited.value.code == 2
  line = capsys.readouterr().err
  assert line.count("\n") == 1 and line.startswith("error: task.options.dataset"), line
  field_value_why = re.fullmatch(r"(.*?)='(.*?)': (.*)", message)  # the raw error's `field='value': why`
  if field_value_why:  # reads `field: why ... (got 'value')`
    field, value, why = field_value_why.groups()
    assert re.search(field + ": " + why, line) and f"(got '{value}')" in line, line
  else:
    assert re.search(message, line), line
  assert "'answer_key': 'answer'" not in line  # no dump of the section
  if "bad." in message:
    assert str(tmp_path / "bad.") in line  # the file, by its path
  startup_errors.exit_if_config_error(raised.value, traceback_wanted=True)  # asked for: the caller re-raises


def test_no_files_and_config_errors_name_the_config_field(word_problems):
  with pytest.raises(ValueError, match=r"task.options.dataset.train_files='': give one or more files"):
    tasks.get_task("dataset")
  config = dataset_config.get_config()
  config.task.options.dataset.update(train_files=word_problems["train.jsonl"], eval_files="/nonexistent.parquet")
  with pytest.raises(ValueError, match=r"invalid config: task.options.dataset=.*/nonexistent.parquet' does not "
                                       r"exist"):
    configuration.validate_config(config)
