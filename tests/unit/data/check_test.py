"""Tests of `erpo-jax data check` and of data.max_prompt_tokens = 0 (auto)."""

import pathlib
import subprocess
import sys

import numpy as np
import pytest

from erpo_jax.config import Config, DataSection, ModelSection, RewardSection
from erpo_jax.config_io import load_config
from erpo_jax.data import load_file
from erpo_jax.data.check import (AUTO_CAP, check_data, format_report, resolve_extract, resolve_max_prompt_tokens,
                                  suggest_max_prompt_tokens)
from erpo_jax.reward.verifier import Verifier

ROOT = pathlib.Path(__file__).resolve().parents[3]
FIXTURES = ROOT / "tests" / "fixtures" / "data"


@pytest.fixture(scope="module")
def tokenizer():
  from erpo_jax.model.io.loading import load_tokenizer
  return load_tokenizer(ModelSection(path="builtin:smollm2-135m-instruct"))


@pytest.fixture(scope="module")
def verifiers():
  """One verifier per reward.extract mode, started when first asked for."""
  made = {}

  def get(extract: str) -> Verifier:
    if extract not in made:
      made[extract] = Verifier(RewardSection(extract=extract, workers=1, timeout_s=5.0)).__enter__()
    return made[extract]

  yield get
  for v in made.values():
    v.close()


def _cfg(source, extract="auto", **data) -> Config:
  return Config(data=DataSection(source=str(source), **data), reward=RewardSection(extract=extract))


@pytest.mark.parametrize("name, rows", [("golds.math", 20), ("golds.gsm8k", 8), ("golds.verl", 8)])
@pytest.mark.parametrize("extract", ["auto", "boxed", "gsm8k"])
def test_every_gold_of_the_fixtures_verifies_against_itself(name, rows, extract, tokenizer, verifiers):
  rep = check_data(_cfg(FIXTURES / f"{name}.jsonl", extract), tokenizer, verifier=verifiers(extract))
  assert rep.usable == rows and rep.skipped == 0
  assert rep.self_verified == rows, rep.not_self_verified


def test_gsm8k_golds_drop_only_unambiguous_thousands_separators():
  answers = [r.answer for r in load_file(FIXTURES / "golds.gsm8k.jsonl")]
  assert answers == ["72", "1000", "14916", "\\frac{1}{4}", "-3", "2.5", "1234567", "10"]
  levels = [r.level for r in load_file(FIXTURES / "golds.math.jsonl")]
  assert set(levels) == {3, 4, 5}


def test_the_report_counts_skipped_rows_by_reason_and_measures_prompts(tokenizer, verifiers):
  cfg = _cfg(FIXTURES / "check.gsm8k.jsonl", max_prompt_tokens=64)
  rep = check_data(cfg, tokenizer, verifier=verifiers("auto"))
  assert (rep.rows_read, rep.usable, rep.skipped) == (8, 3, 5)
  assert rep.skip_reasons == {"invalid JSON": 1, "field 'answer': missing": 2, "field 'question': empty prompt": 1,
                              "field 'answer': expected a GSM8K solution ending in '#### <answer>'": 1}
  assert rep.bad_rows[0].endswith("check.gsm8k.jsonl:2: invalid JSON (Expecting ',' delimiter at column 48)")
  assert rep.self_verified == 3
  assert len(rep.lengths) == 3 and rep.lengths.max() > 64 > rep.lengths.min()
  assert rep.quantiles[0.5] == int(np.median(rep.lengths))
  assert rep.suggested_max_prompt_tokens == 128 and rep.overlong_at_current == 1
  text = format_report(rep, cfg)
  assert "rows: 8 read, 3 usable, 5 skipped" in text
  assert "  skipped 2: field 'answer': missing" in text
  assert "golds that verify against themselves (reward.extract=auto, written as \\boxed{GOLD}): 3/3" in text
  assert f"suggested data.max_prompt_tokens: 128 (the longest prompt, {rep.lengths.max()} tokens" in text


def test_suggestion_is_the_longest_prompt_rounded_up_to_64_and_capped():
  assert suggest_max_prompt_tokens([10, 43]) == 64
  assert suggest_max_prompt_tokens([64]) == 64
  assert suggest_max_prompt_tokens([65, 3]) == 128
  assert suggest_max_prompt_tokens([100_000]) == AUTO_CAP


def test_auto_max_prompt_tokens_resolves_to_what_the_data_need(tokenizer):
  cfg = _cfg(FIXTURES / "check.gsm8k.jsonl", on_bad_row="skip")
  assert cfg.data.max_prompt_tokens == 0  # the default
  assert resolve_max_prompt_tokens(cfg, tokenizer).data.max_prompt_tokens == 128
  explicit = _cfg(FIXTURES / "check.gsm8k.jsonl", on_bad_row="skip", max_prompt_tokens=48)
  assert resolve_max_prompt_tokens(explicit, tokenizer) is explicit


def test_the_shipped_small_configs_keep_their_prompt_limits():
  assert load_config(ROOT / "configs" / "default.yaml").data.max_prompt_tokens == 64
  assert load_config(ROOT / "configs" / "tiny.yaml").data.max_prompt_tokens == 32
  assert load_config(ROOT / "configs" / "grpo_baseline.yaml").data.max_prompt_tokens == 64


def _cli(*args):
  return subprocess.run([sys.executable, "-m", "erpo_jax.cli", "data", "check", *args], cwd=ROOT,
                        capture_output=True, text=True, timeout=600)


def test_the_command_prints_the_report():
  proc = _cli("--config", "configs/default.yaml", f"data.source={FIXTURES / 'check.gsm8k.jsonl'}")
  assert proc.returncode == 0, proc.stderr
  assert "rows: 8 read, 3 usable, 5 skipped" in proc.stdout
  assert "suggested data.max_prompt_tokens: 128" in proc.stdout


def test_the_command_reports_without_importing_jax():
  # Checking a data set reads text and a tokenizer: it does not wait seconds for JAX and XLA to load.
  code = ("import sys\nfrom erpo_jax import cli\n"
          f"rc = cli.main(['data', 'check', '--config', 'configs/default.yaml', "
          f"'data.source={FIXTURES / 'check.gsm8k.jsonl'}'])\n"
          "print(rc, sorted(m for m in ('jax', 'jaxlib', 'flax') if m in sys.modules))")
  proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr
  assert "rows: 8 read, 3 usable, 5 skipped" in proc.stdout
  assert proc.stdout.splitlines()[-1] == "0 []"


def test_a_missing_data_file_is_one_line_and_exit_code_2():
  proc = _cli("--config", "configs/default.yaml", "data.source=/nonexistent/math.jsonl")
  assert proc.returncode == 2
  assert proc.stderr.strip().splitlines() == [
      "erpo-jax data: error: data file '/nonexistent/math.jsonl' not found: provide a .jsonl or .parquet file of "
      "problems (data.source / eval.sets), or use builtin:arithmetic"]


@pytest.mark.parametrize("source,mode", [("sample.math.jsonl", "boxed"), ("sample.gsm8k.jsonl", "auto"),
                                         ("sample.verl.jsonl", "auto"), ("builtin:arithmetic", "auto")])
def test_reward_extract_data_is_boxed_for_math_style_data_and_lenient_otherwise(source, mode):
  spec = source if source.startswith("builtin:") else str(FIXTURES / source)
  cfg = load_config(ROOT / "configs" / "tiny.yaml", [f"data.source={spec}"])
  assert cfg.reward.extract == "data"
  assert resolve_extract(cfg).reward.extract == mode
  explicit = load_config(ROOT / "configs" / "tiny.yaml", [f"data.source={spec}", "reward.extract=last_number"])
  assert resolve_extract(explicit).reward.extract == "last_number"
