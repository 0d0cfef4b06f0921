"""Section 7: the streaming pool (RolloutManager) on its own, with a stand-in for the agent pool actors (no Ray, no
engine): staleness at and past the bound, the data cursor across a checkpoint, filtering and counting."""
import asyncio
import signal

import pytest

import molt
from conftest import small_config

pytestmark = pytest.mark.core  # staleness, versions and the async state: every test here is part of the core tier


class FakePool:
    """Stands in for an AgentPool actor: run_group.remote(row, ...) gives an awaitable GroupOut of n one-token episodes,
    sampled at the version the row names, rewarded with the row's reward (default 1)."""

    def __init__(self, dead=False):
        self.run_group, self.dead = self, dead
        self.calls, self.issued = 0, []
        self.hold_from = None  # prompts from this index on wait until cancelled: they stay in flight

    def remote(self, row, n, sampling, group_id, index=-1, epoch=-1):
        self.calls += 1
        self.issued.append(asyncio.ensure_future(self.group(row, n, group_id, index, epoch)))
        return self.issued[-1]

    async def group(self, row, n, group_id, index, epoch):
        await asyncio.sleep(0)
        if self.hold_from is not None and index >= self.hold_from:
            await asyncio.Event().wait()
        if self.dead:
            import ray
            raise ray.exceptions.RayActorError()
        out = []
        for k in range(n):
            s = molt.Sample(group_id=group_id, rollout_id=f"{group_id}-{k}", prompt_index=index, epoch=epoch)
            s.add_context([5, 6])
            if k in row.get("guided", ()):  # the episode ended on a guided turn (context only): nothing to train on
                s.add_context([7])
            else:  # "version": one version, or a list of them (a turn a weight update cut through)
                versions = row.get("version", 0)
                versions = versions if isinstance(versions, list) else [versions]
                s.add_turn(molt.Completion([7] * len(versions), [-0.5] * len(versions), versions, "stop"))
            s.reward = s.score = row.get("rewards", [1.0] * n)[k]
            s.info = {"tools/forced_parsed": float(k not in row.get("guided", ()))}
            out.append(s)
        return molt.GroupOut(out, {})


def rows(n, **extra):
    return [{"prompt": f"p{i}", "idx": i, **extra} for i in range(n)]


def manager(data, state=None, **overrides):
    cfg = small_config(**{"rollout.batch_size": 2, "rollout.n_samples_per_prompt": 2, "train.async_queue_size": 0,
                          **overrides})
    return molt.RolloutManager(cfg, data, [FakePool()], state)


def batches(m, k, version=0):
    """k batches, within 30 s: a manager that drops every group loops forever, and a busy loop never yields to
    asyncio's timeouts, so an alarm bounds it."""
    def expire(*_):
        raise TimeoutError("the rollout manager produced no batch in 30 s")

    async def main():
        return [await m.get_batch(version) for _ in range(k)]
    old = signal.signal(signal.SIGALRM, expire)
    signal.alarm(30)
    try:
        return asyncio.run(main())
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def prompts(batch):
    return [s.prompt_index for s in batch.samples[::2]]  # one per group (n = 2 samples each)


def test_staleness_exactly_at_the_bound_is_kept_and_one_past_is_dropped():
    data = [{"prompt": "p", "idx": i, "version": v} for i, v in enumerate([7, 6, 7, 6])]  # trained at version 10
    m = manager(data, **{"rollout.max_staleness": 3, "rollout.batch_size": 2, "data.shuffle": False})
    [b] = batches(m, 1, version=10)
    assert prompts(b) == [0, 2]  # staleness 3 kept, staleness 4 dropped
    assert b.counts["rollout/dropped/stale"] == 1  # the fourth prompt was never needed
    assert all(10 - molt.oldest_version(s) == 3 for s in b.samples)


def test_a_partial_rollout_is_as_stale_as_its_oldest_trained_token():
    """Second case: turns a weight update cut through carry two versions; a group is as old as its oldest trained
    token (the context before it, version -1, does not count), not its newest."""
    data = [{"prompt": "p", "idx": i, "version": v} for i, v in enumerate([[6, 7], [7, 8], [8, 6, 9], [9, 10]])]
    m = manager(data, **{"rollout.max_staleness": 3, "rollout.batch_size": 2, "data.shuffle": False})
    [b] = batches(m, 1, version=10)
    assert prompts(b) == [1, 3] and b.counts["rollout/dropped/stale"] == 2  # [6, 7] and [8, 6, 9]: 4 versions old
    assert molt.step_metrics(b.samples, 10)["rollout/staleness_max"] == 3


def test_the_data_cursor_survives_a_checkpoint_in_order():
    straight = [prompts(b) for b in batches(manager(rows(7)), 6)]  # 12 prompts: crosses an epoch boundary
    first = manager(rows(7))
    head = [prompts(b) for b in batches(first, 4)]
    state = first.state()
    assert state["cursor"] == 1 and state["epoch"] == 1 and state["unfinished"] == []  # synchronous: nothing in flight
    assert state["finished"] == []  # and nothing finished ahead
    tail = [prompts(b) for b in batches(manager(rows(7), state), 2)]
    assert head + tail == straight
    assert sorted(p for b in straight[:3] for p in b) + [straight[3][0]] == [0, 1, 2, 3, 4, 5, 6]  # one epoch, once each


def test_groups_outside_the_filter_range_are_dropped_and_counted():
    data = [{"prompt": "p", "idx": i, "rewards": r} for i, r in enumerate([[1, 1], [0, 1], [0, 0], [1, 0]])]
    m = manager(data, **{"algo.filter_range": (0.0, 1.0), "data.shuffle": False})
    [b] = batches(m, 1)
    assert prompts(b) == [1, 3] and b.counts["rollout/dropped/filtered"] == 2


def test_synchronous_mode_generates_exactly_the_batch_and_nothing_ahead():
    m = manager(rows(20), **{"rollout.groups_in_flight": 8})

    async def main():
        await m.get_batch(0)
        for _ in range(5):  # let anything the manager might still dispatch run
            await asyncio.sleep(0)
        return m.pools[0].calls, len(m.finished), len(m.tasks)
    assert asyncio.run(main()) == (2, 0, 0)


def test_async_state_holds_finished_groups_and_prompts_in_flight_and_restores_them():
    """A checkpoint of an async run: groups finished but not trained come back first (same Samples), prompts in
    flight are re-issued before the cursor moves on; over the two lineages every prompt is trained exactly once."""
    m = manager(rows(10), **{"train.async_queue_size": 2, "rollout.groups_in_flight": 3, "data.shuffle": False})
    m.pools[0].hold_from = 4  # prompts 2 and 3 finish ahead of training, 4.. are still in flight at the checkpoint

    async def first_part():
        first = await m.get_batch(0)
        for _ in range(10):
            await asyncio.sleep(0)  # let it run ahead
        return first, m.state()
    first, state = asyncio.run(first_part())
    assert state["finished"] and all(isinstance(s, molt.Sample) for g in state["finished"] for s in g)
    assert sorted(i for i, _ in state["unfinished"]) == [4, 5, 6]  # groups_in_flight 3, all held
    restored = manager(rows(10), state, **{"train.async_queue_size": 2, "rollout.groups_in_flight": 3,
                                           "data.shuffle": False})
    rest = batches(restored, 4)
    assert {s.rollout_id for s in state["finished"][0]} <= {s.rollout_id for s in rest[0].samples}  # trained first
    trained = prompts(first) + [p for b in rest for p in prompts(b)]
    assert sorted(trained) == list(range(10))  # each of the epoch's prompts once: none lost, none twice


def test_closing_cancels_the_groups_in_flight_and_issues_no_more():
    """The run is over: groups still in flight are cancelled, nothing new goes out (a group that finished after Ray's
    shutdown at exit would end the run with status 1), and what finished ahead stays."""
    m = manager(rows(10), **{"train.async_queue_size": 2, "rollout.groups_in_flight": 3, "data.shuffle": False})
    pool = m.pools[0]
    pool.hold_from = 4

    async def main():
        await m.get_batch(0)
        for _ in range(10):
            await asyncio.sleep(0)
        held, calls = [f for f in pool.issued if not f.done()], pool.calls
        await m.close()
        for _ in range(10):
            await asyncio.sleep(0)
        return held, [f.cancelled() for f in held], pool.calls - calls, len(m.tasks)  # before asyncio.run cancels
    held, cancelled, issued, in_flight = asyncio.run(main())
    assert len(held) == 3 and all(cancelled)  # prompts 4, 5 and 6
    assert issued == 0 and in_flight == 0 and len(m.finished) == 2  # prompts 2 and 3, finished ahead, stay


def test_a_bad_row_or_a_dead_pool_costs_that_work_only():
    m = manager(rows(4), **{"data.shuffle": False})
    m.pools.insert(0, FakePool(dead=True))  # the first group goes to a pool that died: it is re-issued
    [b] = batches(m, 1)
    assert sorted(prompts(b)) == [0, 1] and m.dead_pools == {0}
    out = asyncio.run(m.evaluate(rows(3), 2))  # evaluation only uses the living pool
    assert out["eval/failed"] == 0 and out["eval/reward_mean"] == 1.0
    m.keep(molt.GroupOut([], {}, 0, {"bad_row": 1}))
    assert m.counts["rollout/dropped/bad_row"] == 1


def test_agent_metrics_count_every_finished_episode_not_only_the_trained():
    """An episode that ends on a guided turn (a forced call that never parsed) has no action token and is dropped
    before training; the agents' info metrics still average over it (else tools/forced_parsed reads 1.0 while most
    forced calls failed), and episodes/finished says how many there were."""
    m = manager(rows(6, guided=[1]), **{"data.shuffle": False})
    [b] = batches(m, 1)
    assert len(b.samples) == 2 and all(any(s.mask) for s in b.samples)  # one trained episode per group
    metrics = molt.step_metrics(b.samples, 0, b.infos)
    assert metrics["episodes"] == 2 and metrics["episodes/finished"] == len(b.infos) >= 4
    assert metrics["tools/forced_parsed"] == 0.5  # over the trained ones only: 1.0
    assert b.counts["rollout/dropped/no_action_tokens"] == len(b.infos) / 2
    assert m.state()["infos"] == m.infos  # what finished after this batch goes into the checkpoint
