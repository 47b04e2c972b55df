"""gymnasium: a real Gymnasium text environment (registered here with gymnasium.register)
through the adapter, the real multi-turn rollout with the embedded engine, and the CLI."""

from __future__ import annotations

import threading

import gymnasium
import numpy as np
import pytest
import torch
from gymnasium import spaces

import skyrl_environments.gymnasium_text as adapter_module
from skyrl_environments.gymnasium_text import Gymnasium, GymnasiumConfig
from skyrl_host.errors import UserError
from skyrl_host.interfaces import Environment, Episode, EnvStep, Task
from skyrl_host.multiturn import EnvWorkers, MultiTurnOptions, MultiTurnRollout, trajectory_seed

ALPHABET = "0123456789:+-?"
ENV_ID = "skyrl-test/HigherLower-v0"
HINT_IDS = {"+": [6], "-": [7], "?": [8]}
PROMPT_IDS = [3, 4, 5]


class Game:
    """What one game saw and answered."""

    def __init__(self, secret: int):
        self.secret = secret
        self.responses: list[str] = []
        self.rewards: list[float] = []
        self.closed = 0


GAMES: dict[int, Game] = {}  # by reset seed
GAMES_LOCK = threading.Lock()


class HigherLower(gymnasium.Env):
    """Find a secret digit: each response's first digit is a guess, answered '+' (higher),
    '-' (lower) or '?' (no digit). The secret is the task's answer, or drawn from the reset
    seed. ``observe``: 'text', 'ids' (numpy token ids), 'chat' (messages) or 'dict'."""

    metadata = {"render_modes": []}

    def __init__(self, observe: str = "text"):
        self.observe = observe
        text = spaces.Text(max_length=16, min_length=0, charset=ALPHABET)
        self.observation_space = {
            "text": text,
            "ids": spaces.Sequence(spaces.Discrete(16), stack=True),
            "chat": spaces.Sequence(spaces.Dict({"role": spaces.Text(16), "content": text})),
            "dict": spaces.Dict({"text": text, "guesses": spaces.Discrete(100)}),
        }[observe]
        self.action_space = spaces.Text(max_length=256, min_length=0)
        self.game: Game | None = None

    def _obs(self, text: str, ids: list[int]):
        if self.observe == "ids":
            return np.asarray(ids, dtype=np.int64)
        if self.observe == "chat":
            return ({"role": "user", "content": text},)
        if self.observe == "dict":
            return {"text": text, "guesses": len(self.game.responses)}
        return text

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        task = (options or {}).get("task") or {}
        secret = int(task["answer"]) if task.get("answer") else int(self.np_random.integers(10))
        self.explode_at = task.get("meta", {}).get("explode_at")
        self.game = Game(secret)
        with GAMES_LOCK:
            GAMES[seed] = self.game
        prompt = (options or {}).get("prefix", "") + task.get("prompt", ":")
        return self._obs(prompt, PROMPT_IDS), {"secret": secret}

    def step(self, action):
        game = self.game
        game.responses.append(action)
        if self.explode_at == len(game.responses):
            raise RuntimeError("the game crashed")
        digits = [c for c in action if c.isdigit()]
        guess = int(digits[0]) if digits else None
        won = guess == game.secret
        game.rewards.append(1.0 if won else 0.0)
        hint = "?" if guess is None else "+" if game.secret > guess else "-"
        info = {"guesses": len(game.responses), "well_formed": guess is not None, "won": np.bool_(won),
                "note": "not a number", "distance": float("nan") if guess is None else abs(game.secret - guess)}
        return self._obs(hint, HINT_IDS[hint]), np.float32(game.rewards[-1]), np.bool_(won), False, info

    def close(self):
        if self.game is not None:
            self.game.closed += 1


gymnasium.register(id=ENV_ID, entry_point=HigherLower, max_episode_steps=3)


def expected_game(game: Game) -> tuple[float, int, bool]:
    """(reward, turns, truncated) of a game from its responses alone."""
    for t, response in enumerate(game.responses[:3]):
        digits = [c for c in response if c.isdigit()]
        if digits and int(digits[0]) == game.secret:
            return 1.0, t + 1, False
    return 0.0, 3, True


# -- the adapter, driven directly ------------------------------------------------------


def test_a_game_maps_gymnasiums_api_onto_episodes():
    env = Gymnasium(GymnasiumConfig(env_id=ENV_ID, reset_options={"prefix": "?"}))
    episode = env.episode(Task(prompt=":", answer="7"), seed=5)
    assert isinstance(env, Environment) and isinstance(episode, Episode)
    assert episode.reset() == "?:"  # the task's prompt reached the env through reset's options, after the prefix
    steps = [episode.step(r) for r in ("5", "no guess", "it is 7")]
    episode.close()
    assert all(isinstance(s, EnvStep) for s in steps)
    assert [(s.observation, s.reward, s.done) for s in steps] == [("+", 0.0, False), ("?", 0.0, False),
                                                                 (None, 1.0, True)]
    # numbers of info (bools as 0/1) are metrics; text and NaN are left out; the end says how it ended
    assert steps[0].metrics == {"guesses": 1.0, "well_formed": 1.0, "won": 0.0, "distance": 2.0}
    assert steps[1].metrics == {"guesses": 2.0, "well_formed": 0.0, "won": 0.0}
    assert steps[2].metrics == {"guesses": 3.0, "well_formed": 1.0, "won": 1.0, "distance": 0.0, "truncated": 0.0}
    assert type(steps[2].reward) is float and steps[2].done is True  # numpy's float32 and bool_ converted
    assert GAMES[5].closed == 1 and GAMES[5].secret == 7


def test_the_time_limit_truncates_and_max_episode_steps_overrides_it():
    env = Gymnasium(GymnasiumConfig(env_id=ENV_ID))
    episode = env.episode(Task(prompt=":", answer="9"), seed=1)
    episode.reset()
    steps = [episode.step("0") for _ in range(3)]
    assert [s.done for s in steps] == [False, False, True]  # the registered max_episode_steps = 3
    assert steps[-1].observation is None and steps[-1].reward == 0.0 and steps[-1].metrics["truncated"] == 1.0
    longer = Gymnasium(GymnasiumConfig(env_id=ENV_ID, max_episode_steps=5)).episode(Task(prompt=":", answer="9"), seed=1)
    longer.reset()
    assert [longer.step("0").done for _ in range(5)] == [False] * 4 + [True]


def test_the_secret_is_a_pure_function_of_the_trajectory_seed():
    env = Gymnasium(GymnasiumConfig(env_id=ENV_ID))
    secrets = []
    for seed in (11, 12, 13, 14, 11):
        env.episode(Task(prompt=":"), seed=seed).reset()  # no answer: the env draws the secret from its seed
        secrets.append(GAMES[seed].secret)
    direct = gymnasium.make(ENV_ID)
    _obs, info = direct.reset(seed=12, options={"task": {"prompt": ":", "answer": None}})
    assert secrets[0] == secrets[-1] and info["secret"] == secrets[1]
    assert len(set(secrets)) > 1  # the seed matters


def test_token_ids_chat_and_dict_observations():
    task = Task(prompt=":", answer="2")
    ids = Gymnasium(GymnasiumConfig(env_id=ENV_ID, env_kwargs={"observe": "ids"})).episode(task, seed=0)
    first = ids.reset()
    assert first == PROMPT_IDS and all(type(i) is int for i in first)  # a numpy array becomes a list of ints
    assert ids.step("5").observation == HINT_IDS["-"]
    chat = Gymnasium(GymnasiumConfig(env_id=ENV_ID, env_kwargs={"observe": "chat"})).episode(task, seed=0)
    assert chat.reset() == [{"role": "user", "content": ":"}]
    assert chat.step("0").observation == [{"role": "user", "content": "+"}]
    with pytest.raises(UserError, match="environment.observation_key: 'skyrl-test/HigherLower-v0' observes a "
                                        "Dict \\('guesses', 'text'\\): name the entry that is the model's observation"):
        Gymnasium(GymnasiumConfig(env_id=ENV_ID, env_kwargs={"observe": "dict"}))
    keyed = Gymnasium(GymnasiumConfig(env_id=ENV_ID, env_kwargs={"observe": "dict"}, observation_key="text"))
    episode = keyed.episode(task, seed=0)
    assert episode.reset() == ":" and episode.step("9").observation == "-"


def test_job_start_errors_name_the_option():
    with pytest.raises(ValueError, match="expected a registered Gymnasium environment id, e.g."):
        GymnasiumConfig()  # env_id is required
    with pytest.raises(UserError) as err:
        Gymnasium(GymnasiumConfig(env_id=ENV_ID, env_kwargs={"colour": "red"}))
    assert "environment.env_kwargs: gymnasium.make('skyrl-test/HigherLower-v0', **env_kwargs) failed: TypeError" in \
        str(err.value) and "colour" in str(err.value)
    with pytest.raises(UserError, match="environment.env_id: 'CartPole-v1' takes Discrete\\(2\\) actions, but the "
                                        "model's response is text"):
        Gymnasium(GymnasiumConfig(env_id="CartPole-v1"))
    with pytest.raises(ValueError, match="found 'skyrl-test/HigherLowr-v0' \\(did you mean "
                                         "'skyrl-test/HigherLower-v0'\\?\\)"):
        GymnasiumConfig(env_id="skyrl-test/HigherLowr-v0")


# -- the real multi-turn rollout ---------------------------------------------------------


@pytest.fixture(scope="module")
def loaded():
    from skyrl_host.plugins import build_host

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    host = build_host()
    reg = host.registry.get("models", "qwen")
    yield host, reg.create(reg.config(preset="tiny")).load(alphabet=ALPHABET, seed=0)
    torch.set_num_threads(before)


def rollout(loaded, config: GymnasiumConfig, tasks: list[Task], n: int):
    host, model = loaded
    engine_reg = host.registry.get("engines", "embedded")
    engine = engine_reg.create(engine_reg.config())
    engine.start(model)
    sampler_reg = host.registry.get("samplers", "temperature")
    sampler = sampler_reg.create(sampler_reg.config(temperature=1.0))
    opts = MultiTurnOptions(max_turns=8, max_total_tokens=200, max_new_tokens=4, step_timeout=10.0, reward_gamma=1.0,
                            failed_trajectories="zero")
    mt = MultiTurnRollout(Gymnasium(config), engine, sampler, model.tokenizer, model.stop_token_ids, opts,
                          EnvWorkers(4))
    return mt.run(tasks, n, seed=7)


def segments(batch, i: int) -> list[tuple[int, list[int]]]:
    """Row i as runs of (loss mask value, token ids)."""
    lo, hi = batch.cu_seqlens[i], batch.cu_seqlens[i + 1]
    ids, mask = batch.tokens[lo:hi].tolist(), batch.loss_mask[lo:hi].tolist()
    runs: list[tuple[int, list[int]]] = []
    for t, m in zip(ids, mask):
        if runs and runs[-1][0] == m:
            runs[-1][1].append(t)
        else:
            runs.append((m, [t]))
    return runs


@pytest.mark.parametrize("observe", ["text", "ids"])
def test_games_play_through_the_multi_turn_rollout(loaded, observe):
    """Tiny random model, 2 secrets x 6 games: every trajectory's reward, length and
    rows are what the game's own rules give for the responses it received, the
    TimeLimit's truncation ends the lost games, and info numbers are env/ metrics."""
    _host, model = loaded
    tok, stop = model.tokenizer, set(model.stop_token_ids)
    tasks = [Task(prompt=":", answer="3"), Task(prompt=":", answer="8")]
    out = rollout(loaded, GymnasiumConfig(env_id=ENV_ID, env_kwargs={"observe": observe}), tasks, n=6)
    m = out.metrics
    assert m["env_failures"] == 0.0 and m["turn_limit_fraction"] == 0.0 and m["token_budget_fraction"] == 0.0
    games = [GAMES[trajectory_seed(7, i)] for i in range(12)]
    expected = [expected_game(g) for g in games]
    assert out.rewards.tolist() == [r for r, _, _ in expected]
    assert 0.0 < m["env/truncated"] < 1.0  # these seeds give won and lost games both
    assert m["turns_mean"] == pytest.approx(np.mean([t for _, t, _ in expected]))
    assert m["env/truncated"] == pytest.approx(np.mean([tr for _, _, tr in expected]))
    assert m["env/guesses"] == pytest.approx(np.mean([k + 1 for _, t, _ in expected for k in range(t)]))
    assert m["env/won"] == pytest.approx(sum(r for r, _, _ in expected) / sum(t for _, t, _ in expected))
    assert [g.secret for g in games] == [3] * 6 + [8] * 6 and all(g.closed == 1 for g in games)
    encode = (lambda s: list(tok.encode(s, add_special_tokens=False))) if observe == "text" else None
    for i, (game, (_, turns, _)) in enumerate(zip(games, expected)):
        assert len(game.responses) == turns
        runs = segments(out.batch, i)
        assert [m for m, _ in runs] == [0, 1] * turns and len(runs) == 2 * turns
        first = runs[0][1]
        assert first == (list(tok.encode(":")) if observe == "text" else PROMPT_IDS)
        for k in range(turns):
            text = tok.decode([t for t in runs[2 * k + 1][1] if t not in stop], skip_special_tokens=False)
            assert text == game.responses[k]  # the env got each response's text
            if k + 1 < turns:  # then its hint, rendered alone after the response's exact ids
                digits = [c for c in text if c.isdigit()]
                hint = "?" if not digits else "+" if game.secret > int(digits[0]) else "-"
                assert runs[2 * k + 2][1] == (encode(hint) if encode else HINT_IDS[hint])


def test_an_env_that_raises_in_step_fails_its_trajectory_not_the_rollout(loaded):
    tasks = [Task(prompt=":", answer="3"), Task(prompt=":", answer="3", meta={"explode_at": 1})]
    out = rollout(loaded, GymnasiumConfig(env_id=ENV_ID), tasks, n=2)
    m = out.metrics
    assert (m["env_failures"], m["env_errors"], m["env_timeouts"], m["env_malformeds"]) == (2.0, 2.0, 0.0, 0.0)
    games = [GAMES[trajectory_seed(7, i)] for i in range(4)]
    assert out.rewards.tolist()[2:] == [0.0, 0.0]  # failed trajectories train with reward 0
    assert out.rewards.tolist()[:2] == [expected_game(g)[0] for g in games[:2]]
    assert [len(g.responses) for g in games[2:]] == [1, 1] and all(g.closed == 1 for g in games)


# -- the job file and the CLI ------------------------------------------------------------


@pytest.fixture
def games_module(tmp_path, monkeypatch):
    """A module that registers the game, as a third party's package would."""
    name = f"skyrl_test_games_{abs(hash(str(tmp_path))) % 10**8}"
    (tmp_path / f"{name}.py").write_text(
        "import gymnasium\n"
        f"gymnasium.register(id='skyrl-cli/HigherLower-v0', entry_point={HigherLower.__module__ + ':HigherLower'!r},"
        " max_episode_steps=3)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield name
    gymnasium.registry.pop("skyrl-cli/HigherLower-v0", None)


def with_plugin(skyrl_host, skyrl_plugin):
    if "gymnasium" not in skyrl_host.registry.names("environments"):  # before its entry point is installed
        skyrl_plugin(adapter_module, "gymnasium")


def test_skyrl_validate_names_an_unknown_env_id_and_a_module_that_does_not_import(
        skyrl_host, skyrl_plugin, skyrl_cli, games_module, tmp_path):
    with_plugin(skyrl_host, skyrl_plugin)
    job = tmp_path / "job.toml"

    def validate(environment: str):
        job.write_text('[job]\nkind = "rl"\nsteps = 1\n[model]\nfamily = "qwen"\npreset = "tiny"\n'
                       f'[dataset]\nname = "guess_number"\n[environment]\nname = "gymnasium"\n{environment}\n')
        return skyrl_cli("validate", str(job))

    result = validate(f'module = "{games_module}"\nenv_id = "skyrl-cli/HigherLowr-v0"')
    assert result.exit_code == 2 and "Traceback" not in result.stderr
    assert "environment.env_id: expected a registered Gymnasium environment id, found 'skyrl-cli/HigherLowr-v0' " \
           f"(did you mean 'skyrl-cli/HigherLower-v0'?); not in gymnasium.registry after importing " \
           f"'{games_module}'" in result.stderr
    result = validate('module = "no_such_games"\nenv_id = "skyrl-cli/HigherLower-v0"')
    assert result.exit_code == 2
    assert "environment.module: cannot import 'no_such_games': ModuleNotFoundError: No module named " \
           "'no_such_games'" in result.stderr
    assert "environment.env_id" not in result.stderr  # one problem, named once
    result = validate('env_id = "mygames/Wordle-v7"')
    assert result.exit_code == 2
    assert "found 'mygames/Wordle-v7'; not in gymnasium.registry (set module = \"pkg.mod\" to import the module that " \
           "registers it)" in result.stderr
    assert validate(f'module = "{games_module}"\nenv_id = "skyrl-cli/HigherLower-v0"').exit_code == 0
    assert validate(f'env_id = "{games_module}:skyrl-cli/HigherLower-v0"').exit_code == 0  # gymnasium's own form


def test_skyrl_run_trains_on_a_gymnasium_game(skyrl_host, skyrl_plugin, skyrl_cli, skyrl_tiny_rl_job, games_module,
                                             tmp_path):
    with_plugin(skyrl_host, skyrl_plugin)
    job = skyrl_tiny_rl_job(
        tmp_path, "gym", job={"steps": 2, "batch_size": 4, "n_samples": 4, "max_new_tokens": 3, "max_turns": 4,
                              "max_total_tokens": 64},
        dataset={"name": "guess_number", "min_len": None, "max_len": None, "prefix": None},
        environment={"name": "gymnasium", "module": games_module, "env_id": "skyrl-cli/HigherLower-v0"})
    result = skyrl_cli("run", str(job.path))
    assert result.exit_code == 0, result.stderr
    rows = job.rows()
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert r["env_failures"] == 0.0 and r["turn_limit_fraction"] == 0.0  # every game ended itself
        assert 1.0 <= r["turns_mean"] <= 3.0 and r["env/guesses"] >= 1.0
        # a game is won (reward 1) or truncated by the TimeLimit (reward 0)
        assert r["accuracy"] == pytest.approx(1.0 - r["env/truncated"]) and r["reward_mean"] == r["accuracy"]
