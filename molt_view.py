"""The run viewer: `python molt.py view RUN_DIR` writes RUN_DIR/view.html, one self-contained page (no server, no
network): the run's curves as inline SVG, and every dumped sample token by token, coloured by version, log-probs, the
trainer's view or the drift a text-based framework would have. Each step's dump is embedded gzip + base64 and decoded
by the browser only when that step is opened, so a 1,000-sample run opens at once. It runs after (or beside) training
and only reads the run directory, so it lives outside molt.py's RL path."""
from __future__ import annotations

import argparse
import base64
import json
import math
import sys
import time
from pathlib import Path

from molt import UsageError, flat_config, resolve_model


VIEW_PLOTS = (("reward/mean", "reward"), ("rollout/staleness_max", "max staleness"),
              ("rollout/logprob_gap", "log-prob gap"), ("tokens/s", "tokens / s"), ("is/masked_frac", "IS masked"))


VIEW_CONFIG = ("model", "agent", "algo.estimator", "algo.loss", "train.async_queue_size", "rollout.batch_size",
               "rollout.n_samples_per_prompt", "train.lr", "rollout.temperature", "steps")


def main(argv: list[str]):
    parser = argparse.ArgumentParser(prog="molt.py view", description="Write a run's per-token trace viewer: one "
                                     "self-contained HTML file (RUN_DIR/view.html unless --out).")
    parser.add_argument("run_dir")
    parser.add_argument("--out", default="", help="where to write the page")
    args = parser.parse_args(argv)
    root, t0 = Path(args.run_dir), time.perf_counter()
    if not (root / "metrics.jsonl").exists() and not (root / "samples").is_dir():
        raise UsageError(f"{root}: no metrics.jsonl or samples/ here: not a Molt run directory")
    out = Path(args.out or root / "view.html")
    page, n = view_page(root)
    out.write_text(page)
    print(f"[molt] wrote {out}: {n} samples, {out.stat().st_size / 2**20:.1f} MiB in {time.perf_counter() - t0:.1f}s"
          + ("" if n else " (no sample dumps: run with --dump-samples to see tokens)"), file=sys.stderr)


def view_page(root: Path) -> tuple[str, int]:
    """-> (the HTML, samples embedded)."""
    import gzip
    config = json.loads((root / "config.json").read_text()) if (root / "config.json").exists() else {}
    metrics = json_lines(root / "metrics.jsonl") if (root / "metrics.jsonl").exists() else []
    steps, blobs, ids, n = [], [], set(), 0
    for path in sorted((root / "samples").glob("step_*.jsonl")):
        rows = [view_row(r) for r in json_lines(path)]
        ids.update(t for r in rows for t in [*r["tokens"], *(r.get("drift") or {}).get("retokenized", [])])
        steps.append(int(path.stem[5:]))
        packed = base64.b64encode(gzip.compress(json.dumps(rows, separators=(",", ":")).encode(), 6)).decode()
        blobs.append(f'<script type="application/octet-stream" id="step-{steps[-1]}">{packed}</script>')
        n += len(rows)
    vocab, image_token = view_vocab(config.get("model", ""), ids)
    flat = flat_config(config)
    head = {"steps": steps, "vocab": vocab, "image_token": image_token,
            "config": {k: flat[k] for k in VIEW_CONFIG if k in flat}, "run": str(root)}
    data = json.dumps(head, separators=(",", ":")).replace("<", "\\u003c")  # no tag can end or open in it
    return VIEW_PAGE.replace("@PLOTS@", view_plots(metrics)).replace("@DATA@", data).replace(
        "@BLOBS@", "\n".join(blobs)), n


def json_lines(path: Path) -> list[dict]:
    """The complete JSON lines of a file a live run may be appending to (a half-written last line is skipped)."""
    out = []
    for line in open(path):
        try:
            out.append(json.loads(line))
        except ValueError:
            pass
    return out


def view_row(d: dict) -> dict:
    """A dumped Sample, log-probs rounded (the page shows 3 decimals), temperatures only where they vary; NaN and
    infinities become null (the browser's JSON has no such numbers)."""
    d["logprobs"] = [round(x, 4) if math.isfinite(x) else None for x in d["logprobs"]]
    if len({t for t in d.get("temperatures") or []}) <= 1:
        d.pop("temperatures", None)
    for key, values in (d.get("trainer") or {}).items():
        d["trainer"][key] = [x if math.isfinite(x) else None for x in values]
    return d


def view_vocab(model: str, ids: set) -> tuple[dict, int | None]:
    """Each token id's text, and the image placeholder id; empty when the model's tokenizer is not at hand (the page
    then shows ids)."""
    try:
        from transformers import AutoConfig, AutoTokenizer
        path = resolve_model(model)
        tok, hf = AutoTokenizer.from_pretrained(path), AutoConfig.from_pretrained(path)
    except Exception as e:  # noqa: BLE001 - a viewer without token texts still shows everything else
        print(f"[molt] view: no tokenizer for {model!r} ({type(e).__name__}: {e}); showing token ids", file=sys.stderr)
        return {}, None
    return {t: tok.decode([t]) for t in sorted(ids)}, getattr(hf, "image_token_id", None)


def view_plots(metrics: list[dict]) -> str:
    """Small inline SVG line plots, one per VIEW_PLOTS entry, over steps."""
    for m in metrics:
        if "tokens/generated" in m and m.get("time/step"):
            m["tokens/s"] = m["tokens/generated"] / m["time/step"]
    out = []
    for key, label in VIEW_PLOTS:
        pts = [(m["step"], m[key]) for m in metrics if isinstance(m.get(key), (int, float)) and math.isfinite(m[key])]
        if not pts:
            continue
        (x0, x1), (y0, y1) = [(min(v), max(v)) for v in zip(*pts)]
        sx, sy = 220 / max(x1 - x0, 1), 60 / (y1 - y0 or 1)
        line = " ".join(f"{10 + (x - x0) * sx:.1f},{70 - (y - y0) * sy:.1f}" for x, y in pts)
        out.append(f'<figure class="plot" data-key="{key}"><svg width="240" height="80"><polyline points="{line}"/>'
                   f'</svg><figcaption>{label}: {pts[-1][1]:.4g} (range {y0:.3g} to {y1:.3g})</figcaption></figure>')
    return "".join(out)


VIEW_PAGE = r"""<!doctype html>
<html><head><meta charset="utf-8"><title>molt run</title>
<style>
body{font:13px system-ui,sans-serif;margin:16px;color:#222}
h1{font-size:16px;margin:0 0 8px}pre{white-space:pre-wrap}
table{border-collapse:collapse}td,th{padding:2px 8px;border-bottom:1px solid #eee;text-align:left}
th{cursor:pointer;background:#f6f6f6}tr.sample:hover{background:#eef4ff;cursor:pointer}tr.open{background:#dde8ff}
.plots{display:flex;flex-wrap:wrap;gap:8px}.plot{margin:0}.plot svg{background:#fafafa;border:1px solid #ddd}
.plot polyline{fill:none;stroke:#3366cc;stroke-width:1.5}.plot figcaption{font-size:11px;color:#555}
.controls{margin:12px 0;display:flex;gap:12px;align-items:center}
#list{max-height:320px;overflow:auto;border:1px solid #ddd}
.tokens{font:12px ui-monospace,monospace;white-space:pre-wrap;line-height:1.7;border:1px solid #ddd;padding:8px}
.tok{border-radius:2px}.ctx{color:#777}.trained{color:#000;border-bottom:2px solid #3366cc}
.img-pad{display:none}.thumb{height:48px;vertical-align:middle;border:1px solid #999}
.segment-boundary{margin:10px 0;padding:2px 6px;background:#fff3cd;border-left:4px solid #e0a800;font-size:12px}
.drift{display:grid;grid-template-columns:1fr 1fr;gap:8px}.drift .tokens{max-height:240px;overflow:auto}
.differ{background:#ffd0d0}.legend{font-size:11px;color:#555}
</style></head><body>
<h1>molt run <span id="run"></span></h1>
<table id="config"></table>
<div class="plots">@PLOTS@</div>
<div class="controls">
 <label>step <select id="step"></select></label>
 <label>filter <input id="filter" size="40" placeholder="reward>0.5 finish=length stale>=2 segments>1"></label>
 <label>colour by <select id="channel">
  <option value="version">policy version</option><option value="behaviour">behaviour log-prob</option>
  <option value="trainer">trainer log-prob</option><option value="gap">trainer - behaviour</option>
  <option value="is_weight">IS weight</option><option value="advantage">advantage</option></select></label>
 <span class="legend">underlined: trained tokens; grey: prompt / tool / observation tokens; hover a token for all
 channels</span>
</div>
<div id="list"></div>
<div id="detail"></div>
@BLOBS@
<script type="application/json" id="data">@DATA@</script>
<script>
"use strict";
const D = JSON.parse(document.getElementById("data").textContent);
const $ = id => document.getElementById(id), cache = {};
let rows = [], sortKey = "index", sortDir = 1, opened = null, stepNo = null;
const COLS = [["index", "#"], ["rollout", "rollout"], ["group", "group"], ["segment", "seg"], ["reward", "reward"],
  ["score", "score"], ["length", "tokens"], ["segments", "segments"], ["finish", "finish"], ["stale", "max staleness"],
  ["drift", "drift"]];

function text(id) { return D.vocab[id] !== undefined ? D.vocab[id] : "[" + id + "]"; }
async function loadStep(step) {
  if (cache[step]) return cache[step];
  const b64 = $("step-" + step).textContent, bytes = Uint8Array.from(atob(b64), c => c.charCodeAt(0));
  const stream = new Blob([bytes]).stream().pipeThrough(new DecompressionStream("gzip"));
  return cache[step] = JSON.parse(await new Response(stream).text());
}
function summary(s, i, all) {
  const trained = s.versions.filter((v, t) => s.mask[t]);
  return {index: i, rollout: s.rollout_id.slice(0, 8), group: s.group_id.slice(0, 8), segment: s.segment,
    reward: s.reward, score: s.score, length: s.tokens.length, finish: s.finish_reason,
    segments: all.filter(x => x.rollout_id === s.rollout_id).length,
    stale: trained.length ? stepNo - 1 - trained.reduce((a, b) => Math.min(a, b)) : 0,
    drift: s.drift && s.drift.cause ? s.drift.cause.join(" ") : ""};
}
function passes(r, filter) {
  return filter.trim().split(/\s+/).filter(Boolean).every(cond => {
    const m = cond.match(/^(\w+)(>=|<=|!=|=|>|<)(.*)$/);
    if (!m || !(m[1] in r)) return true;
    const a = r[m[1]], b = isNaN(+m[3]) ? m[3] : +m[3];
    return {">=": a >= b, "<=": a <= b, "!=": a != b, "=": a == b, ">": a > b, "<": a < b}[m[2]];
  });
}
function renderList(samples) {
  const shown = rows.filter(r => passes(r, $("filter").value))
    .sort((a, b) => (a[sortKey] > b[sortKey] ? 1 : a[sortKey] < b[sortKey] ? -1 : 0) * sortDir);
  const head = "<tr>" + COLS.map(([k, l]) => `<th data-key="${k}">${l}</th>`).join("") + "</tr>";
  const body = shown.map(r => `<tr class="sample${r.index === opened ? " open" : ""}" data-index="${r.index}"` +
    ` data-rollout="${esc(samples[r.index].rollout_id)}">` + COLS.map(([k]) => `<td>${esc(fmt(r[k]))}</td>`).join("") +
    "</tr>").join("");
  $("list").innerHTML = `<table id="samples">${head}${body}</table>`;
  $("list").querySelectorAll("th").forEach(th => th.onclick = () => {
    sortDir = sortKey === th.dataset.key ? -sortDir : 1; sortKey = th.dataset.key; renderList(samples); });
  $("list").querySelectorAll("tr.sample").forEach(tr => tr.onclick = () => openSample(samples, +tr.dataset.index));
}
function fmt(x) { return typeof x === "number" && !Number.isInteger(x) ? x.toFixed(3) : x === null ? "" : x; }
function channels(s, t) {
  const tr = s.trainer || {}, val = k => tr[k] ? tr[k][t] : undefined, lp = s.mask[t] ? s.logprobs[t] : undefined;
  const trl = s.mask[t] ? val("trainer_logprobs") : undefined;
  return {version: s.mask[t] ? s.versions[t] : undefined, behaviour: lp, trainer: trl,
    gap: trl !== undefined && lp !== undefined ? trl - lp : undefined,
    is_weight: s.mask[t] ? val("is_weight") : undefined, is_masked: s.mask[t] ? val("is_masked") : undefined,
    advantage: s.mask[t] ? val("advantages") : undefined};
}
function colour(ch, v) {
  if (v === undefined) return "";
  const c = x => Math.max(0, Math.min(1, x));
  if (ch === "version") { const age = c((stepNo - 1 - v) / 4); return `hsl(${210 - 210 * age},70%,85%)`; }
  if (ch === "behaviour" || ch === "trainer") return `hsl(0,80%,${100 - 45 * c(-v / 5)}%)`;
  if (ch === "gap") return `hsl(${v > 0 ? 120 : 0},80%,${100 - 45 * c(Math.abs(v) * 5)}%)`;
  if (ch === "is_weight") return `hsl(${v > 1 ? 0 : 220},80%,${100 - 45 * c(Math.abs(Math.log(v || 1e-9)) * 2)}%)`;
  return `hsl(${v > 0 ? 120 : 0},70%,${100 - 45 * c(Math.abs(v))}%)`;
}
function tokenSpans(s) {
  const ch = $("channel").value, out = [];
  let img = 0;
  for (let t = 0; t < s.tokens.length; t++) {
    const id = s.tokens[t], all = channels(s, t), cls = s.mask[t] ? "trained" : "ctx";
    const tip = `id ${id} ${JSON.stringify(text(id))}` + Object.entries(all).filter(([, v]) => v !== undefined)
      .map(([k, v]) => `\n${k}: ${typeof v === "number" ? +v.toFixed(4) : v}`).join("");
    const isImg = D.image_token !== null && id === D.image_token, first = isImg && s.tokens[t - 1] !== id;
    const inner = first && s.thumbnails && s.thumbnails[img] ? `<img class="thumb" src="${esc(s.thumbnails[img++])}">`
      : esc(text(id));
    out.push(`<span class="tok ${cls}${isImg && !first ? " img-pad" : ""}" data-t="${t}" data-id="${esc(id)}" ` +
      `data-m="${esc(s.mask[t])}" data-v="${esc(s.versions[t])}" style="background:${colour(ch, all[ch])}" ` +
      `title="${esc(tip)}">${inner}</span>`);
  }
  return out.join("");
}
function esc(x) {
  return String(x).replace(/[&<>"]/g, c => ({"&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;"})[c]);
}
function driftPanel(s) {
  const d = s.drift;
  if (!d || d.first === null || d.first === undefined || !d.retokenized) return "";
  const lo = Math.max(0, d.first - 8), side = (ids, other) => ids.slice(lo, d.first + 60).map((id, j) =>
    `<span class="${other[lo + j] === id ? "" : "differ"}" title="id ${esc(id)}">${esc(text(id))}</span>`).join("");
  return `<h3>Drift: ${esc(d.cause.join(", "))} (first differing token ${esc(d.first)})</h3><div class="drift">` +
    `<div><b>recorded (token-exact)</b><div class="tokens" id="drift-ours">${side(s.tokens, d.retokenized)}` +
    `</div></div>` +
    `<div><b>re-rendered and re-tokenized</b><div class="tokens" id="drift-theirs">${side(d.retokenized, s.tokens)}` +
    `</div></div></div>`;
}
function openSample(samples, index) {
  opened = index;
  const s = samples[index], episode = samples.map((x, i) => [x, i]).filter(([x]) => x.rollout_id === s.rollout_id)
    .sort((a, b) => a[0].segment - b[0].segment);
  const parts = episode.map(([x, i], k) => (k ? `<div class="segment-boundary" data-segment="${esc(x.segment)}">` +
    `segment ${esc(x.segment)}: the conversation was rewritten here (compaction or an edited turn), a new Sample starts</div>` : "") +
    `<div class="tokens sample-tokens${i === index ? " selected" : ""}" data-index="${i}">${tokenSpans(x)}</div>` +
    driftPanel(x));
  $("detail").innerHTML = `<h2>sample ${index}: rollout ${esc(s.rollout_id)}, group ${esc(s.group_id)}, reward ` +
    `${esc(fmt(s.reward))}` +
    `, ${episode.length} segment(s)</h2><pre>${esc(JSON.stringify(s.info))}</pre>` + parts.join("");
  document.querySelectorAll("tr.sample").forEach(tr => tr.classList.toggle("open", +tr.dataset.index === index));
  history.replaceState(null, "", `#step=${stepNo}&sample=${index}`);
}
async function showStep(step, index) {
  stepNo = step; opened = null;
  const samples = await loadStep(step);
  rows = samples.map((s, i, all) => summary(s, i, all));
  renderList(samples);
  $("detail").innerHTML = "";
  $("filter").oninput = () => renderList(samples);
  $("channel").onchange = () => opened !== null && openSample(samples, opened);
  if (index !== undefined && samples[index]) openSample(samples, index);
}
async function start() {
  $("run").textContent = D.run;
  $("config").innerHTML = Object.entries(D.config).map(([k, v]) => `<tr><th>${esc(k)}</th><td>${esc(v)}</td></tr>`)
    .join("");
  $("step").innerHTML = D.steps.map(s => `<option value="${esc(s)}">${esc(s)}</option>`).join("");
  $("step").onchange = () => showStep(+$("step").value);
  const want = Object.fromEntries(location.hash.slice(1).split("&").filter(Boolean).map(kv => kv.split("=")));
  const step = want.step && D.steps.includes(+want.step) ? +want.step : D.steps[D.steps.length - 1];
  if (step !== undefined) {
    $("step").value = step;
    await showStep(step, want.sample === undefined ? undefined : +want.sample);
  }
  document.body.dataset.ready = performance.now().toFixed(0);
}
start();
</script></body></html>
"""
