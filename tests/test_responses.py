"""Section 7, OpenAI's Responses wire: the stock SDK's responses.create / .stream / .retrieve / .delete /
.input_items against the loopback server and a real tiny engine; state kept per session (previous_response_id
extends the segment token for token), function calls and their outputs, JSON schema, errors in the wire's shape."""
import json

import openai
import pytest
import torch

import molt
from conftest import agent_groups, run
from test_agents import episode
from test_server import CITY, Server, trainer_logprobs

FLAT = {"type": "function", "name": "get_weather", "description": "weather in a city", "parameters": CITY}
ENDS = {"temperature": 1.0, "max_tokens": 16, "structured_outputs": {"regex": "hello there"}}  # ends at a stop


@pytest.mark.parametrize("text, reasoning, calls", [("ok", "", 0), ("", "", 1), ("ok", "hm", 2), ("", "hm", 1),
                                                     ("", "", 0)])
def test_a_replys_output_items_read_back_as_the_reply(text, reasoning, calls):
    """What previous_response_id and a replayed input rest on: a reply's output items, as messages, are the reply
    (the segment it extends is found by this equality), and they form one assistant message."""
    r = molt.Reply(id="x", text=text, reasoning=reasoning, finish="stop", ids=[1], prompt_tokens=1,
                   calls=[{"id": f"call_{k}", "name": "f", "arguments": '{"a": 1}'} for k in range(calls)])
    items = molt.response_output(r, "resp_1")
    assert [i["type"] for i in items] == ["reasoning"] * bool(reasoning) + ["message"] * bool(text or not (calls or reasoning)) + \
        ["function_call"] * calls and len({i["id"] for i in items}) == len(items)
    [m] = molt.response_messages(items)
    assert molt.canonical(m) == molt.canonical(molt.reply_message(r))


def test_a_chain_of_responses_is_one_segment_streamed_or_not_and_kept_per_session(engine, tiny):
    """create, create with previous_response_id, stream with it: one segment, each request's prompt the sampled tokens
    so far plus the new input; retrieve gives the same response (its items named alike), input_items the request's
    input; delete forgets it (404 after, as for another session's id or an unknown one)."""
    async def main():
        async with Server(engine, tiny, ENDS) as srv:
            c = srv.openai()
            r1 = await c.responses.create(model="m", input="hi", instructions="Be brief.")
            r2 = await c.responses.create(model="m", input="more", instructions="Be brief.",
                                          previous_response_id=r1.id)
            async with c.responses.stream(model="m", input=[{"role": "user", "content": [
                    {"type": "input_text", "text": "again"}]}], instructions="Be brief.",
                    previous_response_id=r2.id) as stream:
                deltas = [e.delta async for e in stream if e.type == "response.output_text.delta"]
                r3 = await stream.get_final_response()
            got, items = await c.responses.retrieve(r2.id), await c.responses.input_items.list(r2.id)
            await c.responses.delete(r1.id)
            other = srv.pool.server.open(episode())
            c2 = openai.AsyncOpenAI(base_url=other.base_url, api_key=other.api_key, max_retries=0)
            missing = []
            for call in (c.responses.retrieve(r1.id), c2.responses.retrieve(r2.id),
                         c.responses.create(model="m", input="x", previous_response_id="resp_nope")):
                with pytest.raises(openai.NotFoundError) as err:
                    await call
                missing.append(err.value.body)
            short = await c.responses.create(model="m", input="hi", max_output_tokens=1)
            return r1, r2, r3, deltas, got, items, missing, short, srv.session.segments, srv.pool.router.prompts
    r1, r2, r3, deltas, got, items, missing, short, segments, prompts = run(main())
    assert [r.output_text for r in (r1, r2, r3)] == ["hello there"] * 3 and "".join(deltas) == "hello there"
    assert r1.status == "completed" and r2.previous_response_id == r1.id and r3.usage.output_tokens > 0
    chain = segments[0].tokens
    assert len(segments) == 2 and all(p == chain[:len(p)] for p in prompts[:2])  # (streams are not in prompts)
    tok = molt.Codec(tiny).tokenizer
    assert tok.decode(prompts[1][len(prompts[0]):]).startswith("hello there")  # the reply, then the new input
    assert "again" in tok.decode(chain[len(prompts[1]):]) and tok.decode(chain).count("Be brief.") == 1
    assert got.model_dump() == r2.model_dump()
    assert [i.content[0].text for i in items.data] == ["more"]
    assert all(m["message"].startswith("Response with id") for m in missing)  # (the SDK unwraps "error")
    assert short.status == "incomplete" and short.incomplete_details.reason == "max_output_tokens"


def test_a_chain_continues_its_own_response_whatever_came_between(engine, tiny):
    """previous_response_id names the response to continue, not the session's last turn: after a request of another
    conversation the chain still extends the stored response's tokens (was: re-rendered from text, a new segment);
    a second continuation of the same response (a branch) opens a segment of its own and leaves the first alone."""
    async def main():
        async with Server(engine, tiny, ENDS) as srv:
            c = srv.openai()
            r1 = await c.responses.create(model="m", input="hi")
            await c.responses.create(model="m", input="something else")
            await c.responses.create(model="m", input="more", previous_response_id=r1.id)
            chained = [list(seg.tokens) for seg in srv.session.segments]
            await c.responses.create(model="m", input="instead", previous_response_id=r1.id)
            return chained, srv.session.segments, srv.pool.router.prompts
    chained, segments, prompts = run(main())
    assert len(chained) == 2 and prompts[2][:len(prompts[0])] == prompts[0] and \
        chained[0][:len(prompts[2])] == prompts[2]  # the chain: r1's prompt, r1's sampled reply, then "more"
    assert len(segments) == 3 and list(segments[0].tokens) == chained[0]  # the branch: a segment of its own
    assert "instead" in molt.Codec(tiny).tokenizer.decode(prompts[3]) and "more" not in \
        molt.Codec(tiny).tokenizer.decode(prompts[3])


def test_a_forced_call_its_output_and_a_replayed_input_extend_the_segment(engine, tiny):
    """tool_choice required: a function_call item (call_id, name, arguments held to the schema); its output sent
    with previous_response_id extends the call's segment, and so does the whole conversation replayed as input items
    the way the SDK returns them, with a new question. A JSON schema (text.format) shapes a reply."""
    async def main():
        async with Server(engine, tiny, {"temperature": 1.0, "max_tokens": 120}) as srv:
            c = srv.openai()
            r = await c.responses.create(model="m", input="Weather?", tools=[FLAT], tool_choice="required")
            call = next(o for o in r.output if o.type == "function_call")
            result = {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}
            chained = await c.responses.create(model="m", input=[result], tools=[FLAT], previous_response_id=r.id,
                                               max_output_tokens=4)
            replayed = [{"role": "user", "content": "Weather?"}, *[o.model_dump(exclude_none=True) for o in r.output],
                        result, *[o.model_dump(exclude_none=True) for o in chained.output],
                        {"role": "user", "content": "Thanks"}]
            await c.responses.create(model="m", input=replayed, tools=[FLAT], max_output_tokens=4)
            first = len(srv.session.segments)
            schema = await c.responses.create(model="m", input="City?", max_output_tokens=120, text={"format": {
                "type": "json_schema", "name": "city", "schema": CITY, "strict": True}})
            return call, chained, first, schema, srv.pool.router.prompts
    call, chained, first, schema, prompts = run(main())
    assert call.name == "get_weather" and json.loads(call.arguments)["city"] in ("Paris", "Rome")
    assert call.call_id and call.status == "completed"
    assert first == 1 and prompts[2][:len(prompts[1])] == prompts[1]  # the replay extends the chained request
    assert "sunny" in molt.Codec(tiny).tokenizer.decode(prompts[1][len(prompts[0]):])
    assert json.loads(schema.output_text)["city"] in ("Paris", "Rome")


def test_namespace_tools_are_shown_under_their_namespace_and_hosted_tools_are_dropped_and_counted(engine, tiny):
    """Codex CLI's tools: a namespace's functions are shown to the model as NAMESPACE__NAME (two namespaces with a
    function of the same name, and a flat one of that name, stay three tools); a call forced by namespace and name
    comes back with both, streamed or not; replayed as input (namespace and all) it extends its segment. web_search
    (a tool the API runs itself) is never shown and each request offering it counts one; a tool the client would run
    in another shape than a function call is refused, naming its type."""
    def space(name):
        return {"type": "namespace", "name": name, "description": f"{name} tools", "tools": [FLAT]}
    tools = [space("crm"), space("mail"), FLAT, {"type": "web_search", "external_web_access": False}]
    forced = {"type": "function", "name": "get_weather", "namespace": "mail"}

    async def main():
        async with Server(engine, tiny, {"temperature": 1.0, "max_tokens": 120}) as srv:
            c = srv.openai()
            async with c.responses.stream(model="m", input="Weather?", tools=tools, tool_choice=forced,
                                          store=False) as events:
                streamed = await events.get_final_response()
            r = await c.responses.create(model="m", input="Weather?", tools=tools, tool_choice=forced, store=False)
            call = next(o for o in r.output if o.type == "function_call")
            result = {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}
            replayed = [{"role": "user", "content": "Weather?"}, *[o.model_dump(exclude_none=True) for o in r.output],
                        result]
            await c.responses.create(model="m", input=replayed, tools=tools, max_output_tokens=4, store=False)
            refused = await srv.post("/v1/responses", {"model": "m", "input": "hi", "tools": [
                FLAT, {"type": "custom", "name": "apply_patch"}]})
            return r, streamed, srv.session, srv.pool.router.prompts, refused
    r, streamed, session, prompts, (status, refused) = run(main())
    for response in (r, streamed):
        [call] = [o for o in response.output if o.type == "function_call"]
        assert (call.name, call.namespace) == ("get_weather", "mail") and json.loads(call.arguments)["city"]
    shown = molt.Codec(tiny).tokenizer.decode(prompts[0])
    assert all(f'"name": "{n}"' in shown for n in ("crm__get_weather", "mail__get_weather", "get_weather"))
    assert "web_search" not in shown and session.counts["server/tools_dropped"] == 3
    # (prompts: the unstreamed requests') the replay extends the call's segment; the stream's is the other one
    assert len(session.segments) == 2 and prompts[1][:len(prompts[0])] == prompts[0]
    assert "sunny" in molt.Codec(tiny).tokenizer.decode(prompts[1][len(prompts[0]):])
    assert status == 400 and "'custom' tools are not served" in refused["error"]["message"]
    assert session.counts["server/4xx"] == 1  # that refusal alone


def test_the_second_case_of_a_chain_instructions_items_storage_and_tools(engine, tiny):
    """The cases beside the usual chain. Instructions changed mid-chain: the new ones reach the engine and the old
    do not (OpenAI's semantics: a response's instructions are not carried over), so the chain cannot extend its
    stored tokens (whose system turn said otherwise): a segment of its own. Two assistant messages in a row in the
    input stay two messages, as the template renders them. Two tools offered: a call forced by name is that tool's.
    Past 64 stored responses the oldest is forgotten (404, and a chain from it too), the rest are kept."""
    second = {"type": "function", "name": "get_time", "description": "time in a city", "parameters": CITY}
    codec = molt.Codec(tiny)

    async def main():
        async with Server(engine, tiny, {**ENDS, "max_tokens": 120}) as srv:  # (the forced call asks 120)
            c = srv.openai()
            r1 = await c.responses.create(model="m", input="hi", instructions="Be brief.")
            await c.responses.create(model="m", input="more", instructions="Be long.", previous_response_id=r1.id)
            changed = list(srv.session.segments)
            items = [{"role": "user", "content": "hi"},
                     {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "One."}]},
                     {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Two."}]},
                     {"role": "user", "content": "and?"}]
            await c.responses.create(model="m", input=items)
            call = await c.responses.create(model="m", input="When?", tools=[FLAT, second], max_output_tokens=120,
                                            tool_choice={"type": "function", "name": "get_time"},
                                            temperature=1.0)
            ids = [(await c.responses.create(model="m", input=str(k), max_output_tokens=1)).id for k in range(64)]
            gone = []
            for request in (c.responses.retrieve(r1.id), c.responses.create(model="m", input="x",
                                                                             previous_response_id=r1.id)):
                with pytest.raises(openai.NotFoundError):
                    await request
                gone.append(True)
            kept = await c.responses.retrieve(ids[0])
            return changed, call, gone, kept, ids, srv.pool.router.prompts
    changed, call, gone, kept, ids, prompts = run(main())
    text = [codec.tokenizer.decode(p) for p in prompts]
    assert "Be long." in text[1] and "Be brief." not in text[1] and len(changed) == 2
    two = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "One."},
           {"role": "assistant", "content": "Two."}, {"role": "user", "content": "and?"}]
    assert prompts[2] == codec.encode(codec.render(two))[0]
    [fc] = [o for o in call.output if o.type == "function_call"]
    assert fc.name == "get_time" and "get_weather" in text[3] and "get_time" in text[3]
    assert gone == [True, True] and kept.id == ids[0]


FULL_METADATA = {f"k{i:02d}": "v" * 512 for i in range(16)}  # OpenAI's most: about 8.5 KB as JSON


def test_a_sessions_stored_responses_and_segments_are_bounded(engine, tiny, monkeypatch):
    """64 stored responses with 4 MB of metadata each held +263 MiB; branches off one response opened 300 segments.
    Now metadata within OpenAI's limits (400), a byte budget per session (the oldest go; one alone over it, 413,
    unless not stored) and a segment cap (400). The budgets are lowered here so a few requests reach them."""
    monkeypatch.setattr(molt, "RESPONSES_BYTES", 20_000)
    monkeypatch.setattr(molt, "SESSION_SEGMENTS", 5)

    async def main():
        async with Server(engine, tiny, ENDS) as srv:
            c, post = srv.openai(), srv.post
            over = [await post("/v1/responses", {"model": "m", "input": "hi", "metadata": m}) for m in
                    ({"k": "x" * 4_000_000}, {f"k{i}": "v" for i in range(17)}, {"k" * 65: "v"}, {"k": 1})]
            ids = [(await c.responses.create(model="m", input="hi", metadata=FULL_METADATA, max_output_tokens=1)).id
                   for _ in range(3)]
            kept, session = [rid in srv.session.responses for rid in ids], srv.session
            stored = sum(t.echo["bytes"] for t, *_ in session.responses.values())
            monkeypatch.setattr(molt, "RESPONSES_BYTES", 5_000)
            alone = await post("/v1/responses", {"model": "m", "input": "hi", "metadata": FULL_METADATA})
            unstored = await post("/v1/responses", {"model": "m", "input": "hi", "metadata": FULL_METADATA,
                                                    "store": False, "max_output_tokens": 1})
            branches = [await post("/v1/responses", {"model": "m", "input": "again", "previous_response_id": ids[-1],
                                                     "store": False, "max_output_tokens": 1}) for _ in range(4)]
            return over, kept, stored, alone, unstored, branches, len(session.segments)
    over, kept, stored, alone, unstored, branches, segments = run(main())
    assert [status for status, _ in over] == [400] * 4 and "at most 16 pairs" in over[0][1]["error"]["message"]
    assert kept == [False, True, True] and 0 < stored <= 20_000  # the oldest went to fit the budget
    assert alone[0] == 413 and "store: false" in alone[1]["error"]["message"] and unstored[0] == 200
    assert [status for status, _ in branches] == [200, 200, 400, 400] and segments == 5  # (the first extends)
    assert "at most 5" in branches[2][1]["error"]["message"]


@pytest.mark.parametrize("body, fragment", [
    ({"input": [{"type": "item_reference", "id": "x"}]}, "item_reference"),
    ({"input": "hi", "tools": [{"type": "computer_use_preview"}]}, "'computer_use_preview' tools are not served"),
    ({"input": "hi", "tools": [{"type": "namespace", "name": "n", "tools": [{"type": "web_search"}]}]},
     "must be a function tool"),
    ({"input": []}, "non-empty list"),
    ({"input": "hi", "background": True}, "background"),
    ({"input": [{"type": "reasoning", "encrypted_content": "zz"}]}, "encrypted"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "file_id": "f"}]}]}, "input_image"),
])
def test_bad_responses_requests_are_4xx_in_the_wire_shape(engine, tiny, body, fragment):
    async def main():
        async with Server(engine, tiny) as srv:
            return await srv.post("/v1/responses", {"model": "m", **body}), \
                await srv.post("/v1/responses/compact", {"model": "m", "input": "hi"})
    (status, out), (compact, refusal) = run(main())
    assert status == 400 and fragment in out["error"]["message"] and out["error"]["type"]
    assert compact == 400 and "compaction" in refusal["error"]["message"]


@pytest.mark.parametrize("agent", ["chat_responses", "chat_agents_sdk"])
def test_a_responses_agent_records_one_segment_per_episode_and_trains(engine, tiny, tiny_trainer, agent):
    """agents/chat_responses.py (the stock SDK's responses.create) and agents/chat_agents_sdk.py (the OpenAI Agents
    SDK's Runner, streamed, auto_previous_response_id) on the tiny engine, in process, as a run makes their episodes:
    a forced calculator call, its output by previous_response_id, free turns; no request refused or failed, every
    forced call parsed, one segment (one Sample) per episode, engine and trainer agreeing on every trained token, and a
    training step on them. (The whole loop of this wire runs end to end in tests/test_clis.py: Codex on tiny:qwen3.)"""
    cfg, outs = agent_groups(engine, tiny, f"agents/{agent}.py")
    samples = [s for o in outs for s in o.samples]
    assert all(o.failures == {} for o in outs) and len(samples) == len({s.rollout_id for s in samples}) == 8
    assert all(s.info["server/5xx"] == 0 and s.info["server/4xx"] == 0 and s.info["tools/forced_parsed"] == 1.0 and
               s.info["tools/calls"] >= 1 for s in samples)
    trained = [s for s in samples if any(s.mask)]
    for s in trained:  # the engine's log-prob of each trained token is the trainer's, on the engine's weights
        mask = torch.tensor(s.mask[1:]).bool()
        assert (trainer_logprobs(tiny, s) - torch.tensor(s.logprobs[1:]))[mask].abs().max() < 1e-3
    _, trainer = tiny_trainer  # (the session's: its weights have moved, it only shows the step runs)
    metrics = molt.learn(cfg, {"policy": trainer}, trained)
    assert all(v == v for v in metrics.values())  # (finite: a group that all scored alike moves nothing)
