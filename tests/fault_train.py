"""`erpo-jax` with faults injected through erpo_jax.train.loop.Hooks: python tests/fault_train.py OPTIONS ARGS...

--nan-step K multiplies the rewards of step K by NaN, so the real update of that
step sees a non-finite loss. --hold-step K --release FILE makes step K wait, after
its rollout is scored, until FILE exists (a trainer held in the middle of its run,
whatever the machine's speed; the run's numbers are unchanged); FILE.held appears when
the wait begins. The remaining arguments go to the erpo-jax CLI.
"""

import argparse
import dataclasses
import functools
import pathlib
import sys
import time

import numpy as np

from erpo_jax import cli
from erpo_jax.train import loop


def nan_rewards_at(step: int) -> loop.Hooks:
  def scored(k, result):
    return dataclasses.replace(result, rewards=result.rewards * np.float32("nan")) if k == step else result
  return loop.Hooks(scored=scored)


def hold_at(step: int, release: str, timeout_s: float = 600.0) -> loop.Hooks:
  def scored(k, result):
    if k == step:
      pathlib.Path(release + ".held").touch()  # tells a test the trainer is in the middle of step K now
    deadline = time.monotonic() + timeout_s
    while k == step and not pathlib.Path(release).exists() and time.monotonic() < deadline:
      time.sleep(0.05)
    return result
  return loop.Hooks(scored=scored)


if __name__ == "__main__":
  parser = argparse.ArgumentParser()
  parser.add_argument("--nan-step", type=int)
  parser.add_argument("--hold-step", type=int)
  parser.add_argument("--release")
  args, rest = parser.parse_known_args()
  hooks = nan_rewards_at(args.nan_step) if args.nan_step is not None else hold_at(args.hold_step, args.release)
  loop.train = functools.partial(loop.train, hooks=hooks)
  sys.exit(cli.main(rest))
