"""Environment libraries as agents (agents/verifiers_env.py, agents/reasoning_gym.py, agents/textarena_env.py): the
real libraries, offline, through the real pool / server / engine; every reward a run records equals what the
library's own scoring returns for the same completion, re-scored here; a malformed environment costs its episode."""
import asyncio
import copy
import json
import random
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from transformers import AutoTokenizer

import molt
from conftest import agent_groups, run, small_config

ROOT = Path(__file__).resolve().parent.parent
ENVS = str(ROOT / "examples" / "verifiers")  # vf_qa, vf_calc (and tests/envs: vf_broken)
vf_agent = molt.import_path(str(ROOT / "agents" / "verifiers_env.py"))
rg_agent = molt.import_path(str(ROOT / "agents" / "reasoning_gym.py"))
ta_agent = molt.import_path(str(ROOT / "agents" / "textarena_env.py"))
SAMPLING = {"temperature": 1.0, "max_tokens": 24}


def agent_config(agent: str, env_id: str = "", **args) -> molt.Config:
    return small_config(agent=str(ROOT / "agents" / agent), **{"env.id": env_id, "env.args": json.dumps(args)})


def run_rows(engine, model, cfg, rows, n=2, runner=None, sampling=SAMPLING):
    """Each row's group of n episodes through an AgentPool (the agent module cfg names, or `runner`), sampled as
    the run's `sampling` says (its max_tokens is the cap of every request)."""
    async def main():
        pool = molt.AgentPool(cfg, cfg.agent, model, [engine])
        pool.runner = runner or pool.runner
        outs = [await pool.run_group(row, n, dict(sampling), uuid.uuid4().hex, i) for i, row in enumerate(rows)]
        await pool.server.stop()
        for cls in getattr(pool.runner, "agent_cls", object).__mro__:  # verifiers' serving contexts, in whichever
            close = getattr(vars(cls).get("run"), "__globals__", {}).get("close")  # copy of the module ran them
            if close is not None:
                await close()
        return outs
    return run(main())


def sampled_runs(s: molt.Sample) -> list[tuple]:
    """The token ids of each sampled turn of a Sample (its runs of mask 1)."""
    runs, cur = [], []
    for t, m in zip(s.tokens, s.mask):
        if m:
            cur.append(t)
        elif cur:
            runs, cur = runs + [tuple(cur)], []
    return runs + ([tuple(cur)] if cur else [])


def turns(tok, s: molt.Sample) -> list[str]:
    """The text of each sampled turn, as Molt's codec decodes it for an Env."""
    return [tok.decode(r, skip_special_tokens=True) for r in sampled_runs(s)]


# ---------------------------------------------------------------- reasoning-gym


async def rg_grade(row, reply):
    """The reward the adapter gives `reply` on `row`."""
    env = rg_agent.ReasoningGym()
    await env.reset(row["prompt"], row["label"])
    return (await env.step(reply)).reward


def test_every_reasoning_gym_task_scores_its_gold_answer_as_the_library_does():
    """Every task that generates without a config (all but composite), through the adapter: the sandboxed scorer, the
    entry pickled (arc_agi's and rearc's scorers compare tuples: their gold answers earned 0.05 through JSON)."""
    import reasoning_gym
    from reasoning_gym.factory import DATASETS
    cfg, differ = agent_config("reasoning_gym.py", size=1, seed=0), {}
    tasks = sorted(set(DATASETS) - {"composite"})
    for task in tasks:
        [row] = rg_agent.load_data(rg_agent.SCHEME + task, cfg, False)
        entry = reasoning_gym.create_dataset(task, **rg_agent.task_config(task, {"size": 1}, 0))[0]
        library = reasoning_gym.get_score_answer_fn(task)(str(entry["answer"]).strip(), entry)
        got = run(rg_grade(row, f"<answer>{entry['answer']}</answer>"))
        if got != library:
            differ[task] = (got, library)
    assert len(tasks) >= 100 and differ == {}


def test_reasoning_gym_rows_are_the_librarys_and_its_score_is_the_reward():
    import reasoning_gym
    cfg = agent_config("reasoning_gym.py", size=4, seed=3, config={"leg_counting": {"max_animals": 1,
                                                                                   "min_animals": 1}})
    rows = rg_agent.load_data("reasoning-gym:basic_arithmetic,leg_counting,letter_counting", cfg, False)
    assert [r["label"]["task"] for r in rows[:3]] == ["basic_arithmetic", "leg_counting", "letter_counting"]
    assert len(rows) == 12 and json.loads(json.dumps(rows)) == rows  # JSON rows: dumps and resumes keep them
    again = reasoning_gym.create_dataset("leg_counting", size=4, seed=3, min_animals=1, max_animals=1)[0]
    assert rows[1]["label"]["entry"] == json.loads(json.dumps(again))  # the library's own entry, regenerated

    for row in rows[:6]:
        gold = row["label"]["entry"]["answer"]
        score = reasoning_gym.get_score_answer_fn(row["label"]["task"])
        for reply in (f"so <answer>{gold}</answer>", f"<answer>{gold}7</answer>", "no tags", "<answer>x</answer>",
                      f"<answer>x</answer> <answer>{gold}</answer>", f"<answer>{gold}</answer><answer>x"):
            answer = reasoning_gym.utils.extract_answer(reply)
            assert rg_agent.extract_answer(reply) == answer
            assert run(rg_grade(row, reply)) == score(answer, row["label"]["entry"])
    assert run(rg_grade(rows[0], f"<answer>{rows[0]['label']['entry']['answer']}</answer>")) == 1.0
    evaluation = rg_agent.load_data("reasoning-gym:basic_arithmetic,leg_counting,letter_counting", cfg, True)
    assert [r["label"]["entry"]["question"] for r in evaluation] != [r["label"]["entry"]["question"] for r in rows]
    level = rg_agent.task_config("basic_arithmetic", {"level": 2, "size": 8}, 0)
    assert level["max_terms"] > 2 and level["size"] == 8  # the library's curriculum at level 2


def test_reasoning_gym_episodes_record_the_librarys_scores_and_train(engine, tiny, tiny_trainer):
    import reasoning_gym
    cfg = agent_config("reasoning_gym.py", size=2)
    rows = rg_agent.load_data("reasoning-gym:basic_arithmetic,leg_counting,letter_counting", cfg, False)
    outs, tok = run_rows(engine, tiny, cfg, rows[:3]), AutoTokenizer.from_pretrained(tiny)
    assert all(o.failures == {} and len(o.samples) == 2 for o in outs)
    for row, out in zip(rows, outs):
        for s in out.samples:
            [reply] = turns(tok, s)
            answer = reasoning_gym.utils.extract_answer(reply)
            assert s.reward == reasoning_gym.get_score_answer_fn(row["label"]["task"])(answer, row["label"]["entry"])
    trains(tiny, tiny_trainer, [s for o in outs for s in o.samples])


def trains(tiny, tiny_trainer, samples):
    """An environment's episodes train: the engine's log-prob of every trained token is the trainer's (on the engine's
    weights), and a training step on them runs (the session's trainer, whose weights have moved)."""
    import torch
    from test_server import trainer_logprobs
    trained = [s for s in samples if any(s.mask)]
    for s in trained:
        mask = torch.tensor(s.mask[1:]).bool()
        assert (trainer_logprobs(tiny, s) - torch.tensor(s.logprobs[1:]))[mask].abs().max() < 1e-3
    cfg, trainer = tiny_trainer
    metrics = molt.learn(cfg, {"policy": trainer}, trained)
    assert all(v == v for v in metrics.values())  # (finite: a group that all scored alike moves nothing)


# ---------------------------------------------------------------- verifiers

TRACES: list = []


class Recording(vf_agent.Verifiers):
    async def run(self, ctx):
        result = await super().run(ctx)
        TRACES.append(self.trace)
        env = await vf_agent.serving(ctx.label["env"], ctx.label["args"])
        CLIENTS.append(sum(len(server.clients) for server in env._interception.servers))
        return result


CLIENTS: list = []  # verifiers' HTTP clients kept after each episode (one per session URL unless dropped)


async def rescore(env_id: str, args: str, trace):
    """The environment's own scoring of a recorded transcript, no model call."""
    env = vf_agent.environment(env_id, args)
    again = trace.model_copy(deep=True)
    again.rewards, again.metrics = {}, {}
    await vf_agent.task_of(env, trace.task.data.model_dump(mode="json")).score(again)
    return again.reward


def test_verifiers_single_turn_env_its_rubric_is_the_reward(engine, tiny):
    cfg = agent_config("verifiers_env.py", "vf_qa", path=ENVS)
    rows = vf_agent.load_data("", cfg, False)
    assert [r["label"]["data"]["answer"] for r in rows] == ["4", "8", "5", "2"] and rows[0]["prompt"].startswith("What")
    TRACES.clear(), CLIENTS.clear()
    outs = run_rows(engine, tiny, cfg, rows[:2], runner=molt.ChatAgentRunner(Recording))
    assert max(CLIENTS) <= 2  # at most the group's episodes in flight: each session's client goes with it
    tok = AutoTokenizer.from_pretrained(tiny)
    samples = [s for o in outs for s in o.samples]
    assert all(o.failures == {} for o in outs) and len(samples) == len(TRACES) == 4
    for trace in TRACES:  # each transcript's reply is the tokens one sample trained on, its reward that sample's
        [s] = [s for s in samples if [t.strip() for t in turns(tok, s)] == [trace.last_reply]]  # (verifiers strips)
        assert s.reward == trace.reward == run(rescore("vf_qa", cfg.env.args, trace))
        assert s.info["vf/has_digit"] == trace.rewards["has_digit"].score
    # the rubric is the library's: a correct reply scores 1.5 (exact 1 + has_digit 0.5) when re-scored
    right = TRACES[0].model_copy(deep=True)
    right.branches[-1].messages[-1].content = f"Answer: {right.task.data.answer}"
    assert run(rescore("vf_qa", cfg.env.args, right)) == 1.5


def test_verifiers_tool_env_runs_its_tools_through_the_loopback_server(engine, tiny):
    """The calculator runs in verifiers' own MCP server; forced calls (tool_choice passed through --env.args'
    sampling) make every turn a call, so the transcript has tool results, all in one recorded segment."""
    cfg = agent_config("verifiers_env.py", "vf_calc", path=ENVS, max_turns=2, sampling={"tool_choice": "required"})
    rows = vf_agent.load_data("", cfg, False)
    TRACES.clear()
    [out] = run_rows(engine, tiny, cfg, rows[:1], runner=molt.ChatAgentRunner(Recording),
                     sampling={**SAMPLING, "max_tokens": 96})
    tok = AutoTokenizer.from_pretrained(tiny)
    assert out.failures == {} and len(TRACES) == 2 and len(out.samples) == 2  # one segment per episode
    for trace in TRACES:
        assert [t.name for t in trace.tools] == ["calc_calculator"]
        messages = trace.branches[-1].messages
        tools = [m for m in messages if m.role == "tool"]
        assert tools and len(trace.calls) == 2
        texts = [str(m.content)[:20] for m in tools]  # the tool results are tokens of a sample: that sample
        matches = [s for s in out.samples if all(t in tok.decode(s.tokens) for t in texts)]
        assert matches and all(s.reward == trace.reward == run(rescore("vf_calc", cfg.env.args, trace))
                               for s in matches)


def test_a_malformed_verifiers_env_costs_its_episode(engine, tiny):
    cfg = agent_config("verifiers_env.py", "vf_broken", path=[str(ROOT / "tests" / "envs")])
    outs = run_rows(engine, tiny, cfg, vf_agent.load_data("", cfg, False))
    assert [o.samples for o in outs] == [[], []]  # a reward that raises, one that is NaN: counted apart
    assert [o.failures for o in outs] == [{"error": 2}, {"bad_result": 2}]


def test_env_options_are_checked_at_launch():
    with pytest.raises(molt.UsageError, match="--env.id"):
        vf_agent.load_data("", agent_config("verifiers_env.py"), False)
    for bad in ("[1]", "{oops", '"x"'):
        with pytest.raises(molt.UsageError, match="--env.args must be a JSON object"):
            molt.parse_config(["--env.args", bad])
    for harness in ("bash", "codex"):  # they execute the policy's actions: on the host, here
        with pytest.raises(molt.UsageError, match=f"--env.args harness '{harness}' executes the policy's actions"):
            vf_agent.load_data("", agent_config("verifiers_env.py", "vf_calc", path=ENVS, harness=harness), False)
    cfg = agent_config("reasoning_gym.py", size=3)  # Molt's loader hands the spelling to the module's load_data
    cfg.data.max_prompts = 2
    rows = molt.load_rows("reasoning-gym:letter_counting", cfg.data, cfg)
    assert [r["label"]["task"] for r in rows] == ["letter_counting"] * 2
    with pytest.raises(molt.UsageError, match="no prompts: give --data"):  # no --data and no load_data
        molt.load_rows("", molt.DataConfig(), small_config(agent=str(ROOT / "agents" / "math.py")))
    with pytest.raises(molt.UsageError, match="how many players"):
        ta_agent.load_data("textarena:Chess-v0", agent_config("textarena_env.py"), False)
    with pytest.raises(molt.UsageError, match="the random opponent knows the legal moves of"):
        ta_agent.load_data("textarena:Chess-v0", agent_config("textarena_env.py", players={"Chess-v0": 2}), False)
    assert ta_agent.load_data("textarena:Chess-v0", agent_config("textarena_env.py", players={"Chess-v0": 2},
                                                                 opponent="policy", size=1), False)


# ---------------------------------------------------------------- TextArena


async def replay(row, actions: list[str]):
    """The game replayed from the policy's decoded actions: same seed, same seeded opponent."""
    env = ta_agent.Game()
    await env.reset(row["prompt"], row["label"])
    result = None
    for a in actions:
        result = await env.step(a)
        if result.terminated:
            break
    return result


def test_textarena_games_end_with_the_librarys_outcome():
    cfg = agent_config("textarena_env.py", size=3, kwargs={"GuessTheNumber-v0": {"max_turns": 4}})
    rows = ta_agent.load_data("textarena:TicTacToe-v0,GuessTheNumber-v0", cfg, False)
    assert len(rows) == 6 and rows[1]["label"] == {"game": "TicTacToe-v0", "seed": 1, "players": 2, "kwargs": {},
                                                   "opponent": "random", "opponent_tokens": 32}
    outcomes = set()
    for row in rows[:3]:
        for attempt in range(20):  # random legal moves: wins, losses and draws all occur
            rng = random.Random(attempt)
            moves = [f"[{rng.randrange(9)}]" for _ in range(9)]
            result = run(replay(row, moves))
            outcomes.add(result.reward)
            assert result.terminated and result.reward == library_outcome(row["label"], moves)  # either seat
    assert outcomes == {-1.0, 0.0, 1.0}
    guess = run(replay(rows[3], ["[10]", "[5]", "[15]", "[2]", "[18]"]))
    assert guess.terminated and 0 <= guess.reward <= 1
    invalid = run(replay(rows[0], ["[9]", "[9]"]))  # two invalid moves in a row lose the game
    assert invalid.reward == -1.0 and invalid.info["ta/invalid_move"] == 1.0


def test_self_play_the_opponent_is_the_policy_through_the_unrecorded_route(engine, tiny):
    """--env.args opponent=policy: the opponent's moves are sampled by the same engine (Env.judge()) and never
    trained: the engine's calls are each sample's own turns plus the opponent's, which no sample holds."""
    from test_agents import Recorder
    cfg = agent_config("textarena_env.py", size=2, opponent="policy", opponent_tokens=8)
    rows = ta_agent.load_data("textarena:TicTacToe-v0", cfg, False)
    tok = AutoTokenizer.from_pretrained(tiny)

    async def main():
        pool = molt.AgentPool(cfg, cfg.agent, tiny, [engine])
        pool.router = pool.server.router = Recorder([engine])
        outs = [await pool.run_group(row, 2, dict(SAMPLING, max_tokens=8), uuid.uuid4().hex, i)
                for i, row in enumerate(rows)]
        await pool.server.stop()
        return outs, pool.router.calls
    outs, calls = run(main())
    samples = [s for o in outs for s in o.samples]
    assert all(o.failures == {} for o in outs) and len(samples) == 4
    trained = [r for s in samples for r in sampled_runs(s)]
    policy = [c for c in calls if tuple(c.ids) in set(trained)]
    opponent = [json.loads(tok.decode(c.ids, skip_special_tokens=True)) for c in calls if tuple(c.ids) not in
                set(trained)]
    assert len(policy) == len(trained) and opponent  # the rest are the opponent's moves, guided to legal ones
    assert set(opponent) <= {f"[{i}]" for i in range(9)}


def state_moves(game_id: str, state: dict) -> list[str]:
    """The test's own reading of a game's legal moves from its state, in the game's order (TextArena's "Available
    Moves" text is written for tic-tac-toe only, and a player's message can forge it)."""
    if game_id == "TicTacToe-v0":
        return [f"[{i}]" for i, cell in enumerate(sum(state["board"], [])) if cell == ""]
    if game_id == "ConnectFour-v0":
        return [f"[col {c}]" for c in range(len(state["board"][0])) if state["board"][0][c] == "."]
    return [f"[{i} {q}]" for i, n in enumerate(state["piles"]) for q in range(1, n + 1)]


def library_outcome(label: dict, policy_moves: list[str]) -> float | None:
    """The game as TextArena itself plays it, not the adapter: the policy's recorded moves at its seat (seed % players),
    the seeded random opponent (random.Random(seed): a uniformly random legal move) at the others; the library's
    reward for the policy's seat, or None while the game is not over."""
    import textarena as ta
    game = ta.make(label["game"], **label["kwargs"])
    game.reset(num_players=label["players"], seed=label["seed"])
    me, rng, moves = label["seed"] % label["players"], random.Random(label["seed"]), iter(policy_moves)
    while True:
        player, obs = game.get_observation()
        move = next(moves, None) if player == me else rng.choice(state_moves(label["game"], game.state.game_state))
        if move is None:
            return None
        done, _ = game.step(action=move)
        if done:
            return float(game.close()[0][me])


@pytest.mark.parametrize("game", [g for g, n in ta_agent.PLAYERS.items() if n == 2])
def test_every_two_player_game_plays_both_seats_against_the_default_opponent(game):
    """ConnectFour and Nim list no legal moves in text: every game where the opponent moved first failed in reset."""
    rows = ta_agent.load_data(f"textarena:{game}", agent_config("textarena_env.py", size=4), False)

    async def episode(row, rng):
        env, moves = ta_agent.Game(), []
        await env.reset(row["prompt"], row["label"])
        while True:
            moves.append(rng.choice(state_moves(game, env.game.state.game_state)))
            if (result := await env.step(moves[-1])).terminated:
                return result, moves
    seats = set()
    for row in rows:
        result, moves = run(episode(row, random.Random(row["label"]["seed"] + 7)))
        seats.add(row["label"]["seed"] % 2)
        assert result.info["ta/invalid_move"] == 0 and result.reward == library_outcome(row["label"], moves)
    assert seats == {0, 1}


def test_textarena_episodes_score_what_the_library_scores_and_train(engine, tiny, tiny_trainer):
    """Tic-tac-toe against the seeded random opponent (either seat) and the one-player GuessTheNumber, as episodes:
    each reward is the outcome TextArena itself gives when the recorded moves are played in a game of its own
    (library_outcome), multi-turn, trained on."""
    spec = "textarena:TicTacToe-v0,GuessTheNumber-v0"
    cfg, outs = agent_groups(engine, tiny, "agents/textarena_env.py", "--data", spec, "--rollout.max-new-tokens", 8,
                             "--env.args", json.dumps({"size": 2, "kwargs": {"GuessTheNumber-v0": {"max_turns": 3}}}),
                             rows=4, n=2)
    rows, tok = molt.load_rows(cfg.data.path, cfg.data, cfg), AutoTokenizer.from_pretrained(tiny)
    samples = [s for o in outs for s in o.samples]
    assert all(o.failures == {} for o in outs) and any(len(turns(tok, s)) > 1 for s in samples)  # multi-turn
    ended = set()
    for s in samples:  # a game the shared engine's 1,024-token context cut short is not over: it scores 0 so far
        label, outcome = rows[s.prompt_index]["label"], library_outcome(rows[s.prompt_index]["label"], turns(tok, s))
        assert s.reward == (outcome or 0.0) and (outcome is not None or s.finish_reason == "length")
        ended |= {label["game"]} if outcome is not None else set()
    assert ended == {"TicTacToe-v0", "GuessTheNumber-v0"}
    trains(tiny, tiny_trainer, samples)


def test_a_malformed_game_costs_its_episode(engine, tiny):
    cfg = agent_config("textarena_env.py")
    bad = [{"prompt": "x", "label": {"game": "NoSuchGame-v0", "seed": 0, "players": 2, "kwargs": {},
                                     "opponent": "random"}},
           {"prompt": "x", "label": {"game": "GuessTheNumber-v0", "seed": 0, "players": 1, "kwargs": {"nope": 1},
            "opponent": "random"}}]
    outs = run_rows(engine, tiny, cfg, bad)
    assert [o.failures for o in outs] == [{"error": 2}, {"error": 2}] and not any(o.samples for o in outs)


# ---------------------------------------------------------------- two training steps each, re-scored from the dumps


def train_two_steps(tmp_path, agent, *args):
    run_dir = tmp_path / "run"
    argv = ["--agent", f"agents/{agent}", "--run-dir", run_dir, "--steps", 2, "--rollout.batch-size", 2,
            "--rollout.n-samples-per-prompt", 2, "--rollout.max-new-tokens", 16, "--train.micro-batch-size", 4,
            "--dump-samples", *args]
    proc = subprocess.run([sys.executable, str(ROOT / "molt.py"), *map(str, argv)], cwd=ROOT, capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    samples = [molt.Sample.from_json(json.loads(line)) for f in sorted((run_dir / "samples").glob("*.jsonl"))
               for line in f.read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2] and samples
    return metrics, samples


@pytest.mark.slow
def test_an_env_library_trains_two_steps_and_its_rewards_are_the_librarys(tmp_path, tiny):
    """The verifiers QA environment, named by --env.id and --env.args (its own harness in a subprocess per episode),
    trains 2 steps through molt.py; every dumped sample's reward is the library's score of its decoded turn, and the
    rubric pays (a digit earns 0.5). The one whole run of an environment library: reasoning-gym's and TextArena's
    episodes are re-scored and trained in process above, the verifiers calculator's tools are served in process."""
    tok = AutoTokenizer.from_pretrained(tiny)
    args = json.dumps({"path": ENVS})
    _, samples = train_two_steps(tmp_path, "verifiers_env.py", "--env.id", "vf_qa", "--env.args", args)
    rows = vf_agent.load_data("", agent_config("verifiers_env.py", "vf_qa", path=ENVS), False)
    for s in samples:
        [reply] = turns(tok, s)
        assert s.reward == run(score_messages("vf_qa", args, rows[s.prompt_index]["label"]["data"], reply))
    assert any(s.reward > 0 for s in samples)


async def score_messages(env_id: str, args: str, data: dict, reply: str):
    """The environment's own score of a reply given as plain chat messages (a transcript built here, not recorded)."""
    import verifiers.v1 as vf
    from verifiers.v1.dialects.chat import parse_message
    from verifiers.v1.trace import AgentInfo, TraceTask
    task = vf_agent.task_of(vf_agent.environment(env_id, args), data)
    wire = [{"role": "user", "content": data["prompt"]}, {"role": "assistant", "content": reply}]
    nodes = [vf.MessageNode(parent=i - 1 if i else None, message=parse_message(m), sampled=m["role"] == "assistant")
             for i, m in enumerate(wire)]
    trace = vf.Trace(task=TraceTask(type=type(task).__name__, data=task.data),
                     agent=AgentInfo(config=vf.AgentConfig()), nodes=nodes)
    await task.score(trace)
    return trace.reward
