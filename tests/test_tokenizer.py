"""Tests for the task tokenizer: exact round trips, small vocab, errors, and parity with HF AutoTokenizer."""
import os
import re
import string

import pytest
from hypothesis import given, settings, strategies as st

from vcpo_jax import tasks
from vcpo_jax.model import tokenizer as tokenizer_lib

TOK = tokenizer_lib.build_tokenizer()
ASCII_TEXT = st.text(alphabet=string.printable.replace("\t", "").replace("\r", "")
                     .replace("\x0b", "").replace("\x0c", ""), max_size=200)


def _task_texts():
  texts = []
  for name in sorted(tasks.TASKS):
    if tasks.TASKS.get(name).fn.from_files:  # the user's files: tests/test_dataset.py
      continue
    task = tasks.get_task(name)
    for i, ex in enumerate(task.sample(0, 20)):
      texts.append(ex["prompt"])
      texts.append(task.sft_completion(ex, i, error_rate=0.5))
      texts.append(ex["prompt"] + task.reference_solution(ex, i) + tokenizer_lib.IM_END)
  return texts


TASK_TEXTS = _task_texts() + ["\\boxed{(1 + 2) * 3}", "<answer> 7 </answer>\n\n", "", " ", "  numbers"]


def test_vocab_is_small_and_special_ids_are_the_special_tokens():
  assert TOK.vocab_size <= 128
  assert TOK.id_to_token(TOK.pad_id) == "<|endoftext|>"
  assert TOK.id_to_token(TOK.eos_id) == "<|im_end|>"
  assert {TOK.id_to_token(i) for i in TOK.stop_ids} == {"<|im_end|>", "<|endoftext|>"}
  assert TOK.encode("<|im_start|>") == [TOK.im_start_id]


@pytest.mark.parametrize("text", TASK_TEXTS)
def test_task_text_round_trips_and_pieces_concatenate_to_it(text):
  ids = TOK.encode(text)
  assert TOK.decode(ids) == text
  assert "".join(TOK.id_to_token(i) for i in ids) == text


@settings(max_examples=200, deadline=None)
@given(ASCII_TEXT)
def test_any_printable_ascii_round_trips(text):
  assert TOK.decode(TOK.encode(text)) == text


def test_template_words_are_single_tokens_longest_match_first():
  assert [TOK.id_to_token(i) for i in TOK.encode("<answer> numbers number</answer>")] == [
      "<answer>", " numbers", " number", "</answer>"]
  assert len(TOK.encode("\\boxed{")) == 1
  # A countdown prompt is much shorter in ids than in chars.
  prompt = tasks.get_task("countdown").sample(0, 1)[0]["prompt"]
  assert len(TOK.encode(prompt)) < len(prompt) / 2.5


@pytest.mark.parametrize("bad", ["é", "\t", "\r", "日本", "x\x00"])
def test_unknown_character_raises_naming_it(bad):
  with pytest.raises(ValueError, match="unknown character"):
    TOK.encode(f"12 + {bad}")
  with pytest.raises(ValueError, match=re.escape(repr(bad[-1]))):
    TOK.encode(bad[-1])


def test_decode_rejects_out_of_range_ids_and_can_skip_specials():
  with pytest.raises(ValueError, match="out of range"):
    TOK.decode([TOK.vocab_size])
  with pytest.raises(ValueError, match="out of range"):
    TOK.decode([-1])
  ids = TOK.encode(tokenizer_lib.chat_prompt("Compute 1 + 2."))
  assert TOK.decode(ids, skip_special_tokens=True) == "user\nCompute 1 + 2.\nassistant\n"


def test_save_load_round_trip(tmp_path):
  TOK.save(tmp_path)
  loaded = tokenizer_lib.load(tmp_path)
  assert loaded.vocab_size == TOK.vocab_size
  for text in TASK_TEXTS:
    assert loaded.encode(text) == TOK.encode(text)
  assert (loaded.pad_id, loaded.eos_id, loaded.stop_ids) == (TOK.pad_id, TOK.eos_id, TOK.stop_ids)
  with pytest.raises(ValueError, match="tokenizer.json"):
    tokenizer_lib.load(tmp_path / "missing")


def test_hf_auto_tokenizer_loads_offline_and_matches(tmp_path):
  assert os.environ.get("HF_HUB_OFFLINE") == "1"
  transformers = pytest.importorskip("transformers")
  TOK.save(tmp_path)
  hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
  for text in TASK_TEXTS:
    ids = TOK.encode(text)
    assert hf(text)["input_ids"] == ids
    assert hf.encode(text) == ids
    assert hf.decode(ids) == text
  assert hf.eos_token_id == TOK.eos_id and hf.pad_token_id == TOK.pad_id
  assert len(hf) == TOK.vocab_size
  chat = hf.apply_chat_template([{"role": "user", "content": "Compute 3 * 4."}], tokenize=False,
                                add_generation_prompt=True)
  assert chat == tokenizer_lib.chat_prompt("Compute 3 * 4.")
