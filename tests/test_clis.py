"""The stock agent CLIs (section 7's wires, as real clients speak them): Codex CLI (Responses, streamed), Claude
Code (Messages, streamed) and opencode (chat completions, streamed), installed from the npm registry by scripts/setup.sh, each run once at its defaults against
a session of the loopback server on tiny:qwen3 (a real tokenizer and template; their prompts are 8-12k tokens). Every
field each sends is in a conformance list with Molt's handling; every request is answered 2xx; the run's max_tokens
caps what each asks; what the model saw is checked in the recorded tokens."""
import asyncio
import dataclasses
import itertools
import json
import os
import re
import shutil
import subprocess
import sys
import types
from pathlib import Path

import pytest

import molt
from conftest import run
from test_server import Server

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parent.parent
BIN = ROOT / ".venv" / "clis" / "node_modules" / ".bin"
CAP = 16  # the run's max_tokens
LONG = {"data.max_len": 40960}

# Every field the CLI sends, with what Molt does with it (the test fails on a field not listed here).
CODEX = {  # @openai/codex 0.171.0, POST /v1/responses
    "model": "ignored: the policy answers",
    "stream": "served: the Responses event stream",
    "input": "messages; developer messages are system messages",
    "tools": "function tools shown; a namespace's functions shown as NAMESPACE__NAME, their calls returned with "
             "namespace; web_search dropped (nothing here searches) and counted in server/tools_dropped",
    "tool_choice": "served",
    "parallel_tool_calls": "echoed",
    "reasoning": "effort: the template's reasoning_effort; summary ignored (reasoning is returned as text)",
    "store": "served (false: nothing kept; Codex resends the conversation)",
    "include": "reasoning.encrypted_content ignored: reasoning is returned as text; output_text logprobs served",
    "prompt_cache_key": "ignored", "client_metadata": "ignored",
}
CLAUDE = {  # @anthropic-ai/claude-code 2.1.332, POST /v1/messages?beta=true
    "model": "ignored: the policy answers",
    "stream": "served: the Messages event stream",
    "messages": "served; a system message stays where it is sent (Claude Code's environment block)",
    "system": "served; the x-anthropic-billing-header block (a per-request hash) left out, as vLLM does",
    "tools": "served (defer_loading ignored: every tool is shown)",
    "metadata": "ignored",
    "max_tokens": "capped at the run's --rollout.max-new-tokens (Claude Code asks 128000)",
    "thinking": "adaptive (its display too) pins nothing, as vLLM maps it; enabled / disabled set enable_thinking",
    "context_management": "ignored: the recorded turns keep their thinking as sampled",
    "output_config": "effort: the template's reasoning_effort, as vLLM maps it",
}
OPENCODE = {  # opencode-ai 1.18.33, POST /v1/chat/completions (a title request without tools, then the task)
    "model": "ignored: the policy answers",
    "max_tokens": "capped at the run's --rollout.max-new-tokens (opencode asks 32000)",
    "messages": "served",
    "tools": "served", "tool_choice": "served",
    "stream": "served: chat completion chunks",
    "stream_options": "include_usage served: a last chunk with the usage",
}
CLIS = {"codex": ("codex-cli 0.171.0", CODEX), "claude": ("2.1.332 (Claude Code)", CLAUDE),
        "opencode": ("1.18.33", OPENCODE)}


def command(cli: str, ctx, home: Path) -> tuple[list, dict]:
    """The CLI's one-shot command and environment pointed at the session (a fresh HOME: no user config)."""
    if cli == "codex":
        (home / "config.toml").write_text(
            f'model = "tiny"\nmodel_provider = "molt"\n[model_providers.molt]\nname = "molt"\n'
            f'base_url = "{ctx.base_url}"\nenv_key = "MOLT_KEY"\nwire_api = "responses"\n')
        return [str(BIN / "codex"), "exec", "--skip-git-repo-check", "write hello.txt"], {
            "CODEX_HOME": str(home), "MOLT_KEY": ctx.api_key}
    if cli == "opencode":
        (home / "opencode.json").write_text(json.dumps({"provider": {"molt": {
            "npm": "@ai-sdk/openai-compatible", "name": "molt", "models": {"tiny": {"name": "tiny"}},
            "options": {"baseURL": ctx.base_url, "apiKey": ctx.api_key}}}, "model": "molt/tiny"}))
        return [str(BIN / "opencode"), "run", "write hello.txt"], {"OPENCODE_CONFIG": str(home / "opencode.json")}
    return [str(BIN / "claude"), "-p", "write hello.txt"], {"ANTHROPIC_BASE_URL": ctx.session_url,
                                                           "ANTHROPIC_API_KEY": ctx.api_key}


@pytest.fixture(scope="module")
def qwen3(engines):
    path = molt.resolve_model("tiny:qwen3")
    return path, engines.get(path, **LONG)


def drive(qwen3, cli: str, tmp_path, monkeypatch):
    """Run the CLI once against a fresh session -> (exit status, request bodies, the session, its prompt texts)."""
    assert (BIN / cli).exists(), f"{BIN / cli} is missing: run bash scripts/setup.sh (it installs the pinned CLIs)"
    path, engine = qwen3
    bodies, read = [], molt.LoopbackServer.read_json

    async def spy(self, request):  # the bodies as the server read them (the server itself runs unchanged)
        bodies.append(await read(self, request))
        return bodies[-1]
    monkeypatch.setattr(molt.LoopbackServer, "read_json", spy)

    async def main():
        async with Server(engine, path, sampling={"temperature": 1.0, "max_tokens": CAP}, **LONG) as srv:
            home, work = tmp_path / "home", tmp_path / "work"
            home.mkdir(), work.mkdir()
            cmd, env = command(cli, srv.ctx, home)
            proc = await asyncio.create_subprocess_exec(
                *cmd, cwd=work, env={"PATH": os.environ["PATH"], "HOME": str(home), **env},
                stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
            out, err = await asyncio.wait_for(proc.communicate(), 600)
            return proc.returncode, out.decode() + err.decode(), srv.session
    code, output, session = run(main())
    tok = molt.Codec(path).tokenizer
    prompts = [tok.decode(s.tokens[:s.mask.index(1) if 1 in s.mask else None]) for s in session.segments]
    return code, output, bodies, session, prompts


@pytest.mark.parametrize("cli", ["codex", "claude", "opencode"])
def test_a_stock_cli_at_its_defaults_gets_every_request_answered_and_its_max_tokens_capped(qwen3, cli, tmp_path,
                                                                                          monkeypatch):
    version, fields = CLIS[cli]
    code, output, bodies, session, prompts = drive(qwen3, cli, tmp_path, monkeypatch)
    assert bodies and session.counts["server/4xx"] == session.counts["server/5xx"] == 0, output[-3000:]
    assert {k for b in bodies for k in b} <= set(fields), {k for b in bodies for k in b} - set(fields)
    assert session.segments and all(sum(s.mask) <= CAP for s in session.segments)
    assert max(sum(s.mask) for s in session.segments) == CAP  # each reply cut at the run's cap, whatever was asked
    if cli in ("claude", "opencode"):
        assert all(b["max_tokens"] > CAP for b in bodies)
    if cli == "claude":
        assert all(any(m["role"] == "system" for m in b["messages"]) for b in bodies)  # inline system messages
        assert all("# Environment" in p and "x-anthropic-billing-header" not in p for p in prompts)
        # the environment block is a system turn where Claude Code put it: after the user's request
        assert all(p.index("write hello.txt") < p.index("<|im_start|>system\n# Environment") for p in prompts)
    elif cli == "codex":  # every request offered web_search (dropped, counted) and a namespace (shown under it)
        assert all({t["type"] for t in b["tools"]} == {"function", "namespace", "web_search"} for b in bodies)
        assert session.counts["server/tools_dropped"] == len(bodies)
        assert all('"name": "multi_agent_v1__close_agent"' in p and '"web_search"' not in p for p in prompts)
    reported = subprocess.run([str(BIN / cli), "--version"], capture_output=True, text=True, timeout=60).stdout
    assert re.search(re.escape(version), reported), reported  # the pinned release (README, setup.sh)


# ---------------------------------------------------------------------------------------------------------------
# agents/cli.py: each CLI runs in the sandbox, its only way out the episode's session

cli_agent = molt.import_path(str(ROOT / "agents" / "cli.py"))
SHELL = {"codex": ("exec_command", "cmd"), "claude": ("Bash", "command"), "opencode": ("bash", "command")}


@pytest.mark.parametrize("cli", ["codex", "claude", "opencode"])
def test_a_cli_agent_runs_the_policys_command_in_the_sandbox(qwen3, cli, tmp_path, monkeypatch):
    """The policy (guided to call the CLI's own shell tool) runs a command that marks the work directory, writes a
    host path outside it, copies a host file and then kills its CLI (the episode ends there). Checked from the host:
    the mark is in the work directory (the command ran, through the CLI, inside), the outside path was never written,
    the copy is empty, and every request the CLI made was answered (the relay carried them)."""
    path, engine = qwen3
    secret, outside = tmp_path / "secret.txt", tmp_path / "outside.txt"
    secret.write_text("host secret")
    name, key = SHELL[cli]
    command = f"echo ran > ran.txt; echo x > {outside}; cat {secret} > leak.txt; kill -9 $PPID"
    call = json.dumps({"name": name, "arguments": {key: command}})
    sampling = {"temperature": 1.0, "max_tokens": 200,
                "structured_outputs": {"regex": re.escape(f"<tool_call>\n{call}\n</tool_call>")}}
    works = []
    monkeypatch.setattr(cli_agent, "shutil", types.SimpleNamespace(rmtree=lambda p, **_: works.append(p)))  # kept

    async def main():
        async with Server(engine, path, sampling=sampling, **LONG) as srv:
            ctx = dataclasses.replace(srv.ctx, prompt="Say hi.", label={
                "cli": {"cli": cli, "timeout": 120}, "check": "test -f ran.txt"})
            return await cli_agent.CLIAgent().run(ctx), srv.session
    result, session = run(main())
    [work] = works
    made = {name: Path(work, name).read_text() for name in ("ran.txt", "leak.txt") if Path(work, name).exists()}
    shutil.rmtree(work)
    assert made.get("ran.txt") == "ran\n" and result.reward == 1.0
    assert not outside.exists() and made.get("leak.txt") == ""
    assert session.counts["server/requests"] >= 1 and session.counts["server/4xx"] == session.counts["server/5xx"] == 0


def test_the_codex_agent_trains_two_steps_on_a_real_template(tmp_path):
    """molt.py --agent agents/cli.py (Codex at its defaults, in the sandbox) on tiny:qwen3, 2 steps: every request of
    every episode answered (0 4xx, 0 5xx), samples from every episode, each reply cut at --rollout.max-new-tokens
    (64; Codex asks for no cap), and the trainer's log-probs of them the engine's."""
    run_dir = tmp_path / "run"
    proc = subprocess.run([sys.executable, "molt.py", "--agent", "agents/cli.py", "--model", "tiny:qwen3", "--steps",
                           "2", "--run-dir", str(run_dir), "--dump-samples"], cwd=ROOT, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    assert [m["step"] for m in metrics] == [1, 2]
    assert all(m["server/4xx"] == m["server/5xx"] == 0 and m["server/requests"] >= 1 for m in metrics)
    assert all(m["rollout/logprob_gap"] < 1e-3 for m in metrics)
    samples = [json.loads(line) for f in sorted((run_dir / "samples").iterdir()) for line in open(f)]
    assert len({s["rollout_id"] for s in samples}) == sum(m["episodes"] for m in metrics)  # each episode trained
    assert all(0 < sum(s["mask"]) for s in samples)
    assert all(len(list(reply)) <= 64 for s in samples for trained, reply in itertools.groupby(s["mask"]) if trained)
