"""The ``pagedattn bench --json`` document: its JSON Schema and a small validator.

:data:`SCHEMA` is a JSON-Schema (draft 2020-12 subset) dict, publishable as is.
:func:`validate` implements exactly the keywords it uses -- ``type`` (one or a list,
``"integer"`` excludes bools), ``properties``, ``required``, ``additionalProperties``
(bool or schema), ``items``, ``enum``, ``minimum``, ``minItems``, ``$ref`` to
``#/$defs/...`` -- so the bench stays dependency-free; any standard validator accepts the
same schema.

Document outline (times in seconds, rates in 1e9 units)::

    {schema_version, created, command[], wall_s, other_load_cores, other_load_during_run,
     machine:  {cpu_model, logical_cores, threads, llc_bytes, dram_read_gbps,
                matmul_gflops{dtype: GFLOP/s}, probe_bytes, matmul_size, measured_at, cached,
                details{bandwidth{best, figures[], ...}}, probe_version},
     versions: {pagedattn, torch, python, ...},
     options:  {suite, scenarios, contenders[], repeat, threads, budget_s, warmup_s,
                interleave},
     contenders: {name: {available, reason, description}},
     scenarios: [{scenario{name, kind, batch, seq_lens[], query_lens[], heads..., bytes, flops},
                  copies, roofline{bound, t_min_s, ...},
                  stream{times_s[], median_s, bytes, method},
                  results: [{contender, status, reason, times_s[], median_s, repeats,
                             max_abs_err, gbps, gflops, roofline_fraction,
                             speedup_of_pagedattn, ...}]}]}
"""

from __future__ import annotations

SCHEMA_VERSION = 1

_NUM = {"type": "number"}
_NUM_OR_NULL = {"type": ["number", "null"]}
_TIMES = {"type": "array", "items": {"type": "number", "minimum": 0}}

SCHEMA: dict = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "title": "pagedattn bench results",
    "type": "object",
    "required": ["schema_version", "created", "command", "machine", "versions", "options",
                 "contenders", "scenarios"],
    "properties": {
        "schema_version": {"enum": [SCHEMA_VERSION]},
        "created": {"type": "string"},
        "command": {"type": "array", "items": {"type": "string"}},
        "wall_s": _NUM,
        "other_load_cores": _NUM_OR_NULL,
        "other_load_during_run": _NUM_OR_NULL,
        "machine": {
            "type": "object",
            "required": ["cpu_model", "logical_cores", "threads", "llc_bytes",
                         "dram_read_gbps", "matmul_gflops", "measured_at", "cached"],
            "properties": {
                "cpu_model": {"type": "string"},
                "logical_cores": {"type": "integer", "minimum": 1},
                "threads": {"type": "integer", "minimum": 1},
                "llc_bytes": {"type": "integer", "minimum": 0},
                "dram_read_gbps": {"type": "number", "minimum": 0},
                "matmul_gflops": {"type": "object", "additionalProperties": _NUM},
                "probe_bytes": {"type": "integer"},
                "matmul_size": {"type": "integer"},
                "measured_at": {"type": "string"},
                "cached": {"type": "boolean"},
                "details": {"type": "object"},
                "probe_version": {"type": "integer", "minimum": 1},
            },
        },
        "versions": {
            "type": "object",
            "required": ["pagedattn", "torch", "python"],
            "properties": {"pagedattn": {"type": "string"}, "torch": {"type": "string"},
                           "python": {"type": "string"}, "native": {"type": "boolean"}},
        },
        "options": {
            "type": "object",
            "required": ["suite", "contenders", "repeat"],
            "properties": {
                "suite": {"type": "string"},
                "scenarios": {"type": ["array", "null"], "items": {"type": "string"}},
                "contenders": {"type": "array", "items": {"type": "string"}},
                "repeat": {"type": "integer", "minimum": 1},
                "threads": {"type": ["integer", "null"]},
                "budget_s": _NUM,
                "warmup_s": _NUM,
                "interleave": {"type": "boolean"},
                "kv_dtype": {"enum": [None, "auto", "fp8", "fp8_e4m3", "fp8_e5m2"]},
            },
        },
        "contenders": {
            "type": "object",
            "additionalProperties": {
                "type": "object",
                "required": ["available", "reason", "description"],
                "properties": {"available": {"type": "boolean"}, "reason": {"type": "string"},
                               "description": {"type": "string"}},
            },
        },
        "scenarios": {"type": "array", "items": {"$ref": "#/$defs/scenario_result"}},
    },
    "$defs": {
        "scenario": {
            "type": "object",
            "required": ["name", "kind", "batch", "seq_lens", "query_lens", "num_heads",
                         "num_kv_heads", "head_size", "dtype", "block_size", "bytes", "flops"],
            "properties": {
                "name": {"type": "string"},
                "kind": {"enum": ["decode", "prefill", "mixed", "reshape_and_cache"]},
                "batch": {"type": "integer", "minimum": 1},
                "seq_lens": {"type": "array", "minItems": 1,
                             "items": {"type": "integer", "minimum": 1}},
                "query_lens": {"type": "array", "minItems": 1,
                               "items": {"type": "integer", "minimum": 1}},
                "num_heads": {"type": "integer", "minimum": 1},
                "num_kv_heads": {"type": "integer", "minimum": 1},
                "head_size": {"type": "integer", "minimum": 1},
                "dtype": {"enum": ["bfloat16", "float16", "float32"]},
                "block_size": {"type": "integer", "minimum": 1},
                "causal": {"type": "boolean"},
                "kv_dtype": {"enum": ["auto", "fp8", "fp8_e4m3", "fp8_e5m2"]},
                "bytes": {"type": "integer", "minimum": 0},
                "flops": {"type": "integer", "minimum": 0},
            },
        },
        "cell": {
            "type": "object",
            "required": ["contender", "status", "reason", "times_s", "median_s", "repeats",
                         "max_abs_err", "gbps", "gflops", "roofline_fraction",
                         "speedup_of_pagedattn"],
            "properties": {
                "contender": {"type": "string"},
                "status": {"enum": ["ok", "wrong", "unavailable", "unsupported", "error"]},
                "reason": {"type": "string"},
                "note": {"type": "string"},
                "times_s": _TIMES,
                "median_s": _NUM_OR_NULL,
                "repeats": {"type": "integer", "minimum": 0},
                "budget_limited": {"type": "boolean"},
                "max_abs_err": _NUM_OR_NULL,
                "tolerance": _NUM_OR_NULL,
                "wall_s": {"type": "number", "minimum": 0},
                "gbps": _NUM_OR_NULL,
                "gflops": _NUM_OR_NULL,
                "roofline_fraction": _NUM_OR_NULL,
                "speedup_of_pagedattn": _NUM_OR_NULL,
            },
        },
        "scenario_result": {
            "type": "object",
            "required": ["scenario", "copies", "roofline", "stream", "results"],
            "properties": {
                "scenario": {"$ref": "#/$defs/scenario"},
                "copies": {"type": "integer", "minimum": 1},
                "roofline": {
                    "type": "object",
                    "required": ["bound", "t_min_s"],
                    "properties": {"bound": {"enum": ["memory", "compute"]},
                                   "t_min_s": {"type": "number", "minimum": 0}},
                },
                "stream": {
                    "type": "object",
                    "required": ["times_s", "median_s", "bytes"],
                    "properties": {"times_s": _TIMES, "median_s": _NUM_OR_NULL,
                                   "bytes": {"type": "integer", "minimum": 0},
                                   "method": {"type": "string"}},
                },
                "results": {"type": "array", "items": {"$ref": "#/$defs/cell"}},
            },
        },
    },
}

_TYPES = {
    "object": lambda v: isinstance(v, dict),
    "array": lambda v: isinstance(v, list),
    "string": lambda v: isinstance(v, str),
    "boolean": lambda v: isinstance(v, bool),
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "null": lambda v: v is None,
}


def validate(instance, schema: dict, root: dict | None = None, path: str = "$") -> list[str]:
    """Errors of ``instance`` against ``schema`` as ``"<json path>: <problem>"`` lines
    (empty when valid)."""
    root = schema if root is None else root
    if "$ref" in schema:
        ref = schema["$ref"]
        if not ref.startswith("#/$defs/"):
            raise ValueError(f"only '#/$defs/...' references are supported, got {ref!r}")
        return validate(instance, root["$defs"][ref[len("#/$defs/"):]], root, path)
    errors: list[str] = []
    if "type" in schema:
        types = schema["type"] if isinstance(schema["type"], list) else [schema["type"]]
        if not any(_TYPES[t](instance) for t in types):
            return [f"{path}: expected {' or '.join(types)}, got {type(instance).__name__}"]
    if "enum" in schema and instance not in schema["enum"]:
        errors.append(f"{path}: {instance!r} is not one of {schema['enum']}")
    if "minimum" in schema and _TYPES["number"](instance) and instance < schema["minimum"]:
        errors.append(f"{path}: {instance} < minimum {schema['minimum']}")
    if isinstance(instance, list):
        if len(instance) < schema.get("minItems", 0):
            errors.append(f"{path}: fewer than {schema['minItems']} items")
        if "items" in schema:
            for i, item in enumerate(instance):
                errors += validate(item, schema["items"], root, f"{path}[{i}]")
    if isinstance(instance, dict):
        for key in schema.get("required", []):
            if key not in instance:
                errors.append(f"{path}: missing required {key!r}")
        props = schema.get("properties", {})
        extra = schema.get("additionalProperties", True)
        for key, value in instance.items():
            if key in props:
                errors += validate(value, props[key], root, f"{path}.{key}")
            elif extra is False:
                errors.append(f"{path}: unexpected property {key!r}")
            elif isinstance(extra, dict):
                errors += validate(value, extra, root, f"{path}.{key}")
    return errors


def validate_result(doc) -> list[str]:
    """Errors of a bench JSON document against :data:`SCHEMA`."""
    return validate(doc, SCHEMA)
