"""The stock agent CLIs as Molt agents: Codex CLI (Responses wire), Claude Code (Messages) and opencode (chat
completions), installed by scripts/setup.sh from the npm registry at pinned versions. Each episode runs the CLI, at its
defaults, in the sandbox (rewards/sandbox.py: its own uid, no host paths but its work directory and the read-only
runtime, no trainer secrets), and the CLI's only way out is the episode's loopback session: inside, 127.0.0.1 at the
session's port is relayed to the server's unix socket. Every request it makes is recorded token-exactly.

    python molt.py --agent agents/cli.py --model tiny:qwen3 --env.args '{"cli": "claude"}'

--env.args: "cli" (codex, claude or opencode; codex by default), "binary" (another build of that CLI: its directory is
bound read-only), "timeout" (seconds per CLI run, 600). A data row (examples/cli_tasks.jsonl by default): "prompt"
(the task), "label": {"files": {path: text} written into the work directory first, "followups": [texts sent with the
CLI's own session continuation after the first run], "check": a shell command run afterwards in a fresh sandbox, in
the work directory: reward 1 when it exits 0, else 0}. Info: cli/exit (the last run's exit status, -1 when stopped at
the timeout) beside the session's counts (server/requests: the CLI's turns). A sandbox that cannot start is the
episode's error, never a reward.

The CLI runs with its own approvals and sandbox off (ours holds it); the work directory is also its HOME, so its
session state (what --continue resumes) lives with the episode and goes with it.
"""
import asyncio
import json
import os
import shutil
import tempfile
from pathlib import Path
from urllib.parse import urlsplit

import molt
from molt import ChatAgent, ChatAgentRunner, Result

HERE = Path(__file__).resolve().parent
sandbox = molt.import_path(str(HERE.parent / "rewards" / "sandbox.py"))
BIN = HERE.parent / ".venv" / "clis" / "node_modules" / ".bin"
TASKS = HERE.parent / "examples" / "cli_tasks.jsonl"
DEFAULTS = {"data.path": str(TASKS), "data.max_len": 40960, "rollout.max_new_tokens": 64, "rollout.batch_size": 2,
            "rollout.n_samples_per_prompt": 2,
            "train.micro_batch_size": 1}  # the CLIs' prompts are 8-12k tokens: on CPU, attention holds [T, T] a sample
HOME = sandbox.WORK
PATH = "/usr/bin:/bin"


def codex(ctx, follow: bool, text: str) -> tuple[list[str], dict, dict]:
    config = (f'model = "{ctx.model_name}"\nmodel_provider = "molt"\n[model_providers.molt]\nname = "molt"\n'
              f'base_url = "{ctx.base_url}"\nenv_key = "MOLT_KEY"\nwire_api = "responses"\n')
    flags = ["--skip-git-repo-check", "--dangerously-bypass-approvals-and-sandbox"]
    return (["exec", "resume", "--last", *flags, text] if follow else ["exec", *flags, text],
            {"CODEX_HOME": f"{HOME}/.codex", "MOLT_KEY": ctx.api_key}, {".codex/config.toml": config})


def claude(ctx, follow: bool, text: str) -> tuple[list[str], dict, dict]:
    return (["-p", text, "--dangerously-skip-permissions", *(["--continue"] if follow else [])],
            {"ANTHROPIC_BASE_URL": ctx.session_url, "ANTHROPIC_API_KEY": ctx.api_key}, {})


def opencode(ctx, follow: bool, text: str) -> tuple[list[str], dict, dict]:
    config = {"provider": {"molt": {"npm": "@ai-sdk/openai-compatible", "name": "molt",
                                    "models": {ctx.model_name: {"name": ctx.model_name}},
                                    "options": {"baseURL": ctx.base_url, "apiKey": ctx.api_key}}},
              "model": f"molt/{ctx.model_name}",
              "permission": {"bash": "allow", "edit": "allow", "external_directory": "allow"}}  # (ours holds it)
    return (["run", *(["--continue"] if follow else []), text], {"OPENCODE_CONFIG": f"{HOME}/opencode.json"},
            {"opencode.json": json.dumps(config)})


CLIS = {"codex": codex, "claude": claude, "opencode": opencode}  # -> (arguments, environment, files to write)


def load_data(spec: str, cfg, evaluation: bool) -> list[dict]:
    """The task rows, each label carrying --env.args (the CLI and its settings), checked here: a wrong name fails the
    launch, not every episode."""
    args = {"cli": "codex", "timeout": 600, **json.loads(cfg.env.args or "{}")}
    if args["cli"] not in CLIS:
        raise molt.UsageError(f"--env.args cli must be one of {sorted(CLIS)}, got {args['cli']!r}")
    binary = binary_of(args)
    if not os.access(binary, os.X_OK):
        raise molt.UsageError(f"{binary} is missing: run bash scripts/setup.sh (it installs the pinned CLIs) or set "
                              "--env.args binary")
    rows = [json.loads(line) for line in open(spec or TASKS) if line.strip()]
    return [{**row, "label": {**row.get("label", {}), "cli": args}} for row in rows]


def binary_of(args: dict) -> str:
    return os.path.realpath(args.get("binary") or BIN / args["cli"])


def prepare(work: str, files: dict):
    """Write files under the work directory; a path that leaves it is the data's mistake."""
    for name, text in files.items():
        path = os.path.realpath(os.path.join(work, name))
        if not path.startswith(work + os.sep):
            raise ValueError(f"a task file must stay in the work directory: {name!r}")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        Path(path).write_text(text)


class CLIAgent(ChatAgent):
    async def run(self, ctx) -> Result:
        label, work = ctx.label, os.path.realpath(tempfile.mkdtemp(prefix="molt-cli-"))
        args = label["cli"]
        make, binary = CLIS[args["cli"]], binary_of(args)
        relay = (urlsplit(ctx.base_url).port, ctx.socket)
        try:
            prepare(work, label.get("files", {}))
            for i, text in enumerate([ctx.prompt, *label.get("followups", [])]):
                argv, env, files = make(ctx, i > 0, text)
                prepare(work, files)
                _, _, code, _ = await asyncio.to_thread(
                    sandbox.run_program, [binary, *argv], work, float(args["timeout"]), relay,
                    {"PATH": PATH, **env}, b"", [os.path.dirname(binary)])
            _, _, passed, _ = await asyncio.to_thread(sandbox.run_program, ["/bin/sh", "-c", label["check"]], work,
                                                      60.0, None, {"PATH": PATH})
            return Result(reward=float(passed == 0), info={"cli/exit": -1 if code is None else code})
        finally:
            shutil.rmtree(work, ignore_errors=True)


AgentRunner = ChatAgentRunner(CLIAgent)
