"""Tests of MoE rollout routing replay (`trainers/routing_replay.py`; properties: docs/methods/routing-replay.md §7).

Tiny MoE models are built in-process (hidden 64, 2 layers, 8 experts, top-2; Qwen3-MoE with and without
`norm_topk_prob`, Mixtral, OLMoE), in fp32 and eval mode, with routers drawn from N(0, 0.5) because Qwen3-MoE and
OLMoE zero-initialise them (every token would tie) and Mixtral jitter 0. Prompts are random token ids: no tokenizer.
"""

import pytest
import torch
from torch import Tensor, nn
from transformers import (
    MixtralConfig,
    MixtralForCausalLM,
    OlmoeConfig,
    OlmoeForCausalLM,
    Qwen2MoeConfig,
    Qwen2MoeForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

from trainers.routing_replay import (
    NO_ROUTE,
    RouteRecorder,
    check_routing,
    find_routers,
    force_replay_settings,
    is_moe,
    prefix_recompute_mismatch,
    record_bytes_per_token,
    replay_routes,
    routes_to_training_layout,
    routing_flips,
    split_generate_routes,
    stitch_turn_routes,
)

V, PAD = 64, 0
COMMON = dict(
    vocab_size=V,
    hidden_size=64,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=128,
    pad_token_id=PAD,
    eos_token_id=None,  # no stop token unless a test passes one to generate
    bos_token_id=None,
)
FAMILIES = ["qwen3_moe", "qwen3_moe_norm", "mixtral", "olmoe"]


def tiny_moe(family: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    if family.startswith("qwen3_moe"):
        config = Qwen3MoeConfig(
            **COMMON,
            moe_intermediate_size=32,
            num_experts=8,
            num_experts_per_tok=2,
            norm_topk_prob=family.endswith("norm"),
        )
        model = Qwen3MoeForCausalLM(config)
    elif family == "mixtral":
        config = MixtralConfig(**{**COMMON, "intermediate_size": 32}, num_local_experts=8, num_experts_per_tok=2)
        config.router_jitter_noise = 0.0
        model = MixtralForCausalLM(config)
    else:
        model = OlmoeForCausalLM(
            OlmoeConfig(**{**COMMON, "intermediate_size": 32}, num_experts=8, num_experts_per_tok=2)
        )
    for router in find_routers(model).modules:
        nn.init.normal_(router.weight, 0.0, 0.5)  # non-zero router init (§7)
    return model.float().eval()


def perturb_routers(model: nn.Module, std: float = 0.3, seed: int = 1) -> None:
    """Stand-in for an optimizer step that moves only the routers (§7 item 1)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for router in find_routers(model).modules:
            router.weight.add_(torch.randn(router.weight.shape, generator=generator) * std)


def left_pad(rows: list[list[int]]) -> tuple[Tensor, Tensor]:
    width = max(map(len, rows))
    ids = torch.tensor([[PAD] * (width - len(r)) + r for r in rows])  # (B, P)
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])  # (B, P)
    return ids, mask


def right_pad(rows: list[list[float]], value: float = PAD) -> Tensor:
    width = max(map(len, rows))
    return torch.tensor([r + [value] * (width - len(r)) for r in rows])  # (B, T)


def random_prompts(lengths: list[int], seed: int = 0) -> tuple[Tensor, Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return left_pad([torch.randint(2, V, (n,), generator=generator).tolist() for n in lengths])


def sample(
    model: nn.Module,
    prompt_ids: Tensor,
    prompt_mask: Tensor,
    max_new_tokens: int,
    eos: int | None = None,
    seed: int = 0,
) -> dict:
    """Sample with routes recorded; returns TRL-style completion tensors, sampling log-probs and the recorder."""
    torch.manual_seed(seed)
    with RouteRecorder(model, keep_weights=True) as recorder:
        out = model.generate(
            input_ids=prompt_ids,
            attention_mask=prompt_mask,
            max_new_tokens=max_new_tokens,
            do_sample=True,
            top_k=0,  # no filtering (transformers would default to 50), so scores are the model's distribution
            eos_token_id=eos,
            output_scores=True,
            return_dict_in_generate=True,
        )
    completion_ids = out.sequences[:, prompt_ids.shape[1] :]  # (B, T_gen)
    is_eos = completion_ids == (-1 if eos is None else eos)  # (B, T_gen)
    after_eos = (is_eos.cumsum(1) - is_eos.long()) > 0  # strictly after the first EOS
    completion_mask = (~after_eos).long()  # (B, T_gen): 1 through the first EOS, as TRL
    scores = torch.stack(out.scores, dim=1)  # (B, T_gen, V)
    logps = scores.log_softmax(-1).gather(-1, completion_ids[..., None]).squeeze(-1)  # (B, T_gen)
    assert recorder.num_calls == completion_ids.shape[1]  # prefill + T_gen - 1 decode steps
    return dict(ids=completion_ids, mask=completion_mask, logps=logps, recorder=recorder)


def forward_logps(model: nn.Module, input_ids: Tensor, attention_mask: Tensor, prompt_width: int) -> Tensor:
    """Per-token log-probs of input_ids[:, P:], (B, T); position ids as `generate` derives them from the mask."""
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)  # (B, S)
    logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).logits  # (B, S, V)
    logits = logits[:, prompt_width - 1 : -1]  # (B, T, V)
    return logits.log_softmax(-1).gather(-1, input_ids[:, prompt_width:, None]).squeeze(-1)  # (B, T)


def routes_of_forward(model: nn.Module, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
    with torch.no_grad(), RouteRecorder(model) as recorder:
        forward_logps(model, input_ids, attention_mask, 1)
    return recorder.indices(input_ids.shape[0])  # (B, S, L, k)


def masked_max(x: Tensor, mask: Tensor) -> float:
    return (x.abs() * mask).max().item()


# --------------------------------------------------------------------------------------------------------------------
# Pure functions, on literal tensors
# --------------------------------------------------------------------------------------------------------------------


def test_routing_flips_literal():
    # (B=1, S=3, L=2, k=2). pos 0: layer 0 same set in another order, layer 1 {2,3} -> {2,4} flips; pos 1: equal;
    # pos 2: no record, excluded. F = 1 flip / (2 positions * 2 layers) = 0.25; F_tok = 1 / 2 positions.
    recorded = torch.tensor([[[[0, 1], [2, 3]], [[4, 5], [6, 7]], [[-1, -1], [-1, -1]]]], dtype=torch.int16)
    live = torch.tensor([[[[1, 0], [2, 4]], [[4, 5], [6, 7]], [[0, 1], [2, 3]]]])
    flip_frac, flip_token_frac = routing_flips(recorded, live)
    assert flip_frac.item() == 0.25 and flip_token_frac.item() == 0.5
    flip_frac, flip_token_frac = routing_flips(recorded, live, mask=torch.tensor([[0, 1, 1]]))  # pos 0 excluded
    assert flip_frac.item() == 0.0 and flip_token_frac.item() == 0.0


def test_record_bytes_per_token_eq8():
    # Eq. 8 with T1's policy: L = 48, k = 8 -> 48 * 8 * 2 = 768 B/token at int16, 1536 at int32
    assert record_bytes_per_token(torch.zeros(1, 1, 48, 8, dtype=torch.int16)) == 768
    assert record_bytes_per_token(torch.zeros(48, 8, dtype=torch.int32)) == 1536


def test_split_generate_routes_literal():
    # P = 3, T_gen = 3 -> the record covers 3 + 3 - 1 = 5 positions, valued 10 * b + j.
    routes = (10 * torch.arange(2)[:, None] + torch.arange(5)[None, :]).view(2, 5, 1, 1)
    prompt_mask = torch.tensor([[0, 1, 1], [1, 1, 1]])
    completion_mask = torch.tensor([[1, 1, 0], [1, 1, 1]])  # row 0 stopped at its EOS after 2 tokens
    row0, row1 = split_generate_routes(routes, prompt_mask, completion_mask)
    assert row0.flatten().tolist() == [1, 2, 3]  # 2 prompt + 2 completion - 1 rows, left padding dropped
    assert row1.flatten().tolist() == [10, 11, 12, 13, 14]  # 3 + 3 - 1


def test_routes_to_training_layout_literal():
    prompt_mask = torch.tensor([[0, 1, 1], [1, 1, 1]])
    completion_mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    records = [torch.tensor([10, 11, 12]).view(3, 1, 1), torch.tensor([20, 21, 22]).view(3, 1, 1)]
    routing = routes_to_training_layout(records, prompt_mask, completion_mask)
    # row 0 feeds 4 tokens at positions 1..4 -> records at 1..3, the final position 4 and the padding stay -1
    assert routing.squeeze(-1).squeeze(-1).tolist() == [[-1, 10, 11, 12, -1, -1], [20, 21, 22, -1, -1, -1]]
    with pytest.raises(ValueError, match="row 1 has a record of shape"):
        routes_to_training_layout([records[0], records[1][:2]], prompt_mask, completion_mask)
    with pytest.raises(ValueError, match="row 0 of prompt_mask"):
        routes_to_training_layout(records, torch.tensor([[1, 0, 1], [1, 1, 1]]), completion_mask)


def test_stitch_and_prefix_mismatch_literal():
    previous = torch.tensor([[[0, 1]], [[2, 3]]], dtype=torch.int16)  # (2, L=1, k=2)
    new = torch.tensor([[[1, 0]], [[2, 4]], [[5, 6]], [[6, 7]]], dtype=torch.int16)  # re-prefill + 2 new rows
    stitched = stitch_turn_routes(previous, new)
    assert stitched[:, 0].tolist() == [[0, 1], [2, 3], [5, 6], [6, 7]]  # first computation wins (D5)
    assert prefix_recompute_mismatch(previous, new)[:, 0].tolist() == [False, True]  # Eq. 11: 1 of 2
    with pytest.raises(ValueError, match="does not extend"):
        stitch_turn_routes(new, previous)


# --------------------------------------------------------------------------------------------------------------------
# Discovery, no-ops and errors
# --------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "olmoe"])
def test_find_routers(family):
    routers = find_routers(tiny_moe(family))
    assert routers.names == ("model.layers.0.mlp.gate", "model.layers.1.mlp.gate")
    assert routers.layer_ids == (0, 1) and routers.num_experts == 8 and routers.top_k == 2


def test_dense_model_is_a_no_op():
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(**COMMON)).eval()
    assert not is_moe(model) and find_routers(model) is None
    ids, mask = random_prompts([4, 6])
    expected = model(input_ids=ids, attention_mask=mask).logits
    with replay_routes(model, torch.zeros(2, 6, 2, 2, dtype=torch.int16)):
        assert torch.equal(model(input_ids=ids, attention_mask=mask).logits, expected)
    with RouteRecorder(model) as recorder:
        model(input_ids=ids, attention_mask=mask)
    with pytest.raises(ValueError, match="Qwen3ForCausalLM has no MoE router"):
        recorder.indices(2)


def test_unsupported_family_raises():
    # Qwen2-MoE's router has no adapter yet (D12: enabled once its identity test passes).
    config = Qwen2MoeConfig(**COMMON, moe_intermediate_size=32, shared_expert_intermediate_size=32, num_experts=8)
    model = Qwen2MoeForCausalLM(config)
    assert is_moe(model)
    with pytest.raises(ValueError, match="Qwen2MoeForCausalLM is an MoE model whose router Qwen2MoeTopKRouter"):
        find_routers(model)
    with pytest.raises(ValueError, match="Qwen2MoeTopKRouter"):
        RouteRecorder(model)


def test_force_replay_settings():
    config = MixtralConfig(**COMMON, num_local_experts=8, num_experts_per_tok=2, router_jitter_noise=0.1)
    model = MixtralForCausalLM(config)
    changes = force_replay_settings(model)
    assert len(changes) == 3  # aux coefficient + jitter of both blocks
    assert model.config.router_aux_loss_coef == 0.0 and model.config.router_jitter_noise == 0.0
    assert all(layer.mlp.jitter_noise == 0.0 for layer in model.model.layers)


def test_strictness():
    model = tiny_moe("qwen3_moe")
    routers = find_routers(model)
    ids, mask = random_prompts([4, 6])  # (2, 6)
    routing = routes_of_forward(model, ids, mask)  # (2, 6, 2, 2)
    check_routing(routing, routers, mask)
    with pytest.raises(ValueError, match="routing has 1 layers, the model has 2 MoE layers"):
        check_routing(routing[:, :, :1], routers)
    with pytest.raises(ValueError, match="3 experts per token"):
        check_routing(routing[..., [0, 1, 1]], routers)
    bad = routing.clone()
    bad[1, 3, 1, 0] = 8  # E = 8
    with pytest.raises(ValueError, match=r"outside \[0, 8\) at row 1, position 3, layer 1"):
        check_routing(bad, routers)
    bad = routing.clone()
    bad[0, 2, 0, 1] = bad[0, 2, 0, 0]
    with pytest.raises(ValueError, match="repeated expert id at row 0, position 2, layer 0"):
        check_routing(bad, routers)
    bad = routing.clone()
    bad[0, 4, 1, 0] = NO_ROUTE
    with pytest.raises(ValueError, match="partial record"):
        check_routing(bad, routers)
    bad = routing.clone()
    bad[0, :2] = NO_ROUTE  # left padding of row 0: no record needed
    bad[:, -1] = NO_ROUTE  # final positions: no record needed
    check_routing(bad, routers, mask)
    bad[1, 2, 0] = NO_ROUTE
    with pytest.raises(ValueError, match="missing record .* at row 1, position 2, layer 0"):
        with replay_routes(model, bad, mask):
            pass
    with pytest.raises(ValueError, match="attention_mask"):
        check_routing(routing, routers, mask[:, :5])
    with pytest.raises(ValueError, match="weights"):
        with replay_routes(model, routing, weights=torch.ones(2, 6, 2, 3)):
            pass
    longer, longer_mask = random_prompts([5, 7])  # 7 positions: the installed (2, 6) routing is misaligned
    with pytest.raises(ValueError, match=r"received 14 rows but the installed routing covers B \* S = 2 \* 6 = 12"):
        with replay_routes(model, routing):
            model(input_ids=longer, attention_mask=longer_mask)
    with pytest.raises(ValueError, match="completion_mask keeps up to 4 tokens"):
        split_generate_routes(routing, mask, torch.ones(2, 4))  # 6 positions = P + 0 decode steps


# --------------------------------------------------------------------------------------------------------------------
# Replay mechanics
# --------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_identity_per_family(family):
    """§7 item 8: replaying a model's own routes is bit-identical to the free forward (logits and gate weights)."""
    model = tiny_moe(family)
    ids, mask = random_prompts([5, 8, 3], seed=2)
    with torch.no_grad(), RouteRecorder(model, keep_weights=True) as free:
        expected = model(input_ids=ids, attention_mask=mask).logits
    routing = free.indices(3)  # (3, 8, 2, 2), every position
    with torch.no_grad(), replay_routes(model, routing, mask), RouteRecorder(model, keep_weights=True) as replayed:
        logits = model(input_ids=ids, attention_mask=mask).logits
    assert torch.equal(logits, expected)
    assert torch.equal(replayed.indices(3), routing)
    assert torch.equal(replayed.weights(3), free.weights(3)) and replayed.weights(3).dtype == free.weights(3).dtype


def test_gradient_checkpointing_and_micro_batches():
    """§7 items 9-10: replay survives checkpoint recompute; row chunks with the matching routing slice agree."""
    model = tiny_moe("qwen3_moe")
    ids, mask = random_prompts([5, 8, 3, 6], seed=3)
    routing = routes_of_forward(model, ids, mask)  # (4, 8, 2, 2)
    perturb_routers(model)  # so that replayed and free routing differ

    def loss_and_grads() -> tuple[Tensor, list[Tensor]]:
        model.zero_grad()
        with replay_routes(model, routing, mask):
            loss = forward_logps(model, ids, mask, 1).mul(mask[:, 1:]).sum()
            loss.backward()  # backward inside the block: the recompute replays too (D8)
        return loss.detach(), [p.grad.clone() for p in model.parameters()]

    model.train()  # dropout is 0 in these configs
    loss, grads = loss_and_grads()
    model.activation_checkpointing_enable()
    loss_ckpt, grads_ckpt = loss_and_grads()
    model.activation_checkpointing_disable()
    model.eval()
    torch.testing.assert_close(loss_ckpt, loss, rtol=0, atol=1e-6)
    for g, g_ckpt in zip(grads, grads_ckpt, strict=True):
        torch.testing.assert_close(g_ckpt, g, rtol=1e-5, atol=1e-6)

    with torch.no_grad(), replay_routes(model, routing, mask):
        whole = forward_logps(model, ids, mask, 1)  # (4, 7)
    chunks = []
    for rows in (slice(0, 1), slice(1, 4)):
        with torch.no_grad(), replay_routes(model, routing[rows], mask[rows]):
            chunks.append(forward_logps(model, ids[rows], mask[rows], 1))
    assert masked_max(torch.cat(chunks) - whole, mask[:, 1:]) <= 1e-6


# --------------------------------------------------------------------------------------------------------------------
# Acceptance (§7 items 1-6): generate with recording, then the training forward
# --------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_generation_replay_acceptance(family):
    model = tiny_moe(family)
    L = 2
    prompt_ids, prompt_mask = random_prompts([3, 6, 5, 2], seed=4)  # (4, 6), left-padded
    pilot = sample(model, prompt_ids, prompt_mask, max_new_tokens=6)
    eos = next(t for t in pilot["ids"][0, 2:].tolist() if t not in pilot["ids"][0, :2].tolist())
    gen = sample(model, prompt_ids, prompt_mask, max_new_tokens=6, eos=eos)  # same draws: row 0 stops early
    completion_ids, completion_mask, sampling_logps = gen["ids"], gen["mask"], gen["logps"]  # (B, T) each
    assert completion_mask.sum(1).min() < completion_mask.shape[1]  # post-EOS decode steps exist and are dropped

    B, P = prompt_ids.shape
    records = split_generate_routes(gen["recorder"].indices(B), prompt_mask, completion_mask)
    n_fed = prompt_mask.sum(1) + completion_mask.sum(1)  # (B,) N_b
    assert [r.shape for r in records] == [(n - 1, L, 2) for n in n_fed.tolist()]  # §7 items 5-6
    assert records[0].dtype == torch.int16
    routing = routes_to_training_layout(records, prompt_mask, completion_mask)  # (B, S, L, k)
    weights = routes_to_training_layout(
        split_generate_routes(gen["recorder"].weights(B), prompt_mask, completion_mask),
        prompt_mask,
        completion_mask,
        fill_value=0.0,
    )
    input_ids = torch.cat([prompt_ids, completion_ids], 1)  # (B, S)
    attention_mask = torch.cat([prompt_mask, completion_mask], 1)  # (B, S)
    m = completion_mask.float()  # (B, T)

    # §7 item 5: the generate record equals a single forward over the whole sequence at every recorded position
    has_record = (routing >= 0).all(-1).all(-1)  # (B, S)
    assert torch.equal(routes_of_forward(model, input_ids, attention_mask)[has_record], routing[has_record])

    # §7 item 4: at unchanged weights, R3 replay (and free routing) reproduce the generation log-probs
    with torch.no_grad(), replay_routes(model, routing, attention_mask):
        assert masked_max(forward_logps(model, input_ids, attention_mask, P) - sampling_logps, m) <= 1e-6

    perturb_routers(model)
    # §7 item 2: free routing now flips decisions and moves log-probs
    with torch.no_grad():
        free_logps = forward_logps(model, input_ids, attention_mask, P)
    flip_frac, flip_token_frac = routing_flips(routing, routes_of_forward(model, input_ids, attention_mask))
    assert flip_frac > 0 and flip_token_frac > 0
    assert masked_max(free_logps - sampling_logps, m) > 1e-6

    # §7 item 3: R3 replay uses the recorded experts everywhere (0 flips) and the routers get gradient
    with replay_routes(model, routing, attention_mask), RouteRecorder(model) as used:
        r3_logps = forward_logps(model, input_ids, attention_mask, P)
        (r3_logps * m).sum().backward()
    assert routing_flips(routing, used.indices(B))[0] == 0
    assert all(router.weight.grad.abs().sum() > 0 for router in find_routers(model).modules)

    # §7 item 1: full replay (recorded ids and weights) still reproduces the generation log-probs
    with torch.no_grad(), replay_routes(model, routing, attention_mask, weights=weights):
        assert masked_max(forward_logps(model, input_ids, attention_mask, P) - sampling_logps, m) <= 1e-6
    # ... and is not vacuous: the same record shifted by one position no longer matches (D11)
    with torch.no_grad(), replay_routes(model, routing.roll(1, 1), weights=weights.roll(1, 1)):
        assert masked_max(forward_logps(model, input_ids, attention_mask, P) - sampling_logps, m) > 1e-6


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_multi_turn_stitching(family):
    """§7 item 7: two generate calls on a growing left-padded context; the stitched record has N_b - 1 rows, equals
    a single forward over the whole stream (as does the last call's record), has no prefix mismatch (Eq. 11), and
    full replay in the training layout reproduces both turns' sampling log-probs."""
    model = tiny_moe(family)
    generator = torch.Generator().manual_seed(5)
    prompt_ids, prompt_mask = random_prompts([2, 5, 3], seed=5)  # (3, 5)
    turn1 = sample(model, prompt_ids, prompt_mask, max_new_tokens=4, seed=1)  # no EOS: 4 tokens per row
    records = split_generate_routes(turn1["recorder"].indices(3), prompt_mask, turn1["mask"])
    weights = split_generate_routes(turn1["recorder"].weights(3), prompt_mask, turn1["mask"])
    prompts = [ids[mask.bool()].tolist() for ids, mask in zip(prompt_ids, prompt_mask, strict=True)]
    env = [torch.randint(2, V, (n,), generator=generator).tolist() for n in (1, 3, 2)]  # observation tokens
    streams = [p + c + e for p, c, e in zip(prompts, turn1["ids"].tolist(), env, strict=True)]

    context_ids, context_mask = left_pad(streams)  # (3, 12): re-padded, so each row's padding changes
    turn2 = sample(model, context_ids, context_mask, max_new_tokens=3, seed=2)
    new_records = split_generate_routes(turn2["recorder"].indices(3), context_mask, turn2["mask"])
    new_weights = split_generate_routes(turn2["recorder"].weights(3), context_mask, turn2["mask"])
    completions, sampling_logps, loss_mask = [], [], []
    for b in range(3):
        assert not prefix_recompute_mismatch(records[b], new_records[b]).any()  # Eq. 11 = 0
        records[b] = stitch_turn_routes(records[b], new_records[b])
        weights[b] = stitch_turn_routes(weights[b], new_weights[b])
        stream = streams[b] + turn2["ids"][b].tolist()  # N_b tokens
        assert records[b].shape[0] == len(stream) - 1
        single = routes_of_forward(model, torch.tensor([stream]), torch.ones(1, len(stream), dtype=torch.long))
        assert torch.equal(single[0, :-1], records[b]) and torch.equal(new_records[b], records[b])
        completions.append(stream[len(prompts[b]) :])  # turn 1 + env + turn 2
        sampling_logps.append(turn1["logps"][b].tolist() + [0.0] * len(env[b]) + turn2["logps"][b].tolist())
        loss_mask.append([1.0] * 4 + [0.0] * len(env[b]) + [1.0] * 3)

    completion_ids = right_pad(completions).long()  # (3, T)
    completion_mask = right_pad([[1] * len(c) for c in completions], 0).long()  # (3, T): every fed token
    m, q = right_pad(loss_mask, 0.0), right_pad(sampling_logps, 0.0)  # (3, T)
    routing = routes_to_training_layout(records, prompt_mask, completion_mask)  # (3, S, L, k)
    gate = routes_to_training_layout(weights, prompt_mask, completion_mask, fill_value=0.0)
    input_ids = torch.cat([prompt_ids, completion_ids], 1)
    attention_mask = torch.cat([prompt_mask, completion_mask], 1)
    with torch.no_grad(), replay_routes(model, routing, attention_mask):
        assert masked_max(forward_logps(model, input_ids, attention_mask, 5) - q, m) <= 1e-6
    perturb_routers(model)
    with torch.no_grad(), replay_routes(model, routing, attention_mask, weights=gate):
        assert masked_max(forward_logps(model, input_ids, attention_mask, 5) - q, m) <= 1e-6
