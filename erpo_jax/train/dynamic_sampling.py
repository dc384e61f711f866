"""DAPO's dynamic sampling: groups whose G rewards are all equal teach nothing (their advantages are 0), so
they are dropped and more prompts are drawn until the update batch is full, within a bound.

Round 0 is the step's ordinary batch; each extra round draws the next data.batch_size prompts from the same
data iterator (so the data order, and a resume from a checkpoint, stay exact) and samples them with the
key fold_in(step key, round). The kept groups, in draw order, fill the batch; when the extra rounds run
out first, the remaining places take dropped groups in draw order (they add nothing to the policy
gradient, as in plain GRPO). Host-side and per process: each process fills its own B_local groups, and
all processes draw the same number of rounds (one collective per round).

Dimension letters: B prompts (groups) of this process, G samples per prompt, N = B * G rows, S columns.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import numpy as np

from erpo_jax.data.pipeline import PromptBatch
from erpo_jax.parallel import transfer
from erpo_jax.reward.verifier import RewardResult
from erpo_jax.train.batch import HostRollout


@dataclasses.dataclass
class Drawn:
  """One round: B prompts, their rollout's rows (this process's), texts and rewards."""

  batch: PromptBatch
  host: HostRollout
  texts: list[str]  # [N]
  scored: RewardResult


def spread_groups(rewards_N: np.ndarray, group_size: int) -> np.ndarray:
  """[B] bool: the groups whose rewards are not all equal (the ones with a non-zero advantage)."""
  r_BxG = np.asarray(rewards_N).reshape(-1, group_size)
  return ~np.all(r_BxG == r_BxG[:, :1], axis=1)


def choose(spread_per_round: list[np.ndarray], batch_size: int) -> tuple[list[tuple[int, int]], int]:
  """The (round, group) pairs that make up the batch, and how many of them have no reward spread.

  The first batch_size groups with spread in draw order; the rest of the places, if any, go to the
  groups without spread in draw order.
  """
  order = [(r, b) for r, s in enumerate(spread_per_round) for b in range(len(s))]
  kept = [(r, b) for r, b in order if spread_per_round[r][b]][:batch_size]
  filler = [(r, b) for r, b in order if not spread_per_round[r][b]][:batch_size - len(kept)]
  return sorted(kept + filler), len(filler)


def fill(first: Drawn, draw: Callable[[int], Drawn], *, group_size: int, max_extra_rounds: int, pad_id: int,
         all_full: Callable[[bool], bool] = lambda full: full) -> tuple[Drawn, dict[str, float], list[Drawn]]:
  """Draws extra rounds (draw(1), draw(2), ...) until this process (and, through `all_full`, every
  process) has a batch of groups with reward spread, or max_extra_rounds are drawn.

  Returns the assembled batch (rows in draw order, columns padded to the widest round), this process's
  counts (sampling/*; the loop sums them over processes) and the rounds drawn.
  """
  B = len(first.batch.index)
  rounds = [first]
  spread = [spread_groups(first.scored.rewards, group_size)]
  while not all_full(sum(int(s.sum()) for s in spread) >= B) and len(rounds) <= max_extra_rounds:
    rounds.append(draw(len(rounds)))
    spread.append(spread_groups(rounds[-1].scored.rewards, group_size))
  picks, unfilled = choose(spread, B)
  out = _gather(rounds, picks, group_size, pad_id)
  drawn_rewards = np.concatenate([d.scored.rewards for d in rounds])
  counts = {
      "sampling/extra_rounds": float(len(rounds) - 1),
      "sampling/extra_prompts": float((len(rounds) - 1) * B),
      "sampling/drawn_groups": float(B * len(rounds)),
      "sampling/spread_groups": float(sum(int(s.sum()) for s in spread)),
      "sampling/unfilled_groups": float(unfilled),
      "sampling/drawn_reward_sum": float(drawn_rewards.sum()),
      "sampling/drawn_rows": float(drawn_rewards.size),
  }
  return out, counts, rounds


def sum_over_processes(counts: dict[str, float]) -> dict[str, float]:
  """This process's counts of `fill` -> the counts of all processes (one collective on several processes)."""
  if jax.process_count() == 1:
    return counts
  keys = sorted(counts)
  total = transfer.allgather_rows(np.array([[counts[k] for k in keys]], np.float64)).sum(axis=0)
  # Rounds are drawn by all processes together: the same on each, not a sum.
  return {k: (counts[k] if k == "sampling/extra_rounds" else float(v)) for k, v in zip(keys, total)}


def finalize(counts: dict[str, float]) -> dict[str, float]:
  """The logged sampling metrics from counts summed over processes."""
  return {
      "sampling/extra_rounds": counts["sampling/extra_rounds"],
      "sampling/extra_prompts": counts["sampling/extra_prompts"],
      "sampling/spread_frac": counts["sampling/spread_groups"] / max(counts["sampling/drawn_groups"], 1.0),
      "sampling/unfilled_groups": counts["sampling/unfilled_groups"],
      "sampling/drawn_reward_mean": counts["sampling/drawn_reward_sum"] / max(counts["sampling/drawn_rows"], 1.0),
  }


def _gather(rounds: list[Drawn], picks: list[tuple[int, int]], G: int, pad_id: int) -> Drawn:
  """One Drawn of the picked groups: prompt fields per group, row fields per row (columns padded)."""
  S = max(d.host.tokens.shape[1] for d in rounds)

  def rows(arr: np.ndarray, fill_value) -> np.ndarray:
    if arr.ndim == 2 and arr.shape[1] < S:
      arr = np.pad(arr, ((0, 0), (0, S - arr.shape[1])), constant_values=fill_value)
    return arr

  def take_rows(get, fill_value=0) -> np.ndarray:
    return np.concatenate([rows(get(rounds[r]), fill_value)[b * G:(b + 1) * G] for r, b in picks])

  def take_groups(get) -> list:
    return [get(rounds[r])[b] for r, b in picks]

  h = HostRollout(tokens=take_rows(lambda d: d.host.tokens, pad_id),
                  prompt_mask=take_rows(lambda d: d.host.prompt_mask, False),
                  response_mask=take_rows(lambda d: d.host.response_mask, False),
                  prompt_len=take_rows(lambda d: d.host.prompt_len),
                  response_len=take_rows(lambda d: d.host.response_len),
                  truncated=take_rows(lambda d: d.host.truncated))
  batch = PromptBatch(ids=take_groups(lambda d: d.batch.ids), prompt_tokens=take_groups(lambda d: d.batch.prompt_tokens),
                      answers=take_groups(lambda d: d.batch.answers), texts=take_groups(lambda d: d.batch.texts),
                      index=np.array(take_groups(lambda d: d.batch.index), dtype=np.asarray(rounds[0].batch.index).dtype),
                      question_masks=take_groups(lambda d: d.batch.question_masks))
  texts = [t for r, b in picks for t in rounds[r].texts[b * G:(b + 1) * G]]
  scored = RewardResult(
      rewards=take_rows(lambda d: d.scored.rewards), correct=take_rows(lambda d: d.scored.correct),
      extracted=[x for r, b in picks for x in rounds[r].scored.extracted[b * G:(b + 1) * G]],
      timeouts=sum(d.scored.timeouts for d in rounds), crashes=sum(d.scored.crashes for d in rounds),
      cached=sum(d.scored.cached for d in rounds))
  return Drawn(batch=batch, host=h, texts=texts, scored=scored)
