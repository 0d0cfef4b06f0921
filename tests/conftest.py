"""Shared expensive fixtures: tiny models (built once, cached), one Ray cluster, one engine per model kind."""
import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
import molt  # noqa: E402


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


def _engine(ray, path):
    """One engine for the whole session, killed at its end."""
    e = molt.start_engines(small_config(), path)[0]
    yield e
    ray.kill(e)


@pytest.fixture(scope="session")
def engine(ray_cluster, tiny):
    yield from _engine(ray_cluster, tiny)


@pytest.fixture(scope="session")
def moe_engine(ray_cluster, tiny_moe):
    yield from _engine(ray_cluster, tiny_moe)


@pytest.fixture(scope="session")
def vl_engine(ray_cluster, tiny_vl):
    yield from _engine(ray_cluster, tiny_vl)


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
