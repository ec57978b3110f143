"""Write and check the published JSON Schemas of the wire messages (``controlplane/wire/schemas``).

The files are generated from the models by :func:`json_schemas`, never edited by hand.
Local file I/O only: no Kafka, no network.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Final

from controlplane.wire.channels import CHANNELS
from controlplane.wire.messages import SCHEMA_VERSION

#: Where the committed schema files live (shipped as package data).
SCHEMA_DIR: Final = Path(__file__).resolve().parent / "schemas"
#: The command that regenerates them; quoted in every "stale schema" message.
EXPORT_COMMAND: Final = "controlplane schema export"


def json_schemas() -> dict[str, dict[str, Any]]:
    """The JSON Schemas of the wire's messages, one per channel, as exported to
    ``controlplane/wire/schemas``."""
    out: dict[str, dict[str, Any]] = {}
    for channel in CHANNELS:
        schema = channel.model.model_json_schema(mode="validation")
        schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
        schema["$id"] = (
            f"https://fleet-controlplane.dev/schemas/v{SCHEMA_VERSION}/{channel.schema}.json"
        )
        out[channel.schema] = schema
    return out


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
