"""`erpo-jax weights`: the static weights and reference prompt cache, checked independently; stale caches refused."""

import json
import os
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from erpo_jax.config_io import load_config
from erpo_jax import metrics
from erpo_jax.data import reference_cache as static_weights
from erpo_jax.data import reference_layout, reference_pass
from erpo_jax.data.pipeline import dataset_prompts
from erpo_jax.errors import PathError, UserError
from erpo_jax.model import logprobs
from erpo_jax.model.io.loading import load_model
from erpo_jax.parallel import multihost


def tiny(tmp_path, *overrides):
  return load_config("configs/tiny.yaml", [f"run.dir={tmp_path}", "data.size=12", *overrides])


def test_static_weights_equal_clip_of_mean_over_nll_recomputed_from_the_model(tmp_path):
  cfg = tiny(tmp_path)
  static_weights.run_weights(cfg)
  model, tokenizer = load_model(cfg.model)
  prompts = [t for t, _ in dataset_prompts(cfg, tokenizer)]
  nll = []
  for ids in prompts:  # one prompt at a time, no padding: an independent path
    logp = np.asarray(logprobs.log_probs(model, jnp.asarray([ids])))[0]
    nll.append(-logp[1:len(ids)].astype(np.float64).sum())
  nll = np.array(nll)
  want = np.clip(nll.mean() / nll, 0.0, 2.0)
  with np.load(static_weights.cache_path(cfg)) as f:
    np.testing.assert_allclose(f["nll"], nll, rtol=2e-5)
    np.testing.assert_allclose(f["weights"], want, rtol=2e-5)
    assert f["prompt_len"].tolist() == [len(p) for p in prompts]


def test_a_changed_data_set_or_model_invalidates_the_cache(tmp_path):
  cfg = tiny(tmp_path)
  model, tokenizer = load_model(cfg.model)
  static_weights.ensure_reference_cache(cfg, model, tokenizer)
  assert static_weights.ensure_reference_cache(cfg, model, tokenizer).weights.shape == (12,)
  changed_data = tiny(tmp_path, "data.builtin_seed=7")
  with pytest.raises(UserError, match=r"stale reference cache: its data differ"):
    static_weights.ensure_reference_cache(changed_data, model, tokenizer)
  other_cfg = tiny(tmp_path, "model.seed=3")
  other_model, _ = load_model(other_cfg.model)
  with pytest.raises(UserError, match=r"stale reference cache: its model differ"):
    static_weights.ensure_reference_cache(other_cfg, other_model, tokenizer)
  suffix = tiny(tmp_path, "data.prompt_suffix=' Answer briefly.'")
  with pytest.raises(UserError, match=r"stale reference cache: its prompts, data differ"):
    static_weights.ensure_reference_cache(suffix, model, tokenizer)


def test_cli_weights_rebuilds_and_prints_a_summary(tmp_path):
  res = subprocess.run([sys.executable, "-m", "erpo_jax.cli", "weights", "--config", "configs/tiny.yaml",
                        f"run.dir={tmp_path}", "data.size=8", "log.progress=false"],
                       capture_output=True, text=True, timeout=300)
  assert res.returncode == 0, res.stderr[-2000:]
  summary = json.loads(res.stdout.strip().splitlines()[-1])
  assert summary["prompts"] == 8
  assert summary["reference_pass_s"] > 0 and summary["prompts_per_s"] == pytest.approx(
      8 / summary["reference_pass_s"], rel=0.02)
  assert 0.0 <= summary["weight_min"] <= summary["weight_mean"] <= summary["weight_max"] <= 2.0
  assert (tmp_path / "cache" / "reference_cache.npz").is_file()
  with np.load(tmp_path / "cache" / "reference_cache.npz") as f:
    w = f["weights"]
  want = np.quantile(w, [0.25, 0.5, 0.75])
  np.testing.assert_allclose([summary["weight_q25"], summary["weight_median"], summary["weight_q75"]], want,
                             rtol=1e-6)
  assert summary["clipped_at_hi"] == pytest.approx(np.mean(w >= 2.0))
  assert summary["clipped_at_lo"] == pytest.approx(np.mean(w <= 0.0))
  histograms = metrics.read_tensorboard_histograms(tmp_path / "tb")
  assert histograms["weights/static"] == [(0, 8)] and histograms["weights/reference_nll"] == [(0, 8)]


def _truncate(path):
  path.write_bytes(path.read_bytes()[:len(path.read_bytes()) // 2])


def _flip_a_bit(path):
  data = bytearray(path.read_bytes())
  data[len(data) // 2] ^= 0x10
  path.write_bytes(bytes(data))


def _altered_array(path):
  with np.load(path) as f:
    arrays = {k: f[k] for k in f.files}
  arrays["logp"] = arrays["logp"] + np.float32(0.5)  # a valid file whose arrays no longer match the checksum
  np.savez(path, **arrays)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
  """(config, model, tokenizer, cache) of a cache built once."""
  cfg = tiny(tmp_path_factory.mktemp("cache"))
  model, tokenizer = load_model(cfg.model)
  return cfg, model, tokenizer, static_weights.ensure_reference_cache(cfg, model, tokenizer)


@pytest.mark.parametrize("damage", [_truncate, _flip_a_bit, _altered_array], ids=["truncated", "bit flipped",
                                                                                    "array altered"])
def test_a_damaged_cache_file_is_refused_as_damaged(tmp_path, built, damage):
  path = tmp_path / "reference_cache.npz"
  shutil.copy(static_weights.cache_path(built[0]), path)
  static_weights.load_cache(path, {})  # intact
  damage(path)
  with pytest.raises(static_weights.CacheDamagedError, match=r"reference cache .* is damaged \(.+\)"):
    static_weights.load_cache(path, {})


def test_a_damaged_cache_is_recomputed_with_a_one_line_warning(built, capsys):
  cfg, model, tokenizer, good = built
  _flip_a_bit(static_weights.cache_path(cfg))
  capsys.readouterr()
  again = static_weights.ensure_reference_cache(cfg, model, tokenizer)
  err = [l for l in capsys.readouterr().err.splitlines() if l.strip()]
  assert len(err) == 1 and err[0].startswith("warning: reference cache") and "recomputing" in err[0], err
  np.testing.assert_array_equal(again.weights, good.weights)
  np.testing.assert_array_equal(again.logp, good.logp)
  static_weights.load_cache(static_weights.cache_path(cfg), {})  # rewritten intact


def test_cache_dir_that_is_a_file_is_a_path_error(tmp_path):
  (tmp_path / "afile").write_text("x")
  cfg = tiny(tmp_path, f"erpo.cache_dir={tmp_path / 'afile'}")
  model, tokenizer = load_model(cfg.model)
  with pytest.raises(PathError, match=r"erpo.cache_dir '.*afile' is a file"):
    static_weights.ensure_reference_cache(cfg, model, tokenizer)


def test_reference_pass_lengths_pad_less_than_an_eighth_of_their_power_of_two():
  from erpo_jax import buckets
  assert [buckets.fine_bucket(n) for n in (1, 16, 17, 36, 43, 64, 65, 100, 300, 1000)] == [
      16, 16, 32, 48, 48, 64, 80, 112, 320, 1024]
  lengths = range(1, 2049)
  assert all(0 <= buckets.fine_bucket(n) - n < max(16, buckets.power_of_two(n) // 8) for n in lengths)
  assert len({buckets.fine_bucket(n) for n in range(1025, 2049)}) == 4  # compilations per octave


def test_packed_prompts_fill_rows_with_every_prompt_once():
  rng = np.random.default_rng(0)
  lengths = rng.integers(36, 44, size=512).astype(np.int32)  # the embedded default's prompt lengths
  rows = reference_layout.pack_prompts(lengths, 128)
  placed = sorted(q for row in rows for q in row)
  assert placed == list(range(512))
  assert all(sum(lengths[q] for q in row) <= 128 for row in rows)
  # Padding each prompt to its length bucket (48) fills 83% of the tokens computed; the packed rows fill > 92%.
  assert lengths.sum() / (len(rows) * 128) > 0.92
  assert reference_layout.pack_prompts(np.array([128, 1, 127], np.int32), 128) == [[0], [2, 1]]


def test_packed_reference_pass_equals_each_prompt_alone():
  """Prompts of 1-150 tokens laid end to end (rows of 160) score as they do alone, token by token."""
  cfg = load_config("configs/tiny.yaml")
  model, _ = load_model(cfg.model)
  rng = np.random.default_rng(1)
  prompts = [rng.integers(1, 49152, size=n).tolist() for n in (1, 2, 5, 17, 40, 43, 64, 90, 150, 3, 33, 120)]
  logp, lengths = reference_pass.compute_reference_logp(model, prompts, tokens_per_batch=320, chunk=64,
                                                        progress=False)
  assert logp.shape == (12, 150) and lengths.tolist() == [len(p) for p in prompts]
  # Each prompt in a row of its own, right-padded to 150 (a padded key is never before a valid query).
  rows = np.zeros((len(prompts), 150), np.int32)
  for q, ids in enumerate(prompts):
    rows[q, :len(ids)] = ids
  alone = np.asarray(jax.jit(lambda t: logprobs.log_probs(model, t, chunk=64))(jnp.asarray(rows)))
  for q, ids in enumerate(prompts):
    np.testing.assert_allclose(logp[q, :len(ids)], alone[q, :len(ids)], rtol=2e-5, atol=2e-5)
    assert not logp[q, len(ids):].any()


def test_packed_rows_spread_evenly_over_the_calls():
  # 167 rows of 128 tokens at about 4096 tokens a call: 6 calls of 28 rows (168), not 6 of 32 (192).
  assert reference_layout.rows_per_call(167, 128, 4096) == 28
  assert reference_layout.rows_per_call(5, 128, 4096) == 5
  assert reference_layout.rows_per_call(1, 4096, 1024) == 1  # a row longer than a batch: one row a call

  class Mesh:
    shape = {"data": 2, "fsdp": 2}

  assert reference_layout.rows_per_call(167, 128, 4096, Mesh()) == 28  # a multiple of the 4 batch shards
  assert reference_layout.rows_per_call(170, 128, 4096, Mesh()) == 32


SHARDED_PASS = """
import numpy as np
from erpo_jax.config_io import load_config
from erpo_jax.data import reference_layout, reference_pass
from erpo_jax.model.io.loading import load_model
from erpo_jax.parallel import mesh as mesh_lib
cfg = load_config("configs/tiny.yaml", ["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2"])
rng = np.random.default_rng(2)
whole = [rng.integers(1, 49152, size=n).tolist() for n in rng.integers(1, 60, size=37)]
prefix = rng.integers(1, 49152, size=20).tolist()
templated = [prefix + rng.integers(1, 49152, size=n).tolist() for n in rng.integers(1, 40, size=37)]
model, _ = load_model(cfg.model)
mesh = mesh_lib.make_mesh(cfg.mesh)
for prompts in (whole, templated):
  alone, lengths = reference_pass.compute_reference_logp(model, prompts, tokens_per_batch=512, chunk=64,
                                                         progress=False)
  print(type(reference_layout.choose_plan(prompts, 512, mesh)).__name__)
  mesh_lib.shard_model(model, mesh)
  sharded, _ = reference_pass.compute_reference_logp(model, prompts, tokens_per_batch=512, chunk=64, mesh=mesh,
                                                     progress=False)
  model, _ = load_model(cfg.model)
  print(float(np.abs(sharded - alone).max()), float(np.abs(alone).sum()))
"""


def test_reference_pass_on_a_data_fsdp_tensor_mesh_equals_one_device_in_both_layouts():
  """8 fake CPU devices as (data 2, fsdp 2, tensor 2), in a fresh process (the device count is fixed at start):
  37 prompts in packed rows, and 37 sharing a 20-token prefix in one prefix stream per batch shard, split over
  4 batch shards give the one-device log-probs."""
  env = multihost.cpu_device_env(os.environ, 8)
  out = subprocess.run([sys.executable, "-c", SHARDED_PASS], env=env, capture_output=True, text=True, timeout=600,
                       cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(__file__)))))
  assert out.returncode == 0, out.stderr[-3000:]
  lines = out.stdout.strip().splitlines()[-4:]
  assert [lines[0], lines[2]] == ["PackedPass", "PrefixPlan"]
  for line in (lines[1], lines[3]):
    diff, total = map(float, line.split())
    assert total > 100.0 and diff < 1e-4
