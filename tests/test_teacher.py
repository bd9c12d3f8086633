"""The teacher pass (teacher-pass.md): the privileged block's placement (Eq. 1) and log-probs of the rollout's own
completion tokens with and without it (Eq. 2-3), checked against a plain forward written here."""

import copy

import pytest
import torch
from conftest import CPU_ARGS, EchoEnv, RecordingTrainer
from datasets import Dataset

from trainers.agent_loop import render_prompt_ids
from trainers.base import AgentGRPOConfig
from trainers.teacher import teacher_logps, with_privileged_block


def test_block_goes_to_the_end_of_the_system_message():
    """teacher-pass.md Eq. 1: appended after a blank line; the caller's messages are not changed."""
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "say apple"}]
    kept = copy.deepcopy(messages)
    out = with_privileged_block(messages, "Hint: apple first.")
    assert out == [
        {"role": "system", "content": "Be brief.\n\nHint: apple first."},
        {"role": "user", "content": "say apple"},
    ]
    assert messages == kept


def test_block_makes_a_system_message_when_there_is_none():
    """teacher-pass.md Eq. 1: a new first message; a plain-string prompt is one user message."""
    assert with_privileged_block([{"role": "user", "content": "x"}], "H") == [
        {"role": "system", "content": "H"},
        {"role": "user", "content": "x"},
    ]
    assert with_privileged_block("x", "H") == [{"role": "system", "content": "H"}, {"role": "user", "content": "x"}]
    assert with_privileged_block([{"role": "system", "content": ""}], "H") == [{"role": "system", "content": "H"}]


@pytest.fixture(scope="module")
def scored(tiny_model_folder, tmp_path_factory):
    """One generation batch of 4 echo episodes from the tiny random model, and its trainer."""
    data = Dataset.from_list([{"prompt": "say apple", "task": {"words": ["apple", "river", "stone"]}}] * 2)
    args = AgentGRPOConfig(
        output_dir=str(tmp_path_factory.mktemp("teacher")),
        per_device_train_batch_size=4,
        num_generations=2,
        max_completion_length=30,
        max_turn_tokens=4,
        temperature=0.7,
        **CPU_ARGS,
    )
    trainer = RecordingTrainer(model=tiny_model_folder, train_dataset=data, args=args, env_factory=lambda r: EchoEnv())
    trainer.model.train()
    torch.manual_seed(0)
    trainer.generate_and_score([dict(r) for r in data] * 2)
    return trainer, trainer.seen


def plain_logps(model, prompt: list[int], completion: list[int], temperature: float) -> torch.Tensor:
    """log softmax(logits / temperature) of each completion token after prompt + earlier completion tokens: one
    unpadded forward, independent of TRL's batched forward."""
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].float() / temperature  # (S, V)
    logp = torch.log_softmax(logits[len(prompt) - 1 : -1], dim=-1)  # position s predicts token s + 1
    return logp.gather(1, torch.tensor(completion).unsqueeze(1)).squeeze(1)


def test_logps_match_a_plain_forward_with_and_without_the_block(scored):
    """teacher-pass.md Eq. 2-3: per row, both passes equal an unpadded forward over the re-rendered prompt (with the
    block) or the rollout's own prompt ids (without), on the rollout's completion ids; rows without a block are 0."""
    trainer, batch = scored
    blocks = ["Hint: the words are apple, river, stone.", None, "", "Remember: one word per turn."]
    out = teacher_logps(trainer, batch, blocks)
    assert out.rows.tolist() == [True, False, False, True]
    tok = trainer.processing_class
    for b in range(4):
        n = int(batch.completion_mask[b].sum())  # right-padded: the first n tokens are real
        completion = batch.completion_ids[b, :n].tolist()
        if not out.rows[b]:
            assert out.with_block[b].abs().sum() == 0 and out.without_block[b].abs().sum() == 0
            continue
        row = batch.rows[b]
        privileged = render_prompt_ids(tok, with_privileged_block(row["prompt_messages"], blocks[b]), None)
        own = batch.prompt_ids[b][batch.prompt_mask[b].bool()].tolist()
        assert own == render_prompt_ids(tok, row["prompt_messages"], None)  # the loop recorded what it rendered
        want_with = plain_logps(trainer.model, privileged, completion, 0.7)
        want_without = plain_logps(trainer.model, own, completion, 0.7)
        torch.testing.assert_close(out.with_block[b, :n], want_with, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(out.without_block[b, :n], want_without, atol=1e-5, rtol=1e-5)
        assert out.with_block[b, n:].abs().sum() == 0
        assert not torch.allclose(out.with_block[b, :n], out.without_block[b, :n])  # the context matters
        assert int(out.prompt_tokens_added[b]) == len(privileged) - len(own) > 0
    assert trainer.model.training  # eval mode only inside the pass


def test_chunking_does_not_change_the_result(scored):
    """teacher-pass.md D5: rows scored one at a time or all together give the same log-probs."""
    trainer, batch = scored
    blocks = ["Hint A", "Hint B", "Hint C", "Hint D"]
    together = teacher_logps(trainer, batch, blocks, batch_size=4)
    alone = teacher_logps(trainer, batch, blocks, batch_size=1)
    torch.testing.assert_close(together.with_block, alone.with_block, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(together.without_block, alone.without_block, atol=1e-5, rtol=1e-5)


def test_reference_needs_a_reference_model(scored):
    """teacher-pass.md D2: with β = 0 and no adapter there is no reference; the error names both ways to get one."""
    trainer, batch = scored
    with pytest.raises(ValueError, match="beta > 0.*PEFT adapter"):
        teacher_logps(trainer, batch, ["H"] * 4, source="reference")
    with pytest.raises(ValueError, match="source must be one of"):
        teacher_logps(trainer, batch, ["H"] * 4, source="oracle")
    with pytest.raises(ValueError, match="got 3 blocks for 4 rows"):
        teacher_logps(trainer, batch, ["H"] * 3)


def test_reference_under_lora_is_the_base_model(tiny_model_folder, tmp_path):
    """teacher-pass.md D1-D2: under LoRA the policy source scores with the adapter (no copy of the weights) and the
    reference source with the adapter disabled, which is the saved base model."""
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM

    data = Dataset.from_list([{"prompt": "say apple", "task": {"words": ["apple", "river", "stone"]}}] * 2)
    args = AgentGRPOConfig(
        output_dir=str(tmp_path),
        per_device_train_batch_size=4,
        num_generations=2,
        max_completion_length=30,
        max_turn_tokens=4,
        **CPU_ARGS,
    )
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    trainer = RecordingTrainer(
        model=tiny_model_folder, train_dataset=data, args=args, env_factory=lambda r: EchoEnv(), peft_config=lora
    )
    with torch.no_grad():  # a trained-looking adapter: LoRA starts as the identity (B = 0)
        for name, p in trainer.model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.5)
    trainer.model.train()
    torch.manual_seed(0)
    trainer.generate_and_score([dict(r) for r in data] * 2)
    batch = trainer.seen
    blocks = ["Hint: apple."] * 4
    policy = teacher_logps(trainer, batch, blocks, source="policy")
    reference = teacher_logps(trainer, batch, blocks, source="reference")
    base = AutoModelForCausalLM.from_pretrained(tiny_model_folder).eval()
    n = int(batch.completion_mask[0].sum())
    completion = batch.completion_ids[0, :n].tolist()
    prompt = render_prompt_ids(
        trainer.processing_class, with_privileged_block(batch.rows[0]["prompt_messages"], blocks[0]), None
    )
    want_reference = plain_logps(base, prompt, completion, 1.0)
    torch.testing.assert_close(reference.with_block[0, :n], want_reference, atol=1e-5, rtol=1e-5)
    trainer.model.eval()
    want_policy = plain_logps(trainer.model, prompt, completion, 1.0)  # the adapted model, as it is
    torch.testing.assert_close(policy.with_block[0, :n], want_policy, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(want_policy, want_reference, atol=1e-3)  # the adapter does change the scores
