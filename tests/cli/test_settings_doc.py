"""docs/settings.md lists exactly the settings the code reads, with the code's defaults."""
from pathlib import Path

from uccl_ep_train import settings

DOC = Path(__file__).resolve().parents[2] / "docs" / "settings.md"


def render() -> str:
    lines = ["# Settings", "",
             "Every tunable of uccl-ep-train is an environment variable read in one place,",
             "`uccl_ep_train/settings.py`; malformed values raise `SettingsError` naming the variable.",
             "`UCCL_*` names match UCCL-EP's so cluster settings carry over; `UCCL_EP_*` names are ours.",
             "Regenerate this table with `python tests/cli/test_settings_doc.py`.", "",
             "| variable | default | meaning |", "| --- | --- | --- |"]
    for env, default, doc in settings.describe():
        lines.append(f"| `{env}` | {('`' + default + '`') if default else '(unset)'} | {doc} |")
    return "\n".join(lines) + "\n"


def test_settings_doc_matches_the_code():
    assert DOC.read_text() == render(), "docs/settings.md is stale: run python tests/cli/test_settings_doc.py"


if __name__ == "__main__":
    DOC.write_text(render())
