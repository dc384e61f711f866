"""Tests of erpo_jax.train.checkpoint: bit-exact round trips, retention, crash and write-failure safety, model checks."""

import os
import resource
import shutil
import signal
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import tiny_runs
from erpo_jax.train import checkpoint as ck
from erpo_jax.train import checkpoint_io as cio
from erpo_jax.errors import NonFiniteError, PathError, UserError
from erpo_jax.model import llama
from erpo_jax.model.config import ModelConfig

FP = "llama-L2-D16-V64-test"
TINY = ModelConfig(architecture="llama", vocab_size=64, hidden_size=16, num_layers=2, num_heads=2, num_kv_heads=1,
                   head_dim=8, intermediate_size=32)


@pytest.fixture(scope="module")
def tiny_models():
  """Three tiny Llama models (seeds 0, 1, 2); built once because the first build compiles for seconds."""
  return [llama.init_random(TINY, seed=s) for s in range(3)]


def _pure(model) -> dict:
  return nnx.to_pure_dict(nnx.state(model, nnx.Param))


def _params(seed: int) -> dict:
  k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
  return {"w": jax.random.normal(k1, (8, 4), jnp.float32),
          "b": jax.random.normal(k2, (4,), jnp.float32).astype(jnp.bfloat16),
          "n": {"ids": jax.random.randint(k3, (5,), -1000, 1000, jnp.int32)}}


def _float_params(params: dict) -> dict:
  # The int leaf rides along in the checkpoint but is not trained.
  return {"w": params["w"], "b": params["b"]}


def _save(c, step, params, opt_state=None, **kw):
  kw = {"rng_key": jax.random.key(step), "data_state": {"step": step}, "config_text": "x: 1\n", **kw}
  return c.save(step, params=params, opt_state={} if opt_state is None else opt_state, **kw)


def _bits(x) -> np.ndarray:
  return np.asarray(x).reshape(-1).view(np.uint8)


def _assert_bit_equal(a, b):
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    assert x.dtype == y.dtype and x.shape == y.shape
    np.testing.assert_array_equal(_bits(x), _bits(y))


PROGRAMS = {"compiled": [[48, [1024, 256, 800]], [48, 1024]], "padded": [[48, 640, 1152]]}  # train/programs.py


def test_round_trip_is_bit_exact_and_training_continues_identically(tmp_path):
  params = _params(0)
  opt = optax.adamw(1e-2)

  @jax.jit
  def train_step(p, s, k):
    g = jax.tree.map(lambda x: (x.astype(jnp.float32) * jax.random.normal(k, x.shape)).astype(x.dtype), p)
    u, s = opt.update(g, s, p)
    return optax.apply_updates(p, u), s

  key = jax.random.fold_in(jax.random.key(7), 3)
  trained, state = train_step(_float_params(params), opt.init(_float_params(params)), key)
  params = {**params, **trained}  # non-trivial params, mu, nu and count = 1
  with ck.Checkpointer(tmp_path, every=1, keep=2, fingerprint=FP) as c:
    assert _save(c, 1, params, state, rng_key=key, data_state={"next": 12, "epoch": [0, 1]},
                 config_text="erpo:\n  alpha: 0.01\n", programs=PROGRAMS)
  with ck.Checkpointer(tmp_path, every=1, keep=2, fingerprint=FP) as c:
    targets = jax.tree.map(jnp.zeros_like, (params, state))
    r = c.restore(params_target=targets[0], opt_state_target=targets[1])
  assert r.step == 1 and r.programs == PROGRAMS
  _assert_bit_equal(r.params, params)
  _assert_bit_equal(r.opt_state, state)
  assert jax.random.key_impl(r.rng_key) == jax.random.key_impl(key)
  np.testing.assert_array_equal(jax.random.key_data(r.rng_key), jax.random.key_data(key))
  assert r.data_state == {"next": 12, "epoch": [0, 1]}
  assert r.config_text == "erpo:\n  alpha: 0.01\n"
  _assert_bit_equal(train_step(_float_params(params), state, key),
                    train_step(_float_params(r.params), r.opt_state, r.rng_key))


def test_nnx_state_params_restore_as_nnx_state_into_the_targets_sharding(tmp_path, tiny_models):
  _, state = nnx.split(tiny_models[0], nnx.Param)
  with ck.Checkpointer(tmp_path, every=1, keep=1, fingerprint=FP) as c:
    _save(c, 1, state)
    _, target = nnx.split(tiny_models[1], nnx.Param)
    before = nnx.to_pure_dict(target)
    r = c.restore(params_target=target, opt_state_target={})
  assert isinstance(r.params, nnx.State)
  _assert_bit_equal(nnx.to_pure_dict(r.params), nnx.to_pure_dict(state))
  _assert_bit_equal(nnx.to_pure_dict(target), before)  # the target itself is not overwritten
  assert nnx.to_pure_dict(r.params)["embed"].sharding == before["embed"].sharding


def test_restore_casts_to_the_target_dtype(tmp_path):
  params = {"w": jnp.array([1.5, -2.25], jnp.float32)}
  with ck.Checkpointer(tmp_path, every=1, keep=1, fingerprint=FP) as c:
    _save(c, 1, params)
    r = c.restore(params_target={"w": jax.ShapeDtypeStruct((2,), jnp.bfloat16)}, opt_state_target={})
  assert r.params["w"].dtype == jnp.bfloat16
  np.testing.assert_array_equal(np.asarray(r.params["w"], np.float32), [1.5, -2.25])


def test_keep_n_keeps_the_newest_n(tmp_path):
  with ck.Checkpointer(tmp_path, every=1, keep=2, fingerprint=FP) as c:
    for s in range(1, 5):
      assert _save(c, s, _params(s))
    c.wait()
    assert c.all_steps() == [3, 4]
    assert c.latest_step() == 4
  assert sorted(os.listdir(tmp_path / "checkpoints")) == ["3", "4"]


def test_saves_every_k_steps_unless_forced_and_never_twice(tmp_path):
  with ck.Checkpointer(tmp_path, every=3, keep=5, fingerprint=FP) as c:
    assert [s for s in range(1, 10) if c.should_save(s)] == [3, 6, 9]
    assert not _save(c, 2, _params(0))
    assert _save(c, 3, _params(0))
    assert _save(c, 4, _params(0), force=True)
    assert not _save(c, 4, _params(0), force=True)
    c.wait()
    assert c.all_steps() == [3, 4]
  with ck.Checkpointer(tmp_path, every=0, keep=5, fingerprint=FP) as c:
    assert not any(c.should_save(s) for s in range(1, 10))


def test_async_save_copies_the_state_before_returning(tmp_path):
  # The loop donates params to the next step right after save(); the write must not need them.
  params = {"w": jax.random.normal(jax.random.key(0), (1 << 20,))}
  expected = np.asarray(params["w"]).copy()
  with ck.Checkpointer(tmp_path, every=1, keep=1, fingerprint=FP) as c:
    assert _save(c, 1, params)
    params["w"].delete()
    c.wait()
    assert c.latest_step() == 1
    r = c.restore(params_target={"w": jax.ShapeDtypeStruct((1 << 20,), jnp.float32)}, opt_state_target={})
  np.testing.assert_array_equal(np.asarray(r.params["w"]), expected)


_KILL_MID_SAVE = textwrap.dedent("""
  import os, signal, sys
  import jax, jax.numpy as jnp
  from erpo_jax.train import checkpoint as ck
  from erpo_jax.train import checkpoint_io as cio
  c = ck.Checkpointer(sys.argv[1], every=1, keep=3, fingerprint="fp")
  kw = dict(opt_state={}, rng_key=jax.random.key(0), config_text="")
  c.save(1, params={"w": jnp.full((25_000_000,), 1.0)}, data_state={"at": 1}, **kw)  # 100 MB
  c.wait()
  c.save(2, params={"w": jnp.full((25_000_000,), 2.0)}, data_state={"at": 2}, **kw)
  os.kill(os.getpid(), signal.SIGKILL)  # while step 2 is being written
""")


def test_sigkill_mid_write_never_yields_a_partial_latest(tmp_path):
  proc = subprocess.run([sys.executable, "-c", _KILL_MID_SAVE, str(tmp_path)], capture_output=True, text=True,
                        timeout=120)
  assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
  left = sorted(os.listdir(tmp_path / "checkpoints"))
  assert "1" in left and "2" not in left and any(n.startswith("2.orbax-checkpoint-tmp") for n in left), left
  with ck.Checkpointer(tmp_path, every=1, keep=3, fingerprint="fp") as c:
    assert c.latest_step() == 1
    assert os.listdir(tmp_path / "checkpoints") == ["1"]  # the torn step-2 folder is cleaned up
    r = c.restore(params_target={"w": jax.ShapeDtypeStruct((25_000_000,), jnp.float32)}, opt_state_target={})
  assert r.step == 1 and r.data_state == {"at": 1}
  assert bool(jnp.all(r.params["w"] == 1.0))


def test_disk_full_during_write_raises_and_keeps_the_previous_checkpoint(tmp_path):
  big = {"w": jax.random.normal(jax.random.key(1), (1 << 18,))}  # 1 MB
  expected = np.asarray(big["w"]).copy()
  with ck.Checkpointer(tmp_path, every=1, keep=1, fingerprint=FP) as c:
    _save(c, 1, {"w": jnp.zeros((1 << 18,))})
    c.wait()
    # A 64 KB file-size limit makes every larger write fail with EFBIG, as a full disk fails with ENOSPC.
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    old_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 16, hard))
    try:
      with pytest.raises(ck.CheckpointWriteError, match=r"step 2 could not be written.*latest complete .* step 1"):
        _save(c, 2, big)
        c.wait()
    finally:
      resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
      signal.signal(signal.SIGXFSZ, old_handler)
    np.testing.assert_array_equal(np.asarray(big["w"]), expected)  # in-memory state untouched
    assert c.latest_step() == 1
    assert os.listdir(tmp_path / "checkpoints") == ["1"]  # the torn folder is gone
    assert _save(c, 3, big)  # the checkpointer recovers once space is back
    c.wait()
    assert c.all_steps() == [3]
  with ck.Checkpointer(tmp_path, every=1, keep=1, fingerprint=FP) as c:
    r = c.restore(params_target=big, opt_state_target={})
  np.testing.assert_array_equal(np.asarray(r.params["w"]), expected)


# Orbax's writer threads report the vanished folder once more while shutting down; the error under test is ours.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_checkpoint_folder_removed_during_write_raises_and_previous_stays_restorable(tmp_path):
  ckpt_dir = tmp_path / "checkpoints"
  with ck.Checkpointer(tmp_path, every=1, keep=2, fingerprint=FP) as c:
    _save(c, 1, {"w": jnp.full((1 << 22,), 1.0)})
    c.wait()
    _save(c, 2, {"w": jnp.full((1 << 22,), 2.0)})
    tiny_runs.replace_folder_by_file(ckpt_dir, tmp_path / "moved")  # the folder vanishes mid-write
    with pytest.raises(ck.CheckpointWriteError, match="step 2 could not be written"):
      c.wait()
    ckpt_dir.unlink()
    os.rename(tmp_path / "moved", ckpt_dir)
  with ck.Checkpointer(tmp_path, every=1, keep=2, fingerprint=FP) as c:
    assert c.latest_step() == 1
    r = c.restore(params_target={"w": jax.ShapeDtypeStruct((1 << 22,), jnp.float32)}, opt_state_target={})
  assert bool(jnp.all(r.params["w"] == 1.0))


def test_fingerprint_mismatch_is_refused_naming_both_models(tmp_path):
  with ck.Checkpointer(tmp_path, every=1, keep=1, fingerprint="llama-L30-D576-V49152-aaaa") as c:
    _save(c, 1, _params(0))
  with ck.Checkpointer(tmp_path, every=1, keep=1, fingerprint="qwen2-L28-D3584-V152064-bbbb") as c:
    with pytest.raises(UserError, match="llama-L30-D576-V49152-aaaa.*qwen2-L28-D3584-V152064-bbbb"):
      c.restore(params_target=_params(0), opt_state_target={})


def test_model_fingerprint_changes_with_model_and_tokenizer():
  a = ck.model_fingerprint(TINY, "tok1")
  assert a.startswith("llama-L2-D16-V64-")
  assert a == ck.model_fingerprint(TINY, "tok1")
  assert a != ck.model_fingerprint(TINY, "tok2")
  assert a != ck.model_fingerprint(ModelConfig(**{**TINY.__dict__, "rope_theta": 1e5}), "tok1")


def test_params_of_another_shape_are_refused_naming_the_parameter(tmp_path):
  with ck.Checkpointer(tmp_path, every=1, keep=1, fingerprint=FP) as c:
    _save(c, 1, {"w": jnp.ones((8, 4))})
    with pytest.raises(UserError, match=r"parameter 'w' is \(8, 4\) in the checkpoint but \(8, 5\)"):
      c.restore(params_target={"w": jnp.ones((8, 5))}, opt_state_target={})
    with pytest.raises(UserError, match=r"this model has parameters \['v'\] the checkpoint lacks"):
      c.restore(params_target={"w": jnp.ones((8, 4)), "v": jnp.ones(2)}, opt_state_target={})


def test_changed_optimizer_is_refused_with_a_user_error(tmp_path):
  p = _float_params(_params(0))
  with ck.Checkpointer(tmp_path, every=1, keep=1, fingerprint=FP) as c:
    _save(c, 1, p, optax.adamw(1e-3).init(p))
    other = optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(1e-3, momentum=0.9)).init(p)
    with pytest.raises(UserError, match="optimizer"):
      c.restore(params_target=p, opt_state_target=other)


def _finite(tree) -> bool:
  return cio.summaries(tree)[1]


def test_non_finite_state_is_never_saved(tmp_path):
  assert _finite({"a": jnp.ones(3), "i": jnp.arange(3)})
  assert not _finite({"a": jnp.array([1.0, jnp.inf])})
  assert not _finite((jnp.ones(2), {"m": jnp.array([jnp.nan], jnp.bfloat16)}))
  with ck.Checkpointer(tmp_path, every=1, keep=1, fingerprint=FP) as c:
    with pytest.raises(NonFiniteError, match="step 5"):
      _save(c, 5, {"w": jnp.ones(2)}, {"mu": jnp.array([0.0, jnp.nan])})
    assert c.latest_step() is None


def test_restore_without_checkpoints_names_the_folder(tmp_path):
  with ck.Checkpointer(tmp_path, every=1, keep=1, fingerprint=FP) as c:
    with pytest.raises(PathError, match="no checkpoint to resume from in .*checkpoints"):
      c.restore(params_target={}, opt_state_target={})
    _save(c, 2, _params(0))
    with pytest.raises(PathError, match=r"step 7 not found.*\[2\]"):
      c.restore(7, params_target=_params(0), opt_state_target={})


def test_restore_params_loads_a_tiny_nnx_model_from_latest_step_or_run_folder(tmp_path, tiny_models):
  trained, other, target = tiny_models
  with ck.Checkpointer(tmp_path, every=1, keep=3, fingerprint=FP) as c:
    _save(c, 1, nnx.state(other, nnx.Param))
    _save(c, 2, nnx.state(trained, nnx.Param))
  for checkpoint, run_dir in (("latest", tmp_path), ("2", tmp_path), (str(tmp_path / "checkpoints" / "2"), "x"),
                              (str(tmp_path), "x")):
    nnx.update(target, nnx.state(other, nnx.Param))
    assert cio.restore_params(target, checkpoint, run_dir) is target
    _assert_bit_equal(_pure(target), _pure(trained))  # hence the same function as `trained`
  assert cio.find_checkpoint("1", tmp_path) == tmp_path / "checkpoints" / "1"


def test_restore_params_reads_a_run_folder_given_relative_to_the_working_directory(tmp_path, tiny_models,
                                                                                  monkeypatch):
  # The default config's run.dir is relative (runs/default): `erpo-jax eval --checkpoint latest` passes it as is.
  trained, other, target = tiny_models
  with ck.Checkpointer(tmp_path / "runs" / "x", every=1, keep=3, fingerprint=FP) as c:
    _save(c, 2, nnx.state(trained, nnx.Param))
  monkeypatch.chdir(tmp_path)
  for checkpoint, run_dir in (("latest", "runs/x"), ("runs/x/checkpoints/2", "elsewhere"), ("runs/x", ".")):
    nnx.update(target, nnx.state(other, nnx.Param))
    assert cio.restore_params(target, checkpoint, run_dir) is target
    _assert_bit_equal(_pure(target), _pure(trained))


def test_restore_params_refuses_missing_checkpoints_and_other_models(tmp_path, tiny_models):
  model = tiny_models[2]
  with pytest.raises(PathError, match="no complete checkpoint in .*checkpoints"):
    cio.restore_params(model, "latest", tmp_path)
  with pytest.raises(PathError, match="'/nowhere/run'"):
    cio.restore_params(model, "/nowhere/run", tmp_path)
  with ck.Checkpointer(tmp_path, every=1, keep=1, fingerprint=FP) as c:
    _save(c, 1, {**_pure(model), "embed": jnp.zeros((64, 32))})  # a model with D = 32
  shutil.copytree(tmp_path / "checkpoints" / "1", tmp_path / "checkpoints" / "2.orbax-checkpoint-tmp")
  with pytest.raises(PathError, match="not a step folder"):
    cio.restore_params(model, str(tmp_path / "checkpoints" / "2.orbax-checkpoint-tmp"), tmp_path)
  expected = rf"written for model '{FP}' and does not fit this model: parameter 'embed' is \(64, 32\) in the " \
             r"checkpoint but \(64, 16\)"
  with pytest.raises(UserError, match=expected):
    cio.restore_params(model, "latest", tmp_path)


# ---------------- integrity: damaged checkpoints are found and the newest intact one is used


DAMAGE = {"4 KB overwritten": tiny_runs.overwrite_4k, "truncated": tiny_runs.truncate, "emptied": tiny_runs.empty,
          "params folder missing": tiny_runs.no_params}


def _big_params(seed):
  return {"w": jax.random.normal(jax.random.key(seed), (256, 64), jnp.float32)}


def test_checksums_change_with_any_single_word_and_not_otherwise():
  x = jnp.arange(1000, dtype=jnp.float32)
  base = cio.checksums({"x": x, "b": x.astype(jnp.bfloat16), "i": jnp.arange(3)})
  assert base == cio.checksums({"x": x + 0, "b": x.astype(jnp.bfloat16), "i": jnp.arange(3)})
  for k in (0, 1, 500, 999):
    assert cio.checksums({"x": x.at[k].set(-1.0)})[0] != base[2]  # leaves flatten as b, i, x
  swapped = x.at[0].set(x[1]).at[1].set(x[0])
  assert cio.checksums({"x": swapped})[0] != base[2]


def _documented_checksum(x: np.ndarray) -> str:
  """checksums' formula in numpy: lanes sum(w * (2i+1)) and sum((w ^ i*0x9E3779B9) * 0x85EBCA6B * (2i+3)) mod 2**32."""
  w = x.reshape(-1).view({1: np.uint8, 2: np.uint16, 4: np.uint32}[x.dtype.itemsize]).astype(np.uint64)
  i = np.arange(w.size, dtype=np.uint64)
  m = np.uint64(2 ** 32 - 1)
  a = int(np.sum((w * (2 * i + 1)) & m) & m)
  b = int(np.sum((((w ^ ((i * np.uint64(0x9E3779B9)) & m)) * np.uint64(0x85EBCA6B)) & m) * (2 * i + 3) & m) & m)
  return f"{a:08x}{b:08x}"


def test_checksums_are_the_documented_sums_so_earlier_checkpoints_still_verify():
  rng = np.random.default_rng(0)
  tree = {"f": rng.normal(size=(3, 50, 7)).astype(np.float32), "h": rng.normal(size=(33,)).astype(jnp.bfloat16),
          "i": rng.integers(-5, 5, size=(4, 9)).astype(np.int32), "u": rng.integers(0, 255, size=(17,)).astype(np.uint8)}
  got = cio.checksums(jax.tree.map(jnp.asarray, tree))
  assert got == [_documented_checksum(np.asarray(x)) for x in jax.tree.leaves(tree)]


def test_checksums_and_finiteness_of_optimizer_state_need_no_temporary_copy_of_it():
  # AdamW's mu and nu come in pairs of equal shapes; summing each checksum lane apart made XLA write every
  # leaf's words out whole (2.1 GB for SmolLM2-135M's parameters and state, at every checkpoint save), and
  # isfinite(x).all() wrote out its booleans.
  leaves = [jnp.ones(s, jnp.float32) for s in [(6, 64, 96)] * 3 + [(6, 64, 64), (500, 64)]] * 2
  compiled = cio._summaries.lower(leaves).compile()
  argument_bytes = sum(x.nbytes for x in leaves)
  assert compiled.memory_analysis().temp_size_in_bytes < 0.01 * argument_bytes


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_one_nan_or_inf_anywhere_in_any_float_leaf_is_found(dtype):
  x = jnp.linspace(-3e4, 3e4, 3 * 40 * 33).reshape(3, 40, 33).astype(dtype)
  ints = jnp.arange(7)
  assert _finite({"x": x, "i": ints, "big": jnp.full((5,), jnp.finfo(jnp.float32).max)})
  for pos in (0, 1, 31, 32, 2000, x.size - 1):
    for bad in (jnp.nan, jnp.inf, -jnp.inf):
      broken = x.reshape(-1).at[pos].set(bad).reshape(x.shape)
      assert not _finite({"i": ints, "ok": x, "x": broken}), (pos, bad)
      summed, finite = cio.summaries({"x": broken})
      assert not finite and summed == cio.checksums({"x": broken})


def test_the_allocators_free_memory_is_handed_back_once_a_background_write_is_on_disk(tmp_path, monkeypatch):
  calls = []
  monkeypatch.setattr(ck.allocator, "release_free_memory", lambda: calls.append("released"))
  with ck.Checkpointer(tmp_path, every=1, keep=2, fingerprint=FP) as c:
    c.wait()
    assert calls == []  # nothing was being written
    assert c.save(1, params=_big_params(0), opt_state={}, rng_key=jax.random.key(0), data_state={},
                  config_text="")
    c.wait()
    assert calls == ["released"] and c.all_steps() == [1]
    c.wait()
    assert calls == ["released"]


@pytest.mark.parametrize("damage", list(DAMAGE), ids=list(DAMAGE))
def test_damaged_latest_checkpoint_falls_back_to_the_newest_intact_one_with_a_warning(tmp_path, damage):
  with ck.Checkpointer(tmp_path, every=1, keep=3, fingerprint=FP) as c:
    for step in (1, 2, 3):
      _save(c, step, _big_params(step))
  DAMAGE[damage](tmp_path / "checkpoints" / "3")
  warnings = []
  with ck.Checkpointer(tmp_path, every=1, keep=3, fingerprint=FP) as c:
    with pytest.raises(cio.CheckpointDamagedError, match="checkpoint .*checkpoints/3"):
      c.restore(3, params_target=_big_params(0), opt_state_target={})
    r = c.restore_latest_intact(params_target=_big_params(0), opt_state_target={}, warn=warnings.append)
    assert r.step == 2
    _assert_bit_equal(r.params, _big_params(2))
    assert len(warnings) == 1 and "checkpoints/3" in warnings[0] and "step 2" in warnings[0], warnings
    # The damaged folder is set aside, so step 3 can be written again and is the latest.
    assert c.all_steps() == [1, 2] and (tmp_path / "checkpoints" / "3.damaged").is_dir()
    _save(c, 3, _big_params(7))
    assert c.restore(params_target=_big_params(0), opt_state_target={}).step == 3


def test_readable_arrays_that_differ_from_their_checksums_are_refused(tmp_path):
  with ck.Checkpointer(tmp_path, every=1, keep=2, fingerprint=FP) as c:
    for step in (1, 2):
      _save(c, step, _big_params(step))
  step_dir = tmp_path / "checkpoints"
  shutil.rmtree(step_dir / "2" / "params")
  shutil.copytree(step_dir / "1" / "params", step_dir / "2" / "params")  # valid arrays, other values
  with ck.Checkpointer(tmp_path, every=1, keep=2, fingerprint=FP) as c:
    with pytest.raises(cio.CheckpointDamagedError, match="params array 'w' differs from its saved checksum"):
      c.restore(2, params_target=_big_params(0), opt_state_target={})


def test_no_intact_checkpoint_is_one_error_naming_each(tmp_path):
  with ck.Checkpointer(tmp_path, every=1, keep=2, fingerprint=FP) as c:
    for step in (1, 2):
      _save(c, step, _big_params(step))
  tiny_runs.overwrite_4k(tmp_path / "checkpoints" / "2")
  tiny_runs.no_params(tmp_path / "checkpoints" / "1")
  with ck.Checkpointer(tmp_path, every=1, keep=2, fingerprint=FP) as c:
    with pytest.raises(cio.CheckpointDamagedError, match=r"no intact checkpoint in .*checkpoints/2.*checkpoints/1"):
      c.restore_latest_intact(params_target=_big_params(0), opt_state_target={})


def test_fresh_folder_restores_nothing(tmp_path):
  with ck.Checkpointer(tmp_path, every=1, keep=2, fingerprint=FP) as c:
    assert c.restore_latest_intact(params_target=_big_params(0), opt_state_target={}) is None


def test_restore_params_refuses_a_damaged_checkpoint_in_one_line(tmp_path, tiny_models):
  trained, other, target = tiny_models
  with ck.Checkpointer(tmp_path, every=1, keep=2, fingerprint=FP) as c:
    _save(c, 1, nnx.state(other, nnx.Param))
    _save(c, 2, nnx.state(trained, nnx.Param))
  step_dir = tmp_path / "checkpoints"
  shutil.rmtree(step_dir / "2" / "params")
  shutil.copytree(step_dir / "1" / "params", step_dir / "2" / "params")
  with pytest.raises(cio.CheckpointDamagedError, match=r"checkpoints/2: params array '.*' differs from its saved"):
    cio.restore_params(target, "latest", tmp_path)
  tiny_runs.truncate(step_dir / "1")
  with pytest.raises(cio.CheckpointDamagedError, match=r"checkpoints/1: its arrays cannot be read"):
    cio.restore_params(target, "1", tmp_path)


def test_abandoned_orbax_readers_print_no_traceback_but_other_unraisable_errors_still_do():
  # Orbax's concurrent readers of damaged arrays raise again when collected; only those reports are dropped.
  script = textwrap.dedent("""
      import gc, sys
      from erpo_jax.train.checkpoint_io import quiet_reader_errors

      async def reader(message):
        try:
          await _Suspend()
        except BaseException:
          raise Exception(message)

      class _Suspend:
        def __await__(self):
          yield

      def abandon(message):
        coro = reader(message)
        coro.send(None)  # suspended mid-read, then dropped: closing it raises
        del coro
        gc.collect()

      try:
        with quiet_reader_errors():
          abandon("Encountered error while reading array index: (slice(0, 2, 1),)")
          raise OSError("damaged")
      except OSError:
        pass
      abandon("Encountered error while reading array index: (slice(0, 4, 1),)")
      abandon("some other failure")
      """)
  proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
  assert proc.returncode == 0, proc.stderr
  assert "reading array index" not in proc.stderr, proc.stderr
  assert proc.stderr.count("Exception ignored in") == 1 and "some other failure" in proc.stderr, proc.stderr
