"""Write and check the published JSON Schemas of the wire messages (``controlplane/wire/schemas``).

The files are generated from :func:`controlplane.wire.protocol.json_schemas`, never edited by hand.
Local file I/O only: no Kafka, no network.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Final

from controlplane.wire.protocol import json_schemas

#: Where the committed schema files live (shipped as package data).
SCHEMA_DIR: Final = Path(__file__).resolve().parent / "schemas"
#: The command that regenerates them; quoted in every "stale schema" message.
EXPORT_COMMAND: Final = "controlplane schema export"


def render_schemas() -> dict[str, str]:
    """File name -> exact file text: pretty-printed, keys sorted, one trailing newline."""
    return {
        f"{name}.json": json.dumps(schema, indent=2, sort_keys=True, ensure_ascii=False) + "\n"
        for name, schema in sorted(json_schemas().items())
    }


def write_schemas(directory: Path = SCHEMA_DIR) -> list[Path]:
    """Write every schema file into ``directory`` (created if missing); return their paths."""
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    for name, text in render_schemas().items():
        path = directory / name
        path.write_bytes(text.encode("utf-8"))
        written.append(path)
    return written


def check_schemas(directory: Path = SCHEMA_DIR) -> list[str]:
    """Names of the schema files in ``directory`` that are missing or differ from the models."""
    stale = []
    for name, text in render_schemas().items():
        path = directory / name
        try:
            current = path.read_bytes()
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            stale.append(name)
            continue
        if current != text.encode("utf-8"):
            stale.append(name)
    return stale
