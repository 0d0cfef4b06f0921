"""--mode sft: chat rows cut into Samples exactly as rollouts are (context up to the generation prompt, assistant turns
trainable up to their end-of-turn token), and an end-to-end run that memorises a small set and hands its checkpoint
to RL."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

import molt

ROOT = Path(__file__).resolve().parent.parent
ROW = {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."},
                    {"role": "assistant", "content": "Blue."}, {"role": "user", "content": "Another?"},
                    {"role": "assistant", "content": "Green, then red."}]}


def test_sft_sample_trains_exactly_the_assistant_turns(tiny):
    codec = molt.Codec(tiny)
    s = molt.sft_sample(codec, ROW, 0)
    tok = codec.tokenizer
    # the whole Sample is the rendered conversation, token for token as the engine would see its context
    assert tok.decode(s.tokens, skip_special_tokens=False) == codec.render(ROW["messages"], generation=False)
    trained = [tok.decode(s.tokens[a:b], skip_special_tokens=False) for a, b in spans(s.mask)]
    assert trained == ["Blue." + tok.eos_token, "Green, then red." + tok.eos_token]
    first = s.mask.index(1)  # the context before the first reply is exactly the generation prompt's rendering
    assert s.tokens[:first] == codec.encode(codec.render(ROW["messages"][:2]))[0]
    assert set(s.temperatures[i] for i in range(len(s.tokens)) if s.mask[i]) == {1.0}


def spans(mask):
    out, start = [], None
    for i, m in enumerate(mask + [0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            out.append((start, i))
            start = None
    return out


def test_sft_rows_with_images_show_them_where_the_markers_are(tiny_vl):
    from PIL import Image
    codec, red, blue = molt.Codec(tiny_vl), Image.new("RGB", (64, 64), (200, 30, 30)), Image.new("RGB", (32, 48), "blue")
    row = {"messages": [{"role": "user", "content": "What colour? <image>"}, {"role": "assistant", "content": "Red."},
                        {"role": "user", "content": "And <image> here?"}, {"role": "assistant", "content": "Blue."}]}
    s = molt.sft_sample(codec, row, 0, [red, blue])
    # the same text, image pads and pixels as the processor makes of the whole rendered conversation at once (token
    # ids may split differently at span boundaries, as in a rollout, where each span is tokenized on its own)
    msgs = [{"role": "user", "content": [{"type": "text", "text": "What colour? "}, {"type": "image"}]},
            row["messages"][1], {"role": "user", "content": [{"type": "text", "text": "And "}, {"type": "image"},
                                                             {"type": "text", "text": " here?"}]}, row["messages"][3]]
    ids, mm = codec.encode(codec.render(msgs, generation=False), [red, blue])
    tok = codec.tokenizer
    assert tok.decode(s.tokens, skip_special_tokens=False) == tok.decode(ids, skip_special_tokens=False)
    pad = tok.convert_tokens_to_ids("<|image_pad|>")
    assert s.tokens.count(pad) == ids.count(pad) > 2
    assert s.n_images == 2 and s.mm["image_grid_thw"].tolist() == mm["image_grid_thw"].tolist()
    assert s.mm["pixel_values"].shape == mm["pixel_values"].shape
    assert (s.mm["pixel_values"] == mm["pixel_values"]).all()
    trained = [tok.decode(s.tokens[a:b], skip_special_tokens=False) for a, b in spans(s.mask)]
    assert trained == ["Red." + tok.eos_token, "Blue." + tok.eos_token]
    with pytest.raises(molt.UsageError, match="1 image"):
        molt.sft_sample(codec, row, 4, [red])  # two markers, one image


def test_sft_refuses_rows_without_a_reply(tiny):
    with pytest.raises(molt.UsageError, match="no assistant message"):
        molt.sft_sample(molt.Codec(tiny), {"messages": [{"role": "user", "content": "hi"}]}, 3)


def run_molt(*args, ok=True):
    proc = subprocess.run([sys.executable, str(ROOT / "molt.py"), *map(str, args)], cwd=ROOT, capture_output=True,
                          text=True, timeout=900)
    assert (proc.returncode == 0) == ok, proc.stderr[-4000:]
    return proc


@pytest.mark.slow
def test_sft_memorises_and_its_checkpoint_starts_rl(tmp_path):
    words = ["amber", "basil", "cedar", "delta", "ember", "fjord", "gamma", "heron"]
    rows = [{"messages": [{"role": "user", "content": f"secret {k}"}, {"role": "assistant", "content": w}]}
            for k, w in enumerate(words)]
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    run = tmp_path / "sft"
    run_molt("--mode", "sft", "--data", data, "--eval-data", data, "--run-dir", run, "--sft.batch-size", 8,
             "--sft.epochs", 150, "--steps", 150, "--train.lr", 3e-3, "--eval.every", 50)
    m = [json.loads(line) for line in open(run / "metrics.jsonl")]
    assert [r["step"] for r in m] == list(range(1, 151))
    assert m[0]["loss/sft"] > 3.0 and m[-1]["loss/sft"] < 0.05, (m[0]["loss/sft"], m[-1]["loss/sft"])
    assert [r["step"] for r in m if "eval/loss" in r] == [50, 100, 150] and m[-1]["eval/loss"] < 0.05
    ckpt = run / "checkpoints" / "step_000150"
    assert (ckpt / "molt_state.json").exists()
    rl = tmp_path / "rl"
    run_molt("--agent", "agents/copy.py", "--model", ckpt, "--run-dir", rl, "--steps", 2)
    assert [json.loads(line)["step"] for line in open(rl / "metrics.jsonl")] == [1, 2]
    proc = run_molt("--mode", "sft", "--run-dir", tmp_path / "bad", ok=False)
    assert "--mode sft needs --data" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.slow
def test_sft_on_image_rows_learns_to_name_the_colour(tmp_path):
    from PIL import Image
    colours = {"red": (220, 20, 20), "green": (20, 200, 20), "blue": (20, 20, 220), "yellow": (230, 230, 20)}
    rows = []
    for name, rgb in colours.items():
        Image.new("RGB", (56, 56), rgb).save(tmp_path / f"{name}.png")
        rows.append({"messages": [{"role": "user", "content": "<image> Which colour?"},
                                  {"role": "assistant", "content": name}], "images": [f"{name}.png"]})
    data = tmp_path / "colours.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    run = tmp_path / "sft-vl"
    run_molt("--mode", "sft", "--model", "tiny-vl", "--data", data, "--run-dir", run, "--sft.batch-size", 4,
             "--sft.epochs", 60, "--steps", 60, "--train.lr", 3e-3)
    m = [json.loads(line) for line in open(run / "metrics.jsonl")]
    # the prompts differ only in their image: blind, the best token-mean loss is log(4) on each answer's first token
    # over the 22 answer tokens, 0.25; below that the model reads the pixels
    assert m[0]["loss/sft"] > 2.0 and m[-1]["loss/sft"] < 0.1, (m[0]["loss/sft"], m[-1]["loss/sft"])
