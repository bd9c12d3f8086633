"""The Experience Funnel's consolidation trainer and loop (docs/methods/funnel.md, arXiv 2609.08919): the distillation
loss through TRL's chunked kernel equals Eq. 4-7 computed here from full unpadded forwards, with the same gradient
(§7 properties 5, 7, 9); λ_d = 0 trains exactly as GRPO (property 8); the teacher snapshot never moves (property 7);
a rejected consolidation restores the weights bit for bit and a rejected state edit leaves the prompt unchanged
(properties 10, 12); the test split never reaches the loop's phases (property 17)."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from conftest import CPU_ARGS, EchoEnv
from datasets import Dataset

from trainers.agent_loop import render_prompt_ids
from trainers.base import AgentGRPOConfig, AgentGRPOTrainer
from trainers.funnel import FunnelConfig, FunnelTrainer
from trainers.funnel_loop import FunnelLoop, play_condition, snapshot
from trainers.funnel_state import Entry, State, render_state
from trainers.teacher import with_privileged_block

TASKS = EchoEnv.make_tasks("train", 6)
STATE = State([Entry("E1", "Repeat the word you are asked for, exactly."), Entry("E2", "One word per turn.")], 3)


def rows():
    return [{"prompt": "say", "task": t, "task_id": t["task_id"]} for t in TASKS[:2]]


def token_reward(completion_ids, **kwargs):
    """A reward that varies between rollouts of a random model (the echo reward is 0 for all of them)."""
    return [float(sum(ids) % 7) for ids in completion_ids]


def make_trainer(folder, out_dir, cls=FunnelTrainer, config=FunnelConfig, rewards=None, **fields):
    args = config(
        output_dir=out_dir,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=1,
        num_generations=2,
        max_completion_length=30,
        max_turn_tokens=4,
        temperature=0.7,
        max_steps=3,
        **CPU_ARGS,
        **fields,
    )
    data = Dataset.from_list(rows())
    trainer = cls(model=folder, reward_funcs=rewards, train_dataset=data, args=args, env_factory=lambda r: EchoEnv())
    if isinstance(trainer, FunnelTrainer):
        trainer.selection = {TASKS[0]["task_id"]: 1.0, TASKS[1]["task_id"]: 0.5}
        trainer.state_block = lambda row: render_state(STATE)
    return trainer


def full_logps(model, prompt: list[int], completion: list[int], temperature: float, grad: bool = False):
    """(len(completion), V) log softmax(logits / τ) at each completion position, from one unpadded forward."""
    with torch.set_grad_enabled(grad):
        logits = model(input_ids=torch.tensor([prompt + completion])).logits[0].float() / temperature
    return torch.log_softmax(logits[len(prompt) - 1 : -1], dim=-1)


def test_distill_loss_matches_eq_4_to_7_from_full_forwards(tiny_model_folder, tmp_path):
    """For each selected row: the teacher (the snapshot) with and without the state gives the JSD D_t (Eq. 4) and the
    weights ω (Eq. 5, by hand here); the student on its state-free prompt and the teacher on prompt(x, S) give the
    reverse KL (Eq. 6); Eq. 7 weighs rows by c (1 and 0.5) over the 2 selected rows. Value and gradient agree."""
    trainer = make_trainer(tiny_model_folder, str(tmp_path), distillation_weight=1.0, distill_temperature=0.8)
    trainer.model.train()
    torch.manual_seed(0)
    inputs = [dict(r) for r in rows() for _ in range(2)]
    out = trainer.generate_and_score(inputs)
    tok, tau = trainer.processing_class, 0.8
    model, teacher = trainer.model, trainer.teacher_model
    c = out["funnel_c"]
    assert c.tolist() == [1.0, 1.0, 0.5, 0.5]
    expected_rows = []
    for b in range(4):
        n = int(out["completion_mask"][b].sum())
        completion = out["completion_ids"][b, :n].tolist()
        mask = out["tool_mask"][b, :n].bool()
        prompt = out["prompt_ids"][b][out["prompt_mask"][b].bool()].tolist()
        messages = inputs[b]["prompt_messages"]
        state_prompt = render_prompt_ids(tok, with_privileged_block(messages, render_state(STATE)), None)
        p_state = full_logps(teacher, state_prompt, completion, tau).double()
        p_plain = full_logps(teacher, prompt, completion, tau).double()
        m = 0.5 * (p_state.exp() + p_plain.exp())
        jsd = 0.5 * (p_state.exp() * (p_state - m.log())).sum(-1) + 0.5 * (p_plain.exp() * (p_plain - m.log())).sum(-1)
        d = torch.where(mask, jsd, torch.zeros_like(jsd))
        mean = d.sum() / mask.sum()
        omega = torch.where(mask, (1 + d / (mean + 1e-8)).clamp(0, 5), torch.zeros_like(d))  # Eq. 5, κ 1, ω_max 5
        assert torch.allclose(out["funnel_omega"][b, :n].double(), omega, atol=5e-4)  # fp32 ratios of small JSDs
        student = full_logps(model, prompt, completion, tau, grad=True).double()
        kl = (student.exp() * (student - p_state)).sum(-1)  # Eq. 6, reverse
        expected_rows.append((omega * kl).sum() / omega.sum() * c[b].item())
    expected = sum(expected_rows) / 4  # Eq. 7: four selected rows
    got = trainer.distill_loss(model, out)
    assert torch.allclose(got.double(), expected, atol=1e-5)
    param = model.model.layers[0].mlp.down_proj.weight
    g_expected = torch.autograd.grad(expected, param)[0]
    g_got = torch.autograd.grad(got, param)[0]
    assert torch.allclose(g_got, g_expected.float(), atol=1e-5, rtol=1e-4)


def test_rows_without_selection_get_no_teacher_prompt_and_no_distillation(tiny_model_folder, tmp_path):
    """Rows with c = 0 carry ω = 0 and do not enter L_distill; a micro-batch with none gives an exact 0 whose
    backward leaves zero gradients (D14, §7 property 8)."""
    trainer = make_trainer(tiny_model_folder, str(tmp_path), distillation_weight=1.0)
    trainer.selection = {TASKS[0]["task_id"]: 1.0}
    trainer.model.train()
    torch.manual_seed(0)
    out = trainer.generate_and_score([dict(r) for r in rows() for _ in range(2)])
    assert out["funnel_c"].tolist() == [1.0, 1.0, 0.0, 0.0]
    assert (out["funnel_omega"][2:] == 0).all() and (out["funnel_omega"][:2] > 0).any()
    none = {k: (v[2:] if isinstance(v, torch.Tensor) and v.dim() and v.shape[0] == 4 else v) for k, v in out.items()}
    loss = trainer.distill_loss(trainer.model, none)
    assert loss.item() == 0.0
    loss.backward()
    grads = [p.grad for p in trainer.model.parameters() if p.grad is not None]
    assert grads and all((g == 0).all() for g in grads)


def test_zero_distillation_weight_trains_exactly_as_grpo(tiny_model_folder, tmp_path):
    """λ_d = 0 (Eq. 9): three optimizer steps give bit-identical weights to the agent GRPO trainer's."""
    torch.manual_seed(0)
    funnel = make_trainer(tiny_model_folder, str(tmp_path / "f"), rewards=[token_reward], distillation_weight=0.0,
                          learning_rate=1e-3)  # fmt: skip
    funnel.train()
    torch.manual_seed(0)
    grpo = make_trainer(tiny_model_folder, str(tmp_path / "g"), cls=AgentGRPOTrainer, config=AgentGRPOConfig,
                        rewards=[token_reward], loss_type="grpo", learning_rate=1e-3)  # fmt: skip
    grpo.train()
    from transformers import AutoModelForCausalLM

    initial = dict(AutoModelForCausalLM.from_pretrained(tiny_model_folder).named_parameters())
    a, b = dict(funnel.model.named_parameters()), dict(grpo.model.named_parameters())
    assert all(torch.equal(a[n], b[n]) for n in a)
    assert any(not torch.equal(a[n], initial[n]) for n in a)  # both trained


def test_teacher_snapshot_never_moves(tiny_model_folder, tmp_path):
    """The frozen teacher (§7 property 7): no gradient, and bit-identical to its snapshot after training, while the
    policy moved."""
    trainer = make_trainer(tiny_model_folder, str(tmp_path), rewards=[token_reward], distillation_weight=0.5,
                           learning_rate=1e-2)  # fmt: skip
    before_teacher = {n: p.clone() for n, p in trainer.teacher_model.named_parameters()}
    before_policy = snapshot(trainer.model)
    trainer.train()
    assert all(p.grad is None and not p.requires_grad for p in trainer.teacher_model.parameters())
    assert all(torch.equal(p, before_teacher[n]) for n, p in trainer.teacher_model.named_parameters())
    assert any(not torch.equal(p, before_policy[n]) for n, p in trainer.model.named_parameters())
    logged = [row for row in trainer.state.log_history if "funnel/distill_loss" in row]
    assert logged and all(math.isfinite(row["funnel/distill_loss"]) for row in logged)


def test_peft_teacher_is_a_frozen_copy_of_the_adapter(tiny_model_folder, tmp_path):
    """With LoRA the teacher is a second adapter copied from the trained one (D3): equal at the start, unchanged by
    training, not trainable, removed by drop_teacher."""
    from peft import LoraConfig

    args = FunnelConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=2,
                        max_completion_length=30, max_turn_tokens=4, max_steps=2, learning_rate=1e-2,
                        **CPU_ARGS)  # fmt: skip
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    trainer = FunnelTrainer(model=tiny_model_folder, args=args, train_dataset=Dataset.from_list(rows()),
                            peft_config=lora, env_factory=lambda r: EchoEnv())  # fmt: skip
    trainer.selection = {t["task_id"]: 1.0 for t in TASKS}
    trainer.state_block = lambda row: render_state(STATE)
    params = dict(trainer.model.named_parameters())
    pairs = [(n, n.replace(".default.", f".{FunnelTrainer.TEACHER_ADAPTER}.")) for n in params if ".default." in n]
    assert pairs and all(torch.equal(params[a], params[b]) for a, b in pairs)
    frozen = {b: params[b].clone() for _, b in pairs}
    trainer.train()
    params = dict(trainer.model.named_parameters())
    assert all(torch.equal(params[b], frozen[b]) and not params[b].requires_grad for b in frozen)
    assert any(not torch.equal(params[a], frozen[b]) for a, b in pairs)
    trainer.drop_teacher()
    assert FunnelTrainer.TEACHER_ADAPTER not in trainer.model.peft_config


def loop(folder, tmp_path, **fields):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(folder)
    tok = AutoTokenizer.from_pretrained(folder, padding_side="left")
    args = dict(per_device_train_batch_size=4, num_generations=2, max_completion_length=30, max_turn_tokens=4,
                max_steps=2, rounds=2, consolidate_every=1, collect_tasks=4, selection_tasks=4, selection_rollouts=2,
                gate_tasks=4, gate_rollouts=2, learning_rate=1e-2, temperature=0.7)  # fmt: skip
    args.update(CPU_ARGS)
    args.update(fields)
    config = FunnelConfig(output_dir=str(tmp_path), **args)
    train_rows = [{"prompt": "say", "task": t, "task_id": t["task_id"]} for t in EchoEnv.make_tasks("train", 12)]
    test = EchoEnv.make_tasks("test", 4)
    return FunnelLoop(model, tok, config, train_rows, test, lambda row: EchoEnv(), "echo")


def test_rejected_gates_leave_weights_and_prompt_bit_for_bit(tiny_model_folder, tmp_path, monkeypatch):
    """With a gate no candidate can pass (z = 1e9), every state edit and every consolidation is rejected: the state
    stays empty (prompt(x, S) is the plain prompt) and the weights equal the initial ones bit for bit, although each
    consolidation trained (§7 properties 10 and 12)."""
    run = loop(tiny_model_folder, tmp_path, gate_z=1e9)
    initial = snapshot(run.model)
    trained = []
    original = FunnelLoop._trainer

    def spy(self, *a):
        trainer = original(self, *a)
        trained.append(trainer)
        return trainer

    monkeypatch.setattr(FunnelLoop, "_trainer", spy)
    result = run.run()
    assert len(trained) == 2 and all(t.state.global_step == 2 for t in trained)
    checkpoints = [h for h in result["history"] if h["kind"] == "checkpoint"]
    assert len(checkpoints) == 2 and not any(h["accept"] for h in checkpoints)
    assert result["state"]["entries"] == []
    assert all(torch.equal(p, initial[n]) for n, p in run.model.named_parameters())
    assert render_state(State.from_dict(result["state"])) is None


def test_test_split_never_reaches_the_loop(tiny_model_folder, tmp_path, monkeypatch):
    """Split hygiene (D16, §7 property 17): every task the loop's phases play (evidence, gates, selection,
    consolidation batches) is a training or selection-validation task; test tasks appear only in the final report."""
    run = loop(tiny_model_folder, tmp_path)
    test_ids = {t["task_id"] for t in run.test_tasks}
    seen = []
    real = play_condition

    def spy(model, tok, factory, tasks, *a, **k):
        seen.append([t["task_id"] for t in tasks])
        return real(model, tok, factory, tasks, *a, **k)

    monkeypatch.setattr("trainers.funnel_loop.play_condition", spy)
    batches = []
    original = FunnelTrainer.generate_and_score

    def spy_batches(self, inputs):
        batches.append([r["task_id"] for r in inputs])
        return original(self, inputs)

    monkeypatch.setattr(FunnelTrainer, "generate_and_score", spy_batches)
    run.run()
    first = next(i for i, ids in enumerate(seen) if set(ids) & test_ids)  # the final report starts here
    assert first > 0 and all(set(ids) == test_ids for ids in seen[first:])
    for ids in seen[:first]:
        assert not set(ids) & test_ids
    assert batches and not any(test_ids & {str(x) for x in b} for b in batches)
    sel = {r["task_id"] for r in run.sel_rows}
    assert not sel & {r["task_id"] for r in run.train_rows}


KILLED_LOOP = """
import os, signal, sys
sys.path.insert(0, "tests")
import torch
import test_funnel_trainer as t
from trainers.funnel_loop import FunnelLoop

folder, out, phase = sys.argv[1], sys.argv[2], sys.argv[3]
commit = FunnelLoop.commit

def commit_then_die(self, name):
    commit(self, name)
    if name == phase:
        os.kill(os.getpid(), signal.SIGKILL)

def die_after_training(self, *a):
    trainer = original(self, *a)
    train = trainer.train

    def train_then_die(*args, **kw):
        train(*args, **kw)
        os.kill(os.getpid(), signal.SIGKILL)

    trainer.train = train_then_die
    return trainer

if phase == "inside-consolidation":
    original = FunnelLoop._trainer
    FunnelLoop._trainer = die_after_training
else:
    FunnelLoop.commit = commit_then_die
t.seeded_loop(folder, out).run()
"""


class AcceptingLoop(FunnelLoop):
    """Accepts every candidate (the random echo model earns reward 0 everywhere, so no real gate would), so that the
    resumed run must read accepted weights back from disk."""

    def decide(self, candidate, incumbent, mode):
        return dataclasses.replace(super().decide(candidate, incumbent, mode), accept=True)


def seeded_loop(folder, out):
    torch.manual_seed(0)
    run = loop(folder, out)
    run.__class__ = AcceptingLoop
    return run


@pytest.mark.parametrize("phase", ["state-2", "inside-consolidation"])
def test_kill_9_then_resume_ends_where_the_uninterrupted_loop_ends(tiny_model_folder, tmp_path, phase):
    """A real SIGKILL of the loop, between two phases (after round 2's state phase was committed) or in the middle of
    a phase (after a consolidation trained, before its gate): started again on the same folder, the loop ends with
    the same gate decisions, state and weights (bit for bit) as a run never interrupted (funnel.md §4.2)."""
    import json
    import os
    import signal
    import subprocess
    import sys

    whole = seeded_loop(tiny_model_folder, tmp_path / "whole")
    expected = whole.run()
    killed = tmp_path / "killed"
    env = dict(os.environ, OMP_NUM_THREADS=str(torch.get_num_threads()))
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run([sys.executable, "-c", KILLED_LOOP, tiny_model_folder, str(killed), phase], cwd=repo,
                          env=env, timeout=600, capture_output=True, text=True)  # fmt: skip
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    committed = json.loads((killed / "funnel.json").read_text())
    assert committed["phase"] == ("state-2" if phase == "state-2" else "state-1")
    resumed = seeded_loop(tiny_model_folder, killed)
    got = resumed.run()

    def decisions(result):
        return [{k: v for k, v in h.items() if k != "time"} for h in result["history"]]

    assert decisions(got) == decisions(expected)
    assert got["state"] == expected["state"] and got["test"] == expected["test"]
    a, b = dict(resumed.model.named_parameters()), dict(whole.model.named_parameters())
    assert all(torch.equal(a[n], b[n]) for n in a)
    assert sum(h["kind"] == "checkpoint" and h["accept"] for h in expected["history"]) == 2
    assert (killed / "weights-2" / "weights.pt").is_file() and not (killed / "weights-1").exists()


SMALL = ["--tiny_privileged_frac", "0", "--tiny_sft_steps", "1", "--tiny_num_demos", "32", "--rounds", "2",
         "--collect_tasks", "4", "--selection_tasks", "4", "--gate_tasks", "4", "--max_steps", "2",
         "--per_device_train_batch_size", "8", "--num_generations", "4", "--num_train_tasks", "40",
         "--num_eval_tasks", "6", "--logging_steps", "1"]  # fmt: skip


def test_train_py_runs_the_loop_and_reports_it(tmp_path):
    """`python train.py --config configs/funnel_shop.yaml` (shrunk): the loop runs, summary.json holds the usual
    before/after evaluation, the loop's history, rollouts per phase and the test report, and the gate plot exists."""
    import json

    import train

    out = tmp_path / "run"
    summary = train.main(["--config", "configs/funnel_shop.yaml", *SMALL, "--output_dir", str(out)])
    saved = json.loads((out / "summary.json").read_text())
    assert saved["trainer"] == "funnel" and {"before", "after", "funnel"} <= set(saved)
    funnel = summary["funnel"]
    assert [h["kind"] for h in funnel["history"] if h["kind"] != "residual"] == ["state", "state", "checkpoint"]
    spent = funnel["rollouts"]
    assert spent["consolidation"] == 2 * 8 and spent["total"] == sum(v for k, v in spent.items() if k != "total")
    assert set(funnel["test"]) == {"policy_state_free", "policy_residual_state", "policy_full_state",
                                   "initial_state_free"}  # fmt: skip
    assert (out / "funnel.json").is_file() and (out / "funnel.png").is_file()
    rows = [r for r in saved["log_history"] if "rollouts_spent" in r]
    assert rows and all(r["rollouts_spent"] >= r["step"] * 8 for r in rows)


def test_an_unreachable_editor_stops_the_run_at_start_up(tmp_path, monkeypatch):
    """The API editor's endpoint is probed before any model is built, as the judges' are."""
    import train
    from agent_trl import run_info

    monkeypatch.setattr(run_info, "tiny_model", lambda *a, **k: pytest.fail("built a model before probing the editor"))
    argv = ["--config", "configs/funnel_shop.yaml", *SMALL, "--output_dir", str(tmp_path), "--editor", "openai",
            "--editor_model", "m", "--editor_base_url", "http://127.0.0.1:9/v1"]  # fmt: skip
    with pytest.raises(SystemExit, match="editor_base_url"):
        train.main(argv)
