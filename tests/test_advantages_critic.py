"""Layer 1: the critic-based estimators in `trainers/advantages.py` (token GAE for PPO/T1) and `trainers/mpo.py` (MPO's
two-scale GAE) and the critic diagnostics (explained variance, value-variance shares, whitening). Hand-computed
examples with the arithmetic in comments, then seeded property tests against plain-Python references on the compressed
model-token sequence (`docs/methods/t1.md` §7 items 6-12, 22-24; `docs/methods/mpo.md` §7 items 1-11, 20-22)."""

from __future__ import annotations

import math
import random

import pytest
import torch

from trainers.advantages import (
    bootstrap_values,
    explained_variance,
    explained_variance_from_sums,
    explained_variance_sums,
    masked_sums,
    place_outcome_reward,
    place_turn_rewards,
    token_gae,
    turn_lengths,
    whiten,
)
from trainers.mpo import (
    intra_turn_gae,
    mean_preserving_projection,
    mpo_advantages,
    turn_gae,
    turn_start_values,
    value_variance_shares,
    value_variance_sums,
)

NAN = math.nan
F64 = torch.float64


def t(x, dtype=F64):
    return torch.tensor(x, dtype=dtype)


def close(actual, expected, atol=1e-12, rtol=1e-12):
    torch.testing.assert_close(actual, torch.as_tensor(expected, dtype=actual.dtype), atol=atol, rtol=rtol)


# ---------------------------------------------------------------------------------------------------------------------
# Random rollouts with environment gaps and padding, plus plain-Python references


def random_batch(seed: int, B: int = 5, max_turns: int = 4, max_len: int = 5, empty_row: bool = True):
    """Rows of turns (random lengths) separated by environment gaps (sometimes none), then padding. Returns values,
    mask, turn_index, turn_rewards (NaN past a row's turns), truncated, boot_value."""
    rng = random.Random(seed)
    rows = []
    for b in range(B):
        k_b = 0 if (empty_row and b == B - 1) else rng.randint(1, max_turns)
        mask, tidx = [], []
        for _ in range(rng.randint(0, 2)):  # environment prefix
            mask.append(0)
            tidx.append(-1)
        for k in range(k_b):
            n = rng.randint(1, max_len)
            mask += [1] * n
            tidx += [k] * n
            for _ in range(rng.choice([0, 1, 1, 2, 3])):  # gap; 0 makes two turns adjacent
                mask.append(0)
                tidx.append(-1)
        rows.append((mask, tidx, k_b))
    T = max(len(m) for m, _, _ in rows) + 2
    K = max(max_turns, 1)
    g = torch.Generator().manual_seed(seed)
    values = torch.randn(B, T, generator=g, dtype=F64)
    mask = torch.zeros(B, T, dtype=torch.long)
    turn_index = torch.full((B, T), -1, dtype=torch.long)
    turn_rewards = torch.full((B, K), NAN, dtype=F64)
    for b, (m, ti, k_b) in enumerate(rows):
        mask[b, : len(m)] = torch.tensor(m)
        turn_index[b, : len(ti)] = torch.tensor(ti)
        turn_rewards[b, :k_b] = torch.randn(k_b, generator=g, dtype=F64)
    truncated = torch.rand(B, generator=g) < 0.5
    boot = torch.randn(B, generator=g, dtype=F64)
    return values, mask, turn_index, turn_rewards, truncated, boot


def ref_token_gae(r: list, v: list, end: float, gamma: float, lam: float) -> tuple[list, list]:
    """Plain GAE on a compressed sequence of model tokens (t1.md Eq. 6-8)."""
    M = len(v)
    adv = [0.0] * M
    nxt = 0.0
    for j in reversed(range(M)):
        v_next = v[j + 1] if j + 1 < M else end
        delta = r[j] + gamma * v_next - v[j]
        nxt = delta + gamma * lam * nxt
        adv[j] = nxt
    return adv, [a + x for a, x in zip(adv, v, strict=True)]


def ref_mpo_row(turns: list, rewards: list, end: float, gamma: float, lam: float, lam_i: float, beta: float):
    """mpo.md Eq. 3-10, 17 on one row given as a list of turns (lists of token values), closed forms for the sums."""
    K = len(turns)
    V = [tv[0] for tv in turns] + [end]  # Eq. 3
    delta = [rewards[k] + gamma * V[k + 1] - V[k] for k in range(K)]  # Eq. 5
    A = [sum((gamma * lam) ** j * delta[k + j] for j in range(K - k)) for k in range(K)]  # Eq. 6, closed form
    G = [sum(gamma**j * rewards[k + j] for j in range(K - k)) + gamma ** (K - k) * end for k in range(K)]  # Eq. 17
    out, a_all = [], []
    for k, tv in enumerate(turns):
        n = len(tv)
        d = [tv[i + 1] - tv[i] for i in range(n - 1)] + [rewards[k] + gamma * V[k + 1] - tv[-1]]  # Eq. 7
        a = [sum(lam_i**j * d[i + j] for j in range(n - i)) for i in range(n)]  # Eq. 8, closed form
        a_bar = sum(a) / n  # Eq. 9
        out.append([A[k] + beta * (x - a_bar) for x in a])  # Eq. 10
        a_all.append(a)
    return A, out, a_all, G


def split_turns(values: torch.Tensor, mask: torch.Tensor, turn_index: torch.Tensor, b: int) -> list[list[float]]:
    turns: dict[int, list[float]] = {}
    for pos in range(values.shape[1]):
        if mask[b, pos] and turn_index[b, pos] >= 0:
            turns.setdefault(int(turn_index[b, pos]), []).append(float(values[b, pos]))
    return [turns[k] for k in sorted(turns)]


# ---------------------------------------------------------------------------------------------------------------------
# Reward placement and bootstrap values


def test_place_turn_rewards_last_model_token_of_each_turn():
    # turns: 0 -> positions 0,1; env 2; 1 -> positions 3,4; pad 5. Rewards 0.5 (turn 0), 2.0 (turn 1, outcome).
    turn_index = torch.tensor([[0, 0, -1, 1, 1, -1]])
    out = place_turn_rewards(t([[0.5, 2.0]]), turn_index, turn_index >= 0)
    close(out, [[0.0, 0.5, 0.0, 0.0, 2.0, 0.0]])


def test_place_turn_rewards_empty_turn_nan_and_all_env_row():
    # row 0: turn 1 has no token (C7), its 0.25 joins turn 0's last token (position 1): 1 + 0.25; turn 2 -> position 3.
    # row 1: NaN rewards (absent turns) are 0. row 2: only environment tokens, nothing lands (C6).
    turn_index = torch.tensor([[0, 0, -1, 2], [0, -1, -1, -1], [-1, -1, -1, -1]])
    rewards = t([[1.0, 0.25, 3.0], [NAN, NAN, NAN], [5.0, NAN, NAN]])
    out = place_turn_rewards(rewards, turn_index, turn_index >= 0)
    close(out, [[0.0, 1.25, 0.0, 3.0], [0.0] * 4, [0.0] * 4])
    # a reward with no earlier model token (turn 0 empty) is dropped; float32 in -> float32 out
    out32 = place_turn_rewards(torch.tensor([[7.0, 1.0]]), torch.tensor([[-1, 1, 1]]), torch.tensor([[0, 1, 1]]))
    assert out32.dtype == torch.float32
    close(out32, [[0.0, 0.0, 1.0]])


def test_place_outcome_reward_last_model_token_of_the_row():
    # t1.md Eq. 5: row 0 -> last model token is position 3; row 1 has none; row 2's NaN (unscorable) -> 0.
    mask = torch.tensor([[1, 1, 0, 1, 0], [0, 0, 0, 0, 0], [1, 0, 0, 0, 0]])
    close(place_outcome_reward(t([1.5, 1.0, NAN]), mask), [[0, 0, 0, 1.5, 0], [0] * 5, [0] * 5])


def test_bootstrap_values_successor_of_last_valid_token():
    values = t([[1.0, 2.0, 3.0, 4.0], [5.0, 6.0, 7.0, 8.0], [9.0, 9.0, 9.0, 9.0]])
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0]])
    # row 0: last valid = 1 -> values[2] = 3 (state after it); row 1: last valid is the last column -> values[3] = 8;
    # row 2: no valid token -> 0
    close(bootstrap_values(values, mask), [3.0, 8.0, 0.0])


# ---------------------------------------------------------------------------------------------------------------------
# Token-level GAE (PPO, T1)


def test_token_gae_hand_computed_skips_environment_tokens():
    # positions: m m e m pad; compressed model tokens v = [1, 2, 3], r = [0, 0, 1], gamma 0.9, lam 0.5 (gamma*lam 0.45)
    values = t([[1.0, 2.0, 50.0, 3.0, 10.0]])
    mask = torch.tensor([[1, 1, 0, 1, 0]])
    rewards = t([[0.0, 0.0, 0.0, 1.0, 0.0]])
    # terminated, V_4 = 0: delta = [0.9*2 - 1, 0.9*3 - 2, 1 - 3] = [0.8, 0.7, -2]
    # A3 = -2; A2 = 0.7 + 0.45*(-2) = -0.2; A1 = 0.8 + 0.45*(-0.2) = 0.71; R = A + V = [1.71, 1.8, 1.0]
    adv, ret = token_gae(rewards, values, mask, torch.tensor([False]), gamma=0.9, lam=0.5)
    close(adv, [[0.71, -0.2, 0.0, -2.0, 0.0]])
    close(ret, [[1.71, 1.8, 0.0, 1.0, 0.0]])
    # truncated, boot 10 (the default reads values[4] = 10, the slot after the last model token):
    # delta3 = 1 + 0.9*10 - 3 = 7; A2 = 0.7 + 0.45*7 = 3.85; A1 = 0.8 + 0.45*3.85 = 2.5325
    adv_tr, _ = token_gae(rewards, values, mask, torch.tensor([True]), gamma=0.9, lam=0.5)
    close(adv_tr, [[2.5325, 3.85, 0.0, 7.0, 0.0]])
    adv_b, _ = token_gae(rewards, values, mask, torch.tensor([True]), 0.9, 0.5, boot_value=t([10.0]))
    close(adv_b, adv_tr)


def test_token_gae_t1_setting_gives_reward_minus_value():
    # t1.md Eq. 9 / §7 item 6: gamma = lam = 1 -> A_j = r - V_j, R_j = r; rewards above 1 pass through (item 2)
    values, mask, turn_index, _, _, _ = random_batch(1)
    r = t([2.5, 0.0, 1.0, 0.3, 0.7])
    rewards_tok = place_outcome_reward(r, mask)
    adv, ret = token_gae(rewards_tok, values, mask, torch.zeros(5, dtype=torch.bool), 1.0, 1.0)
    m = mask.bool()
    expected_adv = torch.where(m, r.unsqueeze(1) - values, 0.0)
    close(adv, expected_adv, atol=1e-12)
    close(ret, torch.where(m, r.unsqueeze(1).expand_as(values), 0.0), atol=1e-12)
    # item 11: an all-zero-reward batch gives finite advantages -V
    adv0, _ = token_gae(torch.zeros_like(values), values, mask, torch.zeros(5, dtype=torch.bool), 1.0, 1.0)
    close(adv0, torch.where(m, -values, 0.0))


@pytest.mark.parametrize("seed", range(6))
def test_token_gae_equals_plain_gae_on_compressed_sequence(seed):
    # t1.md §7 item 8: masked estimator == plain GAE on the extracted model-token subsequence
    values, mask, turn_index, turn_rewards, truncated, boot = random_batch(seed)
    gamma, lam = 0.3 + 0.7 * random.Random(seed).random(), random.Random(seed + 1).random()
    rewards_tok = place_turn_rewards(turn_rewards, turn_index, mask)
    adv, ret = token_gae(rewards_tok, values, mask, truncated, gamma, lam, boot_value=boot)
    for b in range(values.shape[0]):
        pos = [p for p in range(values.shape[1]) if mask[b, p]]
        end = float(boot[b]) if truncated[b] else 0.0
        ref_a, ref_r = ref_token_gae(
            [float(rewards_tok[b, p]) for p in pos], [float(values[b, p]) for p in pos], end, gamma, lam
        )
        close(adv[b, pos], ref_a)
        close(ret[b, pos], ref_r)
        off = [p for p in range(values.shape[1]) if not mask[b, p]]
        assert (adv[b, off] == 0).all() and (ret[b, off] == 0).all()


def test_token_gae_environment_token_invariance_and_termination():
    # t1.md §7 items 7, 10, 12: inserting env tokens changes nothing; terminated rows never read boot_value (NaN here);
    # rows with no model token are zeros without NaN
    values = t([[1.0, 2.0, 3.0, 0.0], [4.0, 4.0, 4.0, 4.0]])
    mask = torch.tensor([[1, 1, 1, 0], [0, 0, 0, 0]])
    rewards = t([[0.0, 0.5, 1.0, 0.0], [0.0] * 4])
    term = torch.tensor([False, False])
    adv, ret = token_gae(rewards, values, mask, term, 0.8, 0.9, boot_value=t([NAN, NAN]))
    assert torch.isfinite(adv).all() and torch.isfinite(ret).all()
    assert (adv[1] == 0).all() and (ret[1] == 0).all()
    gapped_v = t([[1.0, 9.0, 9.0, 2.0, 9.0, 3.0, 0.0]])
    gapped_m = torch.tensor([[1, 0, 0, 1, 0, 1, 0]])
    gapped_r = t([[0.0, 7.0, 7.0, 0.5, 0.0, 1.0, 0.0]])  # rewards on env tokens are ignored
    adv_g, ret_g = token_gae(gapped_r, gapped_v, gapped_m, torch.tensor([False]), 0.8, 0.9)
    close(adv_g[0, [0, 3, 5]], adv[0, :3])
    close(ret_g[0, [0, 3, 5]], ret[0, :3])


def test_token_gae_keeps_dtype():
    values = torch.tensor([[0.5, 0.25]], dtype=torch.float32)
    adv, ret = token_gae(torch.tensor([[0.0, 1.0]]), values, torch.tensor([[1, 1]]), torch.tensor([False]), 1.0, 1.0)
    assert adv.dtype == ret.dtype == torch.float32
    close(adv, [[0.5, 0.75]])


# ---------------------------------------------------------------------------------------------------------------------
# MPO: hand-computed example


def hand_mpo_batch():
    # turn 0 -> positions 0,1; env 2; turn 1 -> positions 3,4,5; pad 6
    values = t([[0.5, 0.6, 9.0, 0.2, 0.4, 0.8, 9.0]])
    turn_index = torch.tensor([[0, 0, -1, 1, 1, 1, -1]])
    return values, turn_index >= 0, turn_index, t([[0.1, 1.0]]), torch.tensor([False])


def test_mpo_hand_computed():
    values, mask, turn_index, turn_rewards, truncated = hand_mpo_batch()
    out = mpo_advantages(values, mask, turn_index, turn_rewards, truncated, turn_lambda=0.8, intra_turn_lambda=0.5)
    # Eq. 3: V_1 = 0.5, V_2 = 0.2, V_3 = 0 (terminated)
    # Eq. 5: delta_1 = 0.1 + 0.2 - 0.5 = -0.2 ; delta_2 = 1.0 + 0 - 0.2 = 0.8
    # Eq. 6: A_2 = 0.8 ; A_1 = -0.2 + 0.8 * 0.8 = 0.44
    close(out.turn_advantages, [[0.44, 0.8]])
    # Eq. 7-8, turn 0: delta = [0.6 - 0.5, 0.1 + 0.2 - 0.6] = [0.1, -0.3] -> a = [0.1 + 0.5 (-0.3), -0.3]
    #   = [-0.05, -0.3]
    # turn 1: delta = [0.4 - 0.2, 0.8 - 0.4, 1.0 + 0 - 0.8] = [0.2, 0.4, 0.2] -> a3 = 0.2, a2 = 0.4 + 0.1 = 0.5,
    # a1 = 0.2 + 0.25 = 0.45
    close(out.token_advantages, [[-0.05, -0.3, 0.0, 0.45, 0.5, 0.2, 0.0]])
    # Eq. 9-10: turn 0 mean a = -0.175 -> [0.44 + 0.125, 0.44 - 0.125]; turn 1 mean a = 1.15/3
    m1 = 1.15 / 3
    close(out.advantages, [[0.565, 0.315, 0.0, 0.8 + 0.45 - m1, 0.8 + 0.5 - m1, 0.8 + 0.2 - m1, 0.0]])
    # Eq. 17 mc: G_2 = 1.0, G_1 = 0.1 + 1.0 = 1.1
    close(out.returns, [[1.1, 1.1, 0.0, 1.0, 1.0, 1.0, 0.0]])
    close(out.turn_lengths, torch.tensor([[2, 3]]))
    # Eq. 17 lambda: a + V = [0.45, 0.3, -, 0.65, 0.9, 1.0]
    lam = mpo_advantages(
        values,
        mask,
        turn_index,
        turn_rewards,
        truncated,
        turn_lambda=0.8,
        intra_turn_lambda=0.5,
        value_target="lambda",
    )
    close(lam.returns, [[0.45, 0.3, 0.0, 0.65, 0.9, 1.0, 0.0]])
    close(lam.advantages, out.advantages)


def test_mpo_truncated_row_bootstraps():
    # mpo.md §7 item 10: truncated rows use boot_value in delta_K and G_{K+1}. boot = 0.5:
    # delta_2 = 1.0 + 0.5 - 0.2 = 1.3 = A_2; A_1 = -0.2 + 0.8 * 1.3 = 0.84; G_2 = 1.5, G_1 = 1.6
    values, mask, turn_index, turn_rewards, _ = hand_mpo_batch()
    out = mpo_advantages(values, mask, turn_index, turn_rewards, torch.tensor([True]), boot_value=t([0.5]))
    close(out.turn_advantages, [[0.84, 1.3]])
    close(out.returns, [[1.6, 1.6, 0.0, 1.5, 1.5, 1.5, 0.0]])
    # default boot value: the slot after the last model token (position 6 holds 9.0): A_2 = 1 + 9 - 0.2 = 9.8
    out_default = mpo_advantages(values, mask, turn_index, turn_rewards, torch.tensor([True]))
    close(out_default.turn_advantages[0, 1], 9.8)


def test_mpo_rejects_unknown_value_target():
    values, mask, turn_index, turn_rewards, truncated = hand_mpo_batch()
    with pytest.raises(ValueError, match="value_target"):
        mpo_advantages(values, mask, turn_index, turn_rewards, truncated, value_target="td")


# ---------------------------------------------------------------------------------------------------------------------
# MPO: properties (mpo.md §7)


@pytest.mark.parametrize("seed", range(8))
def test_mpo_matches_reference_on_compressed_turns(seed):
    # the whole estimator against the closed forms of Eq. 6 and Eq. 8 (so closed form == recursion, item 1)
    rng = random.Random(seed)
    gamma, lam, lam_i, beta = rng.uniform(0.5, 1.0), rng.random(), rng.random(), rng.uniform(0.0, 2.0)
    values, mask, turn_index, turn_rewards, truncated, boot = random_batch(seed)
    out = mpo_advantages(values, mask, turn_index, turn_rewards, truncated, boot, gamma, lam, lam_i, beta)
    for b in range(values.shape[0]):
        turns = split_turns(values, mask, turn_index, b)
        if not turns:
            assert (out.advantages[b] == 0).all() and (out.returns[b] == 0).all()
            continue
        end = float(boot[b]) if truncated[b] else 0.0
        A, adv, a, G = ref_mpo_row(turns, turn_rewards[b, : len(turns)].tolist(), end, gamma, lam, lam_i, beta)
        close(out.turn_advantages[b, : len(turns)], A, atol=1e-10)
        pos = mask[b].bool()
        close(out.advantages[b, pos], [x for row in adv for x in row], atol=1e-10)
        close(out.token_advantages[b, pos], [x for row in a for x in row], atol=1e-10)
        close(out.returns[b, pos], [G[k] for k, row in enumerate(turns) for _ in row], atol=1e-10)
        assert (out.advantages[b, ~pos] == 0).all() and (out.returns[b, ~pos] == 0).all()


@pytest.mark.parametrize("seed", range(5))
def test_turn_gae_limits(seed):
    # item 1: lam = gamma = 1 -> A_k = sum_{k' >= k} r_k' + V_{K+1} - V_k ; lam = 0 -> A_k = delta_k
    g = torch.Generator().manual_seed(seed)
    r, v, end = torch.randn(3, 5, generator=g, dtype=F64), torch.randn(3, 5, generator=g, dtype=F64), torch.randn(3)
    end = end.to(F64)
    one = turn_gae(r, v, end, gamma=1.0, lam=1.0)
    close(one.advantages, r.flip(1).cumsum(1).flip(1) + end.unsqueeze(1) - v, atol=1e-12)
    v_next = torch.cat([v[:, 1:], end.unsqueeze(1)], dim=1)
    zero = turn_gae(r, v, end, gamma=0.7, lam=0.0)
    close(zero.advantages, r + 0.7 * v_next - v, atol=1e-12)
    close(zero.next_values, v_next)


def test_turn_gae_empty_turn_counts_for_discounting():
    # C7: turns 0 and 2 have tokens, turn 1 was cut (no token, value NaN) but carries a reward 0.4. gamma 0.5, lam 1.
    # turn 2: A_2 = 1 - v2 ; turn 1: V_1 := 0.4 + 0.5 v2, delta 0, A_1 = 0.5 A_2 ;
    # turn 0: A_0 = 0.5 (0.4 + 0.5 v2) - v0 + 0.5 A_1 = 0.45 - v0 = G_0 - V_0 with G_0 = 0.5 * (0.4 + 0.5 * 1) = 0.45
    v0, v2 = 0.3, 0.6
    out = turn_gae(t([[0.0, 0.4, 1.0]]), t([[v0, NAN, v2]]), t([0.0]), gamma=0.5, lam=1.0)
    close(out.advantages, [[0.45 - v0, 0.5 * (1 - v2), 1 - v2]], atol=1e-12)
    close(out.returns, [[0.45, 0.9, 1.0]], atol=1e-12)


def test_turn_gae_padding_columns_are_not_steps():
    # NaN-padded columns (or 0-padded with turn_valid) after the last turn do not discount the bootstrap value:
    # one turn, r = 0, V_1 = 0, boot 1, gamma 0.5 -> A_1 = 0.5 * 1 - 0 = 0.5 however many padding columns follow
    base = turn_gae(t([[0.0]]), t([[0.0]]), t([1.0]), 0.5, 0.8)
    nan_pad = turn_gae(t([[0.0, NAN, NAN]]), t([[0.0, NAN, NAN]]), t([1.0]), 0.5, 0.8)
    zero_pad = turn_gae(
        t([[0.0, 0.0, 0.0]]), t([[0.0, NAN, NAN]]), t([1.0]), 0.5, 0.8, turn_valid=torch.tensor([[True, False, False]])
    )
    close(base.advantages, [[0.5]])
    close(nan_pad.advantages, [[0.5, 0.0, 0.0]])
    close(zero_pad.advantages, [[0.5, 0.0, 0.0]])


def test_mpo_zero_padded_turn_rewards_with_turn_valid_match_nan_padding():
    # the trainer's RolloutBatch pads turn_rewards with 0 and gives turn_valid; same result as NaN padding
    values, mask, turn_index, turn_rewards, truncated, boot = random_batch(3)
    valid = torch.isfinite(turn_rewards)
    a = mpo_advantages(values, mask, turn_index, turn_rewards, truncated, boot, gamma=0.9)
    b = mpo_advantages(
        values, mask, turn_index, turn_rewards.nan_to_num(0.0), truncated, boot, gamma=0.9, turn_valid=valid
    )
    close(a.advantages, b.advantages)
    close(a.returns, b.returns)


@pytest.mark.parametrize("seed", range(6))
def test_mpo_mean_preservation(seed):
    # items 2, 9 (Eq. 11): the turn mean of A~ equals A_k for any beta, lambda_intra in [0, 1] and values
    rng = random.Random(seed)
    values, mask, turn_index, turn_rewards, truncated, boot = random_batch(seed)
    beta, lam_i = rng.uniform(0, 3), rng.random()
    out = mpo_advantages(values, mask, turn_index, turn_rewards, truncated, boot, 0.9, 0.8, lam_i, beta)
    for b in range(values.shape[0]):
        for k in range(turn_rewards.shape[1]):
            sel = (turn_index[b] == k) & mask[b].bool()
            if sel.any():
                close(out.advantages[b, sel].mean(), out.turn_advantages[b, k], atol=1e-12)


def test_mpo_beta_zero_and_single_token_turns_reduce_to_turn_level():
    # item 3: beta = 0 -> every token of turn k gets A_k; item 5: single-token turns -> A~ = A_k for any beta
    values, mask, turn_index, turn_rewards, truncated, boot = random_batch(4)
    out = mpo_advantages(values, mask, turn_index, turn_rewards, truncated, boot, beta=0.0)
    broadcast = out.turn_advantages.gather(1, turn_index.clamp(min=0)) * mask
    close(out.advantages, broadcast)
    single_index = torch.tensor([[0, -1, 1, 2, -1]])
    single = mpo_advantages(
        t([[0.1, 5.0, 0.4, -0.2, 3.0]]),
        single_index >= 0,
        single_index,
        t([[0.0, 0.3, 1.0]]),
        torch.tensor([False]),
        beta=2.0,
    )
    close(single.advantages, single.turn_advantages.gather(1, single_index.clamp(min=0)) * (single_index >= 0))


def test_mpo_closed_form_eq12():
    # item 4: lambda_intra = gamma = 1 -> a_{k,i} = r_k + V_{k+1} - V_{k,i}, A~_{k,i} = A_k + beta (V_bar_k - V_{k,i})
    values, mask, turn_index, turn_rewards, truncated, boot = random_batch(7)
    beta = 0.7
    out = mpo_advantages(values, mask, turn_index, turn_rewards, truncated, boot, 1.0, 0.8, 1.0, beta)
    K = turn_rewards.shape[1]
    tg = turn_gae(
        turn_rewards, turn_start_values(values, mask, turn_index, K), torch.where(truncated, boot, 0.0), 1.0, 0.8
    )
    for b in range(values.shape[0]):
        for k in range(K):
            sel = (turn_index[b] == k) & mask[b].bool()
            if not sel.any():
                continue
            v = values[b, sel]
            close(out.token_advantages[b, sel], turn_rewards[b, k] + tg.next_values[b, k] - v, atol=1e-12)
            close(out.advantages[b, sel], tg.advantages[b, k] + beta * (v.mean() - v), atol=1e-12)


def test_mpo_single_turn_rows():
    # item 6: A_1 = r_1 + gamma V_2 - V_1 (V_2 = 0 terminated, boot when truncated)
    turn_index = torch.tensor([[-1, 0, 0, 0, -1], [0, 0, -1, -1, -1]])
    values = t([[9.0, 0.2, 0.5, 0.1, 4.0], [0.3, 0.6, 2.0, 0.0, 0.0]])
    out = mpo_advantages(
        values,
        turn_index >= 0,
        turn_index,
        t([[1.0], [0.5]]),
        torch.tensor([False, True]),
        boot_value=t([7.0, 2.0]),
        gamma=0.9,
    )
    # row 0: 1.0 + 0 - 0.2 = 0.8; row 1: 0.5 + 0.9 * 2.0 - 0.3 = 2.0
    close(out.turn_advantages, [[0.8], [2.0]])


def test_intra_turn_recursion_stays_inside_turns():
    # item 7: a_{k,.} depends only on turn k's values, r_k and V_{k+1} (the first token of turn k+1)
    values, mask, turn_index, turn_rewards, truncated, boot = random_batch(11, B=4, empty_row=False, max_turns=4)
    base = mpo_advantages(values, mask, turn_index, turn_rewards, truncated, boot)  # gamma 1, lambda_intra 0.95
    bootstrapped_turns = 0
    for b in range(values.shape[0]):
        n_turns = int(turn_index[b].max()) + 1
        for k in range(n_turns):
            sel = (turn_index[b] == k) & mask[b].bool()
            keep = sel.clone()
            if k + 1 < n_turns:
                first_next = int(((turn_index[b] == k + 1) & mask[b].bool()).nonzero()[0])
                keep[first_next] = True
                # ... and it does depend on V_{k+1}: +3 there adds 3 to delta_{k,n_k} (Eq. 7), so by Eq. 8 token i of
                # the turn's n_k tokens moves by 3 * 0.95^(n_k - 1 - i)
                bumped = values.clone()
                bumped[b, first_next] += 3.0
                moved = mpo_advantages(bumped, mask, turn_index, turn_rewards, truncated, boot).token_advantages
                n_k = int(sel.sum())
                close(moved[b, sel] - base.token_advantages[b, sel], [3.0 * 0.95 ** (n_k - 1 - i) for i in range(n_k)])
                bootstrapped_turns += 1
            perturbed = values.clone()
            perturbed[b, ~keep] += 3.0  # every other value of the row (and env/pad slots)
            out = mpo_advantages(perturbed, mask, turn_index, turn_rewards, truncated, boot)
            close(out.token_advantages[b, sel], base.token_advantages[b, sel], atol=1e-12)
    assert bootstrapped_turns > 0  # the batch has turns followed by another turn (the case the test is about)


def test_mpo_environment_token_invariance():
    # item 8: inserting env tokens between turns leaves A~ and R on model tokens unchanged; env tokens get 0
    ti_a = torch.tensor([[0, 0, 1, 1, 1, 2]])
    ti_b = torch.tensor([[-1, 0, 0, -1, -1, -1, 1, 1, 1, -1, 2, -1]])
    v_a = t([[0.1, 0.4, -0.3, 0.2, 0.9, 0.5]])
    v_b = t([[7.0, 0.1, 0.4, 7.0, 7.0, 7.0, -0.3, 0.2, 0.9, 7.0, 0.5, 7.0]])
    rew, term = t([[0.2, -0.1, 1.0]]), torch.tensor([False])
    a = mpo_advantages(v_a, ti_a >= 0, ti_a, rew, term)
    b = mpo_advantages(v_b, ti_b >= 0, ti_b, rew, term)
    close(b.advantages[ti_b >= 0], a.advantages[0])
    close(b.returns[ti_b >= 0], a.returns[0])
    assert (b.advantages[ti_b < 0] == 0).all() and (b.returns[ti_b < 0] == 0).all()


def test_mpo_all_masked_rows_and_batches():
    # item 9 / C6: no NaN or inf anywhere, zero advantage; a batch where every row is masked is all zeros too
    values, mask, turn_index, turn_rewards, truncated, boot = random_batch(5)
    out = mpo_advantages(values, mask, turn_index, turn_rewards, truncated, boot)
    for x in out[:4]:
        assert torch.isfinite(x).all()
    assert (out.advantages[-1] == 0).all() and (out.returns[-1] == 0).all()
    none = torch.zeros_like(mask)
    empty = mpo_advantages(values, none, torch.full_like(turn_index, -1), turn_rewards, truncated, boot)
    for x in empty[:4]:
        assert torch.isfinite(x).all() and (x == 0).all()


def test_mpo_terminated_rows_never_read_boot_value():
    # item 10: changing boot_value (even to NaN) changes nothing in terminated rows
    values, mask, turn_index, turn_rewards, _, boot = random_batch(6)
    terminated = torch.zeros(values.shape[0], dtype=torch.bool)
    a = mpo_advantages(values, mask, turn_index, turn_rewards, terminated, boot)
    b = mpo_advantages(values, mask, turn_index, turn_rewards, terminated, torch.full_like(boot, NAN))
    close(a.advantages, b.advantages)
    close(a.returns, b.returns)


def test_mpo_batch_independence():
    # item 11: a row's advantages do not depend on the other rows (and rows permute with the batch)
    values, mask, turn_index, turn_rewards, truncated, boot = random_batch(8)
    full = mpo_advantages(values, mask, turn_index, turn_rewards, truncated, boot)
    perm = torch.tensor([3, 0, 4, 1, 2])
    permuted = mpo_advantages(
        values[perm], mask[perm], turn_index[perm], turn_rewards[perm], truncated[perm], boot[perm]
    )
    close(permuted.advantages, full.advantages[perm])
    one = mpo_advantages(values[1:2], mask[1:2], turn_index[1:2], turn_rewards[1:2], truncated[1:2], boot[1:2])
    close(one.advantages[0], full.advantages[1])


def test_mpo_mc_targets_outcome_only():
    # item 20: gamma = 1, outcome-only reward, terminated -> R = outcome on every model token
    values, mask, turn_index, turn_rewards, _, boot = random_batch(9)
    outcome = t([1.0, 0.0, 0.5, 2.0, 0.3])
    rewards = torch.where(torch.isfinite(turn_rewards), 0.0, NAN)
    n_turns = torch.isfinite(turn_rewards).sum(1)
    for b in range(5):
        if n_turns[b]:
            rewards[b, n_turns[b] - 1] = outcome[b]
    out = mpo_advantages(values, mask, turn_index, rewards, torch.zeros(5, dtype=torch.bool), boot)
    close(out.returns, outcome.unsqueeze(1) * mask)


def test_mpo_keeps_dtype_and_no_graph():
    values, mask, turn_index, turn_rewards, truncated = hand_mpo_batch()
    v32 = values.float().requires_grad_()
    out = mpo_advantages(v32, mask, turn_index, turn_rewards.float(), truncated)
    assert out.advantages.dtype == out.returns.dtype == torch.float32
    assert not out.advantages.requires_grad and not out.returns.requires_grad
    close(
        out.advantages,
        mpo_advantages(values, mask, turn_index, turn_rewards, truncated).advantages.float(),
        atol=1e-6,
        rtol=1e-6,
    )


def test_mpo_building_blocks():
    values, mask, turn_index, turn_rewards, _ = hand_mpo_batch()
    starts = turn_start_values(values, mask, turn_index, 3)
    close(starts[:, :2], [[0.5, 0.2]])
    assert torch.isnan(starts[0, 2])
    close(turn_lengths(turn_index, mask, 3), torch.tensor([[2, 3, 0]]))
    a = intra_turn_gae(values, mask, turn_index, turn_rewards, t([[0.2, 0.0]]), 1.0, 0.5)
    close(a, [[-0.05, -0.3, 0.0, 0.45, 0.5, 0.2, 0.0]])
    # Eq. 10 with A = [1, -1], a as above, beta 2: turn 0 -> 1 + 2 * (+-0.125)
    proj = mean_preserving_projection(t([[1.0, -1.0]]), a, turn_index, mask, beta=2.0)
    close(proj[0, :2], [1.25, 0.75])


# ---------------------------------------------------------------------------------------------------------------------
# Value-variance decomposition (mpo.md Eq. 20-21)


def test_value_variance_share_hand_computed():
    # one row: turn 0 values [0, 2], turn 1 values [4]. mean 2; Tot = 4 + 0 + 4 = 8;
    # turn means 1, 4 -> Btw = 2 (1 - 2)^2 + 1 (4 - 2)^2 = 6 -> share 0.75 (pooled = same with one row)
    turn_index = torch.tensor([[0, 0, -1, 1]])
    values = t([[0.0, 2.0, 100.0, 4.0]])
    sums = value_variance_sums(values, turn_index >= 0, turn_index)
    close(sums, [3.0, 6.0, 20.0, 2.0**2 / 2 + 4.0**2, 6.0, 8.0])
    share, pooled = value_variance_shares(sums)
    assert share == pytest.approx(0.75) and pooled == pytest.approx(0.75)


def test_value_variance_share_edge_cases():
    # constant within every turn, not constant overall -> 1; constant everywhere -> None (undefined, not NaN);
    # single-turn rows -> within share 0 while the pooled share counts between-row differences
    ti = torch.tensor([[0, 0, 1, 1], [0, 0, 0, -1]])
    share, pooled = value_variance_shares(
        value_variance_sums(t([[1.0, 1.0, 3.0, 3.0], [2.0, 2.0, 2.0, 0.0]]), ti >= 0, ti)
    )
    assert share == pytest.approx(1.0) and pooled == pytest.approx(1.0)
    const = value_variance_shares(value_variance_sums(torch.full((2, 4), 0.3, dtype=F64), ti >= 0, ti))
    assert const == (None, None)
    single = torch.tensor([[0, 0, 0, -1], [0, 0, -1, -1]])
    share, pooled = value_variance_shares(
        value_variance_sums(t([[0.0, 1.0, 2.0, 0.0], [5.0, 6.0, 0.0, 0.0]]), single >= 0, single)
    )
    assert share == 0.0 and pooled is not None and pooled > 0.5
    empty = value_variance_shares(value_variance_sums(t([[1.0, 2.0]]), torch.zeros(1, 2), torch.full((1, 2), -1)))
    assert empty == (None, None)


@pytest.mark.parametrize("seed", range(5))
def test_value_variance_identities_and_sharding(seed):
    # item 21: Btw + Wth = Tot (Eq. 20 and Eq. 21), shares in [0, 1], pooled >= within; item 22: sharded = pooled
    values, mask, turn_index, _, _, _ = random_batch(seed, B=6)
    sums = value_variance_sums(values, mask, turn_index)
    n, s, q, between_pooled, btw, tot = sums.tolist()
    wth = wth_pooled = 0.0
    for b in range(values.shape[0]):
        for turn in split_turns(values, mask, turn_index, b):
            mean = sum(turn) / len(turn)
            wth += sum((x - mean) ** 2 for x in turn)
    wth_pooled = wth  # the groups are the same (b, k) turns
    assert btw + wth == pytest.approx(tot, rel=1e-10)
    assert (between_pooled - s * s / n) + wth_pooled == pytest.approx(q - s * s / n, rel=1e-10)
    share, pooled = value_variance_shares(sums)
    assert 0.0 <= share <= 1.0 and 0.0 <= pooled <= 1.0 and pooled >= share - 1e-12
    halves = value_variance_sums(values[:2], mask[:2], turn_index[:2]) + value_variance_sums(
        values[2:], mask[2:], turn_index[2:]
    )
    close(halves, sums, atol=1e-10, rtol=1e-12)


# ---------------------------------------------------------------------------------------------------------------------
# Explained variance (t1.md Eq. 14-15, mpo.md Eq. 19, C5)


def test_explained_variance_hand_computed_and_edge_cases():
    # R = [1, 2, 3], V = [1, 2, 2] -> e = [0, 0, 1]: Var e = 1/3 - 1/9 = 2/9, Var R = 14/3 - 4 = 2/3 -> EV = 2/3
    mask = torch.tensor([[1, 1, 1, 0]])
    assert explained_variance(t([[1.0, 2.0, 3.0, 50.0]]), t([[1.0, 2.0, 2.0, 0.0]]), mask) == pytest.approx(2 / 3)
    ret = t([[1.0, 2.0, 3.0, 0.0]])
    assert explained_variance(ret, ret, mask) == pytest.approx(1.0)  # perfect critic
    assert explained_variance(ret, torch.full_like(ret, 2.0), mask) == pytest.approx(0.0)  # constant at the mean
    assert explained_variance(ret, 4.0 - ret, mask) < 0  # anti-correlated
    assert math.isnan(explained_variance(torch.full_like(ret, 0.7), ret, mask))  # Var[R] = 0 -> NaN (C5)
    assert math.isnan(explained_variance(ret, ret, torch.zeros_like(mask)))  # no tokens


def test_explained_variance_sharded_equals_pooled_and_order_free():
    # t1.md §7 item 24: summed per-shard sums == pooled, independent of the number of shards and of row order
    g = torch.Generator().manual_seed(0)
    ret, val = torch.randn(6, 5, generator=g, dtype=F64), torch.randn(6, 5, generator=g, dtype=F64)
    mask = (torch.rand(6, 5, generator=g) < 0.7).long()
    pooled = explained_variance(ret, val, mask)
    shards = sum(explained_variance_sums(ret[i : i + 2], val[i : i + 2], mask[i : i + 2]) for i in range(0, 6, 2))
    assert explained_variance_from_sums(shards) == pytest.approx(pooled, rel=1e-12)
    perm = torch.randperm(6, generator=g)
    assert explained_variance(ret[perm], val[perm], mask[perm]) == pytest.approx(pooled, rel=1e-12)


# ---------------------------------------------------------------------------------------------------------------------
# Whitening


def test_whiten_hand_computed_and_masked():
    # masked entries [1, 3]: mean 2, population variance 1 -> [-1, 1]; the masked-out 100 becomes 0
    close(whiten(t([[1.0, 3.0, 100.0]]), torch.tensor([[1, 1, 0]]), eps=0.0), [[-1.0, 1.0, 0.0]])
    assert (whiten(t([[1.0, 3.0]]), torch.zeros(1, 2)) == 0).all()  # nothing masked in -> zeros
    assert (whiten(t([[2.0, 2.0]]), torch.ones(1, 2), eps=0.0) == 0).all()  # constant -> zeros, no NaN


def test_whiten_with_global_sums():
    # statistics from all-reduced sums: shard 2's rows whitened with the union's mean and variance
    x = t([[1.0, 2.0], [3.0, 6.0]])
    mask = torch.ones(2, 2)
    total = masked_sums(x[:1], mask[:1]) + masked_sums(x[1:], mask[1:])
    close(whiten(x[1:], mask[1:], sums=total), whiten(x, mask)[1:])
