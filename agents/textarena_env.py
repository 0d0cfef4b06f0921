"""TextArena games as an Env: the policy plays one side turn by turn (Molt owns the loop), a fixed opponent the
other, and the game's outcome for the policy's side is the reward (two players: 1 win, 0 draw, -1 loss or repeated
invalid moves; one player: the game's own score).

    python molt.py --agent agents/textarena_env.py                          # tic-tac-toe on the tiny model
    python molt.py --agent agents/textarena_env.py --data textarena:GuessTheNumber-v0 \\
        --env.args '{"kwargs": {"GuessTheNumber-v0": {"max_turns": 5}}}'

--data textarena:ID[,ID...] makes one row per (game, seed); --env.args: "size" (seeds per game, 256), "seed" (the
run's --seed), "kwargs" ({id: ta.make keyword arguments}), "players" ({id: number}, for games outside PLAYERS),
"opponent" ("random", or "policy": the policy itself through the loopback server's unrecorded route, Env.judge(), not
trained on; with --judge.url, that model; "opponent_tokens" 32). Each turn the policy sees only what is new in its
observation (TextArena's wrapper repeats the whole game each turn; the conversation already holds it). The policy
plays every other seed's first move. TextArena 0.7 has no opponent that runs offline (its agents call model APIs), so
the default one is a uniformly random legal move, seeded per episode: a replay of the same actions gives the same
game. Legal moves come from the game's state (LEGAL), never from text: TextArena copies each player's message into
the other's observation. A two-player game outside LEGAL is refused with the random opponent. The game reads the
last ACTION_CHARS of an action, off the event loop. TextArena's reset(seed) reseeds Python's global random.
"""
import contextlib
import json
import random

import molt
from molt import Env, Result, StepEnvRunner

SCHEME = "textarena:"
PLAYERS = {"TicTacToe-v0": 2, "ConnectFour-v0": 2, "Nim-v0": 2, "GuessTheNumber-v0": 1, "TowerOfHanoi-v0": 1,
           "Mastermind-v0": 1}
DEFAULTS = {"data.path": SCHEME + "TicTacToe-v0", "rollout.max_new_tokens": 16, "rollout.max_turns": 10,
            "rollout.n_samples_per_prompt": 4, "rollout.batch_size": 4, "steps": 4, "data.max_len": 4096}
LEGAL = {  # game -> its legal moves, read from its state
    "TicTacToe-v0": lambda s: [f"[{r * 3 + c}]" for r in range(3) for c in range(3) if s["board"][r][c] == ""],
    "ConnectFour-v0": lambda s: [f"[col {c}]" for c, top in enumerate(s["board"][0]) if top == "."],
    "Nim-v0": lambda s: [f"[{i} {q}]" for i, n in enumerate(s["piles"]) for q in range(1, n + 1)],
}
ACTION_CHARS = 512  # what a game reads of an action (ConnectFour's move regex is quadratic: 8.8 s on 6,000 tokens)


def load_data(spec: str, cfg, evaluation: bool) -> list[dict]:
    """One row per (game, seed): the prompt names the game (reset() replaces it with the game's own)."""
    if not spec.startswith(SCHEME):
        return molt.read_rows(spec, cfg.data)
    args = json.loads(cfg.env.args)
    seed = args.get("seed", cfg.seed) * 100_003 + evaluation * 50_000  # evaluation games differ from training's
    rows = []
    for game in (g for g in spec[len(SCHEME):].split(",") if g):
        players = args.get("players", {}).get(game) or PLAYERS.get(game)
        if not players:
            raise molt.UsageError(f"textarena: how many players does {game} have? --env.args "
                                  f"'{{\"players\": {{\"{game}\": N}}}}'")
        if players > 1 and game not in LEGAL and args.get("opponent", "random") == "random":
            raise molt.UsageError(f"textarena: the random opponent knows the legal moves of {sorted(LEGAL)} only; "
                                  f"for {game} set --env.args '{{\"opponent\": \"policy\"}}'")
        label = {"players": players, "kwargs": args.get("kwargs", {}).get(game, {}),
                 "opponent": args.get("opponent", "random"), "opponent_tokens": args.get("opponent_tokens", 32)}
        rows += [{"prompt": f"{game} #{s}", "label": {"game": game, "seed": s, **label}}
                 for s in range(seed, seed + args.get("size", 256))]
    return rows


class Game(Env):
    async def reset(self, prompt, label):
        import textarena as ta
        self.label, self.seen = label, ""
        self.game = ta.make(label["game"], **label["kwargs"])  # a fresh one per episode: its wrapper keeps history
        self.game.reset(num_players=label["players"], seed=label["seed"])
        self.me, self.rng = label["seed"] % label["players"], random.Random(label["seed"])
        self.turn = self.game.get_observation()
        if await self.opponents_move():
            raise RuntimeError(f"{label['game']} ended before the policy's first move")
        return self.news()

    def legal_moves(self) -> list[str]:
        legal = LEGAL.get(self.label["game"])
        return legal(self.game.state.game_state) if legal else []

    async def play(self, action: str) -> bool:
        """One move (its tail) in the game, off the loop; True when the game ended."""
        done, _ = await molt.offload(self.game.step, action[-ACTION_CHARS:])
        return done

    async def opponents_move(self) -> bool:
        """Play the opponent until it is the policy's turn; True when the game ended."""
        while self.turn[0] != self.me:
            done = await self.play(await self.opponent(self.turn[1]))
            if done:
                return True
            self.turn = self.game.get_observation()
        return False

    async def opponent(self, obs: str) -> str:
        """The opponent's move: random, or the policy itself sampled through the judge route (self-play; its
        calls are not recorded, so only the policy's side trains). Where the game's legal moves are known (LEGAL) the
        sample is guided to one of them (a JSON string from the list); one that still fails to parse (cut at
        opponent_tokens) is replaced by a random legal move: an opponent that forfeits teaches nothing."""
        legal = self.legal_moves()
        if self.label["opponent"] == "random":
            return self.rng.choice(legal)
        guide = {"response_format": {"type": "json_schema", "json_schema": {
            "name": "move", "schema": {"type": "string", "enum": legal}}}} if legal else {}
        reply = await self.judge().chat.completions.create(
            model=self.judge_model, messages=[{"role": "user", "content": obs}], temperature=1.0,
            max_tokens=self.label["opponent_tokens"], **guide)
        text = reply.choices[0].message.content or ""
        if not legal:
            return text
        with contextlib.suppress(ValueError):
            if (move := json.loads(text)) in legal:
                return move
        return self.rng.choice(legal)

    def news(self) -> str:
        """What the policy has not seen yet of its observation (the wrapper's text only grows)."""
        obs = self.turn[1]
        new = obs[len(self.seen):] if obs.startswith(self.seen) else obs
        self.seen = obs
        return new.strip() or obs

    async def step(self, action: str) -> Result:
        done = await self.play(action)
        if not done:
            self.turn = self.game.get_observation()
            done = await self.opponents_move()
        if not done:
            return Result(observation=self.news(), terminated=False)
        rewards, info = self.game.close()
        reward, mine = float(rewards[self.me]), info.get(self.me, {})
        return Result(reward=reward, info={"ta/win": float(reward >= 1), "ta/loss": float(reward < 0),
                                           "ta/invalid_move": float(bool(mine.get("invalid_move"))),
                                           "ta/turns": float(mine.get("turn_count", 0))})


AgentRunner = StepEnvRunner(Game)
