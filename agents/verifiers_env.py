"""A verifiers (0.4) environment as a Molt agent: its own rollout logic (harness, tools, turns) runs against the
loopback server, which records every turn token-exactly; its task's rewards are the reward, its metrics the info.

    python molt.py --agent agents/verifiers_env.py                  # examples/verifiers/vf_calc.py on the tiny model
    python molt.py --agent agents/verifiers_env.py --env.id my_env --env.args '{"path": "envs/"}'

--env.id: the environment (a verifiers taskset package: installed, or a module under "path"). --env.args: "path"
(directories put on the import path, for an environment that is not installed), "taskset" (its taskset config's
fields), "harness" ("null": verifiers' plain chat loop with the task's tools; every harness that executes the
policy's actions, "bash" and the agent CLIs, is refused: here it would run them on the host),
"max_turns" (8), "sampling" (more request fields, e.g. {"tool_choice": "required"}; a max_tokens past the run's is
cut to it). --data is the environment's own task set unless given (rows of its TaskData fields: prompt, and what its
rewards read). Each episode runs verifiers' harness program in a local subprocess (never a Prime sandbox) with this
Python and an allow-listed environment (CHILD_ENV: none of the trainer's secrets); a task whose reward or rollout
errs costs its episode, counted.

Unlike verifiers' own trainer, which renders the prompt to token ids on its side (its renderers package) and sends
them to vLLM's generate endpoint, here the environment speaks the plain chat API and Molt's server owns the tokens:
the ids the engine sampled are the trajectory, and a history that differs from them opens a new segment.
"""
import asyncio
import contextlib
import functools
import hashlib
import json
import os
import sys
import types
import weakref
from pathlib import Path

import molt
from molt import ChatAgent, ChatAgentRunner, Result

HERE = os.path.dirname(os.path.abspath(__file__))
EXAMPLES = os.path.join(HERE, "..", "examples", "verifiers")  # vf_qa (single-turn), vf_calc (a calculator tool)
DEFAULTS = {"env.id": "vf_calc", "env.args": json.dumps({"path": EXAMPLES}), "rollout.max_new_tokens": 64,
            "rollout.n_samples_per_prompt": 4, "rollout.batch_size": 4, "steps": 4}
HOST_HARNESSES = {"null"}  # the chat loop and the task's own tools; every other harness executes the policy's actions
CHILD_ENV = ("PATH", "HOME", "LANG", "LC_ALL", "LC_CTYPE", "TZ", "TMPDIR", "PYTHONPATH", "VIRTUAL_ENV")


def allow_listed_children():
    """verifiers 0.4.0's SubprocessRuntime gives every child (harness program, MCP tool server) its module's
    `os.environ` minus names containing API_KEY (HF_TOKEN, AWS_SECRET_ACCESS_KEY, GITHUB_TOKEN reached them): its
    module's `os` becomes one whose environ holds only CHILD_ENV, read now (after PYTHONPATH is set). Assumes the
    runtime reads `os.environ` through its module global `os` (0.4.0)."""
    import verifiers.v1.runtimes.subprocess as runtime
    runtime.os = types.SimpleNamespace(**{**vars(os), "environ": {k: os.environ[k] for k in CHILD_ENV
                                                                  if k in os.environ}})


def offline_chat_program():
    """verifiers 0.4.0's subprocess runtime runs its harness program through `uv sync --script` (installing uv with
    pip or curl when missing: no package index here, and a fresh environment per script); point it at this
    interpreter instead, which has the program's dependencies. Assumes SubprocessRuntime's class-level
    scripts_dir and _interpreters cache (0.4.0)."""
    from verifiers.v1.harnesses.utils.launch import CHAT_PROGRAM_SOURCE
    from verifiers.v1.runtimes.subprocess import SubprocessRuntime
    data = CHAT_PROGRAM_SOURCE.encode()
    path = Path(SubprocessRuntime.scripts_dir) / f"{hashlib.sha256(data).hexdigest()}.py"
    if not path.exists():  # named by its content; written whole (pools on a node share the directory)
        path.parent.mkdir(parents=True, exist_ok=True)
        part = path.with_suffix(f".{os.getpid()}.part")
        part.write_bytes(data)
        os.replace(part, path)
    SubprocessRuntime._interpreters[str(path)] = sys.executable


async def drop_client(env, client):
    """verifiers 0.4.0's interception servers keep one HTTP client per endpoint config until they stop, and each
    Molt session is an endpoint of its own (/s/ID/v1), so a run that never stops serving would keep one per
    episode: close this episode's. Assumes env._interception.servers[*].clients keyed by config.model_dump_json()."""
    for server in getattr(env._interception, "servers", []):
        if (kept := server.clients.pop(client.model_dump_json(), None)) is not None:
            await kept.close()


@functools.cache
def environment(env_id: str, args: str):
    """The verifiers Env, built once per process (taskset, harness and runtime as --env.args say)."""
    import verifiers.v1 as vf
    options = json.loads(args)
    paths = options.get("path") or []
    for path in map(molt.node_path, map(os.path.abspath, [paths] if isinstance(paths, str) else paths)):
        sys.path.insert(0, path)  # the harness and tool servers are subprocesses: they need it too
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (path, os.environ.get("PYTHONPATH")) if p)
    offline_chat_program()
    allow_listed_children()
    agent = vf.AgentConfig(harness={"id": options.get("harness", "null")}, runtime=vf.SubprocessConfig(),
                           max_turns=options.get("max_turns", 8))
    return vf.load_environment(vf.SingleAgentEnvConfig(taskset={"id": env_id, **options.get("taskset", {})},
                                                       agent=agent))


_SERVING: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # event loop -> {(id, args): task -> env, stack}


async def serving(env_id: str, args: str):
    """The environment, inside env.serving() (verifiers' local interception server and the task's shared tools),
    entered once per event loop by one task every episode awaits; built off the loop (imports, the task set)."""
    tasks = _SERVING.setdefault(asyncio.get_running_loop(), {})
    if (env_id, args) not in tasks:
        async def enter():
            env, stack = await molt.offload(environment, env_id, args), contextlib.AsyncExitStack()
            await stack.enter_async_context(env.serving())
            return env, stack
        tasks[env_id, args] = asyncio.ensure_future(enter())
    try:
        return (await asyncio.shield(tasks[env_id, args]))[0]
    except Exception:
        tasks.pop((env_id, args), None)  # the next episode tries again
        raise


async def close():
    """Leave this event loop's serving contexts (a pool's end does it by exiting; tests and benchmarks call it)."""
    for task in _SERVING.pop(asyncio.get_running_loop(), {}).values():
        if not task.cancelled() and task.exception() is None:
            await task.result()[1].aclose()


def load_data(spec: str, cfg, evaluation: bool) -> list[dict]:
    """The environment's task set as rows (the TaskData as the label), or a data file of TaskData rows."""
    if not cfg.env.id:
        raise molt.UsageError("agents/verifiers_env.py needs --env.id (a verifiers environment)")
    if (harness := json.loads(cfg.env.args).get("harness", "null")) not in HOST_HARNESSES:
        raise molt.UsageError(f"--env.args harness {harness!r} executes the policy's actions, and here it would run "
                              f"them on the host: only {sorted(HOST_HARNESSES)} run until harnesses run sandboxed")
    data = molt.read_rows(spec, cfg.data) if spec else \
        [t.data.model_dump(mode="json") for t in environment(cfg.env.id, cfg.env.args).taskset]
    if bad := [i for i, row in enumerate(data) if "prompt" not in row]:
        raise molt.UsageError(f"{spec}: row {bad[0]} has no 'prompt' (rows are the environment's TaskData fields)")
    return [{"prompt": row["prompt"], "label": {"env": cfg.env.id, "args": cfg.env.args, "data": row}} for row in data]


def task_of(env, data: dict):
    """The task for one row: the taskset's own Task type on its own TaskData type."""
    taskset = env.taskset
    return taskset.task_type()(type(taskset).task_type().data_type().model_validate(data), taskset.config.task)


class Verifiers(ChatAgent):
    async def run(self, ctx) -> Result:
        import verifiers.v1 as vf
        env = await serving(ctx.label["env"], ctx.label["args"])
        # verifiers reads the key from a variable. One per session, gone with it; "API_KEY" in its name keeps it out
        # of the harness and tool subprocesses (verifiers' subprocess runtime drops such variables)
        key_var = f"MOLT_SESSION_API_KEY_{ctx.session_id}"
        os.environ[key_var] = ctx.api_key
        sampling = {**{k: ctx.sampling_params[k] for k in ("temperature", "top_p", "max_tokens")
                       if k in ctx.sampling_params}, **json.loads(ctx.label["args"]).get("sampling", {})}
        client = vf.EvalClientConfig(base_url=ctx.base_url, api_key_var=key_var)
        model = vf.ModelContext(model=ctx.model_name, client=client, sampling=vf.SamplingConfig(**sampling))
        try:
            episode = await env.run_episode(task_of(env, ctx.label["data"]), model)
        finally:
            os.environ.pop(key_var, None)
            await drop_client(env, client)
        trace = episode.traces[0] if episode.traces else None
        errors = list(episode.errors) + list(trace.errors if trace else [])
        if errors or trace is None or trace.reward is None:  # the episode fails (counted), never a reward of 0
            raise RuntimeError(f"verifiers episode failed: {'; '.join(str(e.message)[:300] for e in errors)}")
        self.trace = trace  # for whoever subclasses this agent (the tests re-score it)
        info = {f"vf/{k}": r.score for k, r in trace.rewards.items() if r is not None}
        return Result(reward=trace.reward, info={**info, **{f"vf/{k}": v for k, v in (trace.metrics or {}).items()}})


AgentRunner = ChatAgentRunner(Verifiers)
