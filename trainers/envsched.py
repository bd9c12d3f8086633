"""EnvSched: which tasks a generation batch trains on, chosen from each task's own reward history, a task-environment
graph for tasks with little history, per-environment quotas and a similarity penalty; docs/methods/envsched.md.

It replaces the uniform shuffled sampler of every trainer (`scheduler: envsched` in any config); rewards, advantages
and losses are unchanged. Per generation batch:
1. Every task's decayed reward moments (Eq. 1-3) plus a prior propagated over the graph (Eq. 4, 10-15) give the
   expected reward variance Î and an uncertainty U (Eq. 5-7); the score is Î + c_u·√U (Eq. 8).
2. A share ε of the batch is drawn uniformly (exploration); the rest greedily by score minus λ_sim times the largest
   similarity to the tasks already chosen (Eq. 18), no environment above ⌈ρ·B⌉ tasks (Eq. 16).
3. After the batch is played, its rewards (gathered over processes) update the moments.

This file reads top to bottom: the pure functions (`scale_reward`, `decay_factor`, `posterior`, `informativeness`,
`uncertainty`, `score`, `environment_similarity`, `knn_graph`, `priors`, `select_batch`, `# Eq. N` on the implementing
lines), then `EnvScheduler` (state, draws, updates, checkpoints) and `SchedulerSampler` (TRL's sampler layout).

Decision ids (`Dn`) without a page are docs/methods/envsched.md's.
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

import numpy as np
from torch.utils.data import Sampler

# ---------------------------------------------------------------------------------------------------------------------
# Pure math (envsched.md §4)


def scale_reward(r, lo: float = 0.0, hi: float = 1.0) -> np.ndarray:
    """r′ of Eq. 1: clip((r − lo) / (hi − lo), 0, 1)."""
    if not hi > lo:
        raise ValueError(f"the reward range needs hi > lo, got [{lo}, {hi}]")
    return np.clip((np.asarray(r, dtype=np.float64) - lo) / (hi - lo), 0.0, 1.0)  # Eq. 1


def decay_factor(half_life: float) -> float:
    """η of Eq. 2: 2^(−1/h); an infinite half-life gives 1 (no forgetting)."""
    return 1.0 if math.isinf(half_life) else 2.0 ** (-1.0 / half_life)  # Eq. 2


def posterior(W, S1, S2, mu0, n0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(n, μ, v) of Eq. 5 with the Bernoulli-equivalent prior of Eq. 4 (second moment μ0)."""
    n = W + n0
    mu = (S1 + n0 * mu0) / n
    m2 = (S2 + n0 * mu0) / n
    return n, mu, np.maximum(m2 - mu * mu, 0.0)  # Eq. 5 (v ≥ 0 up to round-off)


def informativeness(v, n) -> np.ndarray:
    """Î of Eq. 6: v·n/(n + 1), the expected reward variance."""
    return v * n / (n + 1.0)  # Eq. 6


def uncertainty(v, n) -> np.ndarray:
    """U of Eq. 7: v/(n + 1)."""
    return v / (n + 1.0)  # Eq. 7


def score(info, unc, c_u: float, cost=None, zeta: float = 0.0) -> np.ndarray:
    """s of Eq. 8: (Î + c_u·√U) / c̄^ζ (`cost`: each task's environment's normalised mean rollout time)."""
    s = info + c_u * np.sqrt(unc)
    return s if zeta == 0.0 or cost is None else s / np.power(cost, zeta)  # Eq. 8


def jaccard(a: set, b: set) -> float:
    """J(A, B) = |A ∩ B| / |A ∪ B|, with J(∅, ∅) = 1."""
    return 1.0 if not a and not b else len(a & b) / len(a | b)


def environment_similarity(descriptors: Sequence[dict], alphas: tuple[float, float, float, float],
                           with_embeddings: bool) -> np.ndarray:  # fmt: skip
    """(E, E) environment part of Eq. 10: α_tool·J(tools) + α_state·J(state keys) + α_ver·1[same verifier], the α's
    rescaled to sum to 1 when there are no embeddings (α_emb = 0). The embedding part is added per task pair
    (`pair_similarity`, and `knn_graph` block by block)."""
    a_tool, a_state, a_ver, a_emb = alphas
    if not with_embeddings:
        total = a_tool + a_state + a_ver
        a_tool, a_state, a_ver = a_tool / total, a_state / total, a_ver / total
    E = len(descriptors)
    out = np.zeros((E, E))
    for i, di in enumerate(descriptors):
        for j, dj in enumerate(descriptors):
            out[i, j] = (a_tool * jaccard(set(di["tools"]), set(dj["tools"]))
                         + a_state * jaccard(set(di["state_keys"]), set(dj["state_keys"]))
                         + a_ver * float(di["verifier"] == dj["verifier"]))  # fmt: skip  # Eq. 10
    return out


def pair_similarity(
    env_sim: np.ndarray, env_ids: np.ndarray, emb: np.ndarray | None, a_emb: float, i, j
) -> np.ndarray:
    """w(τ_i, τ_j) of Eq. 10 for index arrays i, j (broadcast): the environment part plus α_emb·max(0, ⟨z_i, z_j⟩)."""
    w = env_sim[env_ids[i], env_ids[j]]
    if emb is not None and a_emb > 0:
        w = w + a_emb * np.maximum(0.0, np.sum(emb[i] * emb[j], axis=-1))  # Eq. 10
    return w


def _tie_hash(seed: int, i: int, j: np.ndarray) -> np.ndarray:
    """A seeded pseudo-random key per pair (τ_i, τ_j), for tie-breaking without the task index (Eq. 11)."""
    x = (np.uint64(seed) * np.uint64(0x9E3779B97F4A7C15) + np.uint64(i) * np.uint64(0xBF58476D1CE4E5B9)
         + j.astype(np.uint64) * np.uint64(0x94D049BB133111EB))  # fmt: skip
    x ^= x >> np.uint64(31)
    x *= np.uint64(0xD6E8FEB86659FD93)
    x ^= x >> np.uint64(32)
    return x


def knn_graph(env_sim: np.ndarray, env_ids: np.ndarray, emb: np.ndarray | None, a_emb: float, k: int, seed: int,
              block: int = 512) -> tuple[np.ndarray, np.ndarray]:  # fmt: skip
    """Eq. 11: each task's k most similar other tasks (ties broken by a seeded hash of the pair), in blocks of rows.
    Returns (N, k) neighbour ids and weights; deterministic for a given pool and seed."""
    N = len(env_ids)
    k = min(k, N - 1)
    idx = np.zeros((N, k), dtype=np.int64)
    wts = np.zeros((N, k))
    if k <= 0:
        return idx, wts
    cols = np.arange(N)
    with np.errstate(over="ignore"):
        for lo in range(0, N, block):
            rows = np.arange(lo, min(N, lo + block))
            w = env_sim[env_ids[rows][:, None], env_ids[None, :]]  # (b, N) environment part of Eq. 10
            if emb is not None and a_emb > 0:
                w = w + a_emb * np.maximum(0.0, emb[rows] @ emb.T)  # a block x N product, never (b, N, d)
            for r, row in enumerate(rows):
                ties = _tie_hash(seed, int(row), cols)
                key = np.lexsort((ties, -w[r]))  # by similarity, then the seeded hash
                key = key[key != row][:k]
                idx[row], wts[row] = key, w[r, key]
    return idx, wts


def priors(W, S1, env_ids, nbr_idx, nbr_w, n_envs: int, kappa: float, mu_init: float, n_base: float,
           n_max: float) -> tuple[np.ndarray, np.ndarray]:  # fmt: skip
    """(μ0, n0) per task, Eq. 12-15: the global mean, each environment's mean shrunk towards it, each task's
    neighbours' own data shrunk towards its environment's mean; strength n_base plus the neighbours' weighted evidence,
    capped at n_max. Neighbours contribute their data (S1, W), never their priors."""
    total_w = W.sum()
    mu_g = S1.sum() / total_w if total_w > 0 else mu_init  # Eq. 12
    env_s1 = np.bincount(env_ids, weights=S1, minlength=n_envs)
    env_w = np.bincount(env_ids, weights=W, minlength=n_envs)
    mu_e = (env_s1 + kappa * mu_g) / (env_w + kappa)  # Eq. 13
    nb_s1 = (nbr_w * S1[nbr_idx]).sum(1) if nbr_idx.size else np.zeros(len(W))
    nb_w = (nbr_w * W[nbr_idx]).sum(1) if nbr_idx.size else np.zeros(len(W))
    mu0 = (nb_s1 + kappa * mu_e[env_ids]) / (nb_w + kappa)  # Eq. 14
    n0 = np.minimum(n_base + nb_w, n_max)  # Eq. 15
    return mu0, n0


@dataclass
class Selection:
    """One generation batch's distinct tasks, in order, and how they were chosen."""

    tasks: list[int]
    explored: int = 0
    quota_violations: int = 0
    penalties: list[float] = field(default_factory=list)  # λ_sim·max-similarity at pick time, greedy picks


def select_batch(
    s: np.ndarray,
    env_ids: np.ndarray,
    B: int,
    rng: np.random.Generator,
    *,
    quota: int | None,
    n_explore: int,
    lambda_sim: float,
    similarity,
    candidates: int | None = None,
) -> Selection:
    """§4.4: n_explore tasks uniformly (respecting quotas), then greedy on s − λ_sim·max-similarity to the tasks
    already chosen (Eq. 18) over the top `candidates` by score, widened to the whole pool and then without quotas when
    nothing eligible is left. Ties go by a seeded permutation, never by index. `similarity(i, js)` gives
    w(τ_i, τ_js)."""
    N = len(s)
    if N < B:
        raise ValueError(f"the task pool ({N}) is smaller than a batch of distinct tasks ({B})")
    counts: dict[int, int] = {}
    chosen: list[int] = []
    taken = np.zeros(N, dtype=bool)

    def allowed(i: int, use_quota: bool) -> bool:
        return not taken[i] and (not use_quota or quota is None or counts.get(int(env_ids[i]), 0) < quota)

    def take(i: int) -> None:
        chosen.append(int(i))
        taken[i] = True
        counts[int(env_ids[i])] = counts.get(int(env_ids[i]), 0) + 1

    order = rng.permutation(N)  # the exploration draw and the tie-break of this step
    explored = 0
    for i in order:  # Eq. 17: uniform over the pool, quotas respected
        if explored == n_explore or len(chosen) == B:
            break
        if allowed(i, True):
            take(i)
            explored += 1
    rank = np.empty(N, dtype=np.int64)
    rank[order] = np.arange(N)
    M = N if candidates is None else min(N, candidates)
    by_score = np.lexsort((rank, -s))  # score, then the seeded permutation
    pool = by_score[:M]
    maxsim = np.zeros(N)
    for j in chosen:
        maxsim[pool] = np.maximum(maxsim[pool], similarity(j, pool))
    violations, penalties = 0, []
    stage = 0  # 0: candidates with quotas; 1: whole pool with quotas; 2: whole pool without quotas (Eq. 16 relaxed)
    while len(chosen) < B:
        use_quota = stage < 2
        eligible = np.array([i for i in pool if allowed(i, use_quota)], dtype=np.int64)
        if len(eligible) == 0:
            stage += 1
            if stage == 1:
                pool = by_score
                maxsim = np.zeros(N)
                for j in chosen:
                    maxsim[pool] = np.maximum(maxsim[pool], similarity(j, pool))
            continue
        value = s[eligible] - lambda_sim * maxsim[eligible]  # Eq. 18
        best = eligible[np.lexsort((rank[eligible], -value))[0]]
        penalties.append(float(lambda_sim * maxsim[best]))
        if stage == 2 and quota is not None and counts.get(int(env_ids[best]), 0) >= quota:
            violations += 1
        take(best)
        maxsim[pool] = np.maximum(maxsim[pool], similarity(best, pool))
    return Selection(chosen, explored, violations, penalties)


# ---------------------------------------------------------------------------------------------------------------------
# The scheduler


@dataclass
class SchedSettings:
    """EnvSched's hyperparameters (envsched.md §5); `AgentGRPOConfig`'s `sched_*` fields fill them."""

    reward_lo: float = 0.0
    reward_hi: float = 1.0
    half_life: float | None = None  # None: max(10, 2·⌈N/B⌉) (D4)
    mu_init: float = 0.5
    n_base: float = 2.0
    n_max: float = 4.0
    kappa: float = 2.0
    c_u: float = 0.5
    k_nn: int = 10
    alphas: tuple[float, float, float, float] = (0.3, 0.2, 0.2, 0.3)
    rho_max: float | None = 0.25  # None: no quota
    lambda_sim: float = 0.1
    explore: float = 0.1
    embeddings: bool = True  # hashed n-gram embeddings of the task text (trainers/encoder.py), D7


def task_text(task: dict) -> str:
    return str(task.get("instruction") or task.get("question") or json.dumps(task, sort_keys=True, default=str))


class EnvScheduler:
    """The scheduler's state and its two operations, `draw()` (the next batch's tasks) and `update(...)`.

    Args:
        env_names: (N,) the environment of each task of the pool.
        descriptors: environment name → {"tools", "state_keys", "verifier"} (`Env.descriptor()`).
        texts: (N,) task texts for the embeddings (None: no embeddings).
        batch_tasks: B, distinct tasks per generation batch.
        seed: the scheduler's own generator (every process uses the same).
    """

    def __init__(self, env_names: Sequence[str], descriptors: dict, texts: Sequence[str] | None, batch_tasks: int,
                 settings: SchedSettings | None = None, seed: int = 0, task_ids: Sequence | None = None):  # fmt: skip
        self.settings = settings = settings or SchedSettings()
        N, B = len(env_names), batch_tasks
        if N < B:  # D19
            raise ValueError(f"EnvSched needs at least one generation batch of distinct tasks: the pool has {N}, a "
                             f"batch takes {B} (generation_batch_size / num_generations)")  # fmt: skip
        self.B, self.seed = B, seed
        self.envs = sorted(set(env_names))
        self.env_ids = np.array([self.envs.index(e) for e in env_names], dtype=np.int64)
        self.emb = None
        if settings.embeddings and texts is not None:
            from trainers.encoder import NgramEncoder

            self.emb = NgramEncoder(dim=512).encode(list(texts)).double().numpy()
        self.a_emb = settings.alphas[3] if self.emb is not None else 0.0
        self.env_sim = environment_similarity([descriptors[e] for e in self.envs], settings.alphas,
                                              self.emb is not None)  # fmt: skip
        self.nbr_idx, self.nbr_w = knn_graph(self.env_sim, self.env_ids, self.emb, self.a_emb, settings.k_nn, seed)
        h = settings.half_life if settings.half_life is not None else max(10, 2 * math.ceil(N / B))  # D4
        self.eta = decay_factor(h)
        self.half_life = h
        self.W, self.S1, self.S2 = np.zeros(N), np.zeros(N), np.zeros(N)
        self.t_last = np.zeros(N, dtype=np.int64)
        self.n_sel = np.zeros(N, dtype=np.int64)
        self.t_sel = np.full(N, -1, dtype=np.int64)
        self.t = 0  # scheduler step: generation batches drawn
        self.rng = np.random.default_rng(seed)
        self.pending: list[list[int]] = []  # drawn, not yet updated (D17)
        self.pending_info: list[dict] = []  # each pending draw's statistics
        self._replay: list[list[int]] = []  # pending draws restored from a checkpoint, not yet served again
        self.invalid = 0
        self.identity = self._identity(task_ids if task_ids is not None else range(N), env_names)
        self.last: dict = {}

    def _identity(self, task_ids, env_names) -> str:
        blob = json.dumps({"settings": asdict(self.settings), "B": self.B, "seed": self.seed,
                           "pool": [[str(t), e] for t, e in zip(task_ids, env_names, strict=True)],
                           "graph": hashlib.sha256(self.nbr_idx.tobytes() + self.nbr_w.tobytes()).hexdigest()},
                          sort_keys=True, default=str)  # fmt: skip
        return hashlib.sha256(blob.encode()).hexdigest()

    # -- scores -------------------------------------------------------------------------------------------------------
    def _decay_to(self, t: int) -> None:
        """Lazy decay (Eq. 3): multiply the sums by η^(t − t_last), then t_last = t."""
        f = self.eta ** (t - self.t_last).astype(np.float64)
        self.W *= f
        self.S1 *= f
        self.S2 *= f
        self.t_last[:] = t

    def scores(self) -> dict[str, np.ndarray]:
        s = self.settings
        self._decay_to(self.t)
        mu0, n0 = priors(self.W, self.S1, self.env_ids, self.nbr_idx, self.nbr_w, len(self.envs), s.kappa,
                         s.mu_init, s.n_base, s.n_max)  # fmt: skip
        n, mu, v = posterior(self.W, self.S1, self.S2, mu0, n0)
        info, unc = informativeness(v, n), uncertainty(v, n)
        return {"score": score(info, unc, s.c_u), "info": info, "bonus": s.c_u * np.sqrt(unc), "mu0": mu0, "mu": mu}

    def similarity(self, i: int, js: np.ndarray) -> np.ndarray:
        return pair_similarity(self.env_sim, self.env_ids, self.emb, self.a_emb, np.full(len(js), i), js)

    # -- draws and updates --------------------------------------------------------------------------------------------
    def draw(self) -> list[int]:
        """The next generation batch's B distinct task indices (§4.4); kept pending until its rewards arrive."""
        s = self.settings
        sc = self.scores()
        one_env = len(self.envs) == 1  # D20: a quota means nothing with one environment
        quota = math.ceil(s.rho_max * self.B) if s.rho_max is not None and not one_env else None  # Eq. 16
        n_explore = math.floor(s.explore * self.B + 0.5 + 1e-9)  # Eq. 17: halves round up (0.35 x 90 is 31.4999...)
        sel = select_batch(sc["score"], self.env_ids, self.B, self.rng, quota=quota, n_explore=n_explore,
                           lambda_sim=s.lambda_sim, similarity=self.similarity,
                           candidates=min(len(self.env_ids), max(8 * self.B, 256)))  # fmt: skip
        tasks = np.array(sel.tasks)
        shares = np.bincount(self.env_ids[tasks], minlength=len(self.envs)) / len(tasks)
        nz = shares[shares > 0]
        self.last = {
            "score_mean": float(sc["score"].mean()),
            "score_selected_mean": float(sc["score"][tasks].mean()),
            "info_selected_mean": float(sc["info"][tasks].mean()),
            "bonus_selected_mean": float(sc["bonus"][tasks].mean()),
            "sim_penalty_selected_mean": float(np.mean(sel.penalties)) if sel.penalties else 0.0,
            "explore_count": sel.explored,
            "coldstart_frac": float((self.W[tasks] < 1).mean()),
            "env_entropy": float(-(nz * np.log(nz)).sum()),
            "env_max_share": float(shares.max()),
            "quota_violations": sel.quota_violations,
            "quota_binding_envs": int(
                (np.bincount(self.env_ids[tasks], minlength=len(self.envs)) >= (quota or 10**9)).sum()
            ),  # fmt: skip
            **{f"share/{name}": float(shares[e]) for e, name in enumerate(self.envs)},
            "reselect_gap_mean": float(np.mean([self.t - g for g in self.t_sel[tasks] if g >= 0]))
            if (self.t_sel[tasks] >= 0).any()
            else 0.0,
        }
        self.last["first_prior"] = {str(int(i)): float(sc["mu0"][i]) for i in tasks if self.n_sel[i] == 0}
        self.n_sel[tasks] += 1
        self.t_sel[tasks] = self.t
        self.t += 1
        self.pending.append([int(i) for i in tasks])
        self.pending_info.append(self.last)  # the draw's statistics, logged when its rewards arrive
        return self.pending[-1]

    def update(
        self, task_indices: Sequence[int], rewards: Sequence[float], valid: Sequence[bool] | None = None
    ) -> dict:
        """Eq. 3 with one generation batch's rollouts (all processes'): every valid rollout adds weight 1 and its r′
        to its task (D13); invalid ones are counted and change nothing (D14). Consumes the oldest pending draw."""
        s = self.settings
        r = scale_reward(np.nan_to_num(np.asarray(rewards, dtype=np.float64), nan=s.reward_lo), s.reward_lo,
                         s.reward_hi)  # fmt: skip
        ok = np.ones(len(r), dtype=bool) if valid is None else np.asarray(valid, dtype=bool)
        idx = np.asarray(task_indices, dtype=np.int64)
        lag = len(self.pending) - 1
        info = dict(self.pending_info.pop(0)) if self.pending_info else {}
        if self.pending:
            self.pending.pop(0)
        first_prior = {int(k): v for k, v in info.pop("first_prior", {}).items()}
        self._decay_to(self.t)
        np.add.at(self.W, idx[ok], 1.0)
        np.add.at(self.S1, idx[ok], r[ok])
        np.add.at(self.S2, idx[ok], r[ok] ** 2)
        self.invalid += int((~ok).sum())
        groups: dict[int, list[float]] = {}
        for i, x in zip(idx[ok], r[ok], strict=True):
            groups.setdefault(int(i), []).append(float(x))
        zero_var = [len(set(v)) <= 1 for v in groups.values()]
        firsts = [abs(first_prior[i] - float(np.mean(v))) for i, v in groups.items() if i in first_prior]
        return {
            **info,
            "reward_selected_mean": float(r[ok].mean()) if ok.any() else math.nan,
            "zero_variance_group_frac": float(np.mean(zero_var)) if zero_var else math.nan,
            "unique_tasks_seen": int((self.n_sel > 0).sum()),
            "pool_coverage": float((self.n_sel > 0).mean()),
            "invalid_rollouts": int((~ok).sum()),
            "stats_lag_batches": lag,
            "prior_abs_error": float(np.mean(firsts)) if firsts else math.nan,
        }

    # -- checkpoints --------------------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Everything a resumed run needs to draw what the uninterrupted one would (§3.1); JSON-ready."""
        return {
            "identity": self.identity, "t": self.t, "W": self.W.tolist(), "S1": self.S1.tolist(),
            "S2": self.S2.tolist(), "t_last": self.t_last.tolist(), "n_sel": self.n_sel.tolist(),
            "t_sel": self.t_sel.tolist(), "pending": copy.deepcopy(self.pending), "invalid": self.invalid,
            "rng": copy.deepcopy(self.rng.bit_generator.state), "pending_info": copy.deepcopy(self.pending_info),
        }  # fmt: skip

    def load_state_dict(self, state: dict, check_identity: bool = True) -> None:
        if check_identity and state["identity"] != self.identity:
            raise ValueError("the EnvSched state in this checkpoint belongs to another pool, graph or settings; "
                             "resume with the same tasks and sched_* fields")  # fmt: skip
        self.t = int(state["t"])
        for name in ("W", "S1", "S2"):
            setattr(self, name, np.array(state[name], dtype=np.float64))
        for name in ("t_last", "n_sel", "t_sel"):
            setattr(self, name, np.array(state[name], dtype=np.int64))
        self.pending = [list(p) for p in state["pending"]]
        self.invalid = int(state["invalid"])
        self.rng.bit_generator.state = state["rng"]
        self.pending_info = [dict(x) for x in state.get("pending_info", [])]
        self._replay = [list(p) for p in self.pending]  # served first by the next sampler pass, once (D17)

    def take_replay(self) -> list[list[int]]:
        """The draws a resumed run must serve before drawing anew (those pending at the save); empty afterwards."""
        replay, self._replay = self._replay, []
        return replay


class SchedulerSampler(Sampler):
    """TRL's `RepeatSampler` layout with the scheduler choosing each block: per generation batch, the B tasks of a
    draw, each repeated G times, the block repeated `repeat` times (TRL: num_iterations × steps_per_generation). A
    block is drawn lazily when its first index is requested; draws still pending (drawn, rewards not yet in) are
    served first after a resume (D17). Its length is nominal: the run's length comes from `max_steps` (D18)."""

    def __init__(self, scheduler: EnvScheduler, num_generations: int, repeat: int, blocks: int):
        self.scheduler, self.G, self.repeat, self.blocks = scheduler, num_generations, repeat, blocks

    def __len__(self) -> int:
        return self.blocks * self.scheduler.B * self.G * self.repeat

    def __iter__(self):
        replay = self.scheduler.take_replay()  # a resumed run serves what was drawn before the save
        for b in range(self.blocks):
            tasks = replay[b] if b < len(replay) else self.scheduler.draw()
            for _ in range(self.repeat):
                for i in tasks:
                    for _ in range(self.G):
                        yield i


class TaskScheduling:
    """EnvSched inside a trainer (`scheduler: envsched`), called by the base trainer at named points, as it calls
    `RoutingReplay`: `attach` (before TRL's init: the scheduler over the training tasks), `sampler` (TRL's sampler
    seam), `update` (after each training batch is scored) and `state_dict` / `load_state_dict` (the checkpoint's
    `agent_state.json`). Inactive (every call a no-op) until `attach`."""

    def __init__(self) -> None:
        self.scheduler: EnvScheduler | None = None

    @property
    def active(self) -> bool:
        return self.scheduler is not None

    def attach(self, trainer, args, train_dataset):
        """The scheduler over the training tasks (docs/methods/envsched.md): every task's environment (its task's `env`
        field, else the environment's name) and descriptor, its text. Returns the dataset with a `sched_index` column
        that maps rows back to the pool."""
        from envs.base import row_task

        if trainer.env_factory is None or train_dataset is None or not hasattr(train_dataset, "add_column"):
            raise ValueError("scheduler 'envsched' needs env_factory and a map-style train_dataset of tasks")
        rows = list(train_dataset)
        tasks = [row_task(row) for row in rows]
        names, descriptors = [], {}
        for row, task in zip(rows, tasks, strict=True):
            env = trainer.env_factory(row)
            name = str(task.get("env") or getattr(env, "name", "env"))
            if name not in descriptors:
                descriptors[name] = env.descriptor(task)
            names.append(name)
        lo, hi = args.sched_reward_range
        settings = SchedSettings(
            reward_lo=lo, reward_hi=hi, half_life=args.sched_half_life, c_u=args.sched_uncertainty_bonus,
            k_nn=args.sched_neighbours, rho_max=args.sched_env_share, lambda_sim=args.sched_similarity_penalty,
            explore=args.sched_explore, embeddings=args.sched_embeddings,
        )  # fmt: skip
        B = args.generation_batch_size // args.num_generations
        ids = [row.get("task_id", i) for i, row in enumerate(rows)]
        texts = [task_text(t) for t in tasks]
        self.scheduler = EnvScheduler(names, descriptors, texts, B, settings, seed=args.seed, task_ids=ids)
        return train_dataset.add_column("sched_index", list(range(len(rows))))

    def sampler(self, trainer) -> SchedulerSampler | None:
        """TRL's training sampler: the scheduler's choice of each generation batch's tasks (None when inactive)."""
        if self.scheduler is None:
            return None
        repeat = trainer.num_iterations * trainer.args.steps_per_generation
        micro_steps = trainer.args.max_steps * trainer.args.gradient_accumulation_steps
        blocks = -(-micro_steps // repeat) + 2  # the dataloader fetches one batch ahead
        return SchedulerSampler(self.scheduler, trainer.num_generations, repeat, blocks)

    def update(self, trainer, inputs: list[dict], batch) -> None:
        """envsched.md Eq. 3 with the whole generation batch (gathered, so every process holds the same state,
        envsched.md D16); unscorable rollouts and environment errors are invalid (envsched.md D14). Logs `sched/*`."""
        if self.scheduler is None:
            return
        from accelerate.utils import gather, gather_object

        index = gather_object([int(row["sched_index"]) for row in inputs])
        valid = gather_object([int(row.get("env_errors", 0)) == 0 for row in inputs])
        rewards = gather(batch.rewards.float()).tolist()
        valid = [v and r == r for v, r in zip(valid, rewards, strict=True)]  # NaN: no reward function answered
        for name, value in self.scheduler.update(index, rewards, valid).items():
            trainer.log_metric(f"sched/{name}", value)

    def state_dict(self) -> dict:
        return self.scheduler.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.scheduler.load_state_dict(state)
