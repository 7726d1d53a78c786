"""Tests for the batched sampler: log-probs vs the learner's recompute, greedy vs brute force, filters."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from vcpo_jax.model import config as model_config
from vcpo_jax.model import decode_kernels
from vcpo_jax.model import sampling
from vcpo_jax.model import transformer as model

CFG = model_config.ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                        num_kv_heads=2, head_dim=8, max_seq_len=64)
PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10, 11, 12], [13]]
PAD_T = 32  # reference recomputes pad every sequence to this length: one compile


@pytest.fixture(scope="module")
def params():
  p = model.init_params(CFG, jax.random.PRNGKey(0))
  # Sharper than the init so tokens differ in probability and greedy ties are impossible in practice.
  return jax.tree.map(lambda x: x * 8.0 if x.ndim == 2 else x, p)


@jax.jit
def _reference_logits(params, tokens_BxT):
  return model.forward(params, CFG, tokens_BxT)


@jax.jit
def _reference_logprobs(params, tokens_BxT, mask_BxT):
  """What the learner recomputes."""
  return model.token_logprobs(params, CFG, tokens_BxT, mask_BxT)


def _right_padded(seqs):
  tokens = np.zeros((len(seqs), PAD_T), np.int32)
  for i, s in enumerate(seqs):
    tokens[i, :len(s)] = s
  return jnp.asarray(tokens)


def test_bucket():
  assert [sampling.bucket(n, 4) for n in (1, 4, 5, 8, 9)] == [4, 4, 8, 8, 16]
  assert sampling.bucket(3, 1) == 4 and sampling.bucket(1, 1) == 1


def test_logprobs_match_learner_recompute(params):
  res = sampling.generate(params, CFG, PROMPTS, max_new_tokens=12, temperature=1.0, seeds=[1, 2, 3])
  seqs = [p + r.output_ids for p, r in zip(PROMPTS, res)]
  tokens = _right_padded(seqs)
  mask = np.zeros(tokens.shape, np.float32)
  for i, (p, s) in enumerate(zip(PROMPTS, seqs)):
    mask[i, len(p):len(s)] = 1.0
  ref = np.asarray(_reference_logprobs(params, tokens, jnp.asarray(mask, jnp.float32)))
  full = np.asarray(_reference_logprobs(params, tokens, jnp.ones(tokens.shape, jnp.float32)))
  for i, (p, r) in enumerate(zip(PROMPTS, res)):
    assert len(r.output_ids) == 12 and r.finish_reason == "length" and r.finished
    np.testing.assert_allclose(r.logprobs, ref[i, len(p):len(p) + 12], atol=1e-5, rtol=0)
    np.testing.assert_allclose(r.prompt_logprobs, full[i, 1:len(p)], atol=1e-5, rtol=0)
  # Raw (temperature-1) log-probs even when sampling at another temperature with filters.
  res = sampling.generate(params, CFG, PROMPTS, max_new_tokens=12, temperature=0.7, top_k=5, top_p=0.9,
                          seeds=[4, 5, 6])
  tokens = _right_padded([p + r.output_ids for p, r in zip(PROMPTS, res)])
  ref = np.asarray(_reference_logprobs(params, tokens, jnp.ones(tokens.shape, jnp.float32)))
  for i, (p, r) in enumerate(zip(PROMPTS, res)):
    np.testing.assert_allclose(r.logprobs, ref[i, len(p):len(p) + 12], atol=1e-5, rtol=0)


def test_greedy_matches_brute_force_argmax(params):
  res = sampling.generate(params, CFG, PROMPTS, max_new_tokens=10, temperature=0.0, seeds=[0, 0, 0])
  for p, r in zip(PROMPTS, res):
    seq = list(p)
    for _ in range(10):  # one full forward per token, no cache, no padding tricks
      logits = np.asarray(_reference_logits(params, _right_padded([seq])))
      seq.append(int(np.argmax(logits[0, len(seq) - 1])))
    assert r.output_ids == seq[len(p):]


def test_no_cache_baseline_agrees(params):
  kw = dict(max_new_tokens=10, temperature=1.0, seeds=[7, 8, 9])
  a = sampling.generate(params, CFG, PROMPTS, **kw)
  b = sampling.generate_no_cache(params, CFG, PROMPTS, **kw)
  for x, y in zip(a, b):
    assert x.output_ids == y.output_ids
    np.testing.assert_allclose(x.logprobs, y.logprobs, atol=1e-5, rtol=0)


def test_seed_determinism_independent_of_batch(params):
  together = sampling.generate(params, CFG, PROMPTS, max_new_tokens=8, seeds=[11, 12, 13])
  again = sampling.generate(params, CFG, PROMPTS, max_new_tokens=8, seeds=[11, 12, 13])
  # The same rows in other batch positions next to another row: its stream depends on its seed only.
  alone = sampling.generate(params, CFG, [PROMPTS[2], PROMPTS[1], PROMPTS[0]], max_new_tokens=8,
                            seeds=[13, 12, 99])
  assert [r.output_ids for r in together] == [r.output_ids for r in again]
  assert alone[0].output_ids == together[2].output_ids
  assert alone[1].output_ids == together[1].output_ids
  other = sampling.generate(params, CFG, PROMPTS, max_new_tokens=8, seeds=[21, 22, 23])
  assert [r.output_ids for r in other] != [r.output_ids for r in together]


def test_stop_ids_max_new_and_ignore_eos(params):
  free = sampling.generate(params, CFG, PROMPTS, max_new_tokens=10, temperature=0.0)
  stop_id = free[0].output_ids[3]
  first = free[0].output_ids.index(stop_id)
  rows = [sampling.RowSpec(prompt=tuple(PROMPTS[0]), max_new_tokens=10, temperature=0.0,
                           stop_token_ids=(stop_id,)),
          sampling.RowSpec(prompt=tuple(PROMPTS[0]), max_new_tokens=10, temperature=0.0,
                           stop_token_ids=(stop_id,), ignore_eos=True),
          sampling.RowSpec(prompt=tuple(PROMPTS[1]), max_new_tokens=3, temperature=0.0),
          sampling.RowSpec(prompt=tuple(PROMPTS[0]), max_new_tokens=10, temperature=0.0,
                           stop_token_ids=(stop_id,), min_new_tokens=first + 2)]
  batch = sampling.start_batch(params, CFG, rows)
  for _ in range(2):  # at most 10 new tokens: one chunk of 64 (generate()'s size, no extra compile) ends every row
    if bool(jnp.all(batch.state.done_B)):
      break
    sampling.decode_chunk(params, batch, 64)
  assert bool(jnp.all(batch.state.done_B)), "rows of at most 10 new tokens not done after 2 chunks of 64"
  stopped, ignored, short, delayed = sampling.results(batch)
  assert stopped.output_ids == free[0].output_ids[:first + 1]
  assert stopped.finish_reason == "stop" and stopped.matched_token == stop_id
  assert ignored.output_ids == free[0].output_ids and ignored.finish_reason == "length"
  assert short.output_ids == free[1].output_ids[:3] and short.finish_reason == "length"
  # min_new_tokens: the stop id cannot be drawn (nor stop the row) before first + 2 tokens.
  assert stop_id not in delayed.output_ids[:first + 2]
  assert delayed.output_ids[:first] == free[0].output_ids[:first]


def test_zero_max_new_tokens(params):
  res = sampling.generate(params, CFG, PROMPTS, max_new_tokens=0)
  assert all(r.output_ids == [] and r.finish_reason == "length" for r in res)


def _allowed_set(logits, temperature, top_k, top_p, min_p):
  """Brute-force float64 reference of the filtered support and its renormalised probabilities."""
  z = np.asarray(logits, np.float64) / temperature
  order = np.argsort(-z, kind="stable")
  keep = np.zeros(z.shape, bool)
  keep[order[:top_k]] = True
  p = np.where(keep, np.exp(z - z.max()), 0.0)
  p /= p.sum()
  mass_before = np.cumsum(p[order]) - p[order]
  keep_p = np.zeros(z.shape, bool)
  keep_p[order[(mass_before < top_p) & keep[order]]] = True
  keep &= keep_p
  keep &= np.exp(z - z.max()) >= min_p
  q = np.where(keep, np.exp(z - z.max()), 0.0)
  return keep, q / q.sum()


@pytest.mark.parametrize("temperature,top_k,top_p,min_p", [
    (1.0, 5, 1.0, 0.0), (0.5, 64, 0.6, 0.0), (1.3, 10, 0.8, 0.0), (1.0, 64, 1.0, 0.2)])
def test_sample_tokens_filters_match_brute_force(temperature, top_k, top_p, min_p):
  n = 4000
  logits = jax.random.normal(jax.random.PRNGKey(3), (64,)) * 2.0
  keys = jax.random.split(jax.random.key(1), n)
  tokens = np.asarray(jax.jit(decode_kernels.sample_tokens)(
      jnp.broadcast_to(logits[None], (n, 64)), jnp.full((n,), temperature), jnp.full((n,), top_p),
      jnp.full((n,), top_k, jnp.int32), jnp.full((n,), min_p), keys))
  keep, q = _allowed_set(logits, temperature, top_k, top_p, min_p)
  assert keep[tokens].all(), "sampled a token outside the filtered support"
  freq = np.bincount(tokens, minlength=64) / n
  # 5 standard errors of a binomial frequency, per token.
  assert np.all(np.abs(freq - q) <= 5 * np.sqrt(q * (1 - q) / n) + 1e-9)


def test_bad_rows_raise_naming_the_field(params):
  with pytest.raises(ValueError, match="prompt"):
    sampling.start_batch(params, CFG, [sampling.RowSpec(prompt=(), max_new_tokens=2)])
  with pytest.raises(ValueError, match="prompt"):
    sampling.start_batch(params, CFG, [sampling.RowSpec(prompt=(1, 64), max_new_tokens=2)])
  with pytest.raises(ValueError, match="max_seq_len"):
    sampling.start_batch(params, CFG, [sampling.RowSpec(prompt=(1, 2), max_new_tokens=63)])


@pytest.mark.slow
def test_sampler_dots_run_at_the_model_precision():
  """The sampler's log-probs are computed like the learner's: same model.matmul_precision on every dot."""
  import re
  cfg = model_config.ModelConfig(matmul_precision="high")
  params = model.init_params(cfg, jax.random.PRNGKey(0))
  rows = [sampling.RowSpec(prompt=(1, 2, 3), max_new_tokens=4)]
  st, tokens, positions, seeds = sampling._initial_state(rows, cfg, 1, 4, 4, 4)
  text = str(jax.make_jaxpr(lambda p: decode_kernels.prefill(p, jnp.asarray(tokens), jnp.asarray(positions),
                                                          jnp.asarray(seeds), st, cfg=cfg, num_new=4))(params))
  assert text.count("dot_general") > 4 and set(re.findall(r"precision=\(?Precision\.(\w+)", text)) == {"HIGH"}


def test_a_rows_draw_does_not_depend_on_the_passes_its_batch_needs():
  """draw() skips the [B, V] passes no row of a batch asks for (suppression, filters, greedy, sampling): a row's
  token and log-prob are the same in a batch that needs only its own passes as in one that needs them all."""
  from vcpo_jax.model import sampling_fields
  V, K = 64, 4
  plain = sampling.RowSpec(prompt=(1,), temperature=0.8, seed=5)
  greedy = sampling.RowSpec(prompt=(1,), temperature=0.0, seed=6)
  # a row that turns on every optional pass: suppressed stop ids, top-k, top-p and min-p
  every = sampling.RowSpec(prompt=(1,), temperature=1.2, top_k=20, top_p=0.9, min_p=0.01, min_new_tokens=5,
                           stop_token_ids=(3, 7), seed=7)
  logits_row = jax.random.normal(jax.random.PRNGKey(11), (V,)) * 3.0
  draw = jax.jit(decode_kernels.draw)

  def run(rows, count):
    arrays, seeds = sampling_fields.row_arrays(rows, len(rows), K, V)
    arrays = jax.tree.map(jnp.asarray, arrays)._replace(key_data_Bx2=decode_kernels.row_keys(jnp.asarray(seeds)))
    n = len(rows)
    out = draw(jnp.broadcast_to(logits_row, (n, V)), arrays, jnp.full((n,), count, jnp.int32), jnp.ones((n,), bool))
    return [np.asarray(x) for x in out]

  for count in range(6):  # several draws of each row's stream
    alone = [run([row], count) for row in (plain, greedy)]
    together = run([plain, greedy, every], count)
    for i, (tok, logp, stop) in enumerate(alone):
      assert (tok[0], logp[0], stop[0]) == (together[0][i], together[1][i], together[2][i])
    assert together[0][2] not in (3, 7)  # the suppressed row never draws a stop id before min_new_tokens
