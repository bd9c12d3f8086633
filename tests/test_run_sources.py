"""`agent_trl.sources`, called directly: `audit_filter`'s counts, `env_rows`' columns, and `load_sources` on an
environment's generated tasks, a single-turn dataset, and the mistakes it stops on (tests/test_audit_filter.py and
tests/test_dataset_runs.py run them through `train.main`)."""

import json
from types import SimpleNamespace

import pytest
from conftest import EchoEnv

from agent_trl.arguments import RunArguments
from agent_trl.sources import audit_filter, env_rows, load_sources


def audit_folder(tmp_path, accepted: list[dict], rejected: list[dict]):
    folder = tmp_path / "audit"
    folder.mkdir()
    for name, records in [("accepted.jsonl", accepted), ("rejected.jsonl", rejected)]:
        (folder / name).write_text("".join(json.dumps(r) + "\n" for r in records))
    return folder


TASKS = [
    {"task_id": "a", "instruction": "make a file"},  # accepted, repaired: trains with the audit's task
    {"task_id": "b", "instruction": "impossible"},  # rejected
    {"task_id": "c", "instruction": "never audited"},
    {"task_id": "d", "instruction": "fine"},  # accepted as it is (the record carries no task)
    {"instruction": "no task_id"},  # cannot be matched: never audited
]
ACCEPTED = [{"task_id": "a", "repaired": True, "task": {"task_id": "a", "instruction": "make a file named x.txt"}},
            {"task_id": "d", "repaired": False}]  # fmt: skip


def test_audit_filter_keeps_the_accepted_tasks_and_counts_the_rest(tmp_path, capsys):
    folder = audit_folder(tmp_path, ACCEPTED, [{"task_id": "b"}])
    kept, counts = audit_filter(TASKS, str(folder))
    assert kept == [(0, {"task_id": "a", "instruction": "make a file named x.txt"}), (3, TASKS[3])]
    assert counts == {"folder": str(folder), "tasks": 5, "kept": 2, "repaired": 1, "dropped_rejected": 1,
                      "dropped_unaudited": 2, "kept_unaudited": 0}  # fmt: skip
    assert capsys.readouterr().out == (
        "audit filter: 2 of 5 training tasks kept (1 rejected, 2 never audited, 1 repaired)\n"
    )


def test_audit_filter_can_keep_the_unaudited_tasks(tmp_path):
    folder = audit_folder(tmp_path, ACCEPTED, [{"task_id": "b"}])
    kept, counts = audit_filter(TASKS, str(folder), keep_unaudited=True)
    assert [i for i, _ in kept] == [0, 2, 3, 4]  # in the order of `tasks`
    assert (counts["kept"], counts["kept_unaudited"], counts["dropped_unaudited"]) == (4, 2, 0)


def test_task_ids_are_matched_as_text(tmp_path):
    folder = audit_folder(tmp_path, [{"task_id": "7"}], [])  # rewards.audit writes str(task_id)
    kept, _ = audit_filter([{"task_id": 7}], str(folder))
    assert kept == [(0, {"task_id": 7})]


def test_a_folder_without_audit_records_stops(tmp_path):
    with pytest.raises(SystemExit) as err:
        audit_filter(TASKS, str(tmp_path))
    assert err.value.code == (
        f"error: audit_filter {str(tmp_path)!r} holds no accepted.jsonl or rejected.jsonl (the --out folder of python "
        "-m rewards.audit)"
    )


def test_a_filter_that_keeps_nothing_stops(tmp_path):
    folder = audit_folder(tmp_path, [], [{"task_id": "b"}])
    with pytest.raises(SystemExit, match=r"leaves no training task \(1 rejected, 1 never audited\)"):
        audit_filter(TASKS[1:3], str(folder))


def test_env_rows_prompt_with_the_first_observation():
    source = SimpleNamespace(factory=lambda task: EchoEnv())
    tasks = [{"words": ["apple", "river"]}, {"words": ["stone"]}]
    assert env_rows(source, tasks).to_list() == [
        {"prompt": "say apple", "task": '{"words": ["apple", "river"]}', "task_id": 0},  # no task_id: the index
        {"prompt": "say stone", "task": '{"words": ["stone"]}', "task_id": 1},
    ]
    named = env_rows(source, [{"words": ["amber"], "task_id": "t-9"}])
    assert named.to_list() == [
        {"prompt": "say amber", "task": '{"words": ["amber"], "task_id": "t-9"}', "task_id": "t-9"}
    ]


def config(**fields) -> SimpleNamespace:
    return SimpleNamespace(**{"max_completion_length": 64, "reward_weights": None, **fields})


def test_an_environment_generates_its_tasks():
    run = RunArguments(num_train_tasks=4, num_eval_tasks=2)  # neither environment nor dataset: shop
    sources = load_sources(run, config())
    assert run.environment == "shop" and sources.environment.name == "shop" and sources.described == "shop tasks"
    assert len(sources.train) == 4 and len(sources.eval_rows) == 2
    assert sources.reward_funcs is None and sources.audit is None and sources.environment_kwargs is None
    first = json.loads(sources.train[0]["task"])
    assert sources.train[0]["prompt"] == sources.environment.factory(first).first_observation(first)


def test_environment_kwargs_as_json_text_are_parsed():
    run = RunArguments(environment="shop", environment_kwargs="{}", num_train_tasks=2, num_eval_tasks=1)
    assert load_sources(run, config()).environment_kwargs == {}


def test_a_single_turn_dataset(tmp_path):
    data = tmp_path / "words.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"say {i}", "answer": str(i)}) + "\n" for i in range(20)))
    fields = dict(dataset_name=str(data), reward_funcs=["exact_match_reward"], num_eval_tasks=3)
    run = RunArguments(**fields)
    sources = load_sources(run, config())
    assert sources.environment is None and run.environment is None and len(sources.reward_funcs) == 1
    assert len(sources.train) == 17 and len(sources.eval_rows) == 3  # min(3, a fifth of 20) rows held out
    held_out = "3 rows held out of 'train' (no 'test' split)"
    assert sources.described == f"{data}: 17 training rows, 3 held-out rows ({held_out})"
    every = sorted([*sources.train["prompt"], *(r["prompt"] for r in sources.eval_rows)])
    assert every == sorted(f"say {i}" for i in range(20))
    cut = load_sources(RunArguments(**fields, num_train_tasks=5), config())
    assert cut.described == f"{data}: 5 training rows, 3 held-out rows ({held_out})"


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (dict(environment_kwargs="{size: 3}"), "error: environment_kwargs '{size: 3}' is not JSON ("),
        (dict(environment_kwargs="[3]"), "error: environment_kwargs must be a mapping of keyword arguments, got [3]"),
        (dict(environment="none", dataset_name="d.jsonl"), "error: dataset_name 'd.jsonl' without an environment "
         "trains single-turn GRPO and needs reward_funcs"),
        (dict(environment="none", dataset_name="d.jsonl", reward_funcs=["exact_match_reward"], audit_filter="audit"),
         "error: audit_filter filters an environment's tasks; a single-turn dataset has none"),
        (dict(environment="none", dataset_name="d.jsonl", reward_funcs=["exact_match_reward"], trainer="ppo"),
         "error: trainer 'ppo' needs an environment; a single-turn dataset trains with grpo"),
    ],
)  # fmt: skip
def test_mistakes_stop_before_any_data_is_read(fields, message):
    with pytest.raises(SystemExit) as err:
        load_sources(RunArguments(**fields), config())
    assert err.value.code.startswith(message)


def test_reward_weights_must_match_the_reward_functions():
    with pytest.raises(SystemExit) as err:  # an environment without reward_funcs has one reward: its own
        load_sources(RunArguments(environment="shop"), config(reward_weights=[1.0, 0.5]))
    assert err.value.code == "error: reward_weights has 2 entries for 1 reward functions"
