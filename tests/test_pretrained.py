"""Starting from a local Hugging Face Qwen2 checkpoint (built here: tiny, float32, byte-level BPE, chat template).

Truth is transformers itself: its Qwen2ForCausalLM log-probs, its AutoTokenizer encodings and chat rendering.
"""
import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import skip_if_not_enough_devices

from vcpo_jax import tasks
from vcpo_jax.model import hf, hf_export
from vcpo_jax.model import tokenizer as tokenizer_lib
from vcpo_jax.model import transformer as model_lib
from vcpo_jax.parallel import sharding
from tests import model_jit

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

# A ChatML template with a default system turn, in the whitespace-controlled style of Qwen2.5's.
CHAT_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}\n"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}\n"
    "{%- else %}\n"
    "{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}\n"
    "{%- endif %}\n"
    "{%- for message in messages %}\n"
    "  {%- if message['role'] != 'system' %}\n"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}\n"
    "  {%- endif %}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "{{- '<|im_start|>assistant\\n' }}\n"
    "{%- endif %}\n")
CORPUS = ["Using the numbers [3, 5], make an equation that equals 8. Put the final answer in <answer></answer>.",
          "<answer>3 + 5</answer> <answer>(12 - 4) * 2</answer> Compute 17 * 23.", "0123456789 +-*/()"]
TEXTS = ["Using the numbers [7, 9], make 63.", "<answer>7 * 9</answer>", "ünïcödé ✓ and\ttabs\n",
         "<|im_start|>user\nhi<|im_end|>\n"]
MODEL_VOCAB = 512  # more rows than tokenizer ids, as Qwen2.5 pads its vocabulary


def qwen_style_tokenizer(corpus, chat_template: str, added_tokens=()):
  """A byte-level BPE tokenizer with Qwen's special tokens, trained on `corpus` (tokenizers, no hub)."""
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
  tok = Tokenizer(models.BPE(unk_token=None))
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
  tok.train_from_iterator(list(corpus) * 20, trainer)
  fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>",
                                              pad_token="<|endoftext|>")
  if added_tokens:
    fast.add_tokens(list(added_tokens))
  fast.chat_template = chat_template
  return fast


def build_checkpoint(out: str, *, tied: bool = True, shard: bool = False, template_in_config: bool = False):
  """A float32 Qwen2 checkpoint with its tokenizer, written by transformers + tokenizers (no hub)."""
  fast = qwen_style_tokenizer(CORPUS, CHAT_TEMPLATE)
  fast.save_pretrained(out)
  if template_in_config:  # the older layout (Qwen2.5's own files): the template inside tokenizer_config.json
    path = os.path.join(out, "tokenizer_config.json")
    config = json.load(open(path))
    config["chat_template"] = CHAT_TEMPLATE
    json.dump(config, open(path, "w"))
    os.remove(os.path.join(out, "chat_template.jinja"))
  cfg = transformers.Qwen2Config(
      vocab_size=MODEL_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
      num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=tied, rope_theta=1e6,
      initializer_range=0.1, eos_token_id=[fast.convert_tokens_to_ids("<|im_end|>"), fast.convert_tokens_to_ids("<|endoftext|>")])
  torch.manual_seed(0)
  model = transformers.Qwen2ForCausalLM(cfg).float()
  with torch.no_grad():  # non-zero biases, so the q/k/v bias mapping is exercised
    for layer in model.model.layers:
      for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
        proj.bias.normal_(0.0, 0.1)
  model.save_pretrained(out, max_shard_size="60KB" if shard else "1GB")
  return out


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
  return build_checkpoint(str(tmp_path_factory.mktemp("qwen_tiny")), tied=True, shard=True)


def hf_logprobs(model_dir, tokens_BxT):
  m = transformers.Qwen2ForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
  with torch.no_grad():
    logits = m(torch.tensor(np.asarray(tokens_BxT), dtype=torch.long)).logits
  logz = torch.log_softmax(logits.double(), dim=-1)[:, :-1]
  logp = torch.gather(logz, -1, torch.tensor(np.asarray(tokens_BxT)[:, 1:, None], dtype=torch.long))[..., 0]
  return np.concatenate([np.zeros((logp.shape[0], 1)), logp.numpy()], axis=1)


def _tokens(vocab, b=3, t=24, seed=0):
  return np.random.default_rng(seed).integers(0, vocab, (b, t)).astype(np.int32)


@pytest.mark.parametrize("tied", [True, False])
def test_our_logprobs_equal_transformers(tmp_path, tied):
  model_dir = build_checkpoint(str(tmp_path / "m"), tied=tied, shard=not tied)
  params, cfg = hf.import_hf(model_dir)
  assert cfg.tie_word_embeddings is tied and cfg.rope_theta == 1e6 and cfg.matmul_precision == "highest"
  tokens = _tokens(cfg.vocab_size)
  ours = model_jit.token_logprobs(params, cfg, jnp.asarray(tokens), jnp.ones(tokens.shape, jnp.float32))
  np.testing.assert_allclose(np.asarray(ours), hf_logprobs(model_dir, tokens), atol=1e-4)


@skip_if_not_enough_devices(8)
def test_sharded_checkpoint_loads_slices_into_their_shardings(ckpt, monkeypatch):
  assert os.path.exists(os.path.join(ckpt, "model.safetensors.index.json"))
  host_params, cfg = hf.import_hf(ckpt)
  mesh = sharding.make_mesh({"data": 1, "fsdp": 4, "tensor": 2})
  shardings = sharding.logical_shardings(model_lib.param_logical_axes(cfg), mesh)
  reads = []  # (tensor name, elements read) for every slice taken from disk
  real_open = hf.safetensors.safe_open

  class Recorder:
    def __init__(self, handle):
      self.handle = handle

    def __enter__(self):
      self.inner = self.handle.__enter__()
      return self

    def __exit__(self, *exc):
      return self.handle.__exit__(*exc)

    def get_slice(self, name):
      tensor = self.inner.get_slice(name)

      class Slice:
        def get_shape(self):
          return tensor.get_shape()

        def __getitem__(self, index):
          block = tensor[index]
          reads.append((name, block.size))
          return block
      return Slice()

  monkeypatch.setattr(hf.safetensors, "safe_open", lambda *a, **k: Recorder(real_open(*a, **k)))
  params, _ = hf.import_hf(ckpt, cfg=cfg, shardings=shardings)
  for (path, leaf), want in zip(jax.tree_util.tree_leaves_with_path(params),
                                jax.tree_util.tree_leaves(host_params)):
    np.testing.assert_array_equal(np.asarray(leaf), want)
  for leaf, target in zip(jax.tree_util.tree_leaves(params), jax.tree_util.tree_leaves(shardings)):
    assert leaf.sharding == target
  # The [vocab, embed] table is split 2 x 4: each of the 8 devices read an eighth of it, never all of it.
  embed = [n for name, n in reads if name == "model.embed_tokens.weight"]
  assert len(embed) == 8 and set(embed) == {MODEL_VOCAB * 64 // 8}


@pytest.mark.parametrize("template_in_config", [False, True])
def test_tokenizer_and_chat_template_match_transformers(tmp_path, template_in_config):
  model_dir = build_checkpoint(str(tmp_path / "m"), template_in_config=template_in_config)
  ours = tokenizer_lib.load_pretrained(model_dir)
  theirs = transformers.AutoTokenizer.from_pretrained(model_dir)
  for text in TEXTS:
    assert ours.encode(text) == theirs.encode(text, add_special_tokens=False), text
    assert ours.decode(ours.encode(text)) == text
  messages = [{"role": "user", "content": "Compute 2 + 2."}]
  want = theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
  assert ours.chat_prompt("Compute 2 + 2.") == want
  assert want.startswith("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n")
  vocab = theirs.get_vocab()
  assert ours.eos_id == vocab["<|im_end|>"] and ours.pad_id == vocab["<|endoftext|>"]
  assert set(ours.stop_ids) == {vocab["<|im_end|>"], vocab["<|endoftext|>"]}
  assert ours.special_ids == {vocab[t] for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")}
  assert ours.vocab_size == len(vocab) < MODEL_VOCAB


def test_task_prompts_render_through_the_chat_template(ckpt):
  tok = tokenizer_lib.load_pretrained(ckpt)
  theirs = transformers.AutoTokenizer.from_pretrained(ckpt)
  task = tasks.get_task("countdown", render_prompt=tok.chat_prompt, num_numbers=2, max_number=25)
  default = tasks.get_task("countdown", num_numbers=2, max_number=25)
  ex, ex_default = task.sample(0, 1)[0], default.sample(0, 1)[0]
  user = ex_default["prompt"].split("user\n", 1)[1].split("<|im_end|>")[0]
  assert ex["key"] == ex_default["key"]
  assert ex["prompt"] == theirs.apply_chat_template([{"role": "user", "content": user}], tokenize=False,
                                                    add_generation_prompt=True)
  # The reward reads decoded text, whatever the tokenizer.
  completion = task.reference_solution(ex)
  assert task.reward(ex, tok.decode(tok.encode(completion))) == 1.0


def test_export_reloads_in_transformers_with_identical_tokenizer(ckpt, tmp_path):
  tok = tokenizer_lib.load_pretrained(ckpt)
  params, cfg = hf.import_hf(ckpt)
  cfg = dataclasses.replace(cfg, max_seq_len=128)
  out = hf_export.export_hf(params, cfg, str(tmp_path / "export"), tok)
  original = transformers.AutoTokenizer.from_pretrained(ckpt)
  exported = transformers.AutoTokenizer.from_pretrained(out)
  for text in TEXTS + [tok.chat_prompt("Compute 2 + 2.")]:
    assert exported.encode(text, add_special_tokens=False) == original.encode(text, add_special_tokens=False)
  messages = [{"role": "user", "content": "x"}]
  assert exported.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == \
      original.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
  assert tokenizer_lib.load_pretrained(out).stop_ids == tok.stop_ids
  generation = json.load(open(os.path.join(out, "generation_config.json")))
  assert set(generation["eos_token_id"]) == set(tok.stop_ids)
  tokens = _tokens(cfg.vocab_size, seed=1)
  np.testing.assert_allclose(hf_logprobs(out, tokens), hf_logprobs(ckpt, tokens), atol=1e-6)


def test_model_config_takes_the_architecture_from_hf_path(ckpt):
  cfg = hf.model_config({"hf_path": ckpt, "max_seq_len": 96, "dtype": "bfloat16", "matmul_precision": "high",
                         "hidden_size": 64})
  assert (cfg.hidden_size, cfg.num_layers, cfg.vocab_size, cfg.max_seq_len) == (64, 2, MODEL_VOCAB, 96)
  assert (cfg.dtype, cfg.param_dtype, cfg.matmul_precision) == ("bfloat16", "float32", "high")
  with pytest.raises(ValueError, match="model.hidden_size=896"):
    hf.model_config({"hf_path": ckpt, "hidden_size": 896})
  assert hf.model_config({"hf_path": "", "vocab_size": 128}).vocab_size == 128


@pytest.mark.parametrize("size,total,non_embedding", [("0.5b", 0.49e9, 0.36e9), ("1.5b", 1.54e9, 1.31e9),
                                                      ("7b", 7.61e9, 6.53e9)])
def test_qwen2_5_config_shapes_have_the_published_parameter_counts(size, total, non_embedding):
  from configs import qwen2_5
  config = qwen2_5.get_config(size)
  cfg = hf.model_config(config.model)
  shapes = jax.eval_shape(lambda: model_lib.init_params(cfg, jax.random.PRNGKey(0)))
  n = model_lib.count_params(shapes)
  embed = cfg.vocab_size * cfg.hidden_size * (1 if cfg.tie_word_embeddings else 2)
  # The model cards state these truncated to two decimals (the 7B has 7.6156e9).
  assert n == pytest.approx(total, abs=0.01e9) and n - embed == pytest.approx(non_embedding, abs=0.01e9)
  assert config.sft.steps == 0 and config.model.hf_path == ""
  with pytest.raises(ValueError, match="unknown Qwen2.5 size"):
    qwen2_5.get_config("3b")
@pytest.mark.slow
def test_job_runs_three_rl_steps_from_the_checkpoint(ckpt, tmp_path):
  """emulate mode, sft.steps=0: the job evaluates and exports the checkpoint as its base, then 3 RL steps."""
  import ml_collections
  from configs import tiny
  from vcpo_jax.job import train
  config = tiny.get_config("emulate")
  config.model = ml_collections.ConfigDict(dict(hf_path=ckpt, max_seq_len=160, param_dtype="float32",
                                                dtype="float32", matmul_precision="highest"))
  config.sft.steps = 0
  config.rl.update(steps=3, max_new_tokens=8)
  config.eval_every = 3
  result = train.train_and_evaluate(config, str(tmp_path / "w"))
  assert result["steps"] == 3
  base = tmp_path / "w" / "base"
  assert (base / "tokenizer.json").read_bytes() == open(os.path.join(ckpt, "tokenizer.json"), "rb").read()
  assert (base / "chat_template.jinja").read_text() == CHAT_TEMPLATE
  # The base is the checkpoint itself (no warm start): same log-probs.
  tokens = _tokens(MODEL_VOCAB, seed=2)
  np.testing.assert_allclose(hf_logprobs(str(base), tokens), hf_logprobs(ckpt, tokens), atol=1e-6)
  lines = [json.loads(line) for line in open(tmp_path / "w" / "metrics.jsonl")]
  assert [line["step"] for line in lines] == [1, 2, 3]
  # Step 1's rows are lag 0: the float32 sampler and learner agree within 1e-4 per token (numerics alone).
  assert lines[0]["mismatch/lag0/num_seqs"] > 0 and lines[0]["mismatch/lag0/token_abs_max"] < 1e-4
  assert all("mismatch/lagged/seq_logw_mean" in line for line in lines)
