"""The CPU decode kernels compute XLA's products and attention, decode what XLA decodes, and say why when off."""

import os
import stat
import subprocess
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kernel_builds
from erpo_jax.model import cpu_kernel, decode, llama
from erpo_jax.model.config import ModelConfig
from erpo_jax.model.kv_cache import GroupKVCache, KVCache
from erpo_jax.rollout.sampler import Sampler

CFG = ModelConfig("llama", 64, 32, 2, 4, 2, 8, 64, tie_word_embeddings=True)
PROMPTS = [[5, 6, 7], [8, 9, 10, 11, 12, 13, 14], [3], list(range(20, 32))]


@pytest.fixture(scope="module")
def kernel_rows():
  with cpu_kernel.forced(True):
    if not cpu_kernel.usable(jnp.float32):
      pytest.skip(f"the CPU decode kernel is {cpu_kernel.status()}")
  return cpu_kernel._load()[1]


def test_the_kernel_library_builds_wherever_a_compiler_and_an_x86_64_cpu_are(tmp_path):
  """The tests above skip when the kernel is off; a source that no longer compiles must fail here instead."""
  cxx = cpu_kernel.compiler()
  if cxx is None or os.uname().machine not in ("x86_64", "amd64"):
    pytest.skip("no C++ compiler or not x86-64: the kernel is off by design")
  assert os.path.exists(cpu_kernel.build(cxx, str(tmp_path)))


def f64_product(w_inxout, x_inxN):
  return np.asarray(w_inxout, np.float64).T @ np.asarray(x_inxN, np.float64)


@pytest.mark.parametrize("fan_in,rows,n", [(576, 1536, 32), (37, 100, 5), (7, 12, 33), (64, 200, 64),
                                           (16, 25, 1), (33, 13, 70), (128, 11, 16)])
def test_kernel_products_equal_float64_products_for_any_rows_and_columns(kernel_rows, fan_in, rows, n):
  kw, kx = jax.random.split(jax.random.key(fan_in * rows + n))
  w = jax.random.normal(kw, (fan_in, rows))
  x = jax.random.normal(kx, (fan_in, n))
  want = f64_product(w, x)
  got = np.asarray(jax.jit(cpu_kernel.matmul)(cpu_kernel.pack(w), x))
  assert got.shape == (rows, n) and got.dtype == np.float32
  np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5 * np.sqrt(fan_in))
  got_rows = np.asarray(jax.jit(cpu_kernel.matmul)(cpu_kernel.pack_rows(w.T), x))
  np.testing.assert_array_equal(got_rows, got)


def test_panels_hold_each_block_of_rows_k_major_with_zero_rows_after_the_last(kernel_rows):
  R = kernel_rows
  w_inxout = jnp.arange(5 * (R + 3), dtype=jnp.float32).reshape(5, R + 3)
  p = cpu_kernel.pack(w_inxout)
  assert p.rows == R + 3 and p.panels.shape == (2, 5, R)
  np.testing.assert_array_equal(p.panels[0], w_inxout[:, :R])
  np.testing.assert_array_equal(p.panels[1, :, :3], w_inxout[:, R:])
  assert not np.any(p.panels[1, :, 3:])


def test_the_avx2_build_equals_float64_products_too(kernel_rows, tmp_path):
  """Machines without AVX-512 build the AVX2 panels (6 rows of 8-lane vectors); this CPU runs them too."""
  lib = kernel_builds.avx2_build(tmp_path)
  assert lib.erpo_panel_rows() == 6
  jax.ffi.register_ffi_target("erpo_decode_matmul_avx2_test", jax.ffi.pycapsule(lib.ErpoDecodeMatmul),
                              platform="cpu")
  w = jax.random.normal(jax.random.key(3), (100, 45))
  x = jax.random.normal(jax.random.key(4), (100, 21))
  panels = jnp.transpose(jnp.pad(w, ((0, 0), (0, 3))).reshape(100, 8, 6), (1, 0, 2))
  got = jax.ffi.ffi_call("erpo_decode_matmul_avx2_test", jax.ShapeDtypeStruct((45, 21), jnp.float32))(panels, x)
  np.testing.assert_allclose(np.asarray(got), f64_product(w, x), rtol=2e-5, atol=2e-4)
  jax.ffi.register_ffi_target("erpo_attention_avx2_test", jax.ffi.pycapsule(lib.ErpoGroupDecodeAttention),
                              platform="cpu")
  for case in ATTENTION_CASES.values():
    args, want_oT, _ = _attention_case(13, *case)
    oT, _ = cpu_kernel.group_attention(*args, target="erpo_attention_avx2_test")
    np.testing.assert_allclose(np.asarray(oT), np.asarray(want_oT), rtol=2e-5, atol=2e-5)


def _attention_case(seed, B, G, K, g, Dh, P, M, len_B, t_N):
  """Random columns (q and k before RoPE), RoPE tables, a prompt cache and half-filled response slots, a mask
  (prompt b's first len_B[b] slots, row n's response slots up to t_N[n]), and XLA's answer: rope_cols,
  GroupKVCache.write into response slot t_N.max(), then attend."""
  ks = jax.random.split(jax.random.key(seed), 8)
  N, H = B * G, K * g
  qT, kT, vT = (jax.random.normal(k, (h * Dh, N)) for k, h in zip(ks[:3], (H, K, K)))
  pos_N = jnp.repeat(jnp.asarray(len_B), G) + jnp.asarray(t_N)
  cos, sin = llama.rope_tables(pos_N[:, None], types.SimpleNamespace(head_dim=Dh, rope_theta=10000.0,
                                                                      rope_scaling=None))
  cosT, sinT = decode.rope_tables_cols(cos, sin)
  prompt = KVCache.from_prompt(jax.random.normal(ks[3], (B, P, K, Dh)), jax.random.normal(ks[4], (B, P, K, Dh)))
  rk, rv = jax.random.normal(ks[5], (N, M, K, Dh)), jax.random.normal(ks[6], (N, M, K, Dh))
  slot_T = jnp.arange(P + M)[None]
  attend = (slot_T < jnp.repeat(jnp.asarray(len_B), G)[:, None]) | (
      (slot_T >= P) & (slot_T <= P + jnp.asarray(t_N)[:, None]))
  s = int(max(t_N))
  xla = GroupKVCache(prompt, KVCache.from_prompt(rk, rv))
  rows = lambda x: jnp.transpose(x, (2, 0, 1))
  xla = xla.write(rows(decode.rope_cols(kT.reshape(K, Dh, N), cosT, sinT))[:, None],
                  rows(vT.reshape(K, Dh, N))[:, None], P + s)
  want_oT = xla.attend(rows(decode.rope_cols(qT.reshape(H, Dh, N), cosT, sinT)), attend).reshape(N, H * Dh).T
  cache = cpu_kernel.GroupCache(prompt, jnp.swapaxes(rk, 1, 2), jnp.swapaxes(rv, 1, 2))
  args = (qT, kT, vT, cosT[0], sinT[0], cache, attend, P + s)
  return args, want_oT, xla


ATTENTION_CASES = {  # B, G, K, g, Dh, P, M, len_B, t_N
    "reference-shape": (4, 8, 3, 3, 64, 50, 64, [50, 31, 7, 44], [5] * 32),
    "rows-at-different-steps": (2, 3, 2, 2, 16, 5, 4, [3, 5], [0, 1, 2, 3, 0, 3]),
    "head-dim-below-a-vector": (3, 2, 1, 4, 6, 19, 9, [19, 1, 12], [8, 2, 0, 4, 8, 8]),
    "one-row-per-prompt": (5, 1, 2, 1, 34, 33, 17, [33, 30, 2, 17, 9], [16, 3, 7, 0, 11]),
}


@pytest.mark.parametrize("case", ATTENTION_CASES.values(), ids=ATTENTION_CASES.keys())
def test_kernel_attention_equals_xla_rope_write_and_attend(kernel_rows, case):
  args, want_oT, xla = _attention_case(11, *case)
  oT, cache = jax.jit(cpu_kernel.group_attention)(*args)
  np.testing.assert_allclose(np.asarray(oT), np.asarray(want_oT), rtol=2e-5, atol=2e-5)
  # The response cache equals XLA's after its write (keys slot-major here, slot-minor there), every slot.
  np.testing.assert_allclose(np.asarray(cache.k), np.asarray(jnp.swapaxes(xla.response.k, 2, 3)), rtol=1e-6,
                             atol=1e-6)
  np.testing.assert_array_equal(np.asarray(cache.v), np.asarray(xla.response.v))
  np.testing.assert_array_equal(np.asarray(cache.prompt.k), np.asarray(xla.prompt.k))


def test_kernel_attention_rejects_a_slot_outside_the_response(kernel_rows):
  args, _, _ = _attention_case(12, *ATTENTION_CASES["rows-at-different-steps"])
  P = args[5].prompt.k.shape[-1]
  with pytest.raises(Exception, match="slot outside the response"):
    jax.block_until_ready(cpu_kernel.group_attention(*args[:7], P - 1))


def test_decode_layers_are_packed_panels_of_the_same_matrices(kernel_rows):
  m = llama.init_random(CFG, seed=0)
  p = m._layer_params()
  with cpu_kernel.forced(True):
    layers = m.decode_layers()
  x = jax.random.normal(jax.random.key(5), (CFG.intermediate_size, 3))
  for i, layer in enumerate(layers):
    assert isinstance(layer["wq"], cpu_kernel.Panels) and layer["wq"].rows == 32
    np.testing.assert_allclose(decode.mm(layer["w_down"], x[:, :3]), f64_product(p["w_down"][i], x), atol=1e-4)
    np.testing.assert_array_equal(layer["attn_norm"], p["attn_norm"][i])


def test_greedy_rollouts_with_the_kernel_equal_those_with_xla_dot(kernel_rows):
  m = llama.init_random(CFG, seed=1)
  eos = types.SimpleNamespace(eos_ids=(CFG.vocab_size + 1,), pad_id=0)
  out = {}
  for on in (True, False):
    with cpu_kernel.forced(on):
      s = Sampler(m, eos, max_new_tokens=10, temperature=0.0, min_prompt_bucket=4)
      out[on] = s.generate(m, PROMPTS, group_size=3, key=jax.random.key(0))
  np.testing.assert_array_equal(np.asarray(out[True].tokens), np.asarray(out[False].tokens))
  np.testing.assert_allclose(np.asarray(out[True].logp), np.asarray(out[False].logp), atol=1e-5)


def test_sampled_rollouts_with_the_kernel_have_the_models_log_probs(kernel_rows):
  from erpo_jax.model import logprobs  # only here: the reference for this one test

  m = llama.init_random(CFG, seed=2)
  eos = types.SimpleNamespace(eos_ids=(1, 2), pad_id=0)
  with cpu_kernel.forced(True):
    r = Sampler(m, eos, max_new_tokens=12, min_prompt_bucket=4).generate(m, PROMPTS, group_size=4,
                                                                         key=jax.random.key(7))
  mask = np.asarray(r.response_mask)
  np.testing.assert_allclose(np.asarray(r.logp)[mask], np.asarray(logprobs.log_probs(m, r.tokens))[mask], atol=1e-5)


def test_bfloat16_and_the_environment_switch_keep_xla_dot(kernel_rows, monkeypatch):
  with cpu_kernel.forced(True):
    assert cpu_kernel.status() == f"on ({kernel_rows}-row panels, float32 decode and update attention)"
  assert not cpu_kernel.usable(jnp.bfloat16)
  monkeypatch.setenv(cpu_kernel.ENV, "off")
  assert not cpu_kernel.usable(jnp.float32)
  assert cpu_kernel.status() == f"off: {cpu_kernel.ENV}=off"
  m = llama.init_random(CFG, seed=0)
  assert not isinstance(m.decode_layers()[0]["wq"], cpu_kernel.Panels)
  assert not isinstance(m.decode_unembed(), cpu_kernel.Panels)


def _fresh_process(env: dict) -> subprocess.CompletedProcess:
  code = ("import jax.numpy as jnp; from erpo_jax.model import cpu_kernel as k; "
          "print(k.usable(jnp.float32)); print(k.status())")
  return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                        env={**os.environ, "JAX_PLATFORMS": "cpu", **env})


def test_without_a_compiler_decode_keeps_xla_dot_and_says_why_once(tmp_path):
  done = _fresh_process({"CXX": str(tmp_path / "no-such-compiler"), "XDG_CACHE_HOME": str(tmp_path)})
  assert done.returncode == 0, done.stderr
  assert done.stdout.splitlines() == ["False", "off: no C++ compiler (set CXX or install g++)"]
  said = [ln for ln in done.stderr.splitlines() if "erpo-jax:" in ln]
  assert said == ["erpo-jax: decoding and the update's attention with XLA's ops, not the CPU kernel: no C++ "
                  "compiler (set CXX or install g++); ERPO_JAX_CPU_KERNEL=off skips the kernel"]


def test_a_failed_build_keeps_xla_dot_and_quotes_the_compiler(tmp_path):
  cxx = tmp_path / "cxx"
  cxx.write_text("#!/bin/sh\n[ \"$1\" = --version ] && { echo 'cxx 1.0'; exit 0; }\n"
                 "echo 'decode_matmul.cc:1: error: no AVX here' >&2; exit 1\n")
  cxx.chmod(cxx.stat().st_mode | stat.S_IEXEC)
  done = _fresh_process({"CXX": str(cxx), "XDG_CACHE_HOME": str(tmp_path)})
  assert done.returncode == 0, done.stderr
  assert done.stdout.splitlines()[0] == "False"
  assert "it did not build (cxx exited with 1: decode_matmul.cc:1: error: no AVX here)" in done.stdout
  assert not list((tmp_path / "erpo-jax" / "native").glob("*.so"))  # nothing half-built is kept


def test_a_cache_folder_that_cannot_be_made_builds_the_kernel_for_the_process_alone_and_leaves_no_folder(
    kernel_rows, tmp_path):
  blocker = tmp_path / "a-file"
  blocker.write_text("not a folder")
  scratch = tmp_path / "tmp"
  scratch.mkdir()
  done = _fresh_process({"XDG_CACHE_HOME": str(blocker), "TMPDIR": str(scratch)})
  assert done.returncode == 0, done.stderr
  assert done.stdout.splitlines()[0] == "True"
  assert "erpo-jax:" not in done.stderr
  assert not list(scratch.glob("erpo-jax-native-*"))  # the loaded library needs no file
