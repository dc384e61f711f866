"""One update, two builds of the CPU kernel library, one process: which attention kernel is faster in the step.

    python scripts/kernel_ab.py --other /path/to/other/checkout --config configs/bench_reference.yaml --variant c

Builds the other checkout's `erpo_jax/model/cpu_decode.cc` beside this one's, registers its update-attention
functions under target names of their own, compiles the same `bench step` update (variant a-e, shared prefix on)
once against each library and times them taking turns (`bench.step.time_interleaved`): the hour's drift falls on
both, so the paired ratio resolves a few percent that two `bench step` processes one after the other do not.
Prints each side's times, the median of the paired ratios (this / other) and the ratio of the medians.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import sys
import tempfile

from erpo_jax.bench import probe as bench_probe
from erpo_jax.bench import step as bench_step
from erpo_jax.bench.run import STEP_VARIANTS, step_variant
from erpo_jax.config_io import load_config
from erpo_jax.model import cpu_kernel

OTHER_TARGETS = ("erpo_group_attention_fwd_other", "erpo_group_attention_bwd_other")


def register_other(checkout: str, build_dir: str | None = None) -> None:
  """Builds the other checkout's kernel library (into build_dir, else a new temporary folder) and registers its
  update attention as OTHER_TARGETS."""
  source = os.path.join(checkout, "erpo_jax", "model", "cpu_decode.cc")
  if not os.path.isfile(source):
    sys.exit(f"kernel_ab: --other {checkout}: no erpo_jax/model/cpu_decode.cc there")
  path = cpu_kernel.build(cpu_kernel.compiler(), build_dir or tempfile.mkdtemp(prefix="erpo-kernel-ab-"),
                          source=source)
  cpu_kernel.register_train_attention(ctypes.cdll.LoadLibrary(path), OTHER_TARGETS)


def main(argv=None) -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--other", required=True, help="another checkout of erpo-jax (a git worktree)")
  p.add_argument("--config", default="configs/bench_reference.yaml")
  p.add_argument("--variant", default="c", choices=sorted(STEP_VARIANTS))
  p.add_argument("--iters", type=int, default=6)
  p.add_argument("--warmup", type=int, default=1)
  args = p.parse_args(argv)
  cpu_kernel.require()
  register_other(args.other)
  cfg = step_variant(load_config(args.config), args.variant, True)
  model, tokenizer, prompts = bench_probe.load_model_and_prompts(cfg)
  inp = bench_step.prepare_inputs(cfg, model, prompts, vocab=tokenizer.vocab_size, pad_id=tokenizer.pad_id,
                                  with_reference=bench_step.train_step.takes_reference(cfg))
  this = bench_step.build_variant(inp, cfg)
  with cpu_kernel.train_attention_targets(OTHER_TARGETS):
    other = bench_step.build_variant(inp, cfg)
  if OTHER_TARGETS[0] not in other.compiled.as_text():
    sys.exit("kernel_ab: the update does not call the attention kernel here (one CPU device, float32)")
  t_this, t_other = bench_step.time_interleaved(inp, [this, other], iters=args.iters, warmup=args.warmup)
  print(f"this:  {[round(t, 3) for t in t_this]} median {statistics.median(t_this):.3f} s")
  print(f"other: {[round(t, 3) for t in t_other]} median {statistics.median(t_other):.3f} s")
  print(f"this / other: median of paired ratios {statistics.median(a / b for a, b in zip(t_this, t_other)):.4f}, "
        f"ratio of medians {statistics.median(t_this) / statistics.median(t_other):.4f}")


if __name__ == "__main__":
  main()
