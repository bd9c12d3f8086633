"""Rollout contracts of trainers/agent_loop.py: TITO, masks, turn ids, budgets, errors, batching."""

import pytest
import torch
from conftest import EchoEnv

from trainers.agent_loop import LoopSettings, observation_text, play, render_prompt_ids
from trainers.generation import hf_generate


def scripted(tokenizer, answer=lambda word: word, close=True, calls=None):
    """A GenerateFn that answers the last 'say X' of each context with the ids of answer(X) (+ eos)."""

    def generate(contexts, max_new_tokens):
        if calls is not None:
            calls.append(len(contexts))
        out = []
        for ctx in contexts:
            word = tokenizer.decode(ctx).rsplit("say ", 1)[-1].split("<|im_end|>")[0]
            ids = tokenizer(answer(word), add_special_tokens=False)["input_ids"]
            ids = (ids + [tokenizer.eos_token_id] if close else ids)[:max_new_tokens]
            out.append((ids, [-0.5] * len(ids)))
        return out

    return generate


def episodes(n, seed=0):
    return EchoEnv.make_tasks("train", n, seed=seed)


def test_expert_script_succeeds_and_generation_is_batched(tiny_tokenizer):
    calls = []
    tasks = episodes(5)
    rollouts = play(scripted(tiny_tokenizer, calls=calls), tiny_tokenizer, [EchoEnv() for _ in tasks], tasks)
    assert all(r.success and r.done and not r.truncated for r in rollouts)
    assert [r.turn_rewards for r in rollouts] == [[1.0, 1.0, 1.0]] * 5
    assert calls == [5, 5, 5]  # one batched generate call per turn, not one per episode


def test_tito_ids_masks_and_turn_index(tiny_tokenizer):
    tok = tiny_tokenizer
    tasks = episodes(3)
    sampled = []

    def generate(contexts, n):
        out = scripted(tok)(contexts, n)
        sampled.append([ids for ids, _ in out])
        return out

    rollouts = play(generate, tok, [EchoEnv() for _ in tasks], tasks)
    for b, r in enumerate(rollouts):
        assert len(r.completion_ids) == len(r.logprobs) == len(r.env_mask) == len(r.turn_index)
        # model tokens are exactly the sampled ids, turn after turn, never re-tokenised
        model_tokens = [t for t, m in zip(r.completion_ids, r.env_mask, strict=True) if m == 1]
        assert model_tokens == [i for turn in sampled for i in turn[b]]
        for m, k, lp in zip(r.env_mask, r.turn_index, r.logprobs, strict=True):
            assert (k >= 0) == (m == 1)
            assert (lp == 0.0) == (m == 0)
        turns = [k for k in r.turn_index if k >= 0]
        assert sorted(set(turns)) == list(range(len(r.turn_rewards)))
        assert turns == sorted(turns)  # contiguous and increasing
        # decoding the ids reproduces the transcript rendered by the chat template
        messages = [{"role": "user", "content": f"say {tasks[b]['words'][0]}"}]
        for t, turn in enumerate(r.transcript):
            messages.append({"role": "assistant", "content": turn["action"]})
            if t < len(r.transcript) - 1:
                messages.append({"role": "user", "content": turn["observation"]})
        rendered = tok.apply_chat_template(messages, tokenize=False)
        assert tok.decode(r.prompt_ids + r.completion_ids) == rendered.rstrip("\n")


def test_truncated_turn_is_closed_by_an_environment_eos(tiny_tokenizer):
    tok = tiny_tokenizer
    tasks = episodes(2)
    settings = LoopSettings(max_turn_tokens=2, max_completion_length=200)
    rollouts = play(
        scripted(tok, answer=lambda w: w + " " + w + " " + w, close=False),
        tok,
        [EchoEnv() for _ in tasks],
        tasks,
        settings=settings,
    )
    for r in rollouts:
        first_env = r.env_mask.index(0)
        assert r.completion_ids[first_env] == tok.eos_token_id  # closing token, masked as environment
        assert r.turn_index[first_env] == -1
        assert r.env_mask[:first_env] == [1, 1]


def test_budgets_truncate_and_turn_budget(tiny_tokenizer):
    tasks = episodes(2)
    rollouts = play(
        scripted(tiny_tokenizer), tiny_tokenizer, [EchoEnv() for _ in tasks], tasks, settings=LoopSettings(max_turns=2)
    )
    assert all(r.truncated and not r.success and len(r.turn_rewards) == 2 for r in rollouts)
    rollouts = play(
        scripted(tiny_tokenizer),
        tiny_tokenizer,
        [EchoEnv() for _ in tasks],
        tasks,
        settings=LoopSettings(max_completion_length=12),
    )
    assert all(r.truncated and len(r.completion_ids) <= 12 for r in rollouts)


def test_environment_errors_become_observations(tiny_tokenizer):
    tasks = episodes(2)
    rollouts = play(
        scripted(tiny_tokenizer, answer=lambda w: "boom"), tiny_tokenizer, [EchoEnv() for _ in tasks], tasks
    )
    assert all(r.transcript[0]["observation"].startswith("error: RuntimeError: kaboom") for r in rollouts)
    assert all(r.env_errors == EchoEnv.max_turns and r.truncated for r in rollouts)
    rollouts = play(
        scripted(tiny_tokenizer, answer=lambda w: "hang"),
        tiny_tokenizer,
        [EchoEnv()],
        tasks[:1],
        settings=LoopSettings(env_timeout=0.2),
    )
    assert rollouts[0].done and not rollouts[0].truncated and rollouts[0].env_errors == 1
    assert "timed out" in rollouts[0].transcript[0]["observation"]


def test_observation_text_follows_the_template(tiny_tokenizer):
    text = observation_text(tiny_tokenizer, "say apple")
    assert text == "\n<|im_start|>user\nsay apple<|im_end|>\n<|im_start|>assistant\n"
    ids = render_prompt_ids(tiny_tokenizer, "say apple")
    assert tiny_tokenizer.decode(ids).endswith("<|im_start|>assistant\n")


def test_real_model_logprobs_match_a_forward_pass(tiny_tokenizer, tiny_model_folder):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_folder).eval()
    tasks = episodes(4)
    gen = hf_generate(model, tiny_tokenizer, temperature=0.7)
    rollouts = play(
        gen,
        tiny_tokenizer,
        [EchoEnv() for _ in tasks],
        tasks,
        settings=LoopSettings(max_turn_tokens=6, max_completion_length=60),
    )
    for r in rollouts:
        ids = torch.tensor([r.prompt_ids + r.completion_ids])
        with torch.no_grad():
            logits = model(ids).logits[0, len(r.prompt_ids) - 1 : -1] / 0.7
        ref = torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(r.completion_ids)[:, None])[:, 0]
        mask = torch.tensor(r.env_mask, dtype=torch.bool)
        torch.testing.assert_close(torch.tensor(r.logprobs)[mask], ref[mask], atol=1e-4, rtol=0)


def test_one_hanging_step_does_not_stall_the_others():
    from trainers.agent_loop import step_all

    tasks = episodes(9)
    envs = [EchoEnv() for _ in tasks]
    for env, task in zip(envs, tasks, strict=True):
        env.reset(task)
    actions = ["hang"] + [t["words"][0] for t in tasks[1:]]
    results = step_all(envs, actions, timeout=1.0, workers=2)
    assert results[0][3] == {"env_timeout": True} and results[0][2]  # the hang ends its episode
    assert [r[1] for r in results[1:]] == [1.0] * 8  # the other eight stepped on the second worker


def test_kv_reuse_across_turns_matches_full_prefill(tiny_tokenizer, tiny_model_folder):
    """Greedy episodes with the cache kept across turns equal those that prefill every turn from scratch: same ids,
    same log-probs up to float rounding, and the reused path really skipped the cached positions."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_folder).eval()
    tasks = episodes(6)
    settings = LoopSettings(max_turn_tokens=5, max_completion_length=80)
    runs, fed = {}, {}
    for reuse in (False, True):
        gen = hf_generate(model, tiny_tokenizer, do_sample=False, reuse_cache=reuse)
        seen = []
        hook = model.model.embed_tokens.register_forward_hook(lambda m, i, o, seen=seen: seen.append(i[0].numel()))
        runs[reuse] = play(gen, tiny_tokenizer, [EchoEnv() for _ in tasks], tasks, settings=settings)
        hook.remove()
        fed[reuse] = sum(seen)
    assert max(len(r.turn_rewards) for r in runs[True]) > 1  # several turns, so the cache was reused
    for plain, reused in zip(runs[False], runs[True], strict=True):
        assert reused.completion_ids == plain.completion_ids and reused.env_mask == plain.env_mask
        torch.testing.assert_close(torch.tensor(reused.logprobs), torch.tensor(plain.logprobs), atol=1e-5, rtol=0)
    assert fed[True] < fed[False]


def test_own_decode_loop_plays_the_episodes_of_transformers_generate(tiny_tokenizer, tiny_model_folder, monkeypatch):
    """Greedy episodes sampled by `sample_tokens` (the default for a plain decoder) equal those of `model.generate`
    with the same KV reuse across turns: same ids, same log-probs up to float rounding; the own loop really ran."""
    from transformers import AutoModelForCausalLM

    from trainers import generation

    model = AutoModelForCausalLM.from_pretrained(tiny_model_folder).eval()
    tasks = episodes(6, seed=3)
    settings = LoopSettings(max_turn_tokens=5, max_completion_length=80)
    assert generation.growing_cache(model) is not None
    own = play(hf_generate(model, tiny_tokenizer, do_sample=False), tiny_tokenizer, [EchoEnv() for _ in tasks], tasks,
               settings=settings)  # fmt: skip
    monkeypatch.setattr(generation, "growing_cache", lambda model: None)
    calls = []
    real_generate = model.generate
    monkeypatch.setattr(model, "generate", lambda *a, **k: calls.append(1) or real_generate(*a, **k))
    ref = play(hf_generate(model, tiny_tokenizer, do_sample=False), tiny_tokenizer, [EchoEnv() for _ in tasks], tasks,
               settings=settings)  # fmt: skip
    assert calls and max(len(r.turn_rewards) for r in ref) > 1
    for a, b in zip(own, ref, strict=True):
        assert a.completion_ids == b.completion_ids and a.env_mask == b.env_mask
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5, rtol=0)


class FixedLogits(torch.nn.Module):
    """A stand-in model whose next-token logits are `table[step]`, (V,) for every row or (N, V) per row (the last entry
    of the table repeats), counting the positions it is fed."""

    def __init__(self, table):
        super().__init__()
        self.table, self.calls, self.fed = table, 0, []

    def forward(self, input_ids, attention_mask, position_ids, cache, use_cache, logits_to_keep):
        assert input_ids.shape == position_ids.shape and attention_mask.shape[1] == self.total(input_ids)
        self.fed.append(input_ids.shape[1])
        row = self.table[min(self.calls, len(self.table) - 1)]
        self.calls += 1
        return type("Out", (), {"logits": row.expand(input_ids.shape[0], -1)[:, None, :]})()

    def total(self, input_ids):
        return sum(self.fed) + input_ids.shape[1]


class NoCache:
    layers = []

    def get_seq_length(self):
        return 0


def test_sampler_draws_from_the_processed_distribution():
    """20000 rows drawn once from fixed logits under temperature 0.5 and top-k 3: each token's frequency is within 5
    standard errors of its probability, computed here by hand (softmax of logits / 0.5 over the three largest), tokens
    outside the top 3 never appear, and the returned log-probs are the logs of those probabilities."""
    from trainers.generation import logits_processors, sample_tokens

    logits = torch.tensor([1.0, 0.2, -0.5, 0.9, -3.0, 0.1])
    kept = [0, 3, 1]  # the three largest
    weights = torch.exp(logits[kept] / 0.5)
    probs = torch.zeros(6)
    probs[kept] = weights / weights.sum()
    n = 20000
    ids, mask = torch.zeros(n, 2, dtype=torch.long), torch.ones(n, 2, dtype=torch.long)
    torch.manual_seed(0)
    sequences, logps = sample_tokens(
        FixedLogits([logits]), ids, mask, NoCache(), 1, logits_processors(temperature=0.5, top_k=3), True, [5], 5
    )
    drawn = sequences[:, 2]
    freq = torch.bincount(drawn, minlength=6).double() / n
    se = torch.sqrt(probs.double() * (1 - probs.double()) / n)
    assert torch.all((freq - probs.double()).abs() <= 5 * se + 1e-12), (freq, probs)
    assert set(drawn.tolist()) == set(kept)
    torch.testing.assert_close(logps[:, 0], probs.log()[drawn], atol=1e-5, rtol=0)


def test_sampler_stops_when_every_row_has_ended_and_pads_after_the_end():
    """Greedy rows over scripted logits: step 0 picks 1, step 1 picks the end id 4, step 2 would pick 2. Row ends come
    at step 1, so the loop stops there (two new ids, not the cap of 5), and a row that ended is continued with pad."""
    from trainers.generation import logits_processors, sample_tokens

    table = [torch.eye(6)[1] * 5, torch.eye(6)[4] * 5, torch.eye(6)[2] * 5]
    model = FixedLogits(table)
    ids, mask = torch.tensor([[0, 3], [3, 3]]), torch.tensor([[0, 1], [1, 1]])
    sequences, logps = sample_tokens(model, ids, mask, NoCache(), 5, logits_processors(do_sample=False), False, [4], 0)
    assert sequences.tolist() == [[0, 3, 1, 4], [3, 3, 1, 4]]
    assert model.fed == [2, 1]  # the prefill, then one decode step; the last sampled id is never fed
    assert logps.shape == (2, 2)
    eye = torch.eye(6) * 5
    model = FixedLogits([eye[[4, 1]], eye[[2, 4]], eye[[2, 2]]])  # row 0 ends at once, row 1 one step later
    ones = torch.ones(2, 2, dtype=torch.long)
    sequences, _ = sample_tokens(model, ids, ones, NoCache(), 5, logits_processors(do_sample=False), False, [4], 0)
    assert sequences.tolist() == [[0, 3, 4, 0], [3, 3, 1, 4]]  # row 0 goes on with pad (0) after its end
    with pytest.raises(ValueError, match="max_new_tokens"):
        sample_tokens(model, ids, ones, NoCache(), 0, logits_processors(), False, [4], 0)


@pytest.mark.parametrize("rows_per_call", [2, 64])
def test_branches_after_shared_prefixes_equal_each_context_alone(tiny_model_folder, rows_per_call):
    """`sample_after_prefixes` (one prefill per sequence, every branch from its cache) gives each branch the greedy ids
    and log-probs that `sample_tokens` gives its context alone, from a fresh cache, up to float rounding: branches of
    one sequence in one call and split over calls (2 rows a call), a one-id context, sequences of unequal length. It
    feeds fewer positions than the separate prefills do."""
    from transformers import AutoModelForCausalLM

    from trainers.generation import logits_processors, sample_after_prefixes, sample_tokens, shared_prefixes
    from trainers.trl_api import growing_cache

    model = AutoModelForCausalLM.from_pretrained(tiny_model_folder).eval()
    g = torch.Generator().manual_seed(5)
    first = torch.randint(5, 200, (30,), generator=g).tolist()
    second = torch.randint(5, 200, (12,), generator=g).tolist()
    contexts = [first[:1], first[:9], first[:17], first[:30], second[:12], second[:4]]
    sequences, branches = shared_prefixes(contexts)
    assert sequences == [first, second] and [p for _, p in branches] == [1, 9, 17, 30, 12, 4]
    fed = []
    hook = model.register_forward_pre_hook(lambda m, a, kw: fed.append(kw["input_ids"].numel()), with_kwargs=True)
    greedy = logits_processors(do_sample=False)
    out = sample_after_prefixes(model, sequences, branches, 6, greedy, False, [2], 0, rows_per_call)
    shared_prefill = fed[0] if rows_per_call == 64 else None
    hook.remove()
    for context, (ids, logps) in zip(contexts, out, strict=True):
        ref_ids, ref_logps = sample_tokens(
            model, torch.tensor([context]), torch.ones(1, len(context), dtype=torch.long), growing_cache(model), 6,
            greedy, False, [2], 0,
        )  # fmt: skip
        want = ref_ids[0, len(context) :].tolist()
        n = next((k + 1 for k, t in enumerate(want) if t == 2), len(want))
        assert ids == want[:n]
        torch.testing.assert_close(torch.tensor(logps), ref_logps[0, :n], atol=1e-5, rtol=0)
    if shared_prefill is not None:  # two sequences padded to 29 positions, against 67 ids prefilled alone
        assert shared_prefill == 2 * 29 < sum(len(c) - 1 for c in contexts)


def test_branch_history_holds_only_its_context(tiny_model_folder):
    """What the logits processors read as a branch's history (a repetition penalty's input) holds its context and
    pads, never the sequence's ids past the context: ids 40 and 41 end the sequence, outside the 6-id context (the
    context's last id comes after the padded positions, where the branch feeds it again)."""
    from transformers import AutoModelForCausalLM
    from transformers.generation.logits_process import LogitsProcessor, LogitsProcessorList

    from trainers.generation import sample_after_prefixes

    class Reads(LogitsProcessor):
        def __init__(self):
            self.histories = []

        def __call__(self, input_ids, scores):
            self.histories.append(input_ids.clone())
            return scores

    model = AutoModelForCausalLM.from_pretrained(tiny_model_folder).eval()
    reads = Reads()
    sequence = [5, 6, 7, 8, 9, 10, 40, 41]
    sample_after_prefixes(model, [sequence], [(0, 6), (0, 8)], 2, LogitsProcessorList([reads]), False, [2], 0)
    first = reads.histories[0]  # (2, width): the short branch, then the long one; pad is 0
    assert [t for t in first[0].tolist() if t != 0] == sequence[:6]  # its context, the ids past it padded
    assert [t for t in first[1].tolist() if t != 0] == sequence


def test_branches_past_the_deadline_are_empty(tiny_model_folder):
    """A deadline already past: no call starts, every branch gets no ids; a branch outside its sequence is refused."""
    from transformers import AutoModelForCausalLM

    from trainers.generation import logits_processors, sample_after_prefixes

    model = AutoModelForCausalLM.from_pretrained(tiny_model_folder).eval()
    greedy = logits_processors(do_sample=False)
    out = sample_after_prefixes(model, [[5, 6, 7]], [(0, 2), (0, 3)], 4, greedy, False, [2], 0, deadline=0.0)
    assert out == [([], []), ([], [])]
    with pytest.raises(ValueError, match="outside sequence 0"):
        sample_after_prefixes(model, [[5, 6, 7]], [(0, 4)], 4, greedy, False, [2], 0)


def test_sampler_stops_after_the_step_that_passes_its_deadline():
    """Rows that would never end (no end id in the scripted logits) stop after the first step when the deadline is
    already past: one new id each, not the cap of 5, so callers see them unfinished; without a deadline all 5 come."""
    from trainers.generation import logits_processors, sample_tokens

    ids, mask = torch.tensor([[3, 3], [3, 3]]), torch.ones(2, 2, dtype=torch.long)
    greedy = logits_processors(do_sample=False)
    model = FixedLogits([torch.eye(6)[1] * 5])
    sequences, _ = sample_tokens(model, ids, mask, NoCache(), 5, greedy, False, [4], 0, deadline=0.0)
    assert sequences.tolist() == [[3, 3, 1], [3, 3, 1]] and model.fed == [2]
    sequences, _ = sample_tokens(FixedLogits([torch.eye(6)[1] * 5]), ids, mask, NoCache(), 5, greedy, False, [4], 0)
    assert sequences.shape == (2, 7)


def test_growing_cache_layer_holds_what_a_dynamic_layer_holds():
    """The same prefill, decode writes, row selection, crop and row repetition on `GrowingLayer` and transformers'
    `DynamicLayer` leave equal keys and values (the growing layer outgrows its buffer twice on the way)."""
    from transformers.cache_utils import DynamicLayer

    from trainers.trl_api import GrowingLayer

    torch.manual_seed(0)
    layers = [DynamicLayer(), GrowingLayer()]
    writes = [torch.randn(4, 2, 3, 8)] + [torch.randn(4, 2, 1, 8) for _ in range(7)]
    for w in writes:
        outs = [layer.update(w, -w) for layer in layers]
        torch.testing.assert_close(outs[0], outs[1], atol=0, rtol=0)
    for layer in layers:
        layer.batch_select_indices(torch.tensor([2, 0]))
        layer.crop(-2)
    assert layers[1].get_seq_length() == layers[0].get_seq_length() == 8
    torch.testing.assert_close((layers[0].keys, layers[0].values), (layers[1].keys, layers[1].values), atol=0, rtol=0)
    w = torch.randn(2, 2, 1, 8)
    torch.testing.assert_close(layers[0].update(w, w), layers[1].update(w, w), atol=0, rtol=0)
    for layer in layers:
        layer.batch_repeat_interleave(2)
    w = torch.randn(4, 2, 1, 8)
    torch.testing.assert_close(layers[0].update(w, w), layers[1].update(w, w), atol=0, rtol=0)


def test_narrowed_layer_keeps_every_row_written_and_zeros_after_a_row_left():
    """Rows 0-3 for 3 positions, then rows 1 and 3 only for 2 positions, then row 3 only for 1: after `widen` every
    row holds what was written for it, in batch order, and zeros where it was no longer decoded."""
    from trainers.trl_api import GrowingLayer

    torch.manual_seed(0)
    layer = GrowingLayer()
    first = torch.randn(4, 2, 3, 8)
    layer.update(first, first + 1)
    rows = torch.arange(4)
    layer.narrow(rows, torch.tensor([1, 3]), 4, capacity=8)
    second = torch.randn(2, 2, 2, 8)
    layer.update(second, second + 1)
    layer.narrow(torch.tensor([1, 3]), torch.tensor([1]), 4, capacity=8)
    third = torch.randn(1, 2, 1, 8)
    keys, _ = layer.update(third, third + 1)
    assert keys.shape == (1, 2, 6, 8)  # only row 3 is computed on
    layer.widen(torch.tensor([3]))
    expected = torch.zeros(4, 2, 6, 8)
    expected[:, :, :3] = first
    expected[[1, 3], :, 3:5] = second
    expected[3, :, 5:] = third[0]
    torch.testing.assert_close(layer.keys, expected, atol=0, rtol=0)
    torch.testing.assert_close(layer.values[:, :, :3], first + 1, atol=0, rtol=0)
    assert layer.get_seq_length() == 6 and layer.full is None


def test_own_decode_loop_on_a_trained_model_with_left_padding_and_kv_reuse(monkeypatch):
    """On the shipped tiny shop agent (a trained model, whose outputs depend on positions), over episodes of different
    lengths (left padding, KV reuse with holes): greedy episodes of the own loop equal those of `model.generate`, with
    and without a repetition penalty, and sampled log-probs equal a plain forward pass over each finished episode."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from envs.shop import ShopEnv
    from envs.tiny import shipped_build
    from trainers import generation, trl_api

    folder = shipped_build()
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    narrowed, real_narrow = [], trl_api.GrowingLayer.narrow
    layer_cls = trl_api.GrowingLayer
    monkeypatch.setattr(layer_cls, "narrow", lambda self, *a: narrowed.append(1) or real_narrow(self, *a))
    tok = AutoTokenizer.from_pretrained(folder)
    tasks = ShopEnv.make_tasks("eval", 12, seed=0)
    settings = LoopSettings(max_turn_tokens=16, max_completion_length=200)
    own_cache = generation.growing_cache
    for penalty in (1.0, 1.5):  # with a repetition penalty the processors read each decoded row's history
        runs = {}
        for name in ("own", "generate"):
            monkeypatch.setattr(generation, "growing_cache", own_cache if name == "own" else lambda model: None)
            gen = hf_generate(model, tok, do_sample=False, repetition_penalty=penalty)
            runs[name] = play(gen, tok, [ShopEnv() for _ in tasks], tasks, settings=settings)
        assert len({len(r.turn_rewards) for r in runs["own"]}) > 1  # episodes of different lengths
        assert narrowed  # rows that ended were left out while longer turns finished
        for a, b in zip(runs["own"], runs["generate"], strict=True):
            assert a.completion_ids == b.completion_ids
            torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-4, rtol=0)
    monkeypatch.setattr(generation, "growing_cache", own_cache)
    torch.manual_seed(0)
    sampled = play(hf_generate(model, tok), tok, [ShopEnv() for _ in tasks], tasks, settings=settings)
    for r in sampled:
        with torch.no_grad():
            logits = model(torch.tensor([r.prompt_ids + r.completion_ids])).logits[0, len(r.prompt_ids) - 1 : -1]
        ref = torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(r.completion_ids)[:, None])[:, 0]
        mask = torch.tensor(r.env_mask, dtype=torch.bool)
        torch.testing.assert_close(torch.tensor(r.logprobs)[mask], ref[mask], atol=1e-4, rtol=0)


class ScriptedCacheModel(torch.nn.Module):
    """A stand-in model with a real cache: every fed id is written into each layer's cache as its own key and value
    (a float), and row r's next id at step k is `script[r][k]` (the last entry repeats). The rows being decoded are
    told apart by their first context id, which is the row's number."""

    def __init__(self, script, vocab):
        super().__init__()
        self.script, self.vocab, self.step, self.batch_sizes = script, vocab, 0, []

    def forward(self, input_ids, attention_mask, position_ids, cache, use_cache, logits_to_keep):
        written = input_ids.float()[:, None, :, None].expand(-1, 1, -1, 2)
        for layer in cache.layers:
            layer.update(written, written)
        rows = cache.layers[0].keys[:, 0, 0, 0].long().tolist()
        self.batch_sizes.append(len(rows))
        nxt = [self.script[r][min(self.step, len(self.script[r]) - 1)] for r in rows]
        self.step += 1
        return type("Out", (), {"logits": torch.eye(self.vocab)[nxt][:, None, :] * 9})()


def test_rows_leave_the_batch_only_after_their_end_id_is_written():
    """Rows 0 and 1 end at step 0, row 2 at step 1, row 3 at step 4 (end id 9). At step 1 half the rows have ended
    and had their end id fed, so the batch narrows, but row 2, which ends at that very step, stays one step more so
    that its end id is written; row 3 goes on alone. After the call every row's cache holds its context and each id it
    keeps (up to and including its end id), then zeros; the cache spans S + t - 1 positions."""
    from trainers.generation import logits_processors, sample_tokens
    from trainers.trl_api import GrowingLayer

    script = [[9], [9], [5, 9], [6, 7, 8, 6, 9]]
    model = ScriptedCacheModel(script, vocab=10)
    ids = torch.tensor([[0, 4, 4], [1, 4, 4], [2, 4, 4], [3, 4, 4]])
    cache = type("Cache", (), {"layers": [GrowingLayer(), GrowingLayer()], "get_seq_length": lambda self: 0})()
    sequences, _ = sample_tokens(model, ids, torch.ones_like(ids), cache, 8, logits_processors(do_sample=False),
                                 False, [9], 0)  # fmt: skip
    assert sequences[:, 3:].tolist() == [[9, 0, 0, 0, 0], [9, 0, 0, 0, 0], [5, 9, 0, 0, 0], [6, 7, 8, 6, 9]]
    assert model.batch_sizes == [4, 4, 2, 1, 1]  # rows 0 and 1 leave after step 1, row 2 after step 2
    expected = torch.zeros(4, 7)
    expected[:, :3] = ids
    expected[0, 3], expected[1, 3], expected[2, 3:5], expected[3, 3:7] = (
        9,
        9,
        torch.tensor([5, 9]),
        torch.tensor([6, 7, 8, 6]),
    )
    for layer in cache.layers:
        torch.testing.assert_close(layer.keys[:, 0, :, 0], expected, atol=0, rtol=0)


def test_a_model_sharded_over_processes_is_sampled_by_generate(tiny_tokenizer, tiny_model_folder, monkeypatch):
    """Under ZeRO-3 (or FSDP) with several processes every forward is a collective, so sampling goes to `generate`,
    which keeps the processes' decode steps in step; one process, or no sharding, keeps the own decode loop."""
    import transformers.integrations.deepspeed as deepspeed
    from transformers import AutoModelForCausalLM

    from trainers import generation

    model = AutoModelForCausalLM.from_pretrained(tiny_model_folder).eval()
    calls, real_generate = [], model.generate
    unsynced = lambda *a, **k: calls.append(1) or real_generate(*a, synced_gpus=False, **k)  # noqa: E731
    monkeypatch.setattr(model, "generate", unsynced)
    context = [tiny_tokenizer("say apple", add_special_tokens=False)["input_ids"]]
    monkeypatch.setattr(deepspeed, "is_deepspeed_zero3_enabled", lambda: True)
    assert not generation.sharded_across_processes(model)  # ZeRO-3 on one process: nothing to keep in step
    hf_generate(model, tiny_tokenizer, do_sample=False)(context, 3)
    assert not calls
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: 2)
    assert generation.sharded_across_processes(model)
    hf_generate(model, tiny_tokenizer, do_sample=False)(context, 3)
    assert calls
