"""Which compiled update program a packed batch runs on: the capacity it needs, or a larger one already compiled.

Dimension letters: N rows (all processes'), G samples per prompt, R response bucket.

Each packed capacity (`packing.capacity_of`) with each prompt bucket is one XLA program, compiled the first time
the run meets it: about one update's time on a CPU, far more than an update on an accelerator. Responses shorten
as a run trains, so capacities keep falling, and each fall used to compile a program. Here a batch whose capacity
has no program yet runs on a larger one the run has compiled, when one holds it; the extra slots it so runs are
counted per missing capacity, and once they add up to `model.compile_after_padding` whole-batch updates that
capacity is compiled (rent or buy: for each capacity, the padding and the compile together cost at most about
twice what knowing the rest of the run would have spent, with a trained slot at three forward slots and one
compile at that many whole-batch updates).
A capacity compiled is never dropped; the programs compiled are a subset of those the capacity-per-batch rule
compiles. Padded slots are masked: the update is the same up to the order of its float sums.

The choice depends on the run's history; its state goes into checkpoints (`state`), so a resumed run chooses as
the uninterrupted one. All processes choose alike: they see the same gathered lengths and rewards.
"""

from __future__ import annotations

import numpy as np

from erpo_jax.train.packing import SplitCapacity, forward_only_rows, stream_tokens

# A trained slot runs forward and backward, about three forward passes; a forward-only slot runs one.
TRAINED_COST, FORWARD_COST = 3, 1


def cost(capacity: int | SplitCapacity) -> int:
  """Forward-slot units of one stream of a program's update (the prompts' part is the same for all)."""
  if isinstance(capacity, SplitCapacity):
    return TRAINED_COST * capacity.trained + FORWARD_COST * capacity.forward_only
  return TRAINED_COST * capacity


def fits(capacity: int | SplitCapacity, len_N: np.ndarray, rewards_N: np.ndarray | None, group_size: int,
         streams: int) -> bool:
  """Whether a program of `capacity` holds this batch: every stream's responses, and with a SplitCapacity the
  rows the step trains (those `forward_only_rows` leaves out at its forward-only capacity) in its trained one."""
  if not isinstance(capacity, SplitCapacity):
    return stream_tokens(len_N, streams) <= capacity
  if rewards_N is None or stream_tokens(len_N, streams) > capacity.whole:
    return False
  fwd_only_N = forward_only_rows(rewards_N, len_N, group_size, streams, capacity.forward_only)
  return stream_tokens(np.where(fwd_only_N, 0, len_N), streams) <= capacity.trained


def _to_json(capacity: int | SplitCapacity):
  return list(capacity) if isinstance(capacity, SplitCapacity) else int(capacity)


def _from_json(value) -> int | SplitCapacity:
  return SplitCapacity(*map(int, value)) if isinstance(value, list) else int(value)


class Programs:
  """The update programs a run has compiled (by prompt bucket and capacity) and the padded slots run so far for
  each capacity not compiled yet; `choose` picks a batch's program."""

  def __init__(self, compile_after_padding: float, state: dict | None = None):
    self.budget = float(compile_after_padding)  # whole-batch updates of padded work per compile
    self.compiled: list[tuple[int | None, int | SplitCapacity]] = []
    self.padded: dict[tuple[int | None, int | SplitCapacity], int] = {}
    self.last: dict[str, float] = {}
    if state:
      self.compiled = [(pb, _from_json(c)) for pb, c in state["compiled"]]
      self.padded = {(pb, _from_json(c)): int(units) for pb, c, units in state["padded"]}

  def state(self) -> dict:
    """JSON for a checkpoint: what `Programs(..., state)` restores."""
    return {"compiled": [[pb, _to_json(c)] for pb, c in self.compiled],
            "padded": [[pb, _to_json(c), units] for (pb, c), units in self.padded.items()]}

  def choose(self, prompt_bucket: int | None, needed: int | SplitCapacity, len_N: np.ndarray,
             rewards_N: np.ndarray | None, group_size: int, streams: int, max_new_tokens: int) -> int | SplitCapacity:
    """The capacity the step runs for a batch that needs `needed`: a compiled one that holds the batch at no
    more cost, else the cheapest compiled one that holds it while the padding counted for `needed` stays under
    the budget, else `needed` (compiled now)."""
    key, chosen = (prompt_bucket, needed), needed
    if self.budget > 0 and key not in self.compiled:  # budget 0: each capacity compiled when first met
      holding = [c for pb, c in self.compiled
                 if pb == prompt_bucket and fits(c, len_N, rewards_N, group_size, streams)]
      if holding:
        best = min(holding, key=cost)  # the first compiled among equal costs
        extra = cost(best) - cost(needed)
        if extra <= 0 or self.padded.get(key, 0) + extra < self.budget * cost(len(len_N) // streams * max_new_tokens):
          chosen = best
          if extra > 0:
            self.padded[key] = self.padded.get(key, 0) + extra
    if chosen == needed and key not in self.compiled:
      self.compiled.append(key)
      self.padded.pop(key, None)
    self.last = {"perf/padded_share": max(0.0, 1 - cost(needed) / cost(chosen)),
                 "perf/update_programs": float(len(self.compiled))}
    return chosen

  def metrics(self) -> dict[str, float]:
    """Of the last choice: the share of its streams' work on slots beyond the batch's own capacity, and how many
    update programs the run has compiled (those a resumed run's checkpoint lists included); {} before any."""
    return dict(self.last)
