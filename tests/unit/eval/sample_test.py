"""Tests of `erpo-jax sample`: completions printed per sample; SmolLM2 knows that 7+5 is 12."""

import os
import subprocess
import sys

import pytest

from erpo_jax.config_io import load_config
from erpo_jax.eval.sample import run_sample

TINY = ["model.path=random", "model.random_init.num_layers=1", "model.random_init.hidden_size=16",
        "model.random_init.num_heads=2", "model.random_init.num_kv_heads=1", "model.random_init.head_dim=8",
        "model.random_init.intermediate_size=32"]


def test_run_sample_prints_each_completion_under_its_header(capsys):
  cfg = load_config(None, TINY)
  texts = run_sample(cfg, prompt="What is 7+5?", max_new_tokens=4, temperature=1.0, num=3, seed=0)
  out = capsys.readouterr().out
  assert len(texts) == 3
  assert [l for l in out.splitlines() if l.startswith("### sample")] == [f"### sample {i}" for i in range(3)]
  for text in texts:
    assert text in out


@pytest.mark.slow
def test_greedy_samples_are_identical_and_a_single_one_has_no_header(capsys):
  cfg = load_config(None, TINY)
  texts = run_sample(cfg, prompt="Hi", max_new_tokens=4, temperature=0.0, num=2, seed=0)
  assert texts[0] == texts[1]
  capsys.readouterr()
  one = run_sample(cfg, prompt="Hi", max_new_tokens=4, temperature=0.0, num=1, seed=5)
  assert one == texts[:1]
  assert "### sample" not in capsys.readouterr().out


@pytest.mark.slow
def test_cli_sample_answers_seven_plus_five_with_twelve(tmp_path):
  config = tmp_path / "smollm2.yaml"
  config.write_text("model:\n  path: builtin:smollm2-135m-instruct\nrun:\n  dir: " + str(tmp_path / "run") + "\n")
  out = subprocess.run([sys.executable, "-m", "erpo_jax.cli", "sample", "--config", str(config), "--prompt",
                        "What is 7+5?", "--max-new-tokens", "24"],
                       capture_output=True, text=True, timeout=600, env=dict(os.environ, JAX_PLATFORMS="cpu"))
  assert out.returncode == 0, out.stderr[-3000:]
  assert "12" in out.stdout, out.stdout
