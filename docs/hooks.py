"""mkdocs hooks: the job-config reference and the job file's JSON schema, generated from
the pydantic schema (src/meshforge/config.py's JobConfig) at every build, so that
neither can drift from the code.

- A page's `<!-- config-reference -->` becomes the table of every section and field
  (type and limits, default, description); `<!-- config-reference: parallel -->` only
  that section and the ones inside it.
- `job.schema.json` (JobConfig.model_json_schema(), with the descriptions) is written
  into the site, for editors (yaml-language-server's `$schema=`).
- The home page is README.md, its `docs/` links made relative to the site, so the
  front door is written once.

Descriptions come from a field's `Field(description=...)` when it has one, else from
docs/job-config.fields.yaml. A field with neither, or an entry there that names no
field, fails the build.
"""

from __future__ import annotations

import json
import re
import sys
import types
import typing
from pathlib import Path
from typing import Any

import annotated_types
import yaml
from mkdocs.exceptions import PluginError
from mkdocs.structure.files import File, Files
from pydantic import BaseModel
from pydantic_core import PydanticUndefined

ROOT = Path(__file__).resolve().parent.parent
DESCRIPTIONS = Path(__file__).with_name("job-config.fields.yaml")
MARKER = re.compile(r"<!--\s*config-reference(?::\s*([\w.]+))?\s*-->")
SCHEMA_FILE = "job.schema.json"


def _job_config() -> type[BaseModel]:
    """This checkout's JobConfig, whatever meshforge the environment has installed."""
    src = str(ROOT / "src")
    if src not in sys.path:
        sys.path.insert(0, src)
    from meshforge.config import JobConfig

    return JobConfig


def _section_model(annotation: Any) -> type[BaseModel] | None:
    """The model class of a section field (`ParallelConfig | Literal["auto"]`, `X | None`)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in typing.get_args(annotation):
        found = _section_model(arg)
        if found is not None:
            return found
    return None


def _sections(model: type[BaseModel], path: str = "") -> list[tuple[str, type[BaseModel]]]:
    """Every section, depth first: ("", JobConfig), ("model", ModelConfig), ..."""
    out = [(path, model)]
    for name, field in model.model_fields.items():
        sub = _section_model(field.annotation)
        if sub is not None:
            out += _sections(sub, f"{path}.{name}" if path else name)
    return out


def _type(annotation: Any) -> str:
    """A field's type as a reader of a YAML file sees it."""
    if annotation is type(None):
        return "null"
    origin = typing.get_origin(annotation)
    if origin is typing.Literal:
        return ", ".join(f"`{json.dumps(a)}`" for a in typing.get_args(annotation))
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type(a) for a in typing.get_args(annotation))
    if origin is dict or annotation is dict:
        return "mapping"
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return "mapping"
    return {int: "int", float: "float", str: "string", bool: "bool"}.get(
        annotation, str(annotation)
    )


def _limits(metadata: list[Any]) -> str:
    signs = {"ge": "≥", "gt": ">", "le": "≤", "lt": "<"}
    out = []
    for item in metadata:
        for attr, sign in signs.items():
            if isinstance(item, getattr(annotated_types, attr.capitalize())):
                out.append(f"{sign} {getattr(item, attr)}")
        if isinstance(item, annotated_types.MinLen) and item.min_length == 1:
            out.append("non-empty")
    return ", ".join(out)


def _default(field: Any) -> str:
    if field.default is PydanticUndefined:
        return "required"
    value = field.default
    if isinstance(value, BaseModel):
        return "(its fields' defaults)"
    return f"`{json.dumps(value)}`"


def _load_descriptions() -> tuple[dict[str, str], dict[str, str]]:
    data = yaml.safe_load(DESCRIPTIONS.read_text()) or {}
    return data.get("sections") or {}, data.get("fields") or {}


def _descriptions(job: type[BaseModel]) -> tuple[dict[str, str], dict[str, str]]:
    """Section and field descriptions, checked against the schema both ways."""
    sections_doc, fields_doc = _load_descriptions()
    fields: dict[str, str] = {}
    problems = []
    section_paths = []
    for path, model in _sections(job):
        section_paths.append(path)
        for name, field in model.model_fields.items():
            if _section_model(field.annotation) is not None:
                continue
            key = f"{path}.{name}" if path else name
            text = field.description or fields_doc.get(key)
            if not text:
                problems.append(f"field {key} has no description")
            fields[key] = " ".join(str(text).split())
        if path not in sections_doc:
            problems.append(f"section {path or '(top level)'} has no description")
    problems += [f"{k} names no field of JobConfig" for k in fields_doc if k not in fields]
    problems += [f"section {k} is not in JobConfig" for k in sections_doc if k not in section_paths]
    if problems:
        raise PluginError(f"{DESCRIPTIONS.name}: " + "; ".join(problems))
    return {k: " ".join(str(v).split()) for k, v in sections_doc.items()}, fields


def reference(only: str | None = None) -> str:
    """The reference as markdown: a heading, an intro and a table per section."""
    job = _job_config()
    sections_doc, fields_doc = _descriptions(job)
    out = []
    for path, model in _sections(job):
        if only is not None and not (path == only or path.startswith(only + ".")):
            continue
        parent, _, leaf = path.rpartition(".")
        field = None
        if path:
            owner = dict(_sections(job))[parent]
            field = owner.model_fields[leaf]
        out.append(f"### `{path}`" if path else "### Top level")
        intro = sections_doc[path]
        if field is not None and field.default is None:
            intro += " Default: unset (`null`)."
        out += ["", intro, "", "| key | type | default | description |", "|---|---|---|---|"]
        for name, f in model.model_fields.items():
            if _section_model(f.annotation) is not None:
                continue
            key = f"{path}.{name}" if path else name
            kind = _type(f.annotation)
            limits = _limits(f.metadata)
            if limits:
                kind += f" ({limits})"
            out.append(f"| `{key}` | {kind} | {_default(f)} | {fields_doc[key]} |")
        out.append("")
    return "\n".join(out)


def schema() -> dict[str, Any]:
    """JobConfig's JSON schema, with the reference's descriptions for editors' hovers."""
    job = _job_config()
    _, fields_doc = _descriptions(job)
    out = job.model_json_schema()
    defs = out.get("$defs", {})
    for path, model in _sections(job):
        props = (defs.get(model.__name__) if path else out).get("properties", {})
        for name in props:
            key = f"{path}.{name}" if path else name
            if key in fields_doc:
                text = re.sub(r"\[([^]]*)\]\([^)]*\)", r"\1", fields_doc[key])
                props[name].setdefault("description", text)
    out["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    out["title"] = "meshforge job file"
    return out


def on_files(files: Files, config: Any) -> Files:
    readme = (ROOT / "README.md").read_text()
    home = re.sub(r"\]\(docs/([^)]*)\)", r"](\1)", readme)
    files.append(File.generated(config, "index.md", content=home))
    files.append(File.generated(config, SCHEMA_FILE, content=json.dumps(schema(), indent=2) + "\n"))
    return files


def on_page_markdown(markdown: str, page: Any, config: Any, files: Files) -> str:
    return MARKER.sub(lambda m: reference(m.group(1)), markdown)


if __name__ == "__main__":  # `python docs/hooks.py > job.schema.json`: the schema alone
    print(json.dumps(schema(), indent=2))
