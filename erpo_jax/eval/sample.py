"""`erpo-jax sample`: completions of one chat prompt from the configured model or a checkpoint."""

from __future__ import annotations

import sys

import jax
import numpy as np

from erpo_jax.config import Config
from erpo_jax.model.io.loading import load_model
from erpo_jax.rollout.sampler import Sampler
from erpo_jax.train.checkpoint_io import restore_params


def run_sample(cfg: Config, *, prompt: str, max_new_tokens: int, temperature: float, num: int, seed: int,
               checkpoint: str | None = None) -> list[str]:
  """Prints `num` completions of `prompt` (wrapped in the chat template) and returns them.

  The chat holds cfg.data.system_prompt (when set) and the user's prompt as
  given. temperature 0 is greedy; top_p, top_k and the prompt bucket come from
  cfg.rollout. With several samples each is preceded by a `### sample i` line.
  """

  model, tokenizer = load_model(cfg.model)
  if checkpoint is not None:
    model = restore_params(model, checkpoint, cfg.run.dir)
  messages = [{"role": "user", "content": prompt}]
  if cfg.data.system_prompt:
    messages.insert(0, {"role": "system", "content": cfg.data.system_prompt})
  prompt_ids = tokenizer.encode(tokenizer.render_chat(messages, add_generation_prompt=True))
  sampler = Sampler(model, tokenizer, max_new_tokens=max_new_tokens, temperature=temperature,
                    top_p=cfg.rollout.top_p, top_k=cfg.rollout.top_k,
                    min_prompt_bucket=cfg.rollout.min_prompt_bucket)
  rollout = sampler.generate(model, [prompt_ids], group_size=num, key=jax.random.key(seed))
  tokens_NxS = np.asarray(rollout.tokens)
  mask_NxS = np.asarray(rollout.response_mask)
  texts = [tokenizer.decode(tokens_NxS[n][mask_NxS[n]].tolist()) for n in range(num)]
  for i, text in enumerate(texts):
    if num > 1:
      print(f"### sample {i}")
    print(text)
  sys.stdout.flush()
  return texts
