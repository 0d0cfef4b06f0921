"""Write examples/geo3k_tiny.jsonl: small geometry problems in the geo3k format (prompt with an <image> marker, the
diagram as a PNG data URI, the answer as label, the python tool schema), with diagrams drawn here so that Molt's
geo3k recipe runs offline.

    .venv/bin/python examples/make_geo3k_tiny.py
"""
import base64
import io
import json
import math
import os
import sys

from PIL import Image, ImageDraw

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "rewards"))
from sandbox import TOOL_SCHEMA  # noqa: E402

ASK = (" Reason step by step; you may call the python tool to compute. Put the final answer in \\boxed{}.")


def uri(img) -> str:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def canvas():
    img = Image.new("RGB", (112, 112), "white")
    return img, ImageDraw.Draw(img)


def right_triangle(a, b):
    img, d = canvas()
    d.polygon([(10, 100), (10 + 9 * a, 100), (10, 100 - 9 * b)], outline="black")
    d.text((10 + 4 * a, 102), str(a), fill="blue")
    d.text((0, 100 - 5 * b), str(b), fill="blue")
    d.text((14 + 4 * a, 96 - 5 * b), "x", fill="red")
    return uri(img), f"<image>In the right triangle, the legs are {a} and {b}. Find x, the hypotenuse.", \
        str(int(math.hypot(a, b)))


def rectangle(w, h):
    img, d = canvas()
    d.rectangle([10, 20, 10 + 8 * w, 20 + 8 * h], outline="black")
    d.text((10 + 4 * w, 8), str(w), fill="blue")
    d.text((14 + 8 * w, 20 + 4 * h), str(h), fill="blue")
    return uri(img), f"<image>Find the area of the rectangle with sides {w} and {h}.", str(w * h)


def angles(p, q):
    img, d = canvas()
    d.polygon([(10, 100), (100, 100), (40, 15)], outline="black")
    d.text((14, 86), f"{p}", fill="blue")
    d.text((80, 86), f"{q}", fill="blue")
    d.text((38, 22), "x", fill="red")
    return uri(img), f"<image>Two angles of the triangle are {p} and {q} degrees. Find x in degrees.", \
        str(180 - p - q)


def main():
    rows = []
    for a, b in [(3, 4), (6, 8), (5, 12), (8, 6)]:
        rows.append(right_triangle(a, b))
    for w, h in [(3, 5), (4, 7), (6, 2), (9, 3)]:
        rows.append(rectangle(w, h))
    for p, q in [(50, 60), (35, 75), (90, 40), (20, 100)]:
        rows.append(angles(p, q))
    with open(os.path.join(HERE, "geo3k_tiny.jsonl"), "w") as f:
        for image, question, answer in rows:
            f.write(json.dumps({"prompt": [{"role": "user", "content": question + ASK}], "images": [image],
                                "label": answer, "tools": [TOOL_SCHEMA]}) + "\n")
    print(f"wrote {len(rows)} problems")


if __name__ == "__main__":
    main()
