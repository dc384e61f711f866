"""The training loop: prompts -> sampler -> rewards -> weights -> update -> metrics -> checkpoint.

Reads top to bottom in `train`. Device-to-host transfers happen only for the
rollout tokens (to decode and score them) and for metrics. Batch assembly is in
train/batch.py, the update in train/step.py.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import pathlib
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from erpo_jax import allocator, compile_cache
from erpo_jax.config import Config
from erpo_jax.config_io import dump_config
from erpo_jax.data.check import resolve_extract, resolve_max_prompt_tokens
from erpo_jax.data.pipeline import check_training_data, make_train_iterator
from erpo_jax.data.reference_cache import ensure_reference_cache
from erpo_jax.errors import ConfigError, NonFiniteError
from erpo_jax.eval.evaluate import eval_during_training, load_eval_sets
from erpo_jax.metrics import MetricsWriter, truncate_jsonl
from erpo_jax.model.io.loading import load_model, load_tokenizer
from erpo_jax.parallel import mesh as mesh_lib
from erpo_jax.parallel import multihost, transfer
from erpo_jax.reward.shaping import overlong_penalty
from erpo_jax.reward.verifier import RewardResult, Verifier
from erpo_jax.rollout.sampler import Sampler, response_texts
from erpo_jax.train import checkpoint_io as cio
from erpo_jax.train import dynamic_sampling, optim, programs as programs_lib
from erpo_jax.train import step as train_step
from erpo_jax.train.batch import assemble_batch, rollout_metrics, to_host
from erpo_jax.train.packing import response_capacity
from erpo_jax.train.checkpoint import Checkpointer, model_fingerprint
from erpo_jax.train.preemption import Preemption
from erpo_jax.train.run_folder import RunLock, check_resume_config, prepare_run_dir, write_config


# ----------------------------------------------------------------------------- the loop


@dataclasses.dataclass(frozen=True)
class Hooks:
  """Points where tests inject faults into a real run; the defaults change nothing."""

  # (step, rewards of that step) -> the rewards the update sees (called for every round drawn)
  scored: Callable[[int, RewardResult], RewardResult] = lambda step, scored: scored
  # (step, round) before each extra round of dynamic sampling
  refill: Callable[[int, int], None] = lambda step, round_: None


def train(cfg: Config, *, allow_config_change: bool = False, hooks: Hooks = Hooks()) -> dict[str, float]:
  """Runs (or resumes) a training run; returns the last step's metrics.

  Holds the run folder's lock throughout; a resume whose config changes what
  the run computes is refused unless `allow_config_change` (see run_folder).
  """
  t_start, compile_start = time.perf_counter(), compile_cache.compile_seconds()
  cfg = resolve_max_prompt_tokens(cfg)  # data.max_prompt_tokens = 0 (auto): what the data need
  tokenizer = load_tokenizer(cfg.model)
  check_training_data(cfg, tokenizer)  # bad rows fail here: before a run folder or model
  if cfg.train.eval_every:  # and eval sets without a problem that fits data.max_prompt_tokens
    load_eval_sets(cfg, tokenizer, cfg.eval.sets, cfg.eval.max_problems)
  run_dir = prepare_run_dir(cfg)
  with RunLock(run_dir, warn=multihost.warn) if multihost.is_main() else contextlib.nullcontext():
    return _train(cfg, run_dir, allow_config_change, hooks, t_start, compile_start)


def _first_step_line(step: int, t_start: float, t_step: float, t_end: float, compiling: float) -> str:
  """The log line of this invocation's first step: how long until it ended, where the time went, what the
  compilation cache held (a relaunch with a warm cache loads its programs instead of compiling them)."""
  huge_pages = allocator.huge_pages()
  return (f"step {step} is this run's first: it ended {t_end - t_start:.1f} s after start (set-up "
          f"{t_step - t_start:.1f} s, the step {t_end - t_step:.1f} s; {compiling:.1f} s of "
          f"it XLA compiling or loading programs); {compile_cache.describe()}; "
          f"host allocator {allocator.in_use()}, freed memory {allocator.freed_memory()}"
          + ("" if huge_pages is None else f", transparent huge pages {huge_pages}"))


def _train(cfg: Config, run_dir: pathlib.Path, allow_config_change: bool, hooks: Hooks,
           t_start: float, compile_start: float) -> dict[str, float]:

  # --- set-up: mesh, models, optimizer, data, sampler, verifier
  mesh = mesh_lib.make_mesh(cfg.mesh)
  if cfg.data.batch_size * cfg.rollout.group_size % mesh_lib.num_batch_shards(mesh):
    raise ConfigError(f"data.batch_size * rollout.group_size = {cfg.data.batch_size * cfg.rollout.group_size} "
                      f"rows must divide over data*fsdp = {mesh_lib.num_batch_shards(mesh)} devices")
  model, tokenizer = load_model(cfg.model)
  mesh_lib.shard_model(model, mesh)
  graphdef, params = nnx.split(model)
  param_sh = mesh_lib.param_shardings(params, mesh)

  # The frozen reference: a copy of the initial weights, in the step (forward) or only for the Policy-KL
  # metric (cached: the step runs a reference forward on the steps that log it, every log.policy_kl_every).
  ref_params, ref_sh = None, None
  forward = cfg.erpo.reference == "forward"
  if train_step.takes_reference(cfg):
    dt = jnp.bfloat16 if cfg.erpo.reference_dtype == "bfloat16" else None
    ref_params = jax.tree.map(lambda x: jnp.array(x, dtype=dt or x.dtype, copy=True), params)
    ref_sh = param_sh

  tx, schedule = optim.make_optimizer(cfg.optim, cfg.train.steps, cfg.ppo.minibatches * cfg.ppo.epochs)
  opt_sh = optim.opt_state_shardings(tx, params, param_sh, mesh)
  opt_state = optim.init_opt_state(tx, params, opt_sh)
  step_fn = train_step.build_train_step(graphdef, tx, schedule, cfg, mesh=mesh, param_shardings=param_sh,
                                        opt_shardings=opt_sh, ref_shardings=ref_sh)
  cached_policy_kl = not forward and ref_params is not None

  data = make_train_iterator(cfg, tokenizer, process_index=jax.process_index(),
                             process_count=jax.process_count())
  sampler = Sampler(graphdef, tokenizer, max_new_tokens=cfg.rollout.max_new_tokens,
                    temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p, top_k=cfg.rollout.top_k,
                    min_prompt_bucket=cfg.rollout.min_prompt_bucket, max_prompt_len=cfg.data.max_prompt_tokens,
                    mesh=mesh)
  base_key = jax.random.key(cfg.train.seed)

  # --- resume
  ckpt = Checkpointer(run_dir, every=cfg.checkpoint.every, keep=cfg.checkpoint.keep,
                      async_save=cfg.checkpoint.async_save,
                      fingerprint=model_fingerprint(model.cfg, tokenizer.fingerprint()))
  start = 0
  restored = ckpt.restore_latest_intact(params_target=params, opt_state_target=opt_state, warn=multihost.warn)
  if restored is not None:
    check_resume_config(run_dir, cfg, saved_text=restored.config_text, allow=allow_config_change,
                        warn=multihost.log)
    params, opt_state, start = restored.params, restored.opt_state, restored.step
    data.set_state(restored.data_state)
    multihost.log(f"resumed from {run_dir}/checkpoints at step {start}")
  programs = programs_lib.Programs(cfg.model.compile_after_padding, restored and restored.programs)
  # After the checkpoint's model check (a run resumed with another model is told that, not of a stale cache).
  ref_cache = None
  if cfg.erpo.weights == "static" or not forward:
    ref_cache = ensure_reference_cache(cfg, model, tokenizer, mesh=mesh)
  if ref_cache is not None and ref_cache.prompt_len.size:
    # The data set's longest prompt: rollouts and updates run on prompt rows of its fine bucket (buckets.py).
    sampler.longest_prompt = int(ref_cache.prompt_len.max())
  if multihost.is_main():
    write_config(run_dir, cfg)
  metrics_out = MetricsWriter(run_dir, tensorboard=cfg.log.tensorboard, progress=cfg.log.progress,
                              total_steps=cfg.train.steps, start_step=start, is_main=multihost.is_main())
  index_log = None
  if cfg.log.data_indices:
    index_path = run_dir / f"data_indices.process{jax.process_index()}.jsonl"
    truncate_jsonl(index_path, start)  # steps after the checkpoint are fed again
    index_log = open(index_path, "a", encoding="utf-8")
  G = cfg.rollout.group_size
  last: dict[str, float] = {}
  with Verifier(resolve_extract(cfg).reward) as verifier, Preemption() as preempt:
    for step in range(start + 1, cfg.train.steps + 1):
      t0 = time.perf_counter()
      faults0, system0 = allocator.process_usage()
      compile0 = compile_cache.compile_seconds()
      step_key = jax.random.fold_in(base_key, step)
      seconds = {"rollout": 0.0, "reward": 0.0}  # summed over the rounds drawn

      def draw(round_: int) -> dynamic_sampling.Drawn:
        """The next B prompts, sampled (round 0 with the step's key) and scored."""
        if round_:
          hooks.refill(step, round_)
        t_round = time.perf_counter()
        batch = next(data)
        # The sampler gathers every process's prompts into one global batch.
        roll = sampler.generate(params, batch.prompt_tokens, group_size=G,
                                key=jax.random.fold_in(step_key, round_) if round_ else step_key)
        host = to_host(roll)
        ta = time.perf_counter()
        texts = response_texts(host.tokens, host.prompt_len, host.response_len, tokenizer)
        scored = hooks.scored(step, verifier.score(texts, [a for a in batch.answers for _ in range(G)]))
        tb = time.perf_counter()
        seconds["rollout"] += ta - t_round
        seconds["reward"] += tb - ta
        return dynamic_sampling.Drawn(batch, host, texts, scored)

      drawn, sampling = draw(0), {}
      if cfg.rollout.dynamic_sampling:
        drawn, counts, rounds = dynamic_sampling.fill(drawn, draw, group_size=G,
                                                      max_extra_rounds=cfg.rollout.max_extra_rounds,
                                                      pad_id=sampler.pad_id, all_full=transfer.all_processes)
        sampling = dynamic_sampling.finalize(dynamic_sampling.sum_over_processes(counts))
      batch, host, texts, scored = drawn.batch, drawn.host, drawn.texts, drawn.scored
      # What the advantages see: the verifier's reward (dynamic sampling filters on it, as DAPO on accuracy)
      # plus DAPO's overlong shaping.
      penalty_N = overlong_penalty(host.response_len, cfg.rollout.max_new_tokens, cfg.reward.overlong_buffer,
                                   cfg.reward.overlong_penalty)
      rewards_N = scored.rewards + penalty_N
      if index_log is not None:
        entry = {"step": step, "index": batch.index.tolist()}
        if cfg.rollout.dynamic_sampling:
          entry["drawn"] = [i for d in rounds for i in d.batch.index.tolist()]
        index_log.write(json.dumps(entry) + "\n")
        index_log.flush()
      # A checkpoint written in the background holds a host copy of the parameters and optimizer state until it
      # is on disk: it ends during the rollout, not beside the update's peak.
      t_wait = time.perf_counter()
      ckpt.wait()
      t2 = time.perf_counter()

      log_step = step % cfg.train.log_every == 0 or step == cfg.train.steps
      want_policy_kl = cached_policy_kl and log_step and (step % cfg.log.policy_kl_every == 0
                                                          or step == cfg.train.steps)
      update = assemble_batch(host, rewards_N, np.asarray(batch.index), G, ref_cache, mesh,
                              batch.question_masks if cfg.erpo.query_span == "question" else None, want_policy_kl)
      prompt_bucket = host.tokens.shape[1] - cfg.rollout.max_new_tokens  # the sampler's (widest round's)
      t3 = time.perf_counter()
      params, opt_state, dev_metrics = step_fn(params, opt_state, ref_params, update, prompt_bucket,
                                               response_capacity(cfg, host, mesh, rewards_N, programs, prompt_bucket))
      finite = bool(dev_metrics["optim/finite"])
      t4 = time.perf_counter()
      faults4, system4 = allocator.process_usage()
      compile4 = compile_cache.compile_seconds()
      if step == start + 1:
        multihost.log(_first_step_line(step, t_start, t0, t4, compile4 - compile_start))
      if not finite:
        if not cfg.train.skip_nonfinite:
          ckpt.wait()  # the last finite checkpoint is complete on disk before the run stops
          raise NonFiniteError(step)
        cio.finite_checksums(step, {"params": params, "opt_state": opt_state})  # skipping cannot mend Inf weights
        multihost.log(f"step {step}: non-finite loss or gradients; update skipped")

      if cfg.train.eval_every and step % cfg.train.eval_every == 0:
        evaluation = eval_during_training(params, graphdef, tokenizer, cfg, step, mesh)
        train_accuracy = float(transfer.allgather_rows(scored.correct).mean())
        evaluation["eval/gap"] = train_accuracy - evaluation["eval/accuracy"]
      else:
        evaluation = {}
      if log_step or evaluation:
        last = {k: float(v) for k, v in jax.device_get(dev_metrics).items()}
        if cached_policy_kl and not want_policy_kl:
          del last["kl/policy"]  # this step ran no reference forward
        last.update(rollout_metrics(host, rewards_N, scored.correct, t4 - t0, scored.timeouts, scored.crashes,
                                    penalty_N))
        last.update({**sampling, **programs.metrics()})
        last.update({"time/rollout": seconds["rollout"], "time/reward": seconds["reward"], "time/reference": t3 - t2,
                     "time/checkpoint_wait": t2 - t_wait, "time/update": t4 - t3, "time/step": t4 - t0,
                     "time/compile": compile4 - compile0,  # of the phases' time, for programs first met
                     "host/page_faults": faults4 - faults0, "host/system_s": system4 - system0})
        if step == start + 1:  # set-up and compilation included: cold vs warm compilation cache
          last["time/to_first_step"] = t4 - t_start
        last.update(evaluation)
        metrics_out.write(step, last)
      if cfg.log.samples_every and step % cfg.log.samples_every == 0:
        for i in range(min(cfg.log.num_samples, len(texts))):
          metrics_out.write_text(step, f"samples/{i}", f"reward {scored.rewards[i]:.2f}\n\n{texts[i]}")

      stop = preempt.requested
      if jax.process_count() > 1:
        # SIGTERM may reach the processes in different steps; they save and stop together.
        stop = bool(transfer.allgather_rows(np.array([stop])).any())
      if ckpt.should_save(step) or step == cfg.train.steps or stop:
        # save's one pass over each tree checks finiteness beside its checksums. Weights that are not finite
        # stop the run here (NonFiniteError, exit 3) whatever train.skip_nonfinite says.
        ckpt.save(step, params=params, opt_state=opt_state, rng_key=base_key, data_state=data.get_state(),
                  config_text=dump_config(cfg), force=True, programs=programs.state())
      if stop:
        multihost.log(f"SIGTERM: saved step {step}; resume with the same command")
        break
  ckpt.wait()
  ckpt.close()
  metrics_out.close()
  if index_log is not None:
    index_log.close()
  return last

