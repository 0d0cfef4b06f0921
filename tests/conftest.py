"""Shared expensive fixtures: tiny models (built once, cached), one Ray cluster, one engine per model kind."""
import asyncio
import gc
import os
import subprocess
import sys
import threading
import time
from collections import defaultdict
from pathlib import Path

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
import molt  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def run(awaitable):
    """Await a coroutine or a Ray ObjectRef from a sync test."""
    async def main():
        try:
            return await awaitable
        finally:
            await molt.close_clients()  # the SDK clients ctx.openai() shares are bound to this loop
    return asyncio.run(main())


@pytest.fixture(scope="session")
def tiny():
    return molt.resolve_model("tiny")


@pytest.fixture(scope="session")
def tiny_moe():
    return molt.resolve_model("tiny-moe")


@pytest.fixture(scope="session")
def tiny_vl():
    return molt.resolve_model("tiny-vl")


def file_state(path: str) -> dict:
    """Every tensor of a local HF checkpoint directory, by checkpoint name."""
    from safetensors.torch import load_file
    return {k: v for f in sorted(Path(path).glob("*.safetensors")) for k, v in load_file(f).items()}


def small_config(**overrides) -> molt.Config:
    cfg = molt.Config()
    cfg.data.max_len = 1024
    cfg.engine.kv_cache_gb = 0.25
    for key, value in overrides.items():
        molt.config_set(cfg, key, value)
    return molt.validate_config(cfg)  # derived defaults filled in, as for a parsed command line


def agent_groups(engine, path: str, agent: str, *flags, rows: int = 2, n=4):
    """An agent module's episodes on a shared engine, in process, as a run makes them (its DEFAULTS and the flags
    parsed, its rollout sampling): n episodes of each of the first `rows` rows of its data (prompt_index: the row's
    index). -> (config, [GroupOut])."""
    cfg = molt.parse_config(["--agent", str(ROOT / agent), "--model", path, "--data.max-len", "1024", *map(str, flags)])
    rows = molt.load_rows(cfg.data.path, cfg.data, cfg)[:rows]

    async def main():
        pool = molt.AgentPool(cfg, cfg.agent, path, [engine])
        try:
            return [await pool.run_group(r, n, molt.rollout_sampling(cfg), f"g{i}", i) for i, r in enumerate(rows)]
        finally:
            await pool.server.stop()
    return cfg, run(main())


@pytest.fixture(scope="session", autouse=True)
def free_shared_memory():
    """Runs and actors the tests kill cannot free their weight buffers in /dev/shm: free them once all are gone."""
    yield
    for _ in range(20):
        molt.free_stale_weights()
        if not list(molt.shm_dir().glob("molt-weights-*")):
            break
        time.sleep(0.5)


@pytest.fixture(scope="session")
def ray_cluster():
    import ray
    molt.ray_init(molt.Config())
    yield ray
    ray.shutdown()


class Engines:
    """The session's engines, one per model and engine options, started on first use. The tiny model's plain engine
    stays up for the whole session (nearly every file uses it); of the others only the one asked for last stays up
    (test files use one other model at a time), and the one named as `then`, started ahead so it loads while this
    one serves: at most three run at once, about 1 GB each."""

    def __init__(self, ray, tiny: str):
        self.ray, self.up, self.kept = ray, {}, (tiny, ())  # key -> (engine, ref that resolves once it is ready)

    def launch(self, path: str, options: dict) -> tuple:
        key = (path, tuple(sorted(options.items())))
        if key not in self.up:
            engines, ready = molt.launch_engines(small_config(**options), path)
            self.up[key] = engines[0], ready[0]
        return key

    def get(self, path: str, then: str | None = None, **options):
        key = self.launch(path, options)
        for other in [k for k in self.up if k not in (self.kept, key)]:
            self.ray.kill(self.up.pop(other)[0])
        engine, ready = self.up[key]
        self.ray.get(ready, timeout=600)
        if then:
            self.launch(then, {})
        return engine

    def stop(self):
        for e, _ in self.up.values():
            self.ray.kill(e)
        self.up = {}


@pytest.fixture(scope="session")
def engines(ray_cluster, tiny):
    pool = Engines(ray_cluster, tiny)
    yield pool
    pool.stop()


@pytest.fixture(scope="module")
def engine(engines, tiny):
    return engines.get(tiny)


@pytest.fixture(scope="module")
def moe_engine(engines, tiny_moe):
    return engines.get(tiny_moe)


@pytest.fixture(scope="module")
def vl_engine(engines, tiny_vl):
    return engines.get(tiny_vl)


@pytest.fixture(scope="session")
def tiny_trainer(ray_cluster, tiny):
    """One policy rank on the tiny model, shared by tests that only need a training step to run."""
    cfg = small_config(**{"train.lr": 1e-4, "train.micro_batch_size": 8})
    group = molt.ModelGroup(cfg, tiny, "policy", total_steps=100)
    yield cfg, group
    for w in group.workers:
        ray_cluster.kill(w)


@pytest.fixture(scope="session")
def geo3k_run(tmp_path_factory):
    """A 2-step geo3k run (tiny-vl, tool turns with images) with its samples dumped: (run dir, completed process)."""
    run_dir = tmp_path_factory.mktemp("geo3k") / "run"
    root = Path(__file__).resolve().parent.parent
    proc = subprocess.run([sys.executable, str(root / "molt.py"), "--agent", "agents/geo3k.py", "--run-dir", run_dir,
                           "--steps", "2", "--dump-samples", "--rollout.max-new-tokens", "32"], cwd=root,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run_dir, proc


IN_FIXTURE = [0]  # fixtures being set up now (a test body may ask for one: request.getfixturevalue)


@pytest.hookimpl(wrapper=True)
def pytest_fixture_setup(fixturedef, request):
    IN_FIXTURE[0] += 1
    try:
        return (yield)
    finally:
        IN_FIXTURE[0] -= 1


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    """Every engine and trainer a test's own body starts is stopped when the test ends, passed or failed: one left up
    holds about a GB for the rest of the session. (Fixtures stop theirs, those a body asks for included; molt.py
    subprocesses end with their run.)"""
    started, launch, init = [], molt.launch_engines, molt.ModelGroup.__init__

    def launch_engines(*args, **kwargs):
        engines, ready = launch(*args, **kwargs)
        started.extend(engines if not IN_FIXTURE[0] else [])
        return engines, ready

    def group_init(self, *args, **kwargs):
        started.extend([self] if not IN_FIXTURE[0] else [])
        init(self, *args, **kwargs)
    molt.launch_engines, molt.ModelGroup.__init__ = launch_engines, group_init
    try:
        return (yield)
    finally:
        molt.launch_engines, molt.ModelGroup.__init__ = launch, init
        if started:
            import ray
            for actor in [w for a in started for w in getattr(a, "workers", [a])]:
                ray.kill(actor)


# ---- The suite's cost, printed at the end of every run: wall time and peak memory, overall and per file. Memory is
# the machine's in use (MemTotal - MemAvailable, sampled every 0.5 s): engines, Ray workers and `vllm serve` are
# other processes, and what they leave behind counts against the next file too.
COST = {"t0": time.time(), "file": "(collection)", "wall": defaultdict(float), "peak": defaultdict(float), "rss": {}}


def used_gb() -> float:
    info = dict(line.split(":", 1) for line in open("/proc/meminfo"))
    return (int(info["MemTotal"].split()[0]) - int(info["MemAvailable"].split()[0])) / 2 ** 20


def _sample_memory():
    while True:
        COST["peak"][COST["file"]] = max(COST["peak"][COST["file"]], used_gb())
        time.sleep(0.5)


def pytest_sessionstart(session):
    COST["base"] = used_gb()
    threading.Thread(target=_sample_memory, daemon=True).start()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    if item.location[0] != COST["file"]:  # a new file: what the last one freed goes back to the system (the C heap
        import ctypes                     # keeps freed tokenizers and models otherwise: GBs over the session)
        gc.collect()
        ctypes.CDLL(None).malloc_trim(0)
    COST["file"], t0 = item.location[0], time.time()
    COST["peak"][COST["file"]] = max(COST["peak"][COST["file"]], used_gb())
    try:
        return (yield)
    finally:
        # What a test's in-process pools leave reachable: aiohttp 3.14 caches each app's middleware chain by handler
        # (1,024 of them), and a handler is a bound method of a test's loopback server (its codec, tokenizer and
        # parsers with it); and molt.start_up freezes everything alive after a pool's constructor (right for an
        # actor's process, which builds one) out of the collector's reach. Together: GBs over the session.
        if "aiohttp.web_app" in sys.modules:
            sys.modules["aiohttp.web_app"]._cached_build_middleware.cache_clear()
        gc.unfreeze()
        COST["wall"][item.location[0]] += time.time() - t0
        COST["rss"][item.location[0]] = int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def pytest_terminal_summary(terminalreporter):
    write = terminalreporter.write_line
    peak = max(COST["peak"].values(), default=used_gb())
    write(f"suite cost: {time.time() - COST['t0']:.0f} s wall, memory in use peak {peak:.1f} GB "
          f"(at start {COST['base']:.1f} GB)")
    for f in sorted(COST["wall"], key=COST["wall"].get, reverse=True):
        write(f"  {COST['wall'][f]:7.1f} s  peak {COST['peak'][f]:5.1f} GB  (pytest {COST['rss'][f] / 2**30:4.1f} GB after)  "
              f"{f}")
