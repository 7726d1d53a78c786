"""PEFT adapter export: Hugging Face + PEFT on the exported base give the learner's log-probs; bad dirs refused."""
import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from vcpo_jax.model import config as C
from vcpo_jax.model import hf_export, lora, peft_export
from vcpo_jax.model import transformer as M

CFG = C.ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                    head_dim=8, max_seq_len=64, rope_theta=1e6, lora=C.LoraConfig(rank=4, alpha=16.0))


def _trained(cfg, seed=0):
  """Base weights and a nonzero adapter large enough that every adapted layer moves the log-probs."""
  params = jax.tree.map(lambda x: x * 4.0, M.init_params(cfg, jax.random.PRNGKey(seed)))
  keys = iter(jax.random.split(jax.random.PRNGKey(seed + 1), 200))
  adapter = jax.tree.map(lambda x: x + 0.1 * jax.random.normal(next(keys), x.shape),
                         lora.init_adapter(jax.random.PRNGKey(seed + 2), cfg))
  return params, adapter


@pytest.mark.parametrize("targets", [C.LINEAR_MODULES, ("q_proj", "v_proj", "down_proj")])
@pytest.mark.slow
def test_peft_on_the_exported_base_gives_the_learners_logprobs(tmp_path, targets):
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  peft = pytest.importorskip("peft")
  cfg = dataclasses.replace(CFG, lora=dataclasses.replace(CFG.lora, target_modules=targets))
  params, adapter = _trained(cfg)
  base_dir = hf_export.export_hf(params, cfg, str(tmp_path / "base"))
  adapter_dir = peft_export.write_adapter(adapter, cfg, None, str(tmp_path / "adapter"), dtype="float32",
                                          base_model=base_dir)
  base = transformers.Qwen2ForCausalLM.from_pretrained(base_dir, dtype=torch.float32, local_files_only=True)
  model = peft.PeftModel.from_pretrained(base, adapter_dir, is_trainable=False)
  toks = np.random.RandomState(0).randint(0, cfg.vocab_size, (3, 24))
  with torch.no_grad():
    logits = model(input_ids=torch.tensor(toks)).logits.double()
  want = torch.log_softmax(logits, -1)[:, :-1].gather(-1, torch.tensor(toks[:, 1:, None]))[..., 0].numpy()
  ones = jnp.ones((3, 24), jnp.int32)
  got = np.asarray(M.token_logprobs(params, cfg, jnp.asarray(toks), ones, adapter=adapter))
  np.testing.assert_allclose(got[:, 1:], want, atol=1e-4)  # tests/test_hf.py's tolerance for the full export
  base_logp = np.asarray(M.token_logprobs(params, cfg, jnp.asarray(toks), ones))
  assert np.abs(base_logp[:, 1:] - want).max() > 100 * 1e-4  # the adapter matters at this tolerance


@pytest.mark.parametrize("scan", [False, True])
@pytest.mark.slow
def test_round_trip_and_file_layout(tmp_path, scan):
  cfg = dataclasses.replace(CFG, scan_layers=scan)
  _, adapter = _trained(cfg)
  out = peft_export.write_adapter(adapter, cfg, None, str(tmp_path / "a"), dtype="float32")
  back, lcfg = peft_export.read_adapter(out, cfg)
  assert lcfg == cfg.lora
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), back, adapter)
  conf = json.load(open(os.path.join(out, "adapter_config.json")))
  assert (conf["peft_type"], conf["r"], conf["lora_alpha"], conf["bias"], conf["use_rslora"]) == (
      "LORA", 4, 16.0, "none", False)
  tensors = peft_export._read_safetensors(os.path.join(out, "adapter_model.safetensors"))
  assert tensors["base_model.model.model.layers.1.self_attn.q_proj.lora_A.weight"].shape == (4, 32)
  assert tensors["base_model.model.model.layers.1.mlp.down_proj.lora_B.weight"].shape == (32, 4)
  assert len(tensors) == 2 * 7 * 2
  # bfloat16 (the default) rounds each weight once
  out16 = peft_export.write_adapter(adapter, cfg, None, str(tmp_path / "b"))
  back16, _ = peft_export.read_adapter(out16, cfg)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2**-8), back16, adapter)


def _edit_config(path, **changes):
  conf_path = os.path.join(path, "adapter_config.json")
  conf = json.load(open(conf_path))
  conf.update(changes)
  json.dump(conf, open(conf_path, "w"))


@pytest.mark.parametrize("changes,message", [
    (dict(peft_type="IA3"), "peft_type 'IA3' is not 'LORA'"),
    (dict(use_rslora=True), "use_rslora=True is not supported"),
    (dict(use_dora=True), "use_dora=True is not supported"),
    (dict(bias="all"), "bias='all' is not supported"),
    (dict(rank_pattern={"q_proj": 8}), "rank_pattern"),
    (dict(target_modules=["q_proj", "lm_head"]), "the model has no linear layer 'lm_head'"),
    (dict(target_modules="q_proj|v_proj"), "must be a list"),
    (dict(r=8), "r=8 is above this model's model.lora.rank=4"),
])
def test_bad_config_is_refused_in_one_line(tmp_path, changes, message):
  _, adapter = _trained(CFG)
  out = peft_export.write_adapter(adapter, CFG, None, str(tmp_path / "a"))
  _edit_config(out, **changes)
  with pytest.raises(ValueError, match=message) as e:
    peft_export.read_adapter(out, CFG)
  assert "\n" not in str(e.value)


def test_tensors_that_do_not_fit_the_model_are_refused(tmp_path):
  _, adapter = _trained(CFG)
  out = peft_export.write_adapter(adapter, CFG, None, str(tmp_path / "a"))
  other = dataclasses.replace(CFG, intermediate_size=48)
  with pytest.raises(ValueError, match=r"mlp.gate_proj.lora_B.weight has shape \[64, 4\], this model needs \[48, 4\]"):
    peft_export.read_adapter(out, other)
  with pytest.raises(ValueError, match="missing"):
    peft_export.read_adapter(out, dataclasses.replace(CFG, num_layers=3))
  narrow = dataclasses.replace(CFG, lora=C.LoraConfig(rank=4, target_modules=("q_proj",)))
  with pytest.raises(ValueError, match="are not in this model's model.lora.target_modules"):
    peft_export.read_adapter(out, narrow)
  with pytest.raises(ValueError, match="no adapter_config.json"):
    peft_export.read_adapter(str(tmp_path), CFG)


@pytest.mark.slow
def test_fit_pads_rank_and_rescales_into_a_stack():
  small = C.LoraConfig(rank=2, alpha=3.0, target_modules=("q_proj", "up_proj"))
  cfg_small = dataclasses.replace(CFG, lora=small)
  _, adapter = _trained(cfg_small)
  fitted = lora.fit(adapter, CFG, small)
  params = M.init_params(CFG, jax.random.PRNGKey(0))
  toks = jnp.asarray(np.random.RandomState(1).randint(0, 64, (2, 9)))
  want = M.forward(params, cfg_small, toks, adapter=adapter)
  stack = lora.put(lora.empty_stack(CFG, None, 2, jnp.float32), 1, fitted)
  got = M.forward(params, CFG, toks, adapter=stack, adapter_B=jnp.array([1, 1]))
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
  with pytest.raises(ValueError, match="does not fit"):
    lora.fit(adapter, CFG, small, C.LoraConfig(rank=1))
