"""`erpo-jax` with faults injected through erpo_jax.train.loop.Hooks: python tests/fault_train.py --nan-step K ARGS...

--nan-step K multiplies the rewards of step K by NaN, so the real update of that
step sees a non-finite loss. The remaining arguments go to the erpo-jax CLI.
"""

import argparse
import dataclasses
import functools
import sys

import numpy as np

from erpo_jax import cli
from erpo_jax.train import loop


def nan_rewards_at(step: int) -> loop.Hooks:
  def scored(k, result):
    return dataclasses.replace(result, rewards=result.rewards * np.float32("nan")) if k == step else result
  return loop.Hooks(scored=scored)


if __name__ == "__main__":
  parser = argparse.ArgumentParser()
  parser.add_argument("--nan-step", type=int, required=True)
  args, rest = parser.parse_known_args()
  loop.train = functools.partial(loop.train, hooks=nan_rewards_at(args.nan_step))
  sys.exit(cli.main(rest))
