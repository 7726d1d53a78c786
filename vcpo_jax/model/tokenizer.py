"""Small task tokenizer (printable ASCII chars + template words) built with `tokenizers`, HF-loadable."""
from __future__ import annotations

import json
import os
import re
import string
from typing import Iterable

import tokenizers
from tokenizers import decoders, models, pre_tokenizers

from vcpo_jax.model import chat
from vcpo_jax.model import pretrained_tokenizer as pretrained

PAD_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = (PAD_TOKEN, IM_START, IM_END)

# Every printable ASCII char plus newline, so any ASCII task text (and adversarial model output) round-trips.
CHARS = tuple(string.digits + string.ascii_letters + string.punctuation + " \n")

# Multi-char pieces that the prompt templates and answers use often; each becomes one id.
# Words carry their leading space so "the numbers" costs two ids, not eleven.
WORDS = (
    "<answer>", "</answer>", "\\boxed{", "user", "assistant",
    "Using", " the", " numbers", " number", " make", " an", " equation", " that", " equals", " Use",
    " each", " exactly", " once", " with", " and", " parentheses", " Put", " final", " answer", " in",
    "Compute",
)
# The calculator call and the tool turn of the Qwen-style tool format (model.chat), appended after WORDS so every
# earlier id is unchanged; three pieces fill the 128 rows the task configs give the model.
TOOL_WORDS = ('<tool_call>\n{"name": "calculator", "arguments": {"expression": "', '"}}\n</tool_call>',
              "user\n<tool_response>\n")

# ChatML plus Qwen2.5's tool format: a call renders as `\n<tool_call>\n{"name": ..., "arguments": {...}}\n
# </tool_call>` in the assistant's turn, consecutive tool messages as `\n<tool_response>\n...\n</tool_response>`
# in one user turn. The tools section is a compact system turn, `<tools>name,...</tools>` (a from-scratch model
# cannot read JSON schemas, and rows are short); without tools the rendering is the plain ChatML above it.
# Literal newlines never follow a `%}` (trim_blocks would drop them): those are written `{{ '\n' }}`.
CHAT_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n<tools>{% for tool in tools %}"
    "{{ (tool.function if tool.function is defined else tool).name }}{% if not loop.last %},{% endif %}"
    "{% endfor %}</tools><|im_end|>\n{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' and message.tool_calls %}<|im_start|>assistant"
    "{% if message['content'] %}\n{{ message['content'] }}{% endif %}"
    "{% for call in message.tool_calls %}{% set call = call.function if call.function is defined else call %}"
    "{{ '\n' }}<tool_call>\n{\"name\": \"{{ call.name }}\", \"arguments\": {{ call.arguments | tojson }}"
    "{{ '}' }}\n</tool_call>{% endfor %}<|im_end|>\n"
    "{% elif message['role'] == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}<|im_start|>user{% endif %}"
    "{{ '\n' }}<tool_response>\n{{ message['content'] }}\n</tool_response>"
    "{% if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}<|im_end|>\n{% endif %}"
    "{% else %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TASK_CHAT = chat.ChatFormat(CHAT_TEMPLATE)  # the task tokenizer's conversation format


def chat_prompt(user_text: str) -> str:
  """The chat-format prompt the assistant continues (same text as CHAT_TEMPLATE renders)."""
  return f"{IM_START}user\n{user_text}{IM_END}\n{IM_START}assistant\n"


def _vocab() -> dict[str, int]:
  pieces = list(SPECIAL_TOKENS) + list(CHARS) + list(WORDS) + list(TOOL_WORDS)
  if len(set(pieces)) != len(pieces):
    raise ValueError("tokenizer pieces are not unique")
  return {p: i for i, p in enumerate(pieces)}


def _split_regex() -> str:
  # Longest alternatives first: the regex engine takes the first alternative that matches, so " numbers"
  # must be tried before " number". The final `[\s\S]` makes every remaining char its own piece.
  words = sorted(WORDS + TOOL_WORDS, key=len, reverse=True)
  return "|".join(re.escape(w) for w in words) + r"|[\s\S]"


def _build_backend() -> tokenizers.Tokenizer:
  backend = tokenizers.Tokenizer(models.WordLevel(vocab=_vocab(), unk_token=None))
  backend.pre_tokenizer = pre_tokenizers.Split(
      pattern=tokenizers.Regex(_split_regex()), behavior="isolated", invert=False)
  # Fuse concatenates pieces with no separator, which makes decode the exact inverse of encode.
  backend.decoder = decoders.Fuse()
  backend.add_special_tokens(list(SPECIAL_TOKENS))
  return backend


class Tokenizer:
  """Wrapper with the small API the project needs; the backend is a `tokenizers.Tokenizer`.

  The project's own tokenizer (build_tokenizer) or a pretrained one (load_pretrained: a Hugging Face
  directory's tokenizer.json, its special tokens and chat template, whose files `save` copies unchanged).
  """

  def __init__(self, backend: tokenizers.Tokenizer, *, pretrained_dir: str | None = None):
    self.backend = backend
    self.pretrained_dir = pretrained_dir
    vocab = backend.get_vocab(with_added_tokens=True)
    self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)
    if pretrained_dir is None:
      for tok in SPECIAL_TOKENS:
        if tok not in vocab:
          raise ValueError(f"tokenizer vocab lacks special token {tok!r}")
      self._known_chars = frozenset(c for c in vocab if len(c) == 1)
      self.chat_template = CHAT_TEMPLATE
      self._template_vars: dict = {}
      self.pad_id: int = vocab[PAD_TOKEN]
      self.eos_id: int = vocab[IM_END]  # end of an assistant turn: where chat generation stops
      self.stop_ids: tuple[int, ...] = (vocab[IM_END], vocab[PAD_TOKEN])
      self.special_ids: frozenset[int] = frozenset(vocab[t] for t in SPECIAL_TOKENS)
      self.bos_id = None
    else:
      self._known_chars = None  # byte-level: every text has ids
      info = pretrained.read_info(pretrained_dir, vocab)
      self.chat_template, self._template_vars = info.chat_template, info.template_vars
      self.pad_id, self.eos_id, self.stop_ids = info.pad_id, info.eos_id, info.stop_ids
      self.special_ids, self.bos_id = info.special_ids, info.bos_id
    self.im_start_id: int | None = vocab.get(IM_START)
    # chat_prompt(user_text, tools=None): the prompt for one user message, ending where the assistant's reply
    # starts; chat_prompt.tool_reply(content): a tool's reply as the template renders it (model.chat).
    self.chat_prompt = chat.ChatFormat(self.chat_template, self._template_vars)

  def encode(self, text: str) -> list[int]:
    if not isinstance(text, str):
      raise ValueError(f"text must be a str, got {type(text).__name__}")
    # Special tokens are made of known chars, so checking chars is enough to guarantee no unknown piece.
    for i, ch in enumerate(text if self._known_chars is not None else ()):
      if ch not in self._known_chars:
        raise ValueError(f"text contains unknown character {ch!r} at index {i}")
    return self.backend.encode(text, add_special_tokens=False).ids

  def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
    ids = [int(i) for i in ids]
    for i in ids:
      if not 0 <= i < self.vocab_size:
        raise ValueError(f"token id {i} out of range [0, {self.vocab_size})")
    return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)

  def id_to_token(self, i: int) -> str:
    tok = self.backend.id_to_token(int(i))
    if tok is None:
      raise ValueError(f"token id {i} out of range [0, {self.vocab_size})")
    return tok

  def token_to_id(self, token: str) -> int:
    i = self.backend.token_to_id(token)
    if i is None:
      raise ValueError(f"unknown token {token!r}")
    return i

  def save(self, out_dir: str | os.PathLike) -> None:
    """Writes tokenizer.json, tokenizer_config.json and special_tokens_map.json (AutoTokenizer-loadable);
    a pretrained tokenizer's files are copied unchanged (SGLang then tokenizes exactly as we do)."""
    os.makedirs(out_dir, exist_ok=True)
    if self.pretrained_dir is not None:
      pretrained.copy_files(self.pretrained_dir, os.fspath(out_dir))
      return
    self.backend.save(os.path.join(out_dir, "tokenizer.json"))
    added = {
        str(self.token_to_id(t)): {
            "content": t, "lstrip": False, "normalized": False, "rstrip": False,
            "single_word": False, "special": True,
        } for t in SPECIAL_TOKENS
    }
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added,
        "bos_token": None,
        "eos_token": IM_END,
        "pad_token": PAD_TOKEN,
        "unk_token": None,
        "additional_special_tokens": [IM_START],
        "clean_up_tokenization_spaces": False,
        "model_max_length": 1 << 20,
        "padding_side": "left",
        "chat_template": CHAT_TEMPLATE,
    }
    special_map = {"eos_token": IM_END, "pad_token": PAD_TOKEN, "additional_special_tokens": [IM_START]}
    _write_json(os.path.join(out_dir, "tokenizer_config.json"), config)
    _write_json(os.path.join(out_dir, "special_tokens_map.json"), special_map)


def _write_json(path: str, obj: dict) -> None:
  with open(path, "w") as f:
    json.dump(obj, f, indent=2)
    f.write("\n")


def build_tokenizer() -> Tokenizer:
  return Tokenizer(_build_backend())


def load_pretrained(model_dir: str | os.PathLike) -> Tokenizer:
  """A Hugging Face model directory's tokenizer (tokenizer.json + tokenizer_config.json + chat template)."""
  model_dir = os.fspath(model_dir)
  file = os.path.join(model_dir, "tokenizer.json")
  if not os.path.isfile(file):
    raise ValueError(f"model.hf_path={model_dir!r} has no tokenizer.json (only fast tokenizers are supported)")
  return Tokenizer(tokenizers.Tokenizer.from_file(file), pretrained_dir=model_dir)


def for_model(hf_path: str | os.PathLike | None) -> Tokenizer:
  """The job's tokenizer: the pretrained checkpoint's (model.hf_path) or, without one, the project's own."""
  return load_pretrained(hf_path) if hf_path else build_tokenizer()


def load(path: str | os.PathLike) -> Tokenizer:
  """Loads from a directory holding tokenizer.json (or from the tokenizer.json file itself)."""
  path = os.fspath(path)
  file = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
  if not os.path.exists(file):
    raise ValueError(f"tokenizer path has no tokenizer.json: {path!r}")
  return Tokenizer(tokenizers.Tokenizer.from_file(file))

def completion_text(tok, ids) -> str:
  """Response text for the reward: special tokens dropped; ids of the model's padded vocabulary rows that
  the tokenizer lacks become U+FFFD, which no task accepts (so they score 0 instead of crashing)."""
  out, run = [], []
  for i in ids:
    i = int(i)
    if i in tok.special_ids:
      continue
    if 0 <= i < tok.vocab_size:
      run.append(i)
      continue
    out.append(tok.decode(run) + "\ufffd")
    run = []
  return "".join(out) + tok.decode(run)
