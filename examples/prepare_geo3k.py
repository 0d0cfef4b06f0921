"""Convert the geometry3k data set (HF hub) into Molt's geo3k rows, for machines with network access.

    .venv/bin/python examples/prepare_geo3k.py --out ~/geo3k          # writes ~/geo3k/train and ~/geo3k/test
    python molt.py --agent agents/geo3k.py --model Qwen/Qwen2.5-VL-3B-Instruct --data ~/geo3k/train \\
        --eval-data ~/geo3k/test --eval.every 10

Each row: prompt (one user message with an <image> marker and the instructions), images (the diagram), label (the
answer) and tools (the python tool schema), saved with datasets.save_to_disk, which --data reads as a directory.
"""
import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "rewards"))
from sandbox import TOOL_SCHEMA  # noqa: E402

ASK = " Reason step by step; you may call the python tool to compute. Put the final answer in \\boxed{}."


def convert(row: dict) -> dict:
    problem = row["problem"].replace("<image>", "").strip()
    answer = row["answer"].strip()
    if answer.startswith("\\boxed{") and answer.endswith("}"):
        answer = answer[len("\\boxed{"):-1]
    return {"prompt": [{"role": "user", "content": "<image>" + problem + ASK}], "images": row["images"][:1],
            "label": answer, "tools": [TOOL_SCHEMA]}


def main(args):
    import datasets
    source = datasets.load_dataset(args.source)
    for split in ("train", "test"):
        ds = source[split].map(convert, remove_columns=source[split].column_names)
        ds.save_to_disk(os.path.join(os.path.expanduser(args.out), split))
        print(f"{split}: {len(ds)} rows")


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--source", default="hiyouga/geometry3k", help="HF data set with problem / answer / images")
    p.add_argument("--out", default="~/geo3k")
    main(p.parse_args())
