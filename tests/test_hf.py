"""Hugging Face interop: bit-identical round trip, transformers log-prob parity, clear import errors."""
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.numpy

from vcpo_jax.model import config as model_config
from vcpo_jax.model import hf, hf_export
from tests.model_jit import init_params, token_logprobs

CFG = model_config.ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                    num_kv_heads=2, head_dim=8, max_seq_len=64, rope_theta=1e6)


def _cfg(**kw):
  return model_config.ModelConfig(**{**CFG.to_dict(), **kw})


@pytest.mark.parametrize("tied,param_dtype", [(False, "float32"), (True, "float32"), (False, "bfloat16")])
def test_round_trip_is_bit_identical(tmp_path, tied, param_dtype):
  cfg = _cfg(tie_word_embeddings=tied, param_dtype=param_dtype)
  params = init_params(cfg, jax.random.PRNGKey(0))
  out = hf_export.export_hf(params, cfg, str(tmp_path / "ckpt"))
  params2, cfg2 = hf.import_hf(out)
  assert cfg2 == cfg
  flat1, tree1 = jax.tree_util.tree_flatten(params)
  flat2, tree2 = jax.tree_util.tree_flatten(params2)
  assert tree1 == tree2
  for a, b in zip(flat1, flat2):
    assert a.dtype == b.dtype and np.array_equal(np.asarray(a), np.asarray(b))
  conf = json.load(open(os.path.join(out, "config.json")))
  assert conf["architectures"] == ["Qwen2ForCausalLM"] and conf["num_key_value_heads"] == 2
  names = set(safetensors.numpy.load_file(os.path.join(out, "model.safetensors")))
  assert ("lm_head.weight" in names) == (not tied)
  assert "model.layers.1.self_attn.q_proj.bias" in names


@pytest.mark.parametrize("tied", [False, True])
def test_transformers_logprobs_match(tmp_path, tied):
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  cfg = _cfg(tie_word_embeddings=tied)
  params = init_params(cfg, jax.random.PRNGKey(1))
  # Larger weights than init so the test is sensitive to every block.
  params = jax.tree_util.tree_map(lambda x: x * 4.0, params)
  out = hf_export.export_hf(params, cfg, str(tmp_path / "ckpt"))
  ref = transformers.Qwen2ForCausalLM.from_pretrained(out, dtype=torch.float32, local_files_only=True)
  toks = np.random.RandomState(0).randint(0, cfg.vocab_size, (3, 24))
  with torch.no_grad():
    logits = ref(torch.tensor(toks)).logits.double()
  want = torch.log_softmax(logits, -1)[:, :-1].gather(-1, torch.tensor(toks[:, 1:, None]))[..., 0].numpy()
  got = np.asarray(token_logprobs(params, cfg, jnp.asarray(toks), jnp.ones((3, 24), jnp.int32)))
  np.testing.assert_allclose(got[:, 1:], want, atol=1e-4)


def test_tokenizer_files_are_exported(tmp_path):
  tokenizer = pytest.importorskip("vcpo_jax.model.tokenizer")
  tok = tokenizer.build_tokenizer()
  cfg = _cfg(vocab_size=max(64, tok.vocab_size))
  out = hf_export.export_hf(init_params(cfg, jax.random.PRNGKey(0)), cfg, str(tmp_path / "ckpt"), tok)
  assert os.path.isfile(os.path.join(out, "tokenizer.json"))
  assert os.path.isfile(os.path.join(out, "tokenizer_config.json"))


def _export(tmp_path, cfg=CFG):
  return hf_export.export_hf(init_params(cfg, jax.random.PRNGKey(0)), cfg, str(tmp_path / "ckpt"))


def test_import_rejects_other_architecture(tmp_path):
  out = _export(tmp_path)
  conf = json.load(open(os.path.join(out, "config.json")))
  conf["architectures"] = ["LlamaForCausalLM"]
  json.dump(conf, open(os.path.join(out, "config.json"), "w"))
  with pytest.raises(ValueError, match="LlamaForCausalLM"):
    hf.import_hf(out)


def test_import_names_missing_tensor_and_wrong_shape(tmp_path):
  out = _export(tmp_path)
  path = os.path.join(out, "model.safetensors")
  tensors = safetensors.numpy.load_file(path)
  missing = dict(tensors)
  del missing["model.layers.1.mlp.up_proj.weight"]
  safetensors.numpy.save_file(missing, path)
  with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.up_proj\.weight"):
    hf.import_hf(out)
  wrong = dict(tensors)
  wrong["model.norm.weight"] = np.zeros((31,), np.float32)
  safetensors.numpy.save_file(wrong, path)
  with pytest.raises(ValueError, match=r"model\.norm\.weight.*\(31,\).*\(32,\)"):
    hf.import_hf(out)


def test_failed_export_leaves_nothing(tmp_path):
  cfg = CFG
  params = init_params(cfg, jax.random.PRNGKey(0))
  bad = dict(params)
  del bad["norm"]
  with pytest.raises(KeyError):
    hf_export.export_hf(bad, cfg, str(tmp_path / "ckpt"))
  assert os.listdir(tmp_path) == []
  # A failed re-export keeps the previous directory intact.
  hf_export.export_hf(params, cfg, str(tmp_path / "ckpt"))
  with pytest.raises(KeyError):
    hf_export.export_hf(bad, cfg, str(tmp_path / "ckpt"))
  assert sorted(os.listdir(tmp_path)) == ["ckpt"]
  assert hf.import_hf(str(tmp_path / "ckpt"))[1] == cfg
