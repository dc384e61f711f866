"""Tests of the data sources, builtin:arithmetic and the Grain pipeline."""

import ast
import dataclasses
import json
import operator
import pathlib
import re

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import tiny_runs

from erpo_jax.config import Config, DataSection, ModelSection
from erpo_jax.config_run import EvalSection
from erpo_jax.data import PAPER_PROMPT_SUFFIX, load_file
from erpo_jax.data.arithmetic import generate
from erpo_jax.data.pipeline import (
  PromptBatch,
  dataset_prompts,
  make_train_iterator,
  training_prompts,
)
from erpo_jax.data.sources import make_eval_source, train_source
from erpo_jax.errors import ConfigError, DataError, PathError

FIXTURES = tiny_runs.REPO / "tests" / "fixtures" / "data"
SHAPES = ("verl", "trl", "gsm8k", "math")
QUESTIONS = ["What is 7+5?", "Natalia sold clips", "Find $\\frac{1}{2} + \\frac{1}{4}$.", "What is the smallest"]
ANSWERS = ["12", "72", "\\frac{3}{4}", "8"]


@pytest.fixture(scope="module")
def tokenizer():
  from erpo_jax.model.io.loading import load_tokenizer
  return load_tokenizer(ModelSection(path="builtin:smollm2-135m-instruct"))


def _question(record) -> str:
  return record.prompt if isinstance(record.prompt, str) else [c for r, c in record.prompt if r == "user"][-1]


def _to_parquet(jsonl: pathlib.Path, out: pathlib.Path) -> pathlib.Path:
  rows = [json.loads(l) for l in jsonl.read_text().splitlines() if l.strip()]
  pq.write_table(pa.Table.from_pylist(rows), out)
  return out


def _write(path: pathlib.Path, *lines: bytes) -> pathlib.Path:
  path.write_bytes(b"\n".join(lines) + b"\n")
  return path


# ----------------------------------------------------------------------------- file sources


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("container", ["jsonl", "parquet"])
def test_each_shape_yields_the_same_records(shape, container, tmp_path):
  path = FIXTURES / f"sample.{shape}.jsonl"
  if container == "parquet":
    path = _to_parquet(path, tmp_path / f"sample.{shape}.parquet")
  for fmt in ("auto", shape):
    source = load_file(path, format=fmt)
    assert len(source) == 4 and source.skipped == 0
    assert [r.answer for r in source] == ANSWERS
    assert all(_question(r).startswith(q) for r, q in zip(source, QUESTIONS))
    assert len({r.id for r in source}) == 4
  if shape == "verl":
    assert source[0].prompt == (("user", "What is 7+5?"),)
  expected_levels = [1, 2, 2, 3] if shape == "math" else [None] * 4
  assert [r.level for r in source] == expected_levels


def test_math_prefers_an_answer_column_over_the_boxed_solution(tmp_path):
  path = _write(tmp_path / "m.jsonl", b'{"problem": "p", "solution": "so \\\\boxed{2}", "answer": "\\\\frac{4}{2}", '
                b'"level": 4, "unique_id": "test/1.json"}')
  (record,) = load_file(path)
  assert (record.answer, record.level, record.id) == ("\\frac{4}{2}", 4, "test/1.json")


def test_columns_format_reads_the_named_columns():
  path = FIXTURES / "sample.columns.jsonl"
  source = load_file(path, format="columns", prompt_column="query", answer_column="final")
  assert [r.answer for r in source] == ANSWERS and _question(source[0]) == "What is 7+5?"
  assert [r.answer for r in load_file(path, prompt_column="query", answer_column="final")] == ANSWERS  # auto
  with pytest.raises(DataError, match="cannot tell the row shape from columns \\['final', 'query'\\]"):
    load_file(path)
  with pytest.raises(ConfigError, match="data.prompt_column"):
    load_file(path, format="columns")


def test_a_column_override_replaces_one_column_of_a_shape(tmp_path):
  path = _write(tmp_path / "g.jsonl", b'{"query": "What is 2+2?", "answer": "2+2=4\\n#### 4"}')
  (record,) = load_file(path, format="gsm8k", prompt_column="query")
  assert (record.prompt, record.answer) == ("What is 2+2?", "4")


# (shape, second line of a file as latin-1 text, message after "<file>:")
MALFORMED = [tuple(json.loads(l).values()) for l in (FIXTURES / "malformed_rows.jsonl").read_text().splitlines()]
GOOD = {"gsm8k": b'{"question": "What is 1+1?", "answer": "#### 2"}',
        "verl": b'{"prompt": [{"role": "user", "content": "q"}], "reward_model": {"ground_truth": "2"}}',
        "math": b'{"problem": "q", "solution": "\\\\boxed{2}"}', "trl": b'{"prompt": "q", "solution": "2"}'}


@pytest.mark.parametrize("shape,line,message", MALFORMED)
def test_malformed_row_raises_data_error_naming_file_line_and_field(shape, line, message, tmp_path):
  path = _write(tmp_path / "t.jsonl", GOOD[shape], line.encode("latin-1"))
  with pytest.raises(DataError) as e:
    load_file(path, format=shape)
  assert str(e.value) == f"{path}:{message}"


def test_bad_rows_are_skipped_and_counted_with_on_bad_row_skip():
  path = FIXTURES / "bad.gsm8k.jsonl"
  source = load_file(path, on_bad_row="skip")
  assert [(r.prompt, r.answer) for r in source] == [("What is 7+5?", "12"), ("What is 6+1?", "7")]
  assert source.skipped == 7
  assert [m.split(": ", 1)[0] for m in source.bad_rows] == [f"{path}:{n}" for n in (2, 3, 4, 5, 6, 7, 10)]
  assert source.bad_rows[3].endswith("field 'answer': expected a string or number, got list")
  with pytest.raises(DataError, match=re.escape(f"{path}:2: invalid JSON")):
    load_file(path)


def test_parquet_rows_duplicate_ids_and_missing_files_are_reported(tmp_path):
  path = tmp_path / "p.parquet"
  pq.write_table(pa.Table.from_pylist([{"question": "a", "answer": "#### 1"}, {"question": "b", "answer": None}]),
                 path)
  with pytest.raises(DataError, match=re.escape(f"{path}:row 1: field 'answer': expected a string or number")):
    load_file(path)
  path = _write(tmp_path / "d.jsonl", b'{"id": "a", "question": "q1", "answer": "#### 1"}',
                b'{"id": "a", "question": "q2", "answer": "#### 2"}')
  with pytest.raises(DataError, match="d.jsonl:2: field 'id': duplicate id 'a'"):
    load_file(path)
  with pytest.raises(PathError, match="not found: provide a .jsonl or .parquet file"):
    load_file(tmp_path / "nope.jsonl")


# ----------------------------------------------------------------------------- builtin:arithmetic

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}
_WORD = [
    (r"(\w+) has (\d+) \w+\. \1 gets (\d+) more and then gives away (\d+)\. How many \w+ does \1 have now\?",
     lambda g: int(g[1]) + int(g[2]) - int(g[3])),
    (r"A box holds (\d+) \w+\. How many \w+ are in (\d+) boxes\?", lambda g: int(g[0]) * int(g[1])),
    (r"(\w+) reads (\d+) pages every day\. How many pages does \1 read in (\d+) days\?",
     lambda g: int(g[1]) * int(g[2])),
    (r"(\d+) \w+ are shared equally among (\d+) children\. How many \w+ does each child get\?",
     lambda g: int(g[0]) // int(g[1])),
    (r"A pen costs (\d+) dollars\. \w+ buys (\d+) pens and pays with a (\d+)-dollar bill\. How many dollars of "
     r"change does \w+ get\?", lambda g: int(g[2]) - int(g[0]) * int(g[1])),
]


def _evaluate(node):
  if isinstance(node, ast.Constant) and isinstance(node.value, int):
    return node.value
  if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
    return _OPS[type(node.op)](_evaluate(node.left), _evaluate(node.right))
  raise ValueError(ast.dump(node))


def _solve(text: str) -> int:
  for pattern, answer in _WORD:
    m = re.fullmatch(pattern, text)
    if m:
      return answer(m.groups())
  for pattern, op in ((r"Add (\d+) and (\d+)\.|What is the sum of (\d+) and (\d+)\?", "+"),
                      (r"What is the difference between (\d+) and (\d+)\?", "-"), (r"Subtract (\d+) from (\d+)\.", "r-"),
                      (r"Multiply (\d+) by (\d+)\.|What is the product of (\d+) and (\d+)\?", "*")):
    m = re.fullmatch(pattern, text)
    if m:
      a, b = (int(x) for x in m.groups() if x is not None)
      return {"+": a + b, "-": a - b, "r-": b - a, "*": a * b}[op]
  expr = re.fullmatch(r"(?:What is|Compute|Calculate|Find|How much is) (.+)[?.]|(.+) = \?", text)
  expr = (expr.group(1) or expr.group(2)).replace(" plus ", "+").replace(" minus ", "-").replace(" times ", "*")
  return _evaluate(ast.parse(expr, mode="eval").body)


def test_arithmetic_is_deterministic_and_its_answers_are_correct():
  records = generate(500, (1, 2, 3, 4, 5), seed=3)
  assert len(records) == 500 and records == generate(500, (1, 2, 3, 4, 5), seed=3)
  assert [r.prompt for r in records] != [r.prompt for r in generate(500, (1, 2, 3, 4, 5), seed=4)]
  for r in records:
    assert r.answer == str(_solve(r.prompt)), r


def test_arithmetic_levels_are_distinct_kinds_of_problem():
  by_level = {}
  for r in generate(500, (1, 2, 3, 4, 5), seed=0):
    by_level.setdefault(r.level, []).append(r.prompt)
  assert sorted(by_level) == [1, 2, 3, 4, 5] and all(len(v) == 100 for v in by_level.values())
  numbers = lambda t: [int(x) for x in re.findall(r"\d+", t)]  # noqa: E731
  assert all(1 <= min(numbers(t)) and max(numbers(t)) <= 9 for t in by_level[1])
  assert all(all(10 <= n <= 99 for n in numbers(t)) for t in by_level[2])
  assert all(re.search(r"\*|times|Multiply|product", t) for t in by_level[3])
  assert all(len(t.split()) >= 10 and "(" not in t for t in by_level[4])
  assert all("(" in t and len(numbers(t)) >= 4 for t in by_level[5])


@pytest.mark.parametrize("eval_seed", [10_000, 0])
def test_builtin_eval_split_is_disjoint_from_training(eval_seed):
  cfg = Config(data=DataSection(size=2000, levels=(1, 2, 3)), eval=EvalSection(builtin_seed=eval_seed,
                                                                              builtin_size=300))
  train = {r.prompt for r in train_source(cfg)}
  held_out = make_eval_source(cfg, "builtin:arithmetic")
  assert [sum(r.level == l for r in held_out) for l in (1, 2, 3)] == [100, 100, 100]
  assert not train & {r.prompt for r in held_out}


def test_eval_file_source_is_cut_to_max_problems():
  cfg = Config(eval=EvalSection(max_problems=2))
  source = make_eval_source(cfg, str(FIXTURES / "sample.math.jsonl"))
  assert [r.answer for r in source] == ANSWERS[:2]


# ----------------------------------------------------------------------------- Grain pipeline


def _cfg(**data) -> Config:
  return Config(data=DataSection(**{"size": 40, "levels": (1, 2, 3), "batch_size": 4, **data}))


def _iter(tokenizer, p=0, n=1, **data):
  return make_train_iterator(_cfg(**data), tokenizer, process_index=p, process_count=n)


def _take(it, n) -> list[PromptBatch]:
  return [next(it) for _ in range(n)]


def _same(a: PromptBatch, b: PromptBatch) -> bool:
  return (a.ids, a.prompt_tokens, a.answers, a.texts, a.index.tolist()) == (
      b.ids, b.prompt_tokens, b.answers, b.texts, b.index.tolist())


def test_batches_hold_tokenized_chat_prompts(tokenizer):
  batch = next(_iter(tokenizer, system_prompt="Be brief.", prompt_suffix=PAPER_PROMPT_SUFFIX))
  assert dataclasses.is_dataclass(batch) and batch.index.dtype == np.int64 and len(batch.ids) == 4
  source = train_source(_cfg())
  for i, text, tokens, answer in zip(batch.index, batch.texts, batch.prompt_tokens, batch.answers):
    record = source[int(i)]
    assert text == (f"<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n{record.prompt} "
                    f"{PAPER_PROMPT_SUFFIX}<|im_end|>\n<|im_start|>assistant\n")
    assert tokens == tokenizer.encode(text) and answer == record.answer
  batch = next(_iter(tokenizer, chat_template=False, prompt_suffix="Answer:"))
  assert batch.texts == [f"{source[int(i)].prompt} Answer:" for i in batch.index]


def test_same_seed_gives_the_same_order_and_another_seed_another(tokenizer):
  a, b = _take(_iter(tokenizer), 5), _take(_iter(tokenizer), 5)
  c = _take(_iter(tokenizer, shuffle_seed=1), 5)
  assert all(_same(x, y) for x, y in zip(a, b))
  assert [x.index.tolist() for x in a] != [x.index.tolist() for x in c]


def test_process_shards_are_disjoint_and_cover_the_data(tokenizer):
  shards = []
  for p in range(2):
    epoch = np.concatenate([b.index for b in _take(_iter(tokenizer, p, 2), 10)])  # 40 records / 2 / B_local 2
    assert len(set(epoch.tolist())) == 20
    shards.append(set(epoch.tolist()))
  assert not shards[0] & shards[1] and shards[0] | shards[1] == set(range(40))


def test_each_epoch_is_a_new_order_of_the_same_prompts(tokenizer):
  it = _iter(tokenizer)
  e1, e2 = (np.concatenate([b.index for b in _take(it, 10)]).tolist() for _ in range(2))
  assert sorted(e1) == sorted(e2) == list(range(40)) and e1 != e2


def test_restored_state_continues_with_identical_batches(tokenizer):
  it = _iter(tokenizer)
  _take(it, 7)  # mid-epoch
  state = json.loads(json.dumps(it.get_state()))
  it2 = _iter(tokenizer)
  it2.set_state(state)
  assert all(_same(x, y) for x, y in zip(_take(it, 100), _take(it2, 100)))
  with pytest.raises(DataError, match="process_count=1 but this run has process_count=2"):
    _iter(tokenizer, 0, 2).set_state(state)


def test_overlong_prompts_are_skipped_and_counted(tokenizer):
  lengths = sorted(len(t) for _, t in training_prompts(_cfg(), tokenizer))
  limit = lengths[len(lengths) // 2]
  it = _iter(tokenizer, max_prompt_tokens=limit)
  assert all(len(t) <= limit for b in _take(it, 10) for t in b.prompt_tokens)
  assert it.skipped_overlong > 0 and it.get_state()["skipped_overlong"] == it.skipped_overlong
  listed = training_prompts(_cfg(max_prompt_tokens=limit), tokenizer)
  assert sum(t is None for _, t in listed) == sum(n > limit for n in lengths)
  assert all(len(t) <= limit for t, _ in dataset_prompts(_cfg(max_prompt_tokens=limit), tokenizer))


def test_overlong_prompts_are_cut_from_the_left_with_truncate(tokenizer):
  batch = next(_iter(tokenizer, max_prompt_tokens=24, on_overlong="truncate"))
  for text, tokens in zip(batch.texts, batch.prompt_tokens):
    full = tokenizer.encode(text)
    assert full[0] == tokenizer.bos_id  # SmolLM2's BOS is <|im_start|>, which opens the template
    assert tokens == [tokenizer.bos_id] + full[-23:]  # keeps the leading BOS and the question's end


def test_overlong_prompt_is_a_data_error_naming_the_record(tokenizer):
  with pytest.raises(DataError, match=r"record 'arithmetic-0-\d+': prompt has \d+ tokens, more than "
                                      r"data.max_prompt_tokens=8"):
    next(_iter(tokenizer, max_prompt_tokens=8, on_overlong="error"))


def test_training_prompts_list_every_record_in_dataset_order(tokenizer):
  listed = training_prompts(_cfg(), tokenizer)
  assert [i for i, _ in listed] == [r.id for r in train_source(_cfg())]
  assert [t for t, _ in dataset_prompts(_cfg(), tokenizer)] == [t for _, t in listed]
  batch = next(_iter(tokenizer))
  assert [listed[i] for i in batch.index] == list(zip(batch.ids, batch.prompt_tokens))


def test_batch_size_must_divide_over_processes(tokenizer):
  with pytest.raises(ConfigError, match="data.batch_size: expected a multiple of the number of processes \\(3\\)"):
    _iter(tokenizer, 0, 3)


def test_grain_worker_processes_give_the_same_batches(tokenizer):
  a = _take(_iter(tokenizer), 6)
  it = _iter(tokenizer, num_workers=1)
  b = _take(it, 3)
  state = json.loads(json.dumps(it.get_state()))
  it.close()
  it2 = _iter(tokenizer, num_workers=1)
  it2.set_state(state)
  b += _take(it2, 3)
  it2.close()
  assert all(_same(x, y) for x, y in zip(a, b))
