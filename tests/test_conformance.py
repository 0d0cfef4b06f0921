"""Section 7 against the real thing: the same requests on each wire (chat completions, messages, responses), streamed
and not, sent to Molt's loopback server and to vLLM's own OpenAI/Anthropic-compatible server (`vllm serve`, shipped
with vllm) on the same tiny model. Sampling is seeded per request (greedy where vLLM's route takes no seed), so both
servers sample the same tokens and their answers can be compared field by field: status, key sets, finish / stop
reasons, text (stop strings removed), SSE event sequences; on the Responses wire also a previous_response_id chain and
a retrieval, each server continuing its own stored response. Every difference that remains is listed below as
deliberate; a new one fails the test."""
import asyncio
import json
import os
import socket
import subprocess
import sys
import time

import aiohttp
import pytest

from conftest import run
from test_server import CITY, WEATHER, Server

pytestmark = pytest.mark.slow
TOOL = {"name": "get_weather", "description": "weather in a city", "input_schema": CITY}
HELLO = [{"role": "user", "content": "Tell me a story."}]
S = {"seed": 1234, "temperature": 1.0}  # seeded: both servers sample the same tokens
G = {"temperature": 0.0}  # vLLM's Anthropic route drops the seed: greedy there, so both sample the same tokens

OPENAI = {  # name: (body, stream)
    "plain": ({"messages": HELLO, "max_tokens": 8, **S}, False),
    "one token": ({"messages": HELLO, "max_tokens": 1, **S}, False),
    "max_completion_tokens": ({"messages": HELLO, "max_completion_tokens": 6, **S}, False),
    "system and turns": ({"messages": [{"role": "system", "content": "Be brief."}, *HELLO,
                                       {"role": "assistant", "content": "Once."}, {"role": "user", "content": "More"}],
                          "max_tokens": 8, **S}, False),
    "content parts": ({"messages": [{"role": "user", "content": [{"type": "text", "text": "Tell me"}]}],
                       "max_tokens": 8, **S}, False),
    "stop absent": ({"messages": HELLO, "max_tokens": 8, "stop": ["\x07never"], **S}, False),
    "stop found": ({"messages": HELLO, "max_tokens": 16, "stop": "@STOP@", **S}, False),  # filled in from "plain"
    "n=2": ({"messages": HELLO, "max_tokens": 6, "n": 2, **S}, False),
    "logprobs": ({"messages": HELLO, "max_tokens": 4, "logprobs": True, "top_logprobs": 2, **S}, False),
    "ignored fields": ({"messages": HELLO, "max_tokens": 4, "user": "u", "metadata": {"a": "b"},
                        "service_tier": "auto", "store": False, **S}, False),
    "template kwargs": ({"messages": HELLO, "max_tokens": 6, "chat_template_kwargs": {"enable_thinking": False},
                         **S}, False),
    "json schema": ({"messages": HELLO, "max_tokens": 24, "response_format": {"type": "json_schema", "json_schema": {
        "name": "city", "schema": CITY}}, **S}, False),
    "tools auto": ({"messages": HELLO, "max_tokens": 8, "tools": [WEATHER], **S}, False),
    "tools none": ({"messages": HELLO, "max_tokens": 8, "tools": [WEATHER], "tool_choice": "none", **S}, False),
    "tools required": ({"messages": HELLO, "max_tokens": 120, "tools": [WEATHER], "tool_choice": "required", **S},
                       False),
    "tools named": ({"messages": HELLO, "max_tokens": 120, "tools": [WEATHER], "tool_choice": {
        "type": "function", "function": {"name": "get_weather"}}, **S}, False),
    "stream": ({"messages": HELLO, "max_tokens": 8, "stream": True, **S}, True),
    "stream usage": ({"messages": HELLO, "max_tokens": 8, "stream": True, "stream_options": {"include_usage": True},
                      **S}, True),
    "stream stop": ({"messages": HELLO, "max_tokens": 16, "stream": True, "stop": "@STOP@", **S}, True),
    "stream one token": ({"messages": HELLO, "max_tokens": 1, "stream": True, **S}, True),
    "stream tool named": ({"messages": HELLO, "max_tokens": 120, "stream": True, "tools": [WEATHER], "tool_choice": {
        "type": "function", "function": {"name": "get_weather"}}, **S}, True),
    "no messages": ({"max_tokens": 4}, False),
    "messages not a list": ({"messages": "hi", "max_tokens": 4}, False),
    "unknown role": ({"messages": [{"role": "wizard", "content": "hi"}], "max_tokens": 4}, False),
    "negative max_tokens": ({"messages": HELLO, "max_tokens": -1}, False),
    "n=0": ({"messages": HELLO, "max_tokens": 4, "n": 0}, False),
    "temperature a string": ({"messages": HELLO, "max_tokens": 4, "temperature": "hot"}, False),
    "stop not strings": ({"messages": HELLO, "max_tokens": 4, "stop": [1, 2]}, False),
    "tools not a list": ({"messages": HELLO, "max_tokens": 4, "tools": "x"}, False),
    "top_logprobs too many": ({"messages": HELLO, "max_tokens": 4, "logprobs": True, "top_logprobs": 100}, False),
    "not json": ("{not json", False),
    "no model": ({"messages": HELLO, "max_tokens": 4, **S}, False),
}
ANTHROPIC = {
    "plain": ({"messages": HELLO, "max_tokens": 8, **G}, False),
    "one token": ({"messages": HELLO, "max_tokens": 1, **G}, False),
    "system string": ({"system": "Be brief.", "messages": HELLO, "max_tokens": 8, **G}, False),
    "system blocks": ({"system": [{"type": "text", "text": "Be brief."}], "messages": HELLO, "max_tokens": 8, **G},
                      False),
    "turns": ({"messages": [*HELLO, {"role": "assistant", "content": "Once."}, {"role": "user", "content": "More"}],
               "max_tokens": 8, **G}, False),
    "content blocks": ({"messages": [{"role": "user", "content": [{"type": "text", "text": "Tell me"}]}],
                        "max_tokens": 8, **G}, False),
    "stop absent": ({"messages": HELLO, "max_tokens": 8, "stop_sequences": ["\x07never"], **G}, False),
    "stop found": ({"messages": HELLO, "max_tokens": 16, "stop_sequences": ["@STOP@"], **G}, False),
    "metadata": ({"messages": HELLO, "max_tokens": 4, "metadata": {"user_id": "u"}, **G}, False),
    "top_k": ({"messages": HELLO, "max_tokens": 6, "top_k": 5, **G}, False),
    "tools auto": ({"messages": HELLO, "max_tokens": 8, "tools": [TOOL], **G}, False),
    "tools none": ({"messages": HELLO, "max_tokens": 8, "tools": [TOOL], "tool_choice": {"type": "none"}, **G}, False),
    "tools any": ({"messages": HELLO, "max_tokens": 120, "tools": [TOOL], "tool_choice": {"type": "any"}, **G}, False),
    "tools named": ({"messages": HELLO, "max_tokens": 120, "tools": [TOOL],
                     "tool_choice": {"type": "tool", "name": "get_weather"}, **G}, False),
    "stream": ({"messages": HELLO, "max_tokens": 8, "stream": True, **G}, True),
    "stream stop": ({"messages": HELLO, "max_tokens": 16, "stream": True, "stop_sequences": ["@STOP@"], **G}, True),
    "stream one token": ({"messages": HELLO, "max_tokens": 1, "stream": True, **G}, True),
    "stream tool named": ({"messages": HELLO, "max_tokens": 120, "stream": True, "tools": [TOOL],
                           "tool_choice": {"type": "tool", "name": "get_weather"}, **G}, True),
    "stream system": ({"system": "Be brief.", "messages": HELLO, "max_tokens": 8, "stream": True, **G}, True),
    "no max_tokens": ({"messages": HELLO}, False),
    "no messages": ({"max_tokens": 4}, False),
    "messages not a list": ({"messages": "hi", "max_tokens": 4}, False),
    "unknown role": ({"messages": [{"role": "wizard", "content": "hi"}], "max_tokens": 4}, False),
    "negative max_tokens": ({"messages": HELLO, "max_tokens": -1}, False),
    "temperature a string": ({"messages": HELLO, "max_tokens": 4, "temperature": "hot"}, False),
    "stop not strings": ({"messages": HELLO, "max_tokens": 4, "stop_sequences": [1]}, False),
    "tools not a list": ({"messages": HELLO, "max_tokens": 4, "tools": "x"}, False),
    "bad block type": ({"messages": [{"role": "user", "content": [{"type": "hologram"}]}], "max_tokens": 4}, False),
    "system not text": ({"system": 5, "messages": HELLO, "max_tokens": 4}, False),
    "not json": ("{not json", False),
    "no model": ({"messages": HELLO, "max_tokens": 4, **G}, False),
}

FLAT = {"type": "function", **WEATHER["function"]}
CALL = [{"role": "user", "content": "Weather in Paris?"},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"}]
RESPONSES = {  # vLLM's Responses route has no seed: greedy, as on the Anthropic wire
    "plain": ({"input": "Tell me a story.", "max_output_tokens": 8, **G}, False),
    "one token": ({"input": "Tell me a story.", "max_output_tokens": 1, **G}, False),
    "instructions": ({"instructions": "Be brief.", "input": "Tell me a story.", "max_output_tokens": 8, **G}, False),
    "message items": ({"input": HELLO, "max_output_tokens": 8, **G}, False),
    "input_text parts": ({"input": [{"role": "user", "content": [{"type": "input_text", "text": "Tell me"}]}],
                          "max_output_tokens": 8, **G}, False),
    "turns": ({"input": [*HELLO, {"type": "message", "role": "assistant", "content": [
        {"type": "output_text", "text": "Once."}]}, {"role": "user", "content": "More"}], "max_output_tokens": 8, **G},
              False),
    "developer role": ({"input": [{"role": "developer", "content": "Be brief."}, *HELLO], "max_output_tokens": 8,
                        **G}, False),
    "ignored fields": ({"input": "Tell me a story.", "max_output_tokens": 8, "metadata": {"a": "b"}, "user": "u",
                        "store": False, "truncation": "disabled", "parallel_tool_calls": True, **G}, False),
    "top_p": ({"input": "Tell me a story.", "max_output_tokens": 8, "top_p": 0.5, **G}, False),
    "logprobs": ({"input": "Tell me a story.", "max_output_tokens": 4, "include": ["message.output_text.logprobs"],
                  "top_logprobs": 2, **G}, False),
    "json schema": ({"input": "Tell me a story.", "max_output_tokens": 24, "text": {"format": {
        "type": "json_schema", "name": "city", "schema": CITY}}, **G}, False),
    "tools auto": ({"input": "Tell me a story.", "max_output_tokens": 8, "tools": [FLAT], **G}, False),
    "tools none": ({"input": "Tell me a story.", "max_output_tokens": 8, "tools": [FLAT], "tool_choice": "none",
                    **G}, False),
    "tools required": ({"input": "Tell me a story.", "max_output_tokens": 120, "tools": [FLAT],
                        "tool_choice": "required", **G}, False),
    "tools named": ({"input": "Tell me a story.", "max_output_tokens": 120, "tools": [FLAT], "tool_choice": {
        "type": "function", "name": "get_weather"}, **G}, False),
    "call and output": ({"input": CALL, "max_output_tokens": 8, "tools": [FLAT], **G}, False),
    "previous_response_id": ({"input": "More", "previous_response_id": "@PREV@", "max_output_tokens": 8, **G}, False),
    "stream": ({"input": "Tell me a story.", "max_output_tokens": 8, "stream": True, **G}, True),
    "stream one token": ({"input": "Tell me a story.", "max_output_tokens": 1, "stream": True, **G}, True),
    "stream tools named": ({"input": "Tell me a story.", "max_output_tokens": 120, "stream": True, "tools": [FLAT],
                            "tool_choice": {"type": "function", "name": "get_weather"}, **G}, True),
    "retrieve": ("@GET@", False),
    "no input": ({"max_output_tokens": 4}, False),
    "input a number": ({"input": 5, "max_output_tokens": 4}, False),
    "unknown item": ({"input": [{"type": "hologram"}], "max_output_tokens": 4}, False),
    "negative max_output_tokens": ({"input": "hi", "max_output_tokens": -1}, False),
    "temperature a string": ({"input": "hi", "max_output_tokens": 4, "temperature": "hot"}, False),
    "tools not a list": ({"input": "hi", "max_output_tokens": 4, "tools": "x"}, False),
    "unknown previous_response_id": ({"input": "hi", "max_output_tokens": 4, "previous_response_id": "resp_nope"},
                                     False),
    "not json": ("{not json", False),
    "no model": ({"input": "Tell me a story.", "max_output_tokens": 8, **G}, False),
}


@pytest.fixture(scope="module")
def vllm_serve(tiny, tmp_path_factory):
    yield from serve(tiny, tmp_path_factory, "--tool-call-parser", "hermes")


def start_serve(model, tmp_path_factory, *parsers) -> tuple:
    """vLLM's own API server on a model, in float32 like Molt's CPU engine, serving it under Molt's name, with the
    given parser flags (and its Responses store on: previous_response_id and retrieval need it); not waited for.
    -> (process, port, log)"""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = open(tmp_path_factory.mktemp("vllm-serve") / "serve.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
                             "--served-model-name", "policy", "--host", "127.0.0.1", "--port", str(port),
                             "--dtype", "float32", "--max-model-len", "1024", "--enforce-eager",
                             "--enable-auto-tool-choice", *parsers,
                             # Molt's engines: guided JSON with no free whitespace
                             "--structured-outputs-config", '{"backend": "xgrammar", "disable_any_whitespace": true}'],
                            stdout=log,
                            stderr=subprocess.STDOUT, env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1",
                                                               "VLLM_ENABLE_RESPONSES_API_STORE": "1",
                                                               # the engine in the server's process: 10 s sooner up
                                                               "VLLM_ENABLE_V1_MULTIPROCESSING": "0"})
    return proc, port, log


def serve(model, tmp_path_factory, *parsers, started: tuple | None = None):
    """start_serve's server (or the one started), once it answers: yields its URL, and stops it after."""
    proc, port, log = started or start_serve(model, tmp_path_factory, *parsers)
    url, t0 = f"http://127.0.0.1:{port}", time.time()
    try:
        while True:
            assert proc.poll() is None, open(log.name).read()[-3000:]
            assert time.time() - t0 < 300, "vllm serve did not start in 300 s"
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=1):
                    break
            except OSError:
                time.sleep(1)
        run(wait_healthy(url))
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=60)
        log.close()


async def wait_healthy(url):
    async with aiohttp.ClientSession() as http:
        for _ in range(120):
            try:
                async with http.get(url + "/health") as r:
                    if r.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(1)


def events(text: str) -> list:
    """SSE -> [(event name or None, parsed data)], [DONE] kept as the string."""
    out = []
    for block in text.replace("\r\n", "\n").split("\n\n"):
        name = next((x[6:].strip() for x in block.splitlines() if x.startswith("event:")), None)
        data = "\n".join(x[5:].strip() for x in block.splitlines() if x.startswith("data:"))
        if data:
            out.append((name, data if data == "[DONE]" else json.loads(data)))
    return out


async def send(http, url, path, body, stream, key, name):
    if isinstance(body, dict) and name != "no model":
        body = {"model": "policy", **body}  # as the SDKs send it
    data = body if isinstance(body, str) else json.dumps(body)
    headers = {"content-type": "application/json", "Authorization": f"Bearer {key}", "x-api-key": key,
               "anthropic-version": "2023-06-01"}
    get = body == "@GET@"  # the stored "plain" response (its id already in the path)
    async with http.request("GET" if get else "POST", url + path, data=None if get else data, headers=headers) as r:
        text = await r.text()
        if stream and r.status == 200:
            return r.status, events(text)
        return r.status, json.loads(text)


def keys(obj) -> frozenset:
    return frozenset(obj) if isinstance(obj, dict) else frozenset()


def openai_view(status, body, stream) -> dict:
    """What is compared of an OpenAI-wire answer: per object kind, its key set; and the sampled content."""
    if status != 200:
        return {"kinds": {"error": keys(body), "error.error": keys(body.get("error"))}}
    if stream:
        chunks = [d for _, d in body if d != "[DONE]"]
        seq = []
        for c in chunks:
            ch = c["choices"][0] if c["choices"] else None
            step = ("usage",) if ch is None else (tuple(sorted(k for k, v in ch["delta"].items() if v not in (
                None, [], "") and k != "reasoning_content")), ch.get("finish_reason"))  # Molt's alias of reasoning
            if not seq or seq[-1] != step:
                seq.append(step)
        text, reasoning = ("".join((c["choices"][0]["delta"].get(k) or "") for c in chunks if c["choices"])
                           for k in ("content", "reasoning"))
        return {"kinds": {"chunk": frozenset().union(*map(keys, chunks)),
                          "chunk.choice": frozenset().union(*(keys(c["choices"][0]) for c in chunks if c["choices"]))},
                "sequence": seq, "done": body[-1][1] == "[DONE]", "text": text, "reasoning": reasoning}
    ch = body["choices"]
    return {"kinds": {"response": keys(body), "choice": frozenset().union(*map(keys, ch)),
                      "message": frozenset().union(*(keys(c["message"]) for c in ch)), "usage": keys(body["usage"])},
            "finish": [c["finish_reason"] for c in ch], "text": [c["message"]["content"] for c in ch],
            "reasoning": [c["message"].get("reasoning") for c in ch],
            "usage": (body["usage"]["prompt_tokens"], body["usage"]["completion_tokens"]),
            "calls": [[t["function"]["name"] for t in c["message"].get("tool_calls") or []] for c in ch],
            "logprobs": [[e["token"] for e in c["logprobs"]["content"]] if c.get("logprobs") else None for c in ch]}


def anthropic_view(status, body, stream) -> dict:
    if status != 200:
        return {"kinds": {"error": keys(body), "error.error": keys(body.get("error"))}}
    if stream:
        seq = []
        for name, d in body:
            step = (name, d.get("delta", {}).get("type") or d.get("content_block", {}).get("type"))
            if not seq or seq[-1] != step:
                seq.append(step)
        delta = next(d for n, d in body if n == "message_delta")
        text, thinking = ("".join(d["delta"].get(k, "") for n, d in body if n == "content_block_delta")
                          for k in ("text", "thinking"))
        return {"kinds": {"message_delta": keys(delta), "message_delta.delta": keys(delta["delta"])},
                "sequence": seq, "stop": (delta["delta"].get("stop_reason"), delta["delta"].get("stop_sequence")),
                "text": text, "thinking": thinking}
    return {"kinds": {"message": keys(body), "usage": keys(body["usage"]),
                      "block": frozenset().union(*map(keys, body["content"]))},
            "stop": (body["stop_reason"], body.get("stop_sequence")),
            "usage": (body["usage"]["input_tokens"], body["usage"]["output_tokens"]),
            "blocks": [(b["type"], b.get("text", b.get("thinking")), b.get("name")) for b in body["content"]]}


def responses_view(status, body, stream) -> dict:
    if status != 200:
        return {"kinds": {"error": keys(body), "error.error": keys(body.get("error"))}}
    if stream:
        seq = []
        for name, d in body:
            if not seq or seq[-1] != name:
                seq.append(name)
        final = body[-1][1]["response"]
        return {"kinds": {**{f"event.{n}": frozenset().union(*(keys(d) for m, d in body if m == n)) for n in seq},
                          **responses_view(200, final, False)["kinds"]}, "sequence": seq, "status": final["status"],
                "text": "".join(d["delta"] for n, d in body if n == "response.output_text.delta")}
    out = body["output"]
    return {"kinds": {"response": keys(body), "usage": keys(body["usage"]),
                      **{f"item.{t}": frozenset().union(*(keys(o) for o in out if o["type"] == t))
                         for t in {o["type"] for o in out}},
                      **{f"content.{o['type']}": frozenset().union(*(keys(c) for c in o["content"])) for o in out
                         if o.get("content")}},
            "status": (body["status"], body["incomplete_details"]), "items": [o["type"] for o in out],
            "text": [c.get("text") for o in out if o["type"] == "message" for c in o["content"]],
            "calls": [o["name"] for o in out if o["type"] == "function_call"],
            "usage": (body["usage"]["input_tokens"], body["usage"]["output_tokens"]),
            "logprobs": [[e["token"] for e in c.get("logprobs") or []] for o in out if o["type"] == "message"
                         for c in o["content"]]}


async def answers(engine, tiny, vllm_url, wire, requests):
    """{name: (status from Molt, status from vLLM, Molt's view, vLLM's view)}."""
    path, view = {"openai": ("/v1/chat/completions", openai_view), "anthropic": ("/v1/messages", anthropic_view),
                  "responses": ("/v1/responses", responses_view)}[wire]
    out, plain_ids = {}, {}
    async with Server(engine, tiny, {"temperature": 1.0, "max_tokens": 120}) as srv, aiohttp.ClientSession() as http:
        for name, (body, stream) in requests.items():
            if "@STOP@" in json.dumps(body):  # a stop string the seeded reply contains: its 3rd-5th characters
                plain = out["plain"][2]["text"][0] if wire == "openai" else out["plain"][2]["blocks"][0][1]
                body = json.loads(json.dumps(body).replace("@STOP@", json.dumps(plain[2:5])[1:-1]))
            answer = []
            for url in (srv.ctx.session_url, vllm_url):  # each server continues or retrieves its own "plain"
                b = json.loads(json.dumps(body).replace("@PREV@", plain_ids.get(url, "")))
                answer.append(await send(http, url, path + (f"/{plain_ids[url]}" if b == "@GET@" else ""), b,
                                         stream, srv.ctx.api_key, name))
                if name == "plain" and wire == "responses":
                    plain_ids[url] = answer[-1][1]["id"]
            (ms, mb), (vs, vb) = answer
            out[name] = (ms, vs, view(ms, mb, stream), view(vs, vb, stream))
    return out


# What differs, each for a reason. Keys: Molt answers with the public APIs' fields; vLLM adds its extensions (token
# ids, transfer params, ...) and leaves out Anthropic's stop_sequence when null and its error's "type": "error".
VLLM_EXTRAS = {
    ("openai", "response"): (frozenset(), frozenset({"ec_transfer_params", "kv_transfer_params", "metrics",
                                                     "prompt_logprobs", "prompt_text", "prompt_token_ids",
                                                     "service_tier", "system_fingerprint"})),
    ("openai", "choice"): (frozenset(), frozenset({"routed_experts", "stop_reason", "token_ids"})),
    ("openai", "message"): (frozenset(), frozenset({"annotations", "audio", "function_call", "reasoning", "refusal"})),
    ("openai", "usage"): (frozenset(), frozenset({"completion_tokens_details", "prompt_tokens_details"})),
    ("openai", "chunk"): (frozenset(), frozenset({"prompt_text", "prompt_token_ids", "system_fingerprint"})),
    ("openai", "chunk.choice"): (frozenset(), frozenset({"logprobs", "stop_reason", "token_ids"})),
    ("anthropic", "message"): (frozenset({"stop_sequence"}), frozenset()),
    ("anthropic", "error"): (frozenset({"type"}), frozenset()),
    ("anthropic", "error.error"): (frozenset(), frozenset({"code", "param"})),
    # a forced Anthropic call: Molt's is a tool_use block; vLLM's runs to max_tokens as text (below)
    ("anthropic", "block"): (frozenset({"id", "input", "name"}), frozenset({"text"})),
    # Responses: OpenAI's Response has error and store, which vLLM leaves out; vLLM adds its extensions (the
    # messages it rendered, transfer params, penalties)
    ("responses", "response"): (frozenset({"error", "store"}), frozenset({
        "ec_transfer_params", "frequency_penalty", "input_messages", "kv_transfer_params", "output_messages",
        "presence_penalty"})),
    ("responses", "item.message"): (frozenset(), frozenset({"phase"})),  # vLLM's, null on these models
    ("responses", "item.function_call"): (frozenset(), frozenset({"async", "caller", "namespace"})),  # (the same)
}
# Where vLLM's stream puts finish_reason for a stop string varied: once in four whole-suite runs (texts equal, passed
# alone), most likely vLLM coalescing tokens when its server falls behind on a loaded machine (not confirmed). Molt's
# own sequence for it is checked on its own (an empty delta carries the finish).
LOADED = {("openai", "stream stop", "sequence")}
DELIBERATE = {
    # tool_choice none: Molt offers no tool (the template renders none); vLLM still renders them into the prompt
    ("openai", "tools none", "usage"), ("anthropic", "tools none", "usage"),
    # a forced call: both sample through the hermes parser's structural tag, but Molt holds the arguments to the
    # tool's schema (vLLM's --tool-strict-level parameter) with at most one whitespace in a row, so the tokens differ;
    # OpenAI says content null, vLLM ""
    ("openai", "tools required", "usage"), ("openai", "tools required", "text"),
    ("openai", "tools named", "usage"), ("openai", "tools named", "text"),
    # ... and Molt's finish reason is tool_calls whenever the reply holds calls; vLLM says stop for a named tool
    ("openai", "tools named", "finish"), ("openai", "stream tool named", "sequence"),
    # vLLM's Anthropic endpoint does not hold a forced call to the schema (greedy, it writes "arguments": 3333... to
    # max_tokens) and answers it as text, or streams it as a truncated tool_use block; Molt's is a parsed call
    ("anthropic", "tools any", "blocks"), ("anthropic", "tools any", "stop"), ("anthropic", "tools any", "usage"),
    ("anthropic", "tools named", "blocks"), ("anthropic", "tools named", "stop"), ("anthropic", "tools named", "usage"),
    ("anthropic", "stream tool named", "stop"),
    # an empty reply (the stop string came first): Molt still opens and closes a text block, as Anthropic's API does
    ("anthropic", "stream stop", "sequence"),
    # streaming: Molt ends with an empty delta carrying finish_reason, as OpenAI's API does; vLLM puts it on the last
    # content delta
    ("openai", "stream", "sequence"), ("openai", "stream usage", "sequence"), ("openai", "stream one token", "sequence"),
    # Responses, as on the other wires: tool_choice none offers no tool; vLLM writes a forced call (greedy) as text
    # to max_output_tokens, a message item of an incomplete response, where Molt's is a function_call item
    ("responses", "tools none", "usage"), ("responses", "stream tools named", "status"),
    *[("responses", name, f) for name in ("tools required", "tools named")
      for f in ("calls", "items", "logprobs", "status", "text", "usage")],
    # a stream cut at max_output_tokens: Molt ends it with response.incomplete, as OpenAI's API does; vLLM with
    # response.completed (the response it carries says incomplete in both)
    ("responses", "stream", "sequence"), ("responses", "stream one token", "sequence"),
}
DELIBERATE_STATUS = {
    ("openai", "unknown role"): (400, 200),  # Molt refuses a role its templates do not know; vLLM renders it
    ("anthropic", "top_k"): (400, 200),  # not the run's top_k: the trainer could not correct the log-probs
    ("anthropic", "no model"): (200, 400),  # the session fixes the model; Molt does not insist on the field
    ("responses", "top_p"): (400, 200),  # not the run's top_p: the trainer could not correct the log-probs
}


@pytest.mark.parametrize("wire", ["openai", "anthropic", "responses"])
def test_molt_answers_like_vllms_own_server_but_for_listed_differences(engine, tiny, vllm_serve, wire):
    requests = {"openai": OPENAI, "anthropic": ANTHROPIC, "responses": RESPONSES}[wire]
    assert len(requests) >= 30
    res = run(answers(engine, tiny, vllm_serve, wire, requests))
    status = {(wire, name): (ms, vs) for name, (ms, vs, _, _) in res.items() if ms != vs}
    assert status == {k: v for k, v in DELIBERATE_STATUS.items() if k[0] == wire}

    keys, fields = {}, set()
    for name, (ms, vs, mv, vv) in res.items():
        if ms != vs:
            continue
        for kind in set(mv["kinds"]) | set(vv["kinds"]):
            if wire == "responses" and not (kind in mv["kinds"] and kind in vv["kinds"]):
                continue  # an item kind one side lacks: its items differ, which "items" compares
            x, y = mv["kinds"].get(kind, frozenset()), vv["kinds"].get(kind, frozenset())
            if x != y:  # the union over requests: no request's difference hides behind another's
                old = keys.get((wire, kind), (frozenset(), frozenset()))
                keys[(wire, kind)] = (old[0] | (x - y), old[1] | (y - x))
        fields |= {(wire, name, f) for f in set(mv) - {"kinds"} if mv[f] != vv.get(f)}
    assert keys == {k: v for k, v in VLLM_EXTRAS.items() if k[0] == wire}
    assert fields - LOADED == {d for d in DELIBERATE if d[0] == wire}
    # the comparison has teeth: the answers it found equal hold sampled text, finish reasons and stop strings
    plain, stop = res["plain"][2], res.get("stop found", [0, 0, {}])[2]
    if wire == "responses":  # the chain and the retrieval were compared too, and answered
        assert plain["status"] == ("incomplete", {"reason": "max_output_tokens"}) and len(plain["text"][0]) >= 5
        assert res["retrieve"][2] == plain and res["stream"][2]["text"] == plain["text"][0]
        assert res["previous_response_id"][:2] == (200, 200) and res["previous_response_id"][2]["text"][0]
        assert res["logprobs"][2]["logprobs"][0] and res["call and output"][:2] == (200, 200)
    elif wire == "openai":
        assert plain["finish"] == ["length"] and len(plain["text"][0]) >= 5 and stop["finish"] == ["stop"]
        assert res["stream stop"][2]["text"] == stop["text"][0] and res["logprobs"][2]["logprobs"][0]
        assert res["stream stop"][2]["sequence"][-1] == ((), "stop")  # Molt's, whatever vLLM's was (LOADED)
    else:
        assert plain["stop"] == ("max_tokens", None) and stop["stop"][0] == "stop_sequence" and stop["stop"][1]
        assert res["stream stop"][2]["stop"] == stop["stop"] and res["stream stop"][2]["text"] == stop["blocks"][0][1]
