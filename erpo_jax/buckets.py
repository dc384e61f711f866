"""Shape buckets: sizes rounded up so that each jitted program compiles for a few shapes only."""

from __future__ import annotations


def round_up(n: int, multiple: int) -> int:
  """The smallest multiple of `multiple` >= n, and at least `multiple`."""
  return max(multiple, -(-n // multiple) * multiple)


def power_of_two(n: int, minimum: int = 1) -> int:
  """The smallest power of two >= max(n, minimum, 1)."""
  return 1 << (max(n, minimum, 1) - 1).bit_length()


def prompt_bucket(length: int, min_bucket: int, longest_prompt: int | None = None) -> int:
  """The sampler's and the update's prompt length P for prompts of at most `length` tokens: a power of two
  >= min_bucket, cut to the fine bucket of the data set's longest prompt when that is known (a reference cache
  gives it) and `length` fits. P takes no value the powers of two do not already bring, so nothing compiles more
  often (the embedded default: 64 -> 48)."""
  p = power_of_two(length, min_bucket)
  if longest_prompt is None or length > longest_prompt:
    return p
  return min(p, fine_bucket(longest_prompt))


def fine_bucket(length: int, minimum: int = 16) -> int:
  """A length for `length` tokens: the next multiple of max(minimum, power_of_two(length) / 8), so the padding
  is under an eighth of that power of two and an octave has at most 4 values (43 -> 48, 100 -> 112, 300 -> 320)."""
  return round_up(length, max(minimum, power_of_two(length) // 8))


def sequence_bucket(length: int) -> int:
  """The update batch's row length S for rows of at most `length` tokens: a multiple of 32."""
  return round_up(length, 32)


def packed_capacity(response_tokens: int, slots: int, minimum: int = 128) -> int:
  """Static capacity for `response_tokens` packed tokens, at most `slots` (= N*R, the unpacked layout): the next
  multiple of max(minimum, power_of_two(response_tokens) / 16), so the padding stays under 1/16 of that power of
  two and an octave has at most 8 values, each compiled once (1350 -> 1408, 1427 -> 1536, 20000 -> 20480)."""
  return min(slots, round_up(response_tokens, max(minimum, power_of_two(response_tokens) // 16)))
