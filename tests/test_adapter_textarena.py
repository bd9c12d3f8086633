"""The TextArena adapter (`envs/adapters/textarena.py`, `environment: textarena:<game id>`) on the package's real
GuessTheNumber-v0: a bisection player that reads only the hint words of the observations wins, the secret is the
one TextArena itself draws for the seed, Python's global `random` is left alone, TextArena's own invalid-move
handling, a budget cut inside `trainers.agent_loop.play`, the start-up errors (unknown game, two-player game, bad
environment_kwargs, package missing) and the tiny default's expert and demonstrations.

Expected values: GuessTheNumber-v0 draws from 1-20 (its prompt says so), so bisection on the hints needs at most
ceil(log2(21)) = 5 guesses; the secret of a seed is read from `textarena.make('GuessTheNumber-v0-raw')` reset with
that seed, independently of the adapter.
"""

from __future__ import annotations

import random

import pytest
import textarena

from envs.adapters import _adapter_class, adapter_class
from envs.sources import load_environment
from envs.tiny import build_tokenizer, check_expert, demonstrations
from tests.guess_the_number import bisect_play, package_secret
from trainers.agent_loop import LoopSettings, play

SPEC = "textarena:GuessTheNumber-v0"
INVALID_FORMAT = "You attempted an invalid move. Reason: Invalid move format."  # TextArena's SinglePlayerState text


@pytest.fixture(scope="module")
def game():
    return adapter_class(SPEC, {})


@pytest.fixture(scope="module")
def tasks(game):
    return game.make_tasks("train", 6, seed=0)


def test_bisection_on_the_hints_wins_within_five_guesses(game, tasks):
    for task in tasks:
        env = game()
        first = env.reset(task)
        assert "between 1 and 20" in first
        guesses, results = bisect_play(env, first)
        observation, reward, done, info = results[-1]
        assert len(guesses) <= 5  # ceil(log2(21)): 20 numbers
        assert guesses[-1] == package_secret(task["seed"])
        assert reward == 1.0 and done and info["success"] is True
        assert all(r[1] == 0.0 and not r[2] for r in results[:-1])  # the reward arrives at the end
        assert "Congratulations" in observation  # TextArena's own reason of the win


def test_the_secret_is_the_one_textarena_draws_for_the_seed(game, tasks):
    secrets = []
    for task in tasks:
        env = game()
        env.reset(task)
        secrets.append(env.game.game_number)
        assert env.game.game_number == package_secret(task["seed"])
    assert len(set(secrets)) > 1  # different seeds, different games


def test_global_random_is_unchanged_by_reset_and_step(game, tasks):
    random.seed(1234)
    before = random.getstate()
    env = game()
    env.reset(tasks[0])
    env.step("[10]")
    env.step("[3]")
    assert random.getstate() == before
    # and the caller's draws do not change the game: the same seed gives the same hints after other draws
    random.random()
    again = game()
    again.reset(tasks[0])
    assert again.game.game_number == env.game.game_number


def test_a_move_without_brackets_gets_textarenas_invalid_move_message_and_play_goes_on(game, tasks):
    env = game()
    env.reset(tasks[0])
    secret = package_secret(tasks[0]["seed"])
    observation, reward, done, info = env.step("ten")
    assert observation.startswith(INVALID_FORMAT)
    assert (reward, done, info["success"]) == (0.0, False, False)
    observation, reward, done, info = env.step(f"[{secret}]")  # a valid move after it is played
    assert (reward, done, info["success"]) == (1.0, True, True)


def test_moves_the_game_refuses_are_flagged_invalid(game, tasks):
    env = game()
    env.reset(tasks[0])
    secret = package_secret(tasks[0]["seed"])
    wrong = 1 if secret != 1 else 2
    assert env.step("ten")[3]["invalid"] is True  # no [number]: TextArena's first invalid move
    assert env.step(f"[{wrong}]")[3]["invalid"] is False  # a valid guess
    observation, _, done, info = env.step(f"[{wrong}]")  # guessed before: the game refuses it
    assert "already guessed" in observation and not done
    assert info["invalid"] is True


def test_two_invalid_moves_in_a_row_lose(game, tasks):
    env = game()
    env.reset(tasks[0])
    env.step("ten")
    observation, reward, done, info = env.step("eleven")
    # TextArena ends the game on the second error in a row, rewarding the closeness of the last valid guess: none
    # was made, so its completion is 0
    assert done and info["success"] is False and reward == 0.0
    assert "Invalid Move" in observation


def test_an_episode_that_never_ends_is_cut_by_the_turn_budget(tasks):
    cls = adapter_class(SPEC, {"turn_budget": 2})
    assert cls.max_turns == 2
    task = next(t for t in tasks if package_secret(t["seed"]) != 1)  # "[1]" must not win
    action = "[1]"  # first a valid guess, then a repeat (the game's first invalid move): never done in two turns
    tokenizer = build_tokenizer(["user assistant system", action, "The target number is higher."] * 20, 300)
    ids = tokenizer(action, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]

    def generate(contexts, max_new_tokens):
        return [(list(ids), [-0.1] * len(ids)) for _ in contexts]

    settings = LoopSettings(max_turn_tokens=64, max_completion_length=4000)
    (rollout,) = play(generate, tokenizer, [cls()], [task], settings=settings)
    assert rollout.truncated and rollout.done and not rollout.success
    assert [t["action"] for t in rollout.transcript] == [action, action]
    assert rollout.transcript[0]["observation"] == "The target number is higher."
    assert "already guessed" in rollout.transcript[1]["observation"]


def test_an_unknown_game_names_the_field_and_a_close_name():
    with pytest.raises(SystemExit) as e:
        load_environment("textarena:GuessTheNumbr-v0")
    assert "environment" in str(e.value) and "GuessTheNumbr-v0" in str(e.value)
    assert "GuessTheNumber-v0" in str(e.value).split("did you mean", 1)[1]


def test_a_two_player_game_is_refused():
    assert "TicTacToe-v0" in textarena.envs.registration.ENV_REGISTRY
    with pytest.raises(SystemExit) as e:
        load_environment("textarena:TicTacToe-v0")
    assert "not a single-player game" in str(e.value) and "TicTacToe-v0" in str(e.value)


def test_bad_environment_kwargs_name_the_field_and_the_key():
    with pytest.raises(SystemExit) as e:
        load_environment(SPEC, {"no_such_argument": 3})
    assert "environment_kwargs" in str(e.value) and "no_such_argument" in str(e.value)
    with pytest.raises(SystemExit) as e:
        load_environment(SPEC, {"turn_budget": 0})
    assert "environment_kwargs" in str(e.value) and "turn_budget" in str(e.value)


def test_a_word_game_without_its_nltk_data_stops_naming_it_and_downloads_nothing(tmp_path, monkeypatch):
    """Hangman reads NLTK's `words` corpus and calls nltk.download at import; with no NLTK data installed (an empty
    data path) the adapter must stop at start-up naming the resource, and never reach NLTK's downloader."""
    import nltk

    def no_network(*args, **kwargs):
        raise AssertionError("NLTK's downloader was called")

    monkeypatch.setattr(nltk.data, "path", [str(tmp_path)])
    monkeypatch.setattr(nltk.downloader.Downloader, "download", no_network)
    monkeypatch.setattr(nltk, "download", no_network)  # the adapter swaps this one out while a game is made
    _adapter_class.cache_clear()
    with pytest.raises(SystemExit) as e:
        adapter_class("textarena:Hangman-v0", {})
    message = str(e.value)
    assert "textarena:Hangman-v0" in message and "words" in message and "NLTK" in message
    assert nltk.download is no_network  # put back after the game was made


def test_game_arguments_reach_the_game():
    cls = adapter_class(SPEC, {"max_number": 8})
    env = cls()
    first = env.reset(cls.make_tasks("train", 1, seed=0)[0])
    assert "between 1 and 8" in first
    guesses, results = bisect_play(env, first)
    assert len(guesses) <= 4 and results[-1][3]["success"]  # ceil(log2(9)) = 4


def test_the_bisection_expert_passes_the_tiny_default_check(game):
    check_expert(game, f"tiny:{SPEC}", 0, n=5)


def test_a_game_without_expert_stops_the_tiny_default():
    hanoi = adapter_class("textarena:TowerOfHanoi-v0", {})
    with pytest.raises(SystemExit) as e:
        check_expert(hanoi, "tiny:textarena:TowerOfHanoi-v0", 0, n=2)
    assert "TowerOfHanoi-v0" in str(e.value) and "has none" in str(e.value) and "expert" in str(e.value)


def test_demonstrations_are_the_experts_moves_and_replay_to_success(game):
    demos = demonstrations(game, n=4, seed=0, difficulty=0, noise=0.0)
    tasks = game.make_tasks("train", 4, seed=0)
    for demo, task in zip(demos, tasks, strict=True):
        env = game()
        assert demo[0] == {"role": "user", "content": env.reset(task)}
        actions, observations = demo[1::2], demo[2::2]  # assistant turns, and what the game said after each
        assert {m["role"] for m in actions} == {"assistant"} and len(observations) == len(actions) - 1
        low, high, done, info = 1, 20, False, {}
        for k, action in enumerate(actions):
            guess = (low + high) // 2
            assert action["content"] == f"[{guess}]"  # bisection on the hints so far
            observation, _, done, info = env.step(action["content"])
            if done:
                break
            assert observations[k]["content"] == observation
            low, high = (guess + 1, high) if "higher" in observation else (low, guess - 1)
        assert k == len(actions) - 1
        assert done and info["success"]
        assert demo[-1]["role"] == "assistant"  # a finished episode ends on the winning move


def test_the_skill_text_is_the_bisection_the_expert_plays(game, tasks):
    """GuessTheNumber's skill text (what AlignOPSD's teacher reads) states the expert's rule: keep the range the hints
    leave and guess its middle. Played by its own words on the hint history, it picks the expert's action at every
    turn of an expert game; a game without a skill text gives ""."""
    from envs.base import SKILL_HEADER, skill_card

    assert "middle" in game.skill and "'higher'" in game.skill and "'lower'" in game.skill
    assert skill_card(game.skill).startswith(SKILL_HEADER)
    env = game()
    env.reset(tasks[0])
    low, high = 1, 20  # the skill's rule, applied by hand to the hints the game gives
    for _ in range(5):
        guess = (low + high) // 2
        assert env.expert_action() == f"[{guess}]"
        observation, _, done, _ = env.step(f"[{guess}]")
        if done:
            break
        low, high = (guess + 1, high) if "higher" in observation else (low, guess - 1)
    assert done
    assert adapter_class("textarena:TowerOfHanoi-v0", {}).skill == ""


def test_a_sound_guess_is_one_the_hints_still_allow(game, tasks):
    """`sound_action` (bench/credit_signal.py's `--label sound`): a guess inside the range the hints so far leave
    (which holds no earlier guess). The secret is read from the package, the range kept by hand from it, and every
    number from 1 to 20 checked at each turn against that range."""
    task = next(t for t in tasks if 3 <= package_secret(t["seed"]) <= 18)
    secret = package_secret(task["seed"])
    env = game()
    env.reset(task)
    low, high = 1, 20
    for guess in (1, 20, secret):  # one guess below the secret, one above, then the secret
        expected = set(range(low, high + 1))
        assert {n for n in range(1, 21) if env.sound_action(f"[{n}]")} == expected
        assert env.sound_action(f"I guess [ {guess} ] now") == (guess in expected)  # the first [n] of a move
        assert not env.sound_action("twelve") and not env.sound_action("[]")
        env.step(f"[{guess}]")
        low, high = (max(low, guess + 1), high) if guess < secret else (low, min(high, guess - 1))
    # the base rule elsewhere: the expert's action, whitespace and case ignored
    from envs.base import Env

    class One(Env):
        def expert_action(self):
            return "Go  North"

    assert One().sound_action("go north") and not One().sound_action("go south")
