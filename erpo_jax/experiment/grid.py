"""The ablation grid: variant overrides, the run folders of variants x seeds, and the check of existing folders.

Pure config work (no model, no training); erpo_jax/experiment/runner.py runs the plan.
"""

from __future__ import annotations

import dataclasses
import pathlib
import typing
from collections.abc import Callable
from typing import Any

from erpo_jax.config import Config
from erpo_jax.config_io import flatten, load_config
from erpo_jax.config_run import ExperimentSection, VariantName
from erpo_jax.errors import UserError


@dataclasses.dataclass(frozen=True)
class FromConfig:
  """An override whose value follows from the experiment's config; the report shows `label`."""

  label: str
  value: Callable[[Config], Any]

  def __str__(self) -> str:
    return self.label


# DAPO's overlong buffer L_cache: the last quarter of the response budget, whatever the experiment's budget.
_QUARTER_OF_MAX_NEW_TOKENS = FromConfig("rollout.max_new_tokens/4", lambda cfg: cfg.rollout.max_new_tokens // 4)
_DAPO = {"rollout.dynamic_sampling": True, "ppo.eps_low": 0.2, "ppo.eps_high": 0.28, "ppo.loss_aggregation": "token-mean",
         "reward.overlong_buffer": _QUARTER_OF_MAX_NEW_TOKENS, "reward.overlong_penalty": 1.0,
         "ppo.mask_truncated": False}  # DAPO's soft overlong penalty, not overlong filtering

# The paper's variants, each one set of config overrides on top of the experiment's config,
# then RLOO and DAPO, each alone and with ERPO's two components (as configs/rloo*.yaml, configs/dapo*.yaml).
VARIANTS: dict[str, dict[str, Any]] = {
    # GRPO: k3 policy-KL on the response tokens, no question weights (needs the reference forward).
    "grpo": {"erpo.kl_on": "response", "erpo.weights": "none", "erpo.reference": "forward"},
    # GRPO*: the static question weights only, no penalty.
    "grpo_star": {"erpo.kl_on": "none", "erpo.weights": "static"},
    # Query-KL only: the prompt penalty, no weights.
    "query_kl": {"erpo.kl_on": "prompt", "erpo.weights": "none"},
    # ERPO as in the paper: Query-KL and static weights.
    "erpo_static": {"erpo.kl_on": "prompt", "erpo.weights": "static"},
    # ERPO as in the public implementation: Query-KL and the current policy's prompt-NLL weights.
    "erpo_dynamic": {"erpo.kl_on": "prompt", "erpo.weights": "dynamic"},
    # RLOO advantages with GRPO's k3 policy-KL on the response tokens, no weights.
    "rloo": {"ppo.advantage": "rloo", "erpo.kl_on": "response", "erpo.weights": "none", "erpo.reference": "forward"},
    # RLOO advantages with ERPO: Query-KL and static weights.
    "rloo_erpo": {"ppo.advantage": "rloo", "erpo.kl_on": "prompt", "erpo.weights": "static"},
    # DAPO: dynamic sampling, clip-higher, token-mean aggregation, soft overlong punishment; no KL, no weights.
    "dapo": {**_DAPO, "erpo.kl_on": "none", "erpo.weights": "none"},
    # DAPO with ERPO: Query-KL and static weights.
    "dapo_erpo": {**_DAPO, "erpo.kl_on": "prompt", "erpo.weights": "static"},
}
assert set(VARIANTS) == set(typing.get_args(VariantName)), "config.VariantName and VARIANTS disagree"

RUNS_DIR = "runs"  # <experiment.dir>/runs/<variant>-s<seed>
BASE_DIR = "base"  # <experiment.dir>/base: the untrained model's eval and analysis
CACHE_DIR = "cache"  # <experiment.dir>/cache: the reference cache all runs share


@dataclasses.dataclass(frozen=True)
class RunSpec:
  """One run of the grid."""

  variant: str
  seed: int
  cfg: Config  # the run's full config (run.dir is its folder)

  @property
  def name(self) -> str:
    return run_name(self.variant, self.seed)

  @property
  def dir(self) -> pathlib.Path:
    return pathlib.Path(self.cfg.run.dir)


def run_name(variant: str, seed: int) -> str:
  return f"{variant}-s{seed}"


def with_overrides(cfg: Config, overrides: dict[str, Any]) -> Config:
  """`cfg` with dotted `section.field` values replaced (each section is validated again)."""
  sections: dict[str, dict[str, Any]] = {}
  for key, value in overrides.items():
    section, _, field = key.partition(".")
    sections.setdefault(section, {})[field] = value
  return dataclasses.replace(cfg, **{s: dataclasses.replace(getattr(cfg, s), **f) for s, f in sections.items()})


def run_config(cfg: Config, variant: str, seed: int) -> Config:
  """The config of run <variant>-s<seed>: the variant's overrides, the seed, its folder, the shared cache.

  Its experiment section is the default one, so adding variants or seeds to the grid
  leaves the config of the runs already made unchanged.
  """
  exp = cfg.experiment
  overrides = {k: v.value(cfg) if isinstance(v, FromConfig) else v for k, v in VARIANTS[variant].items()}
  overrides.update({"train.seed": seed, "data.shuffle_seed": seed,
                    "run.dir": str(pathlib.Path(exp.dir) / RUNS_DIR / run_name(variant, seed))})
  if not cfg.erpo.cache_dir:
    overrides["erpo.cache_dir"] = str(pathlib.Path(exp.dir) / CACHE_DIR)
  out = with_overrides(cfg, overrides)
  return dataclasses.replace(out, experiment=ExperimentSection())


def base_config(cfg: Config) -> Config:
  """The config under which the untrained model is evaluated and analysed (<experiment.dir>/base)."""
  out = with_overrides(cfg, {"run.dir": str(pathlib.Path(cfg.experiment.dir) / BASE_DIR)})
  return dataclasses.replace(out, experiment=ExperimentSection())


def plan(cfg: Config) -> list[RunSpec]:
  """The grid's runs, seed-major (every variant of the first seed first, so a partial grid compares variants)."""
  return [RunSpec(v, s, run_config(cfg, v, s)) for s in cfg.experiment.seeds for v in cfg.experiment.variants]


# Where a run and its reference cache live, not what it computes: a moved experiment folder is the same grid.
LOCATION_KEYS = ("run.dir", "erpo.cache_dir")


def config_diff(old: Config, new: Config) -> list[str]:
  """'key: old -> new' for each field that differs, in field order (the LOCATION_KEYS left out)."""
  a, b = flatten(old.to_dict()), flatten(new.to_dict())
  return [f"{k}: {a.get(k)!r} -> {b.get(k)!r}" for k in list(dict.fromkeys([*a, *b]))
          if a.get(k) != b.get(k) and k not in LOCATION_KEYS]


def check_existing(spec: RunSpec) -> None:
  """Raises UserError when the run folder holds a run made with another config than the grid's now."""

  saved = spec.dir / "config.yaml"
  if not saved.is_file():
    return
  try:
    old = load_config(saved)
  except UserError as e:
    raise UserError(f"experiment: {saved} cannot be read as a config ({e}); delete {spec.dir} to redo the run") \
        from None
  diff = config_diff(old, spec.cfg)
  if diff:
    more = f" (and {len(diff) - 3} more)" if len(diff) > 3 else ""
    raise UserError(f"experiment: run folder {spec.dir} was made with another config ({'; '.join(diff[:3])}{more}); "
                    f"delete that folder to redo the run, or give another experiment.dir")
