"""The TRL boundary (trainers/trl_api.py): every private name it uses exists in the installed TRL and transformers with
the signature it is called with; no other project file uses a private name of TRL's or transformers' trainer, config
or internal modules; the CPU switches are made only inside a trainer's passes; the trainers' imports form no circle."""

import ast
import importlib
import inspect
import re
from pathlib import Path

import pytest
import torch
import transformers
import trl

from trainers.trl_api import PRIVATE, cpu_fast_paths

ROOT = Path(__file__).resolve().parent.parent
BOUNDARY = ROOT / "trainers" / "trl_api.py"

# Modules of TRL and transformers that are internals: imported only by the boundary. TRL's top level (`from trl
# import GRPOTrainer`), `trl.rewards`, `trl.chat_template_utils` and transformers' documented modules stay open.
INTERNAL_MODULES = (
    "trl.trainer",
    "trl.models",
    "trl.kernels",
    "trl.generation",
    "trl.extras",
    "transformers.cache_utils",
    "transformers.integrations.sdpa_attention",
    "transformers.integrations.deepspeed",
    "transformers.distributed",
    "transformers.trainer",  # also transformers.trainer_utils
)

# The parameters each private callable is called with, read off TRL 1.16.0 / transformers 5.24 by hand.
SIGNATURES = {
    ("trl.GRPOTrainer", "_generate_and_score_completions"): ["self", "inputs"],
    ("trl.GRPOTrainer", "_calculate_rewards"): ["self", "inputs", "prompts", "completions", "completion_ids_list"],
    ("trl.GRPOTrainer", "_compute_loss"): ["self", "model", "inputs"],
    ("trl.GRPOTrainer", "_get_per_token_logps_and_entropies"): [
        "self",
        "model",
        "input_ids",
        "attention_mask",
        "logits_to_keep",
        "batch_size",
        "compute_entropy",
        "compute_aux_loss",
    ],  # fmt: skip
    ("trl.GRPOTrainer", "_get_train_sampler"): ["self", "dataset"],
    ("transformers.Trainer", "_save_checkpoint"): ["self", "model", "trial"],
    ("transformers.Trainer", "_load_from_checkpoint"): ["self", "resume_from_checkpoint", "model"],
    ("transformers.Trainer", "_get_output_dir"): ["self", "trial"],
    ("trl.trainer.utils", "_use_triton"): ["device"],
    ("trl.trainer.utils", "add_fused_lm_head"): ["model", "temperature", "cast_lm_head_to_fp32"],
    ("trl.trainer.utils", "get_config_model_id"): ["config"],
    ("trl.trainer.utils", "create_model_from_path"): ["model_id", "architecture"],
    ("trl.trainer.utils", "use_adapter"): ["model", "adapter_name"],
    ("trl.trainer.utils", "disable_dropout_in_model"): ["model"],
    ("trl.models", "unwrap_model_for_generation"): ["model", "accelerator"],
    ("transformers.integrations.sdpa_attention", "use_gqa_in_sdpa"): ["attention_mask", "key", "value"],
    ("transformers.distributed.fsdp", "is_fsdp_managed_module"): ["module"],
    ("transformers.integrations.deepspeed", "is_deepspeed_zero3_enabled"): [],
}


def owner(name: str):
    module, _, attr = name.rpartition(".")
    if module in ("trl", "transformers") and attr[0].isupper():
        return getattr(importlib.import_module(module), attr)
    return importlib.import_module(name)


@pytest.mark.parametrize("where,name", [(w, n) for w, names in PRIVATE.items() for n in names])
def test_every_private_name_exists(where, name):
    obj = owner(where)
    if where == "trl.GRPOTrainer" and name in ("_metrics", "_step"):  # set in __init__: pinned in test_trl_parity
        assert f"self.{name} =" in inspect.getsource(trl.GRPOTrainer.__init__) + inspect.getsource(
            transformers.Trainer
        ), f"TRL no longer sets {name}"
        return
    if where == "transformers.PretrainedConfig":  # instance attributes of every loaded config
        config = transformers.PretrainedConfig(name_or_path="x")
        assert hasattr(config, name), f"transformers' configs no longer carry {name}"
        return
    assert hasattr(obj, name), f"{where}.{name} is gone: update trainers/trl_api.py"
    if (where, name) in SIGNATURES:
        params = list(inspect.signature(getattr(obj, name)).parameters)
        expected = SIGNATURES[(where, name)]
        assert params[: len(expected)] == expected, f"{where}.{name} is now {params}: update trainers/trl_api.py"


def test_every_private_callable_has_a_pinned_signature():
    callables = {
        (w, n)
        for w, names in PRIVATE.items()
        for n in names
        if callable(getattr(owner(w), n, None)) and not inspect.isclass(getattr(owner(w), n))
    }
    assert callables <= set(SIGNATURES), sorted(callables - set(SIGNATURES))


def private_trainer_names() -> set[str]:
    """Private names of TRL's and transformers' trainers and configs: class attributes, `self._x = ...` in their
    sources, and private module-level names of TRL's trainer utilities and transformers' attention integration."""
    names = {n for n in dir(trl.GRPOTrainer) if n.startswith("_") and not n.startswith("__")}
    for module in (trl.trainer.grpo_trainer, transformers.trainer, transformers.configuration_utils):
        names |= set(re.findall(r"self\.(_[a-z]\w*)\s*=", inspect.getsource(module)))
    names |= {n for n in vars(transformers.PretrainedConfig(name_or_path="x")) if n.startswith("_")}
    import transformers.integrations.sdpa_attention as sdpa
    import trl.trainer.utils as utils

    for module in (utils, sdpa):
        names |= {n for n in vars(module) if n.startswith("_") and not n.startswith("__")}
    return names


def uses(path: Path, private: set[str]) -> list[str]:
    """`line: what` for every use of a private name or an internal module in the file at `path`."""
    found = []
    tree = ast.parse(path.read_text(), filename=str(path))
    methods = {  # methods of classes that extend something: an override of a trainer's private method shows here
        id(item)
        for node in ast.walk(tree)
        if isinstance(node, ast.ClassDef) and node.bases
        for item in node.body
        if isinstance(item, ast.FunctionDef)
    }
    for node in ast.walk(tree):
        what = None
        if isinstance(node, ast.Attribute) and node.attr in private:
            what = f".{node.attr}"
        elif isinstance(node, ast.FunctionDef) and id(node) in methods and node.name in private:
            what = f"def {node.name}"
        elif isinstance(node, ast.ImportFrom) and node.module:
            if node.module.startswith(INTERNAL_MODULES):
                what = f"from {node.module} import ..."
            elif node.module in ("trl", "transformers") and any(a.name.startswith("_") for a in node.names):
                what = f"from {node.module} import _..."
        elif isinstance(node, ast.Import):
            hits = [a.name for a in node.names if a.name.startswith(INTERNAL_MODULES)]
            what = f"import {hits[0]}" if hits else None
        if what:
            found.append(f"{node.lineno}: {what}")
    return found


def project_files() -> list[Path]:
    skip = ("tests", ".venv", "build", "runs", "notebooks")
    return [
        p for p in ROOT.rglob("*.py") if not set(p.relative_to(ROOT).parts) & set(skip) and p != BOUNDARY
    ]  # fmt: skip


def test_no_file_outside_the_boundary_uses_trl_private_api():
    private = private_trainer_names()
    assert {"_generate_and_score_completions", "_metrics", "_step", "_use_triton", "_attn_implementation"} <= private
    offenders = {str(p.relative_to(ROOT)): hits for p in project_files() if (hits := uses(p, private))}
    assert offenders == {}, f"TRL/transformers internals outside trainers/trl_api.py: {offenders}"


def test_the_boundary_uses_what_it_lists():
    """The scan finds, in the boundary itself, the trainer and config names of `PRIVATE` (so the scan would see them
    elsewhere too) and an import for every internal module `PRIVATE` names."""
    hits = uses(BOUNDARY, private_trainer_names())
    attributes = {h.split(": ")[1] for h in hits}
    for where in ("trl.GRPOTrainer", "transformers.Trainer", "transformers.PretrainedConfig"):
        for name in PRIVATE[where]:
            assert f".{name}" in attributes, name
    source = BOUNDARY.read_text()
    for where in PRIVATE:
        if where.islower():  # a module
            package, _, module = where.rpartition(".")
            imported = (f"from {where} import", f"import {where}", f"from {package} import {module}")
            assert any(form in source for form in imported), where


def test_the_scan_sees_a_private_use(tmp_path):
    """The scan is not blind: a file that overrides and calls TRL's private methods and imports an internal module is
    reported line by line."""
    path = tmp_path / "probe.py"
    path.write_text(
        "from trl.trainer.utils import use_adapter\n"
        "class T(Base):\n"
        "    def _compute_loss(self, model, inputs):\n"
        "        return super()._compute_loss(model, inputs) + self._metrics\n"
    )
    hits = uses(path, private_trainer_names())
    assert sorted(hits) == ["1: from trl.trainer.utils import ...", "3: def _compute_loss", "4: ._compute_loss",
                            "4: ._metrics"]  # fmt: skip


# --------------------------------------------------------------------------------------------------------------------
# The CPU switches


def switches():
    import transformers.integrations.sdpa_attention as sdpa
    import trl.trainer.utils as utils

    return utils._use_triton, sdpa.use_gqa_in_sdpa


def test_importing_the_trainers_switches_nothing():
    import subprocess
    import sys

    code = (
        "import trl.trainer.utils as u, transformers.integrations.sdpa_attention as s\n"
        "before = (u._use_triton, s.use_gqa_in_sdpa)\n"
        "import trainers, train\n"
        "assert (u._use_triton, s.use_gqa_in_sdpa) == before, 'switched at import'\n"
    )
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, capture_output=True)


def test_switches_nest_and_are_undone_on_error():
    own = switches()
    cpu = torch.device("cpu")
    assert own[0](cpu) is False  # TRL's choice on a CPU: no Triton, so no compact path
    with cpu_fast_paths():
        inner = switches()
        assert inner[0] is not own[0] and inner[0](cpu) is True
        assert inner[0].__wrapped__ is own[0] and inner[1].__wrapped__ is own[1]
        with cpu_fast_paths():
            assert switches() == inner  # not wrapped twice
        assert switches() == inner  # the inner block leaves them on
    assert switches() == own
    with pytest.raises(RuntimeError, match="inside"):
        with cpu_fast_paths():
            raise RuntimeError("inside")
    assert switches() == own


def test_a_trainer_switches_only_while_it_trains(tiny_model_folder, tmp_path, monkeypatch):
    """`train()` runs with the switches on (seen from inside a reward function) and leaves them as they were."""
    from conftest import CPU_ARGS
    from datasets import Dataset

    from trainers.base import AgentGRPOConfig, AgentGRPOTrainer

    own, seen = switches(), []

    def reward(completions, **kwargs):
        seen.append(switches())
        return [float(len(c) % 3) for c in completions]

    data = Dataset.from_list([{"prompt": "say apple"}] * 4)
    args = AgentGRPOConfig(
        output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=4, max_completion_length=4,
        max_steps=1, **CPU_ARGS,
    )  # fmt: skip
    trainer = AgentGRPOTrainer(model=tiny_model_folder, reward_funcs=[reward], train_dataset=data, args=args)
    assert switches() == own
    trainer.train()
    assert seen and all(s[0].__wrapped__ is own[0] and s[1].__wrapped__ is own[1] for s in seen)
    assert switches() == own


def test_held_out_evaluation_runs_with_the_switches(tiny_model_folder):
    """Episodes played outside a trainer (the held-out evaluation) run with the same switches as training, and leave
    them as they were."""
    from conftest import EchoEnv
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from agent_trl.evaluation import evaluate
    from trainers.agent_loop import LoopSettings

    own, seen = switches(), []

    class Watched(EchoEnv):
        def reset(self, task):
            seen.append(switches())
            return super().reset(task)

    model = AutoModelForCausalLM.from_pretrained(tiny_model_folder)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_folder)
    tasks = [{"words": ["apple"]}] * 2
    evaluate(model, tokenizer, Watched, tasks, settings=LoopSettings(max_turn_tokens=2), progress=False)
    assert len(seen) == 2 and all(s[1].__wrapped__ is own[1] for s in seen)
    assert switches() == own


# --------------------------------------------------------------------------------------------------------------------
# The import graph


def import_graph(packages: tuple[str, ...]) -> dict[str, set[str]]:
    """module -> project modules it imports anywhere in its file (top level, inside functions, under TYPE_CHECKING).
    `from pkg import name` counts as importing `pkg.name` when that is a module; package `__init__` files are left
    out (they only re-export)."""
    modules = {}
    for package in packages:
        for path in (ROOT / package).rglob("*.py"):
            if path.name != "__init__.py":
                modules[".".join(path.relative_to(ROOT).with_suffix("").parts)] = path
    graph = {}
    for name, path in modules.items():
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
            elif isinstance(node, ast.Import):
                targets |= {a.name for a in node.names}
        graph[name] = {t for t in targets if t in modules and t != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every import circle, each once, as the path that closes it (depth-first search from every module)."""
    found, done = [], set()

    def visit(node, path):
        for nxt in sorted(graph[node]):
            if nxt in path:
                loop = path[path.index(nxt) :]
                start = loop.index(min(loop))
                key = tuple(loop[start:] + loop[:start])
                if key not in done:
                    done.add(key)
                    found.append([*key, key[0]])
            elif nxt not in finished:
                visit(nxt, [*path, nxt])
        finished.add(node)

    finished: set[str] = set()
    for start in sorted(graph):
        visit(start, [start])
    return found


def test_cycle_finder_finds_a_circle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c", "a"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_circle_in_the_project():
    graph = import_graph(("trainers", "envs", "rewards", "agent_trl"))
    assert "trainers.routing_replay" in graph["trainers.base"]  # the graph sees the imports it should
    assert cycles(graph) == []
    for layer in ("envs", "rewards"):  # environments and rewards know nothing about trainers (docs/layout.md)
        imported = set().union(*(graph[m] for m in graph if m.startswith(layer + ".")))
        assert not {m for m in imported if m.startswith("trainers.")}, layer
