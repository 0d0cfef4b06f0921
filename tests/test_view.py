"""Section 13 and the drift report: what a text-based framework would have trained on (crafted episodes, one per
cause, the real tiny tokenizer and chat template), and the per-token viewer rendered in headless Chromium on dumped
tiny runs (an Env with tool turns and images, a chat agent that compacts its history)."""
import json
import re
import shutil
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path

import pytest

import molt

ROOT = Path(__file__).resolve().parent.parent
WEATHER = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]


@pytest.fixture(scope="module")
def codec(tiny):
    return molt.Codec(tiny)


def ids(codec, text):
    return codec.encode(text)[0]


def turn(codec, seg, reply_ids, tools):
    """The policy sampled reply_ids: what the server records and answers."""
    seg.add_turn(molt.Completion(ids=reply_ids, logprobs=[-1.0] * len(reply_ids), versions=[0] * len(reply_ids),
                                 finish_reason="stop"))
    text, calls = molt.parse_tool_calls(codec.decode(reply_ids)) if tools else (codec.decode(reply_ids), [])
    return molt.Reply(id="r", text=text, calls=calls, finish="stop", ids=reply_ids, prompt_tokens=0)


def episode(codec, replies, tools=None, template=None, earlier=None):
    """A session as the loopback server leaves it after the user asked, the policy answered replies[0], the user
    asked again, and so on; earlier: a segment recorded before a compaction."""
    template, seg = template or {}, molt.Sample(rollout_id="r")
    msgs = [{"role": "user", "content": "What is the weather?"}]
    seg.add_context(ids(codec, codec.render(msgs, tools, **template)))
    for i, reply_ids in enumerate(replies):
        if i:
            prefix = codec.render(msgs, tools, generation=False, **template)
            msgs = msgs + [{"role": "user", "content": "And tomorrow?"}]
            seg.add_context(ids(codec, codec.closing(seg.tokens) + codec.render(msgs, tools, **template)[len(prefix):]))
        reply = turn(codec, seg, reply_ids, tools)
        if i < len(replies) - 1:
            msgs = msgs + [molt.reply_message(reply)]
    s = molt.Session(ep=None, key=b"", segments=[*([earlier] if earlier else []), seg], last_messages=msgs,
                     last_tools=tools, choices=[(reply, seg)], template=template)
    return molt.drift_report(codec, s, s.segments), seg


def test_an_episode_whose_tokens_survive_re_rendering_has_no_drift(codec):
    report, seg = episode(codec, [ids(codec, "in the sun<|im_end|>"), ids(codec, "the rain<|im_end|>")])
    assert report["metrics"]["drift/retokenize_mismatch_frac"] == 0.0
    assert report["metrics"]["drift/tokens_changed_frac"] == 0.0 and report["cause"] == []
    assert "retokenized" not in report


def test_the_same_text_in_other_tokens_is_a_boundary_drift(codec):
    merged = ids(codec, "the")
    assert len(merged) == 1  # the tiny vocabulary merges t h e; the policy sampled the three letters instead
    split = [i for c in "the" for i in ids(codec, c)]
    report, seg = episode(codec, [split + ids(codec, "<|im_end|>")])
    assert report["cause"] == ["boundary"] and report["metrics"]["drift/cause/boundary"] == 1.0
    assert seg.tokens[report["first"]:report["first"] + 3] == split
    assert report["retokenized"][report["first"]] == merged[0]
    assert report["metrics"]["drift/tokens_changed_frac"] == pytest.approx(3 / len(seg.tokens))


def test_a_special_token_the_policy_sampled_is_a_boundary_drift(codec):
    report, _ = episode(codec, [ids(codec, "in<|im_start|>the<|im_end|>")])  # its text drops <|im_start|>
    assert report["cause"] == ["boundary"]


def test_a_tool_call_rewritten_by_the_template_is_a_tool_call_drift(codec):
    call = ids(codec, '<tool_call>{"name":"get_weather","arguments":{"city":"Rome"}}</tool_call><|im_end|>')
    report, _ = episode(codec, [call, ids(codec, "the sun<|im_end|>")], tools=WEATHER)  # re-rendered: ", " and ": "
    assert report["cause"] == ["tool_call"] and report["metrics"]["drift/cause/tool_call"] == 1.0
    assert report["metrics"]["drift/cause/template"] == 0.0


def test_an_earlier_turn_the_template_renders_differently_is_a_template_drift(codec):
    # enable_thinking=False puts an empty think block after each generation prompt; the final conversation, rendered
    # whole, has none in the earlier assistant turn
    report, _ = episode(codec, [ids(codec, "in<|im_end|>"), ids(codec, "the<|im_end|>")],
                        template={"enable_thinking": False})
    assert report["cause"] == ["template"] and report["metrics"]["drift/retokenize_mismatch_frac"] == 1.0
    assert report["metrics"]["drift/unrendered"] == 0.0


def test_a_template_that_cannot_render_the_conversation_back_costs_only_the_comparison(tiny, tmp_path):
    # Qwen3's template raises on a prefix without a user turn, which drift_cause renders to locate a difference
    template = tmp_path / "template.jinja"
    template.write_text("{%- if messages | selectattr('role', 'equalto', 'user') | list | length == 0 -%}"
                        "{{ raise_exception('No user query found in messages.') }}{%- endif -%}" + molt.CHATML_TEMPLATE)
    codec = molt.Codec(tiny, str(template))
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather?"}]
    seg = molt.Sample(rollout_id="r")
    seg.add_context(ids(codec, codec.render(msgs, enable_thinking=False)))
    reply = turn(codec, seg, ids(codec, "in<|im_end|>"), None)
    s = molt.Session(ep=None, key=b"", segments=[seg], last_messages=msgs, choices=[(reply, seg)],
                     template={"enable_thinking": False})  # the think block: a template drift, located by rendering
    report = molt.drift_report(codec, s, [seg])
    assert report["metrics"] == {"drift/unrendered": 1.0} and "No user query" in report["error"]


def test_a_compacted_episode_is_a_compaction_drift_counting_the_lost_segment(codec):
    earlier = molt.Sample(rollout_id="r", tokens=[5] * 30, mask=[0] * 20 + [1] * 10, logprobs=[0.0] * 30,
                          versions=[-1] * 20 + [0] * 10)
    report, seg = episode(codec, [ids(codec, "in the sun<|im_end|>")], earlier=earlier)
    assert report["cause"] == ["compaction"]
    assert report["metrics"]["drift/tokens_changed_frac"] == pytest.approx(30 / (30 + len(seg.tokens)))


# ---------------------------------------------------------------------------------------------------- the viewer

ARTIFACTS = ROOT / "tests" / "artifacts"  # screenshots of the rendered pages (git-ignored)


class Dom(HTMLParser):
    """The rendered page's token spans (per sample block), segment boundaries, thumbnails, sample rows."""

    def __init__(self, html):
        super().__init__()
        self.blocks, self.boundaries, self.thumbs, self.rows, self.ready, self.block = {}, 0, 0, 0, None, None
        self.feed(html)

    def handle_starttag(self, tag, attrs):
        a, cls = dict(attrs), dict(attrs).get("class", "").split()
        if tag == "body" and "data-ready" in a:
            self.ready = float(a["data-ready"])
        if tag == "div" and "sample-tokens" in cls:
            self.block = self.blocks.setdefault(int(a["data-index"]), [])
        if tag == "div" and "segment-boundary" in cls:
            self.boundaries += 1
        if tag == "span" and "tok" in cls and self.block is not None:
            self.block.append({"t": int(a["data-t"]), "id": int(a["data-id"]), "m": int(a["data-m"]),
                               "v": int(a["data-v"]), "trained": "trained" in cls})
        self.thumbs += tag == "img" and "thumb" in cls
        self.rows += tag == "tr" and "sample" in cls


def render(page: Path, fragment: str, name: str) -> Dom:
    """The page as headless Chromium leaves it after running its script, and a screenshot of it."""
    exe = shutil.which("chromium") or shutil.which("chromium-browser")
    assert exe, "headless Chromium is missing: bash scripts/setup.sh installs Debian's chromium package"
    url = page.resolve().as_uri() + "#" + fragment
    flags = [exe, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--virtual-time-budget=30000",
             "--window-size=1400,1200"]
    ARTIFACTS.mkdir(exist_ok=True)
    subprocess.run([*flags, f"--screenshot={ARTIFACTS / name}.png", url], capture_output=True, timeout=120)
    assert (ARTIFACTS / f"{name}.png").stat().st_size > 10_000
    dom = subprocess.run([*flags, "--dump-dom", url], capture_output=True, text=True, timeout=120).stdout
    return Dom(dom)


def view(run_dir: Path) -> Path:
    proc = subprocess.run([sys.executable, str(ROOT / "molt.py"), "view", str(run_dir)], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "view.html" in proc.stderr and (run_dir / "view.html").exists()
    html = (run_dir / "view.html").read_text()
    assert not re.search(r"""(src|href)=["']?(https?:)?//""", html)  # nothing fetched: it opens from disk offline
    return run_dir / "view.html"


def dumped(run_dir, step):
    return [json.loads(line) for line in open(run_dir / "samples" / f"step_{step:06d}.jsonl")]


def check_tokens(dom: Dom, index: int, s: dict):
    spans = dom.blocks[index]
    assert [x["id"] for x in spans] == s["tokens"]  # one span per token, in order
    assert [x["m"] for x in spans] == s["mask"] and [x["trained"] for x in spans] == [bool(m) for m in s["mask"]]
    assert [x["v"] for x in spans] == s["versions"]  # the version shown is the dump's


@pytest.mark.slow
def test_the_viewer_shows_an_env_run_with_tool_turns_and_images_token_by_token(geo3k_run):
    run_dir, _ = geo3k_run
    page = view(run_dir)
    step1, step2 = dumped(run_dir, 1), dumped(run_dir, 2)
    # the dump carries the trainer's view: step 1 is on-policy, so the trainer's log-probs are the engine's
    for s in step1:
        tr = s["trainer"]
        assert {len(v) for v in tr.values()} == {len(s["tokens"])}
        for t in (t for t, m in enumerate(s["mask"]) if m):
            assert abs(tr["trainer_logprobs"][t] - s["logprobs"][t]) <= 2e-3
            assert tr["is_weight"][t] == pytest.approx(1.0, abs=3e-3) and tr["is_masked"][t] == 0.0
    by_group = {}
    for s in step1:
        by_group.setdefault(s["group_id"], []).append(s["reward"])
    for s in step1:  # GRPO: one advantage per episode, on each trained token, signed by reward - group mean
        adv = {s["trainer"]["advantages"][t] for t, m in enumerate(s["mask"]) if m}
        mean = sum(by_group[s["group_id"]]) / len(by_group[s["group_id"]])
        assert len(adv) == 1
        a = adv.pop()
        assert a == 0.0 if s["reward"] == mean else (a > 0) == (s["reward"] > mean)
    i = max(range(len(step2)), key=lambda k: step2[k]["n_images"])
    dom = render(page, f"step=2&sample={i}", "view-geo3k")
    assert dom.ready is not None and dom.rows == len(step2)
    check_tokens(dom, i, step2[i])
    assert step2[i]["n_images"] >= 1 and dom.thumbs == step2[i]["n_images"] == len(step2[i]["thumbnails"])


@pytest.fixture(scope="module")
def compacting_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("compacting") / "run"
    proc = subprocess.run([sys.executable, str(ROOT / "molt.py"), "--agent", "tests/agents/compacting.py", "--data",
                           "examples/math_tiny.jsonl", "--run-dir", run_dir, "--dump-samples"], cwd=ROOT,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run_dir


@pytest.mark.slow
def test_the_viewer_marks_where_a_chat_agent_compacted_and_the_drift(compacting_run):
    run_dir = compacting_run
    samples = dumped(run_dir, 2)
    assert len(samples) == 2 * len({s["rollout_id"] for s in samples})  # two segments per episode
    last = [s for s in samples if s["segment"] == 1]
    assert all("compaction" in s["drift"]["cause"] for s in last)
    m = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    assert all(r["drift/cause/compaction"] == 1.0 and r["drift/retokenize_mismatch_frac"] == 1.0 for r in m)
    i = next(k for k, s in enumerate(samples) if s["segment"] == 0)
    dom = render(view(run_dir), f"step=2&sample={i}", "view-compacting")
    assert dom.boundaries == 1 and len(dom.blocks) == 2  # the episode's two segments, a boundary between them
    for index, spans in dom.blocks.items():
        check_tokens(dom, index, samples[index])
    assert {samples[k]["rollout_id"] for k in dom.blocks} == {samples[i]["rollout_id"]}


def test_the_viewer_shows_hostile_strings_as_text(tmp_path):
    # rollout ids, finish reasons, info and config values come from agent code and data rows: an attacker's markup in
    # them must stay text. The effect is checked from outside the page: the DOM Chromium leaves behind.
    attack = '<img id="pwned" src="x" onerror="document.body.dataset.pwned=1"></script><script>document.body.' \
             'dataset.pwned=2</script>'
    run = tmp_path / "run"
    (run / "samples").mkdir(parents=True)
    (run / "config.json").write_text(json.dumps({"model": "tiny", "agent": attack}))
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "reward/mean": 1.0}) + "\n")
    s = {"rollout_id": attack, "group_id": attack, "segment": 0, "tokens": [5, 6, 7], "mask": [0, 1, 1],
         "logprobs": [0.0, -1.0, -2.0], "versions": [-1, 0, 0], "reward": 1.0, "score": 1.0,
         "finish_reason": attack, "info": {attack: 1.0}, "drift": {"cause": [attack], "first": 1,
                                                                   "retokenized": [5, 8, 7]}}
    (run / "samples" / "step_000001.jsonl").write_text(json.dumps(s) + "\n")
    page = view(run)
    dom = subprocess.run([shutil.which("chromium") or "chromium", "--headless", "--no-sandbox", "--disable-gpu",
                          "--virtual-time-budget=20000", "--dump-dom", page.resolve().as_uri() + "#step=1&sample=0"],
                         capture_output=True, text=True, timeout=120).stdout
    assert 'data-ready="' in dom and len(Dom(dom).blocks[0]) == 3  # the page ran and drew the sample
    elements = Tags(dom).tags
    assert not [a for _, a in elements if a.get("id") == "pwned" or "data-pwned" in a]  # no element, no script ran
    assert "&lt;img id=" in dom  # shown, as text


class Tags(HTMLParser):
    def __init__(self, html):
        super().__init__()
        self.tags = []
        self.feed(html)

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))
