"""β-OPSD's trainer (docs/methods/beta-opsd.md): TRL's loss fed with A = −G has Eq. 9's gradient (§7 item 14), the
teacher scores the rollout's own tokens after a prompt of another length (item 16), rows without a privileged text
carry no signal, and a train.py run logs the method's metrics."""

from __future__ import annotations

import json
import math

import pytest
import torch
from conftest import CPU_ARGS, EchoEnv
from datasets import Dataset

import train
from trainers.agent_loop import render_prompt_ids
from trainers.beta_opsd import BetaOPSDConfig, BetaOPSDTrainer, beta_opsd_loss, mixture_target_logps, reward_to_go
from trainers.teacher import with_privileged_block

HINTS = ["The words are apple, river, stone.", "", "Say apple, then river, then stone, one per turn.", None]


class Recording(BetaOPSDTrainer):
    def compute_advantages(self, batch):
        self.seen = batch
        self.adv = super().compute_advantages(batch)
        return self.adv


def scored_batch(folder, out_dir, **fields):
    """One generation batch of 4 echo episodes, the privileged text from a `hint` column (two rows without one)."""
    rows = [{"prompt": "say apple", "task": {"words": ["apple", "river", "stone"]}, "hint": h} for h in HINTS]
    data = Dataset.from_list(rows[:2])
    args = BetaOPSDConfig(
        output_dir=out_dir,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=1,
        num_generations=2,
        max_completion_length=30,
        max_turn_tokens=4,
        temperature=0.7,
        max_steps=10,
        opsd_privileged="column:hint",
        **CPU_ARGS,
        **fields,
    )
    trainer = Recording(model=folder, train_dataset=data, args=args, env_factory=lambda r: EchoEnv())
    trainer.model.train()
    torch.manual_seed(0)
    out = trainer.generate_and_score([dict(r) for r in rows])
    return trainer, out


@pytest.fixture(scope="module")
def scored(tiny_model_folder, tmp_path_factory):
    return scored_batch(tiny_model_folder, str(tmp_path_factory.mktemp("opsd")))


def unpadded_logps(model, prompt: list[int], completion: list[int], temperature: float) -> torch.Tensor:
    """log softmax(logits / temperature) of each completion token in one unpadded forward written here."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + completion])).logits[0].float() / temperature
    logp = torch.log_softmax(logits[len(prompt) - 1 : -1], dim=-1)
    return logp.gather(1, torch.tensor(completion).unsqueeze(1)).squeeze(1)


def test_advantages_follow_from_separate_forwards_of_student_and_teacher(scored):
    """§7 item 16 and Eq. 6-10 end to end: for each row with a hint, the student's log-probs (its own prompt) and the
    teacher's (the initial model with the hint after the task in the first user message: a longer prompt) are
    recomputed by unpadded forwards; ρ, the return-to-go and A = −G follow; rows without a hint get 0."""
    trainer, _ = scored
    batch, adv = trainer.seen, trainer.adv
    tok, temp = trainer.processing_class, trainer.temperature
    assert trainer.initial_model is not None  # no PEFT: a frozen copy of the initial weights (D3)
    w = 0.5  # step 0: teacher_weight_start
    for b, row in enumerate(batch.rows):
        n = int(batch.completion_mask[b].sum())
        completion = batch.completion_ids[b, :n].tolist()
        model_tokens = batch.mask[b, :n].bool()
        if not row["hint"]:
            assert (adv[b] == 0).all()
            continue
        prompt = batch.prompt_ids[b][batch.prompt_mask[b].bool()].tolist()
        teacher_prompt = render_prompt_ids(
            tok, with_privileged_block(row["prompt_messages"], row["hint"], "first_user_after_task"), None
        )
        assert len(teacher_prompt) > len(prompt)
        student = unpadded_logps(trainer.model, prompt, completion, temp).double()
        teacher = unpadded_logps(trainer.initial_model, teacher_prompt, completion, temp).double()
        target = torch.log((1 - w) * student.exp() + w * teacher.exp())  # Eq. 6, in probabilities
        rho = torch.where(model_tokens, student - target, torch.zeros_like(student))
        expected = torch.zeros(n, dtype=torch.float64)
        running = 0.0
        for t in range(n - 1, -1, -1):  # Eq. 8 by hand, γ = 0.99, environment tokens skipped
            if model_tokens[t]:
                running = rho[t].item() + 0.99 * running
                expected[t] = -running
        assert torch.allclose(adv[b, :n].double(), expected, atol=1e-5), b
        assert (adv[b, n:] == 0).all()


def unpadded_full_logps(model, prompt: list[int], completion: list[int], temperature: float) -> torch.Tensor:
    """(len(completion), V) log softmax(logits / temperature) at each completion position, one unpadded forward."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + completion])).logits[0].float() / temperature
    return torch.log_softmax(logits[len(prompt) - 1 : -1], dim=-1).double()


def test_logit_full_target_and_blending_follow_separate_full_forwards(tiny_model_folder, tmp_path):
    """`target_space: logit_full` (Eq. 5) with λ_d = 0.5 (Eq. 10): per row, the normalised geometric interpolant of
    the student's and the teacher's full next-token distributions, from unpadded forwards written here, gives ρ, G and
    A = 0.5·Â − 0.5·G; a row without a hint keeps 0.5·Â on its model tokens."""
    trainer, _ = scored_batch(
        tiny_model_folder, str(tmp_path), target_space="logit_full", distillation_weight=0.5, logz_chunk_rows=3
    )
    batch, adv, tok, temp, w = trainer.seen, trainer.adv, trainer.processing_class, trainer.temperature, 0.5
    for b, row in enumerate(batch.rows):
        n = int(batch.completion_mask[b].sum())
        completion = batch.completion_ids[b, :n].tolist()
        model_tokens = batch.mask[b, :n].bool()
        grpo = 0.5 * batch.advantages[b].double()
        if not row["hint"]:
            assert torch.allclose(adv[b, :n].double(), torch.where(model_tokens, grpo, 0.0), atol=1e-6)
            continue
        prompt = batch.prompt_ids[b][batch.prompt_mask[b].bool()].tolist()
        teacher_prompt = render_prompt_ids(
            tok, with_privileged_block(row["prompt_messages"], row["hint"], "first_user_after_task"), None
        )
        student = unpadded_full_logps(trainer.model, prompt, completion, temp)
        teacher = unpadded_full_logps(trainer.initial_model, teacher_prompt, completion, temp)
        mixed = (1 - w) * student + w * teacher  # Eq. 5, unnormalised
        ids = torch.tensor(completion).unsqueeze(1)
        target = mixed.gather(1, ids).squeeze(1) - torch.logsumexp(mixed, dim=-1)
        rho = torch.where(model_tokens, student.gather(1, ids).squeeze(1) - target, 0.0)
        expected, running = torch.zeros(n, dtype=torch.float64), 0.0
        for t in range(n - 1, -1, -1):
            if model_tokens[t]:
                running = rho[t].item() + 0.99 * running
                expected[t] = grpo - 0.5 * running
        assert torch.allclose(adv[b, :n].double(), expected, atol=1e-5), b
    logged = trainer.logged_metrics("train")
    assert logged["beta_opsd/logZ_mean"][-1] <= 0  # Eq. 11: log Z <= 0 with the current-student reference


def test_trl_loss_with_a_equal_minus_g_has_the_gradient_of_eq9(scored):
    """§7 item 14: num_iterations 1, λ_d = 1, TRL's beta 0, loss_type grpo: the gradient of TRL's loss with the
    trainer's advantages equals the gradient of Eq. 9 with G = −A, parameter by parameter."""
    trainer, out = scored
    model, mask = trainer.model, trainer.seen.mask
    trainer.current_gradient_accumulation_steps = 1  # as inside train() with gradient_accumulation_steps 1
    params = [p for p in model.parameters() if p.requires_grad]
    model.zero_grad()
    trainer.policy_loss(model, out).backward()
    trl_grads = [p.grad.clone() for p in params]
    model.zero_grad()
    logps, _, _ = trainer.forward_logps(model, out)
    beta_opsd_loss(logps, -out["advantages"].double(), mask).backward()  # Eq. 9
    for a, b in zip(trl_grads, [p.grad for p in params], strict=True):
        assert torch.allclose(a, b, atol=1e-7, rtol=1e-5)
    assert any(g.abs().sum() > 0 for g in trl_grads)  # the check is not vacuous
    model.zero_grad()


@pytest.mark.parametrize("seed", range(3))
def test_trainer_loss_on_random_returns_and_masks_is_eq9(scored, seed):
    """The trainer's loss path (`policy_loss`: TRL's GRPO loss, which β-OPSD does not override) on the scored
    micro-batch with random returns G (A = −G, any sign and scale, padding included) and a random model-token mask
    has, parameter by parameter, the gradient of `beta_opsd_loss` (Eq. 9) on the same log-probs, G and mask. Its
    value is Eq. 9's aggregation of G alone, (1/B) Σ_b (1/M_b) Σ_t m_t·G_t (the ratio is 1 at the rollout point),
    not Eq. 9's value: the two differ by a term without gradient."""
    trainer, out = scored
    model = trainer.model
    trainer.current_gradient_accumulation_steps = 1
    g = torch.Generator().manual_seed(seed)
    inputs = dict(out)
    B, T = inputs["completion_ids"].shape
    returns = 3.0 * torch.randn(B, T, generator=g, dtype=torch.float64)  # G
    inputs["advantages"] = (-returns).to(out["advantages"].dtype)  # the trainer's A = −G (Eq. 10 at λ_d = 1)
    tool = inputs.get("tool_mask", torch.ones_like(inputs["completion_mask"]))
    inputs["tool_mask"] = tool * (torch.rand(B, T, generator=g) < 0.7).to(tool.dtype)  # drop ~30% more tokens
    inputs["tool_mask"][0] = 0  # a row without model tokens contributes 0 (C6)
    mask = trainer.loss_mask(inputs)
    assert mask[1:].sum(-1).min() > 0 and not torch.equal(mask, trainer.loss_mask(out))
    params = [p for p in model.parameters() if p.requires_grad]
    model.zero_grad()
    loss = trainer.policy_loss(model, inputs)
    loss.backward()
    trl_grads = [p.grad.clone() for p in params]
    model.zero_grad()
    logps, _, _ = trainer.forward_logps(model, inputs)
    beta_opsd_loss(logps, returns.to(inputs["advantages"].dtype).double(), mask).backward()  # Eq. 9
    for a, b in zip(trl_grads, [p.grad for p in params], strict=True):
        torch.testing.assert_close(a, b, atol=1e-7, rtol=1e-5)
    assert any(t.abs().sum() > 0 for t in trl_grads)  # the check is not vacuous
    model.zero_grad()
    m = mask.double()
    g_used = returns.to(inputs["advantages"].dtype).double()
    value = ((g_used * m).sum(-1) / m.sum(-1).clamp(min=1)).mean()  # Eq. 9's aggregation of G, ratio 1
    assert loss.item() == pytest.approx(value.item(), rel=1e-5, abs=1e-6)


def test_teacher_gets_no_gradient_and_w_follows_the_global_step(scored):
    trainer, _ = scored
    assert all(p.grad is None for p in trainer.initial_model.parameters())
    trainer.state.global_step = 9  # the end of the 10-step schedule: w = 0.8
    batch = trainer.seen
    adv = BetaOPSDTrainer.compute_advantages(trainer, batch)
    logged = trainer.logged_metrics("train")
    assert logged["beta_opsd/teacher_weight"][-1] == pytest.approx(0.8)
    assert logged["beta_opsd/beta"][-1] == pytest.approx(1.25)
    trainer.state.global_step = 0
    assert adv.shape == batch.completion_ids.shape


def test_w_equal_one_is_vanilla_opsd():
    """At w = 1 the mixture target is the teacher itself, so −ρ is the vanilla OPSD signal logp_T − logp_old."""
    student, teacher = torch.log(torch.tensor([[0.2, 0.5]])), torch.log(torch.tensor([[0.6, 0.25]]))
    target = mixture_target_logps(student, teacher, 1.0)
    returns = reward_to_go(student - target, torch.ones(1, 2), 0.0)
    assert torch.allclose(-returns, (teacher - student).double())
    assert math.isclose(returns[0, 0].item(), math.log(0.2 / 0.6), rel_tol=1e-6)  # float32 inputs


def test_train_run_logs_the_method(tmp_path, monkeypatch):
    """A train.py run on tiny:shop built with privileged demonstrations: β-OPSD's metrics are logged and the schedule
    moves from 0.5 towards 0.8."""
    monkeypatch.setenv("AGENT_TRL_CACHE", str(tmp_path / "cache"))
    argv = ["--trainer", "beta_opsd", "--environment", "shop", "--model_name_or_path", "tiny:shop"]
    argv += ["--tiny_sft_steps", "1", "--tiny_num_demos", "32", "--tiny_privileged_frac", "0.5"]
    argv += ["--num_train_tasks", "16", "--skip_eval", "true", "--per_device_train_batch_size", "4"]
    argv += ["--num_generations", "2", "--max_turns", "2", "--max_turn_tokens", "8", "--max_completion_length", "64"]
    argv += ["--logging_steps", "1", "--report_to", "none", "--use_cpu", "true", "--bf16", "false", "--max_steps", "3"]
    summary = train.main([*argv, "--output_dir", str(tmp_path / "run")])
    steps = [row for row in summary["log_history"] if "loss" in row]
    assert [row["beta_opsd/teacher_weight"] for row in steps] == pytest.approx([0.5, 0.65, 0.8])
    assert all(row["beta_opsd/privileged_frac"] == 1.0 for row in steps)  # the shop expert always has a plan
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["trainer"] == "beta_opsd"


@pytest.mark.parametrize("name", ["shop", "search", "terminal"])
def test_the_privileged_plan_solves_the_task_and_leaves_the_env_alone(name):
    """beta-opsd.md D8: `Env.privileged` is the expert's actions from the start; replayed on a new environment they
    succeed, and computing them mid-episode does not move the caller's environment."""
    from envs import ENVIRONMENTS

    cls = ENVIRONMENTS[name]
    for task in cls.make_tasks("eval", 5, seed=4):
        env = cls()
        env.reset(task)
        env.step(env.expert_action())
        before = (env.state_key(), env.expert_action())
        plan = env.privileged(task)
        assert (env.state_key(), env.expert_action()) == before
        assert plan.startswith("Plan: ")
        replay, info = cls(), {}
        replay.reset(task)
        for action in plan[len("Plan: ") :].split(" | "):
            _, _, done, info = replay.step(action)
        assert done and info["success"]


def test_privileged_demonstrations_show_the_plan_and_follow_it():
    """A share of the tiny default's demonstrations holds the plan after the first observation (beta-opsd.md D8) and
    acts it out without noise; with the share 0 the demonstrations are those of the standard build."""
    from envs import ENVIRONMENTS
    from envs.tiny import TinySpec, demonstrations

    shop = ENVIRONMENTS["shop"]
    plain = demonstrations(shop, 40, seed=0, difficulty=0, noise=0.3)
    assert demonstrations(shop, 40, seed=0, difficulty=0, noise=0.3, privileged_frac=0.0) == plain
    mixed = demonstrations(shop, 40, seed=0, difficulty=0, noise=0.3, privileged_frac=0.5)
    shown = [d for d in mixed if "\n\nPlan: " in d[0]["content"]]
    assert 10 <= len(shown) <= 30  # about half of 40
    for demo in shown:
        plan = demo[0]["content"].split("\n\nPlan: ")[1].split(" | ")
        assert [m["content"] for m in demo if m["role"] == "assistant"] == plan
    assert TinySpec(env="shop").key() != TinySpec(env="shop", privileged_frac=0.5).key()
