"""Write docs/cli.md and docs/configuration.md from the click commands and the config dataclasses.

Run after changing a command, a flag or a config field: `python scripts/gen_cli_docs.py`
(tests/cli/test_reference_docs.py fails while either file is out of date).
"""

from pathlib import Path

from dflash_pipe.reference import write_references

if __name__ == "__main__":
    for path in write_references(Path(__file__).resolve().parents[1] / "docs"):
        print(f"wrote {path}")
