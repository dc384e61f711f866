"""Tests of the paper's data sets as presets read from local files in their published shapes."""

import json
import pathlib
import subprocess
import sys

import pytest

from erpo_jax.config import Config, DataSection
from erpo_jax.config_io import load_config
from erpo_jax.config_run import EvalSection
from erpo_jax.data import open_source
from erpo_jax.data.sources import PRESETS, make_eval_source
from erpo_jax.errors import ConfigError, PathError

ROOT = pathlib.Path(__file__).resolve().parents[3]


def _jsonl(path: pathlib.Path, rows) -> None:
  path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")


@pytest.fixture()
def preset_dir(tmp_path):
  """Every preset's file, a few rows each, in the shape its publisher gives."""
  for level in range(1, 6):  # the MATH release: MATH/train/<subject>/<n>.json
    for k in range(2):
      path = tmp_path / "MATH" / "train" / ("algebra" if k == 0 else "geometry") / f"{level}{k}.json"
      path.parent.mkdir(parents=True, exist_ok=True)
      path.write_text(json.dumps({"problem": f"Problem {level}.{k}", "level": f"Level {level}", "type": "Algebra",
                                  "solution": f"So it is $\\boxed{{{level}{k}}}$."}))
  _jsonl(tmp_path / "math500.jsonl", [{"problem": "Compute $\\frac{1}{2}+\\frac{1}{4}$.", "solution": "...",
                                       "answer": "\\frac{3}{4}", "subject": "Algebra", "level": 2,
                                       "unique_id": "test/algebra/1.json"}])
  _jsonl(tmp_path / "aime24.jsonl", [{"id": 60, "problem": "Find n.", "solution": "Thus $\\boxed{204}$.",
                                      "answer": "204", "url": "https://example.org", "year": "2024"}])
  _jsonl(tmp_path / "aime25.jsonl", [{"problem": "Find m.", "answer": "70", "id": "0"}])
  _jsonl(tmp_path / "amc.jsonl", [{"id": 0, "problem": "Find k.", "answer": 142.0, "url": "https://example.org"}])
  _jsonl(tmp_path / "minerva.jsonl", [{"question": "Compute the speed.", "answer": "3e8"}])
  _jsonl(tmp_path / "olympiadbench.jsonl", [{"id": 1606, "question": "Find all x.", "final_answer": ["1", "-2"]}])
  return tmp_path


def test_math_l3to5_keeps_levels_3_to_5_of_the_release_folder(preset_dir):
  source = open_source("preset:math_l3to5", DataSection(preset_dir=str(preset_dir)))
  assert sorted(r.level for r in source) == [3, 3, 4, 4, 5, 5]
  assert sorted(r.answer for r in source) == ["30", "31", "40", "41", "50", "51"]
  assert len({r.id for r in source}) == 6


@pytest.mark.parametrize("name, answer", [("math500", "\\frac{3}{4}"), ("aime24", "204"), ("aime25", "70"),
                                          ("amc", "142.0"), ("minerva", "3e8"), ("olympiadbench", "1, -2")])
def test_each_eval_preset_reads_its_published_shape(preset_dir, name, answer):
  cfg = Config(data=DataSection(preset_dir=str(preset_dir)), eval=EvalSection(sets=(f"preset:{name}",)))
  records = list(make_eval_source(cfg, f"preset:{name}"))
  assert [r.answer for r in records] == [answer]


def test_a_missing_preset_file_names_what_to_get_and_where_to_put_it(tmp_path):
  with pytest.raises(PathError) as e:
    open_source("preset:aime25", DataSection(preset_dir=str(tmp_path)))
  message = str(e.value)
  assert f"{tmp_path}/aime25.jsonl or {tmp_path}/aime25.parquet" in message
  assert "math-ai/aime25" in message and "nothing is downloaded at run time" in message
  with pytest.raises(ConfigError, match="unknown preset 'preset:gsm9k'"):
    open_source("preset:gsm9k", DataSection())


def test_the_paper_configs_point_to_the_presets():
  cfg = load_config(ROOT / "configs" / "qwen25_math_7b_erpo.yaml")
  assert cfg.data.source == "preset:math_l3to5"
  assert cfg.eval.sets == tuple(f"preset:{n}" for n in ("math500", "aime24", "aime25", "amc", "minerva",
                                                          "olympiadbench"))
  assert set(PRESETS) == {"math_l3to5", "math500", "aime24", "aime25", "amc", "minerva", "olympiadbench"}


def test_data_check_on_a_missing_preset_is_one_line_and_exit_code_2(tmp_path):
  proc = subprocess.run([sys.executable, "-m", "erpo_jax.cli", "data", "check", "--config", "configs/default.yaml",
                         "data.source=preset:math_l3to5", f"data.preset_dir={tmp_path}"], cwd=ROOT,
                        capture_output=True, text=True, timeout=600)
  assert proc.returncode == 2
  lines = proc.stderr.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith("erpo-jax data: error: preset:math_l3to5: no ")
  assert "MATH/train" in lines[0] and "EleutherAI/hendrycks_math" in lines[0]
