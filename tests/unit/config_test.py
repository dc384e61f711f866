"""Config files and overrides: typed values, one-line errors with the key, file and line."""

import dataclasses
import pathlib
import subprocess
import sys

import pytest

from erpo_jax.config import Config
from erpo_jax.config_io import dump_config, flatten, load_config
from erpo_jax.errors import ConfigError, PathError


def test_shipped_configs_load_and_grpo_baseline_differs_only_in_erpo():
  default = load_config("configs/default.yaml")
  grpo = load_config("configs/grpo_baseline.yaml")
  assert default.erpo.kl_on == "prompt" and default.erpo.weights == "static"
  assert grpo.erpo.kl_on == "response" and grpo.erpo.weights == "none"
  for section in ("model", "data", "rollout", "ppo", "optim", "train", "reward"):
    assert getattr(default, section) == getattr(grpo, section), section
  for name in ("tiny", "qwen25_math_7b_erpo", "qwen25_math_7b_grpo"):
    assert isinstance(load_config(f"configs/{name}.yaml"), Config)


def test_every_shipped_config_loads():
  names = sorted(p.stem for p in pathlib.Path("configs").glob("*.yaml"))
  assert {"default", "rloo", "rloo_erpo", "dapo", "dapo_erpo"} <= set(names)
  for name in names:
    assert isinstance(load_config(f"configs/{name}.yaml"), Config), name


def _changed_from_default(name):
  default = flatten(load_config("configs/default.yaml").to_dict())
  return {k: v for k, v in flatten(load_config(f"configs/{name}.yaml").to_dict()).items() if default[k] != v}


DAPO_FIELDS = {"rollout.dynamic_sampling": True, "reward.overlong_buffer": 8, "ppo.eps_high": 0.28, "ppo.loss_aggregation": "token-mean"}


@pytest.mark.parametrize("name,changed", [
    ("rloo", {"ppo.advantage": "rloo", "erpo.weights": "none", "erpo.kl_on": "response", "erpo.reference": "forward"}),
    ("rloo_erpo", {"ppo.advantage": "rloo"}),
    ("dapo", {**DAPO_FIELDS, "erpo.kl_on": "none", "erpo.weights": "none"}),
    ("dapo_erpo", DAPO_FIELDS),
])
def test_rloo_and_dapo_configs_change_only_their_own_fields_of_the_default(name, changed):
  assert _changed_from_default(name) == {**changed, "run.dir": f"runs/{name}"}


def test_a_bare_name_finds_the_shipped_config():
  assert load_config("tiny") == load_config("configs/tiny.yaml")


def test_overrides_parse_yaml_values_and_win_over_the_file():
  cfg = load_config("configs/tiny.yaml", ["erpo.weights=dynamic", "optim.lr=3e-4", "erpo.dynamic_clip=[0.5, 2]",
                                          "ppo.dual_clip=3", "data.levels=[1,2]"])
  assert cfg.erpo.weights == "dynamic"
  assert cfg.optim.lr == pytest.approx(3e-4)
  assert cfg.erpo.dynamic_clip == (0.5, 2.0)
  assert cfg.ppo.dual_clip == 3.0 and cfg.data.levels == (1, 2)


def test_dump_then_load_round_trips(tmp_path):
  cfg = load_config("configs/default.yaml", ["erpo.weights=dynamic"])
  path = tmp_path / "c.yaml"
  path.write_text(dump_config(cfg))
  assert load_config(path) == cfg


@pytest.mark.parametrize("override,needle", [
    ("erpo.weight=static", "unknown config key 'erpo.weight'; did you mean 'erpo.weights'?"),
    ("erpo.weights=sometimes", "erpo.weights: expected one of 'static', 'dynamic', 'none', got 'sometimes'"),
    ("train.steps=many", "train.steps: expected an integer, got 'many'"),
    ("rollout.group_size=1", "rollout.group_size: expected an integer >= 2 for group-relative advantages"),
    ("optim.lr=-1", "optim.lr: expected a positive number"),
    ("mesh.data=0", "mesh: expected sizes >= 1 or -1"),
    ("erpo.weights", "expected key=value"),
])
def test_bad_overrides_name_the_key_and_what_was_expected(override, needle):
  with pytest.raises(ConfigError) as e:
    load_config("configs/tiny.yaml", [override])
  assert needle in str(e.value)
  assert "\n" not in str(e.value)


@pytest.mark.parametrize("overrides,needle", [
    (["ppo.advantage=rloo", "ppo.advantage_scale=none"],
     "ppo.advantage_scale: expected 'group' (the default) with ppo.advantage=rloo: advantage_scale applies to "
     "ppo.advantage=grpo only, got 'none'"),
    (["ppo.advantage=reinforce", "ppo.advantage_scale=batch"], "with ppo.advantage=reinforce"),
    (["ppo.advantage=ppo"], "ppo.advantage: expected one of 'grpo', 'rloo', 'reinforce'"),
    (["rollout.group_size=1", "ppo.advantage=rloo"], "rollout.group_size: expected an integer >= 2"),
    (["reward.overlong_buffer=8"], "reward.overlong_buffer: expected fewer tokens than rollout.max_new_tokens=8"),
    (["reward.overlong_buffer=-1"], "reward.overlong_buffer: expected an integer >= 0"),
    (["reward.overlong_penalty=-0.5"], "reward.overlong_penalty: expected a finite number >= 0"),
    (["ppo.mask_truncated=maybe"], "ppo.mask_truncated: expected"),
])
def test_advantage_and_overlong_settings_are_checked(overrides, needle):
  with pytest.raises(ConfigError) as e:
    load_config("configs/tiny.yaml", overrides)
  assert needle in str(e.value)


def test_unscaled_grpo_still_allows_groups_of_one_and_a_buffer_below_the_limit_loads():
  assert load_config("configs/tiny.yaml", ["rollout.group_size=1", "ppo.advantage_scale=none"]).rollout.group_size == 1
  assert load_config("configs/tiny.yaml", ["reward.overlong_buffer=7"]).reward.overlong_buffer == 7


def test_errors_in_a_file_name_its_line(tmp_path):
  path = tmp_path / "bad.yaml"
  path.write_text("model:\n  path: random\nerpo:\n  alpha: 0.1\n  kl_onn: prompt\n")
  with pytest.raises(ConfigError, match=r"bad.yaml:5: unknown config key 'erpo.kl_onn'; did you mean 'erpo.kl_on'"):
    load_config(path)
  path.write_text("erpo:\n  alpha: -3\n")
  with pytest.raises(ConfigError, match=r"bad.yaml:2: erpo.alpha: expected a number >= 0"):
    load_config(path)
  path.write_text("erpo: [unclosed\n")
  with pytest.raises(ConfigError, match=r"bad.yaml:\d+: invalid YAML"):
    load_config(path)


def test_missing_config_file_is_a_path_error():
  with pytest.raises(PathError, match="config file 'nope.yaml' not found"):
    load_config("nope.yaml")


@pytest.mark.parametrize("args,needle", [
    (["--config", "nope.yaml"], "config file 'nope.yaml' not found"),
    (["--config", "configs/tiny.yaml", "erpo.weight=static"], "did you mean 'erpo.weights'"),
    (["--config", "configs/tiny.yaml", "erpo.kl_on=both"], "erpo.kl_on: expected one of"),
    (["--config", "configs/tiny.yaml", "train.steps=1.5"], "train.steps: expected an integer"),
])
def test_cli_prints_one_line_and_exits_2_without_traceback(args, needle):
  res = subprocess.run([sys.executable, "-m", "erpo_jax.cli", "train", *args], capture_output=True, text=True,
                       timeout=120)
  assert res.returncode == 2
  assert needle in res.stderr
  assert "Traceback" not in res.stderr
  assert len(res.stderr.strip().splitlines()) == 1


# ---------------- YAML that a config must not be: tags, complex keys, alias cycles and bombs

ALIAS_BOMB = "a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"{c}: &{c} [{', '.join(['*' + p] * 9)}]\n" for p, c in zip("abcdefgh", "bcdefghi"))


@pytest.mark.parametrize("text,needle", [
    ("train:\n  steps: !!python/object/apply:os.system ['echo pwned']\n",
     "bad.yaml:2: invalid YAML (tags such as '!!python/object/apply:os.system' are not allowed"),
    ("optim:\n  lr: !!float abc\n", "bad.yaml:2: invalid YAML (tags such as '!!float' are not allowed"),
    ("? [train, steps]\n: 3\n", "bad.yaml:1: invalid YAML (a mapping key must be a plain value"),
    ("train: &t\n  steps: *t\n", "invalid YAML (an alias refers to itself)"),
    (ALIAS_BOMB, "invalid YAML (aliases expand to more than 10000 values)"),
])
def test_yaml_tags_complex_keys_and_alias_tricks_are_one_line_config_errors(tmp_path, text, needle):
  path = tmp_path / "bad.yaml"
  path.write_text(text)
  with pytest.raises(ConfigError) as e:
    load_config(path)
  assert needle in str(e.value)
  assert "\n" not in str(e.value) and len(str(e.value)) < 300


def test_aliases_within_the_budget_still_work(tmp_path):
  path = tmp_path / "ok.yaml"
  path.write_text("model:\n  path: random\neval:\n  temperatures: &t [0.0, 1.0]\n  sets: [builtin:arithmetic]\n"
                  "x_unused: *t\n")
  with pytest.raises(ConfigError, match="unknown config key 'x_unused'"):
    load_config(path)
  path.write_text("model:\n  path: random\ntrain: &t\n  steps: 3\n")
  assert load_config(path).train.steps == 3


def test_a_large_list_value_is_reported_in_a_short_line(tmp_path):
  path = tmp_path / "big.yaml"
  path.write_text("train:\n  steps: [&a [" + ", ".join(["xxxxxxxxxx"] * 90) + "], *a, *a, *a, *a, *a]\n")
  with pytest.raises(ConfigError) as e:
    load_config(path)
  assert "train.steps: expected an integer" in str(e.value)
  assert len(str(e.value).split("got ", 1)[1]) <= 80


@pytest.mark.parametrize("override,needle", [
    ("optim.lr=!!float abc", "override 'optim.lr=!!float abc': invalid YAML (tags such as '!!float'"),
    ("train.seed=1180591620717411303424", "train.seed: expected an integer in [-2**63, 2**63)"),
    ("reward.timeout_s=.inf", "reward.timeout_s: expected a number of seconds in (0, 3600], got inf"),
    ("eval.batch_size=0", "eval.batch_size: expected an integer >= 1, got 0"),
    ("model.random_init.head_dim=7", "model.random_init.head_dim: expected an even number (RoPE rotates pairs)"),
    ("run.dir=", "run.dir: expected a folder"),
    ("run.dir=  ", "run.dir: expected a folder"),
])
def test_values_that_used_to_crash_later_are_refused_by_the_config(override, needle):
  with pytest.raises(ConfigError) as e:
    load_config("configs/tiny.yaml", [override])
  assert needle in str(e.value)


def test_override_values_that_are_not_yaml_stay_text():
  assert load_config("configs/tiny.yaml", ["data.system_prompt=[unclosed"]).data.system_prompt == "[unclosed"


def test_the_random_reference_config_is_the_reference_workload_on_the_builtin_models_shape():
  from erpo_jax.model.io.loading import model_config

  ref = load_config("configs/bench_reference.yaml")
  rnd = load_config("configs/bench_reference_random.yaml")
  assert rnd.model.path == "random"
  tokens = {"bos_token_id": None, "eos_token_ids": (), "pad_token_id": None}  # from the tokenizer for random
  assert model_config(rnd.model) == dataclasses.replace(model_config(ref.model), **tokens)
  assert {k for k, v in flatten(rnd.to_dict()).items() if flatten(ref.to_dict())[k] != v} == {
      "model.path", "run.dir", *(f"model.random_init.{k}" for k in (
          "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim", "intermediate_size",
          "rope_theta", "max_position_embeddings"))}
