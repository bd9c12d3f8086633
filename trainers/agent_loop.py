"""Multi-turn rollouts: the agent plays environments, batched across every live episode, token-in/token-out.

`play` is the loop; `trainer_rollouts` plays it for `AgentGRPOTrainer` (whose TRL `rollout_func` hook returns
`to_trl` of those rollouts), and `agent_trl/evaluation.py` runs it on held-out tasks outside training. The sampling
itself is the generation engine's (`trainers/generation.py`, a `GenerateFn`). One turn of the loop:

1. the contexts of all live episodes (`prompt_ids + completion_ids`, plain token concatenation, never re-tokenised)
   are left-padded and generated in ONE batched call, capped at `max_turn_tokens` new tokens; the HF backend
   (`hf_generate`) keeps the KV cache from the previous turn, so only the new ids are prefilled, and samples with its
   own decode loop over the model's forward where the model's cache allows;
2. each row is cut at its first end-of-turn id (kept, so stopping receives gradient); the sampled ids and their
   sampling log-probs are appended with `env_mask` 1 and `turn_index` k;
3. each environment steps on the decoded turn (on up to 8 worker threads, with a timeout; an exception becomes an
   error observation, a hang ends the episode);
4. the observation is rendered by the chat template as the next message plus the next generation prompt, and its ids
   are appended with `env_mask` 0, log-prob 0 and `turn_index` -1. A turn cut by its token cap is closed by an
   end-of-turn id in front of the observation (an environment token), so the stored sequence stays well formed.

An episode ends when the environment says `done` (terminated), or when it runs out of turns or of completion tokens
(`truncated`: a budget cut, a failed episode unless the environment declares that its episodes continue past a cut,
conventions.md C4). The outcome reward is the sum of the per-turn
rewards.

Returned per rollout (the rollout-batch contract, docs/layout.md#the-rollout-batch): `prompt_ids`, `completion_ids`,
`logprobs`, `env_mask`, `turn_index`, `turn_rewards` (K), `state_keys` (K, the state before each turn:
`envs.base.state_key_of`), `prompt_messages` and `prompt_tools` (what `prompt_ids` was rendered from), `transcript`
(per turn: action, invalid, observation, reward), `env_reward`, `success`, `truncated`, `continues` (truncated in an
environment that declares `continues_past_cut`), `final_info`.

MoE routing replay (R3, `docs/methods/routing-replay.md`): a generation backend may also return, per context, the route
record of that call (`hf_generate(..., record_routes=True)`); `play` then keeps one record per rollout, stitched over
turns by the first-computation rule (D5), of N_b - 1 rows for its N_b = prompt + completion tokens (`Rollout.routes`).

Decision ids (`Dn`) without a page are docs/methods/routing-replay.md's.
"""

from __future__ import annotations

import copy
import json
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from tqdm.auto import tqdm

from envs.base import Env, row_task, state_key_of
from trainers.generation import GenerateFn, hf_generate, vllm_generate
from trainers.trl_api import unwrap_model_for_generation

logger = logging.getLogger(__name__)


@dataclass
class LoopSettings:
    """Budgets of one episode. `max_turns=None` uses each environment's own `max_turns`."""

    max_turn_tokens: int = 32
    max_completion_length: int = 256
    max_turns: int | None = None
    env_timeout: float = 30.0


@dataclass
class Rollout:
    prompt_ids: list[int]
    completion_ids: list[int] = field(default_factory=list)
    sampled_ids: list[int] = field(default_factory=list)  # every id the sampler emitted, in order (TITO audit)
    logprobs: list[float] = field(default_factory=list)
    env_mask: list[int] = field(default_factory=list)
    turn_index: list[int] = field(default_factory=list)
    turn_rewards: list[float] = field(default_factory=list)
    state_keys: list[str | None] = field(default_factory=list)  # None: the environment's state_key raised
    prompt_messages: list[dict] = field(default_factory=list)  # the messages `prompt_ids` was rendered from
    prompt_tools: list[dict] | None = None  # the tool schemas rendered with them (the teacher pass re-renders both)
    transcript: list[dict] = field(default_factory=list)
    done: bool = False
    truncated: bool = False
    continues: bool = False  # truncated, in an environment whose episodes go on past a cut (conventions.md C4)
    success: bool = False
    env_errors: int = 0  # environment exceptions and timeouts, turned into observations
    final_info: dict = field(default_factory=dict)
    routes: torch.Tensor | None = None  # (N_b - 1, L, k) int16 route record, N_b = prompt + completion tokens (R3)
    route_mismatch: int = 0  # (position, layer) pairs a later prefill routed differently (routing-replay.md Eq. 11)
    route_compared: int = 0  # (position, layer) pairs re-prefilled and compared

    @property
    def env_reward(self) -> float:
        return float(sum(self.turn_rewards))


def render_prompt_ids(tokenizer, messages: list[dict] | str, tools: list[dict] | None = None) -> list[int]:
    """Chat-templated prompt ids ending with the generation prompt; a plain string is one user message."""
    if isinstance(messages, str):
        messages = [{"role": "user", "content": messages}]
    text = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def with_system(prompt: list[dict] | str, system: str | None) -> list[dict] | str:
    """`prompt` (a text, or chat messages) with `system` as its system message: a text becomes a chat of system and
    user; a chat's own system message is replaced. Unchanged when `system` is None.

    >>> with_system("2 + 2?", "Reply with the number.")
    [{'role': 'system', 'content': 'Reply with the number.'}, {'role': 'user', 'content': '2 + 2?'}]
    >>> with_system([{"role": "system", "content": "old"}, {"role": "user", "content": "hi"}], "new")[0]["content"]
    'new'
    """
    if system is None:
        return prompt
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
    return [{"role": "system", "content": system}] + [m for m in messages if m.get("role") != "system"]


def observation_text(tokenizer, observation: str, role: str = "user") -> str:
    """What the chat template puts between the end-of-turn of an assistant turn and the next generation prompt's end.

    Rendered from the tokenizer's own template, so any Qwen/ChatML-style template works unchanged.
    """
    sentinel = "\x02ACTION\x02"
    eos = tokenizer.eos_token
    messages = [{"role": "user", "content": "\x01"}, {"role": "assistant", "content": sentinel}]
    messages.append({"role": role, "content": observation})
    full = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    anchor = full.find(sentinel + eos)
    if anchor < 0:
        raise ValueError(f"chat template does not end assistant turns with the eos token {eos!r}")
    return full[anchor + len(sentinel) + len(eos) :]


class EnvironmentFailure(RuntimeError):
    """An environment's `reset` raised: the episode cannot start. The message names the class and the task."""


def reset_all(envs: Sequence[Env], tasks: Sequence[dict]) -> list:
    """Each environment's first observation (`env.reset(task)`), in order. One function, like `step_all`, so that the
    environment's own work is timed as such (bench/profile_step.py). A `reset` that raises stops the batch with an
    `EnvironmentFailure` naming the environment and the task (a step that raises only ends its episode)."""
    firsts = []
    for env, task in zip(envs, tasks, strict=True):
        try:
            firsts.append(env.reset(task))
        except Exception as e:
            shown = json.dumps(task, default=str)[:200]
            raise EnvironmentFailure(
                f"environment {type(env).__name__}.reset raised {type(e).__name__}: {e} (task {shown})"
            ) from e
    return firsts


def step_all(
    envs: Sequence[Env], actions: Sequence[str], timeout: float, workers: int = 8
) -> list[tuple[str, float, bool, dict]]:
    """Step every environment on its action, `workers` daemon threads pulling from one queue. An exception becomes an
    error observation; a step still running after `timeout` seconds ends its episode (its thread is abandoned, never
    joined; the other threads go on with the queue, so one hang does not stall the rest)."""
    results: list = [None] * len(envs)
    jobs: queue.SimpleQueue = queue.SimpleQueue()
    for j in range(len(envs)):
        jobs.put(j)

    def work() -> None:
        while True:
            try:
                j = jobs.get_nowait()
            except queue.Empty:
                return
            try:
                results[j] = envs[j].step(actions[j])
            except Exception as e:  # an environment bug must not crash training
                results[j] = (f"error: {type(e).__name__}: {e}", 0.0, False, {"env_error": True})

    threads = [threading.Thread(target=work, daemon=True) for _ in range(min(workers, len(envs)))]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    if stuck := [t for t in threads if t.is_alive()]:
        ABANDONED.update(stuck)
        running = [t for t in ABANDONED if t.is_alive()]
        ABANDONED.intersection_update(running)
        logger.warning(
            "%d environment step(s) ran past env_timeout (%gs) and were cut; %d abandoned step thread(s) of this "
            "process are still running, holding CPU and memory until they return (a step that never returns is a "
            "bug in the environment)",
            len(stuck),
            timeout,
            len(running),
        )
    expired = (f"error: environment step timed out after {timeout:g}s", 0.0, True, {"env_timeout": True})
    return [r if r is not None else expired for r in results]


#: step threads `step_all` gave up on that may still run: counted in its warning
ABANDONED: set[threading.Thread] = set()


def play(
    generate: GenerateFn,
    tokenizer,
    envs: Sequence[Env],
    tasks: Sequence[dict],
    prompts: Sequence[list[dict] | str] | None = None,
    settings: LoopSettings | None = None,
    num_live_global: Callable[[int], int] | None = None,
    progress: bool = False,
) -> list[Rollout]:
    """Play one episode per (env, task) with batched generation; returns one `Rollout` per episode, in order.

    `prompts` (optional) are the dataset prompts; the first observation from `env.reset` replaces the content of their
    last user message (so a TRL-style `reset` that appends text works as in TRL). A `reset` that returns a list of
    chat messages (a conversation ending with the environment's turn, e.g. X-Tree's replayed prefix) gives the whole
    prompt: those past turns are never part of the completion, so they are never trained on. `num_live_global` maps
    this process's live-episode count to the count over all processes, so every process makes the same number of
    generate calls (needed under ZeRO-3/FSDP, where each generate call is a collective); a process with nothing left
    generates on a one-token dummy context and discards it.
    """
    settings = settings or LoopSettings()
    eos_id = tokenizer.eos_token_id
    rollouts, turns, last_obs = [], [], []  # last_obs: the observation before each env's next turn (state keys)
    prompt_ids: dict[str, list[int]] = {}  # a group's G episodes share their prompt: rendered once per call
    for i, (env, first) in enumerate(zip(envs, reset_all(envs, tasks), strict=True)):
        if isinstance(first, list):  # a conversation so far (e.g. a replayed prefix): it is the whole prompt
            messages, first = copy.deepcopy(first), first[-1]["content"]
        else:
            messages = copy.deepcopy(prompts[i]) if prompts is not None else [{"role": "user", "content": first}]
            if isinstance(messages, str):
                messages = [{"role": "user", "content": messages}]
            user = [m for m in messages if m["role"] == "user"]
            if user:
                user[-1]["content"] = first
            else:
                messages.append({"role": "user", "content": first})
        try:
            key = json.dumps([messages, env.tools], sort_keys=True)
        except TypeError:  # content that is not plain text (e.g. images): rendered every time
            key = None
        ids = prompt_ids.get(key) if key is not None else None
        if ids is None:
            ids = render_prompt_ids(tokenizer, messages, env.tools)
            if key is not None:
                prompt_ids[key] = ids
        rollouts.append(
            Rollout(
                prompt_ids=list(ids),
                prompt_messages=messages,
                prompt_tools=env.tools,
            )
        )
        last_obs.append(first)
        turns.append(settings.max_turns if settings.max_turns is not None else env.max_turns)

    rendered: dict[tuple[str, str], list[int]] = {}  # (observation, role) -> its ids, rendered once per call
    bar = tqdm(total=len(rollouts), desc="episodes", leave=False, disable=not progress)
    k = 0
    while True:
        live = [i for i, r in enumerate(rollouts) if not r.done]
        if (num_live_global(len(live)) if num_live_global else len(live)) == 0:
            break
        if not live:  # keep generate calls in step with the other processes
            generate([[eos_id]], 1)
            continue
        budgets = [settings.max_completion_length - len(rollouts[i].completion_ids) for i in live]
        for i in live:
            rollouts[i].state_keys.append(state_key_of(envs[i], last_obs[i]))
        contexts = [rollouts[i].prompt_ids + rollouts[i].completion_ids for i in live]
        outputs = generate(contexts, min(settings.max_turn_tokens, max(budgets)))
        steps = []
        for i, context, budget, (ids, logps, *routes) in zip(live, contexts, budgets, outputs, strict=True):
            if eos_id in ids:
                cut = ids.index(eos_id) + 1
                ids, logps = ids[:cut], logps[:cut]
            ids, logps = ids[: min(budget, settings.max_turn_tokens)], logps[: min(budget, settings.max_turn_tokens)]
            r = rollouts[i]
            if routes:  # keep the positions fed to the model: context + kept tokens except the last (never fed)
                _add_turn_routes(r, routes[0][: len(context) + len(ids) - 1])
            r.completion_ids += ids
            r.sampled_ids += ids
            r.logprobs += [float(x) for x in logps]
            r.env_mask += [1] * len(ids)
            r.turn_index += [k] * len(ids)
            closed = bool(ids) and ids[-1] == eos_id
            action = tokenizer.decode(ids[:-1] if closed else ids, skip_special_tokens=False)
            steps.append((i, action, closed))
        results = step_all([envs[i] for i, _, _ in steps], [a for _, a, _ in steps], settings.env_timeout)
        going_on = []  # (episode, observation key, whether its turn closed) of the episodes that take another turn
        for (i, action, closed), (observation, reward, done, info) in zip(steps, results, strict=True):
            r = rollouts[i]
            r.turn_rewards.append(float(reward))
            r.env_errors += int(bool(info.get("env_error") or info.get("env_timeout")))
            r.final_info = dict(info)
            r.success = bool(info.get("success", False))
            invalid = bool(info.get("invalid", False))  # the environment rejected the action (TASPO's executed turns)
            r.transcript.append(
                {"action": action, "observation": observation, "reward": float(reward), "invalid": invalid}
            )
            last_obs[i] = observation
            out_of_tokens = len(r.completion_ids) >= settings.max_completion_length
            if done or k + 1 >= turns[i] or out_of_tokens:
                r.done, r.truncated = True, not done
                r.continues = r.truncated and envs[i].continues_past_cut
                bar.update(1)
                continue
            going_on.append((i, (observation, envs[i].observation_role), closed))
        new = [key for key in dict.fromkeys(key for _, key, _ in going_on) if key not in rendered]
        if new:  # a group's episodes often see the same observation: each is rendered once, all in one tokenizer call
            texts = [observation_text(tokenizer, observation, role) for observation, role in new]
            rendered.update(zip(new, tokenizer(texts, add_special_tokens=False)["input_ids"], strict=True))
        for i, key, closed in going_on:
            r = rollouts[i]
            obs_ids = list(rendered[key])
            if not closed:
                obs_ids = [eos_id] + obs_ids
            if len(r.completion_ids) + len(obs_ids) >= settings.max_completion_length:
                r.done, r.truncated = True, True  # no room for the observation and another turn
                r.continues = envs[i].continues_past_cut
                bar.update(1)
                continue
            r.completion_ids += obs_ids
            r.logprobs += [0.0] * len(obs_ids)
            r.env_mask += [0] * len(obs_ids)
            r.turn_index += [-1] * len(obs_ids)
        k += 1
    bar.close()
    return rollouts


def _add_turn_routes(rollout: Rollout, routes: torch.Tensor) -> None:
    """Stitch one call's record (n_new, L, k) onto the rollout's record by the first-computation rule (D5)."""
    from trainers.routing_replay import prefix_recompute_mismatch, stitch_turn_routes

    if rollout.routes is None:
        rollout.routes = routes
        return
    mismatch = prefix_recompute_mismatch(rollout.routes, routes)  # (n_prev, L), routing-replay.md Eq. 11
    rollout.route_mismatch += int(mismatch.sum())
    rollout.route_compared += mismatch.numel()
    rollout.routes = stitch_turn_routes(rollout.routes, routes)  # (n_new, L, k), D5


def to_trl(rollouts: list[Rollout]) -> dict[str, list]:
    """A TRL `rollout_func` return value: TRL's required keys, `env_mask`, and the contract's extra fields."""
    return {
        "prompt_ids": [r.prompt_ids for r in rollouts],
        "completion_ids": [r.completion_ids for r in rollouts],
        "logprobs": [r.logprobs for r in rollouts],
        "env_mask": [r.env_mask for r in rollouts],
        "sampled_ids": [r.sampled_ids for r in rollouts],
        "turn_index": [r.turn_index for r in rollouts],
        "turn_rewards": [r.turn_rewards for r in rollouts],
        "state_keys": [r.state_keys for r in rollouts],
        "prompt_messages": [r.prompt_messages for r in rollouts],
        "prompt_tools": [r.prompt_tools for r in rollouts],
        "transcript": [r.transcript for r in rollouts],
        "env_reward": [r.env_reward for r in rollouts],
        "success": [r.success for r in rollouts],
        "truncated": [r.truncated for r in rollouts],
        "continues": [r.continues for r in rollouts],
        "env_errors": [r.env_errors for r in rollouts],
        "final_info": [r.final_info for r in rollouts],
    }


def trainer_rollouts(prompts: list, trainer, rows: list[dict]) -> list[Rollout]:
    """The rollouts of one generation batch of `trainer` (an `AgentGRPOTrainer`), as `Rollout` objects (their
    `routes` stay here, out of TRL's rows). The task of each prompt comes from `rows`, the batch's dataset rows in the
    order of `prompts` (already repeated G times): the trainer's generation step holds them.

    Every process makes the same number of generate calls (`trainer.num_live_global`); with
    `trainer.replay_routing` the HF backend records MoE routes (routing-replay.md D1).
    """
    if len(rows) != len(prompts):
        raise RuntimeError(f"trainer_rollouts got {len(prompts)} prompts but {len(rows)} rows")
    envs = [trainer.env_factory(row) for row in rows]
    # a `task` column (JSON or dict) holds the task; without one the row itself is the task, as TRL's reset(**row)
    tasks = [row_task(row) for row in rows]
    settings = trainer.loop_settings
    sync = trainer.num_live_global
    if trainer.use_vllm:  # routes cannot come from TRL's vLLM client; the trainer refuses replay with vLLM at init
        return play(vllm_generate(trainer), trainer.processing_class, envs, tasks, prompts, settings, sync)
    with unwrap_model_for_generation(trainer.model_wrapped, trainer.accelerator) as model:
        generate = hf_generate(
            model,
            trainer.processing_class,
            temperature=trainer.temperature,
            top_p=trainer.top_p,
            top_k=trainer.top_k,
            min_p=trainer.min_p,
            repetition_penalty=trainer.repetition_penalty,
            eos_token_ids=trainer.eos_token_ids,
            record_routes=trainer.replay_routing,
            reuse_cache=trainer.args.reuse_kv_cache,
        )
        return play(generate, trainer.processing_class, envs, tasks, prompts, settings, sync)
