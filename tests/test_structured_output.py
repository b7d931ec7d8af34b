"""Structured output (issue 34, item 5): ``response_format`` json_object / json_schema and
vLLM's regex and grammar fields on both completion endpoints, and
``SamplingParams.structured_output`` offline. Every JSON answer must parse and validate
against its schema; bad specs are 400s naming the field; constrained rows leave their
unconstrained batch-mates' greedy tokens alone; a matcher's failure fails its request alone.
"""

from __future__ import annotations

import json
import re
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("xgrammar", reason="structured output needs the 'xgrammar' package "
                                       "(pip install xgrammar)")
jsonschema = pytest.importorskip("jsonschema", reason="the schema checks need 'jsonschema'")
httpx = pytest.importorskip("httpx")

from pagedattn import LLM, SamplingParams  # noqa: E402
from pagedattn.engine.structured_output import (  # noqa: E402
    Grammars,
    StructuredOutput,
    StructuredOutputError,
)
from serve_helpers import BATCH_INVARIANT, serve_in_thread  # noqa: E402

MAX_TOKENS = 120

# Strings, arrays and integers are bounded so a greedy small model cannot run past
# MAX_TOKENS inside a value; every other JSON Schema feature here is what is tested.
SCHEMAS = {
    "person": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 120}},
        "required": ["name", "age"]},
    "enum_color": {"type": "object", "properties": {
        "color": {"type": "string", "enum": ["red", "green", "blue"]}},
        "required": ["color"]},
    "bool_flag": {"type": "object", "properties": {
        "answer": {"type": "boolean"}, "confidence": {"type": "number", "minimum": 0,
                                                      "maximum": 1}},
        "required": ["answer", "confidence"]},
    "tags_array": {"type": "object", "properties": {
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12},
                 "minItems": 1, "maxItems": 3}},
        "required": ["tags"]},
    "nested_address": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 20},
        "location": {"type": "object", "properties": {
            "lat": {"type": "number", "minimum": -90, "maximum": 90},
            "lon": {"type": "number", "minimum": -180, "maximum": 180}},
            "required": ["lat", "lon"]}},
        "required": ["city", "location"]},
    "array_of_objects": {"type": "object", "properties": {
        "items": {"type": "array", "maxItems": 2, "items": {
            "type": "object", "properties": {
                "sku": {"type": "string", "pattern": "^[A-Z]{3}[0-9]{2}$"},
                "qty": {"type": "integer", "minimum": 1, "maximum": 9}},
            "required": ["sku", "qty"]}}},
        "required": ["items"]},
    "top_level_array": {"type": "array", "items": {"type": "integer", "minimum": 0,
                                                   "maximum": 99},
                        "minItems": 2, "maxItems": 4},
    "enum_ints_and_null": {"type": "object", "properties": {
        "level": {"enum": [1, 2, 3]}, "note": {"type": ["string", "null"], "maxLength": 10}},
        "required": ["level", "note"]},
    "deep_nesting": {"type": "object", "properties": {
        "a": {"type": "object", "properties": {
            "b": {"type": "object", "properties": {
                "c": {"type": "string", "enum": ["x", "y"]}}, "required": ["c"]}},
            "required": ["b"]}},
        "required": ["a"]},
    "const_and_optional": {"type": "object", "properties": {
        "kind": {"const": "event"}, "day": {"type": "integer", "minimum": 1, "maximum": 31},
        "title": {"type": "string", "maxLength": 16}},
        "required": ["kind", "day"]},
    "any_of": {"type": "object", "properties": {
        "value": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9},
                            {"type": "string", "enum": ["none"]}]}},
        "required": ["value"]},
    "refs": {"type": "object", "$defs": {
        "point": {"type": "object", "properties": {
            "x": {"type": "integer", "minimum": -9, "maximum": 9},
            "y": {"type": "integer", "minimum": -9, "maximum": 9}},
            "required": ["x", "y"]}},
        "properties": {"start": {"$ref": "#/$defs/point"}, "end": {"$ref": "#/$defs/point"}},
        "required": ["start", "end"]},
}


def _validate(text: str, schema: dict) -> None:
    value = json.loads(text)
    jsonschema.validate(value, schema)


@pytest.fixture(scope="module")
def llm():
    """Offline: its own engine (the server's is stepped by the server's thread)."""
    return LLM(model="smollm2", **BATCH_INVARIANT)


@pytest.fixture(scope="module")
def served():
    served_llm = LLM(model="smollm2", **BATCH_INVARIANT)
    with serve_in_thread(served_llm) as (url, _app):
        yield url, served_llm


@pytest.fixture(scope="module")
def server(served):
    return served[0]


def _post(url: str, route: str, body: dict) -> httpx.Response:
    return httpx.post(f"{url}/v1/{route}", json={"model": "smollm2", **body}, timeout=120)


def _chat(url: str, content: str, **extra) -> httpx.Response:
    return _post(url, "chat/completions", {"messages": [{"role": "user", "content": content}],
                                           "max_tokens": MAX_TOKENS, "temperature": 0,
                                           **extra})


# ---------------------------------------------------------------------- json schemas


def test_json_schema_answers_validate_on_chat(server):
    """Twelve schemas, sent together (one batch): every answer parses and validates."""
    def ask(item):
        name, schema = item
        return name, schema, _chat(server, f"Give an example '{name}' record as JSON.",
                                   response_format={"type": "json_schema", "json_schema": {
                                       "name": name, "schema": schema, "strict": True}})

    with ThreadPoolExecutor(len(SCHEMAS)) as pool:
        results = list(pool.map(ask, SCHEMAS.items()))
    assert len(results) >= 10
    for name, schema, r in results:
        assert r.status_code == 200, (name, r.text)
        choice = r.json()["choices"][0]
        assert choice["finish_reason"] == "stop", (name, choice)
        _validate(choice["message"]["content"], schema)


def test_json_schema_on_completions_and_streamed(server):
    schema = SCHEMAS["person"]
    body = {"prompt": "A person record in JSON:", "max_tokens": MAX_TOKENS, "temperature": 0,
            "response_format": {"type": "json_schema",
                                "json_schema": {"name": "person", "schema": schema}}}
    r = _post(server, "completions", body)
    assert r.status_code == 200, r.text
    whole = r.json()["choices"][0]
    assert whole["finish_reason"] == "stop"
    _validate(whole["text"], schema)
    # streamed: the pieces join to the same text
    with httpx.stream("POST", f"{server}/v1/completions", timeout=120,
                      json={"model": "smollm2", **body, "stream": True}) as s:
        events = [line[6:] for line in s.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole["text"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


def test_json_object_answers_parse(server):
    for route, body in (
            ("chat/completions", {"messages": [{"role": "user", "content":
                                                "Reply with a JSON object with a cat's name "
                                                "and age."}]}),
            ("completions", {"prompt": 'A JSON object describing Paris: '})):
        r = _post(server, route, {**body, "max_tokens": MAX_TOKENS, "temperature": 0,
                                  "response_format": {"type": "json_object"}})
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        text = choice.get("text", None) if route == "completions" else choice["message"]["content"]
        if choice["finish_reason"] == "stop":
            assert isinstance(json.loads(text), dict), text
        else:  # ran out of tokens inside the object: still a JSON object's prefix
            assert choice["finish_reason"] == "length" and text.lstrip().startswith("{")


def test_response_format_text_is_free_text(server):
    r = _chat(server, "Say hi.", response_format={"type": "text"}, max_tokens=4)
    assert r.status_code == 200, r.text


# ---------------------------------------------------------------------- regex and grammar


@pytest.mark.parametrize("field", ["guided_regex", "regex"])
def test_regex_answer_fullmatches(server, field):
    pattern = r"[0-9]{3}-[0-9]{4}"
    r = _post(server, "completions", {"prompt": "Call me at", "max_tokens": 20,
                                      "temperature": 0, field: pattern})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop"
    assert re.fullmatch(pattern, choice["text"]), choice["text"]


def test_regex_with_sampling_fullmatches(server):
    pattern = r"(yes|no), because [a-z ]{1,30}\."
    for seed in range(3):
        r = _chat(server, "Is the sky blue? Answer yes or no and why.", guided_regex=pattern,
                  temperature=0.8, seed=seed, max_tokens=40)
        assert r.status_code == 200, r.text
        text = r.json()["choices"][0]["message"]["content"]
        assert re.fullmatch(pattern, text), text


def test_regex_holds_every_choice_of_n(server):
    """n=3: each choice walks the grammar with a matcher of its own."""
    pattern = r"(yes|no), because [a-z ]{1,30}\."
    r = _chat(server, "Is the sky blue? Answer yes or no and why.", guided_regex=pattern,
              temperature=0.8, seed=5, max_tokens=40, n=3)
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2]
    for c in choices:
        assert c["finish_reason"] == "stop"
        assert re.fullmatch(pattern, c["message"]["content"]), c["message"]["content"]


@pytest.mark.parametrize("field", ["guided_grammar", "grammar"])
def test_grammar_answer_is_in_the_language(server, field):
    grammar = ('root ::= expr "="\n'
               'expr ::= num (op num){0,3}\n'
               'op ::= "+" | "-" | "*"\n'
               'num ::= [1-9] [0-9]?')
    r = _chat(server, "Write a short arithmetic expression.", max_tokens=30, **{field: grammar})
    assert r.status_code == 200, r.text
    text = r.json()["choices"][0]["message"]["content"]
    assert re.fullmatch(r"[1-9][0-9]?([-+*][1-9][0-9]?){0,3}=", text), text


def test_structured_outputs_object(server):
    r = _post(server, "completions", {"prompt": "Pick:", "max_tokens": 10, "temperature": 0,
                                      "structured_outputs": {"regex": "(left|right)"}})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] in ("left", "right")


# ---------------------------------------------------------------------- bad input: 400s


@pytest.mark.parametrize("extra, param, needle", [
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "objectx"}}}},
     "response_format", "objectx"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format.json_schema.schema", "schema"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema", "json_schema"),
    ({"response_format": {"type": "xml"}}, "response_format.type", "xml"),
    ({"guided_regex": "(ab"}, "guided_regex", "(ab"),
    ({"regex": "[z-a]"}, "regex", "[z-a]"),
    ({"guided_grammar": "root ::= undefined_rule"}, "guided_grammar", "undefined_rule"),
    ({"guided_json": "{not json"}, "guided_json", "not valid JSON"),
    ({"guided_json": {"type": "object"}, "guided_regex": "a"}, "guided_regex", "only one"),
    ({"response_format": {"type": "json_object"}, "grammar": "root ::= \"a\""}, "grammar",
     "only one"),
    # the grammar ends after one token; min_tokens would fail it mid-generation
    ({"regex": "(left|right)", "min_tokens": 3}, "min_tokens", "min_tokens"),
])
@pytest.mark.parametrize("route", ["completions", "chat/completions"])
def test_bad_spec_is_a_400_naming_it(server, route, extra, param, needle):
    body = ({"prompt": "hi"} if route == "completions"
            else {"messages": [{"role": "user", "content": "hi"}]})
    r = _post(server, route, {**body, "max_tokens": 4, **extra})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] is not None and err["param"].startswith(param.split(".")[0]), err
    assert needle in err["message"], err
    ok = _post(server, "completions", {"prompt": "hi", "max_tokens": 2, "temperature": 0})
    assert ok.status_code == 200  # the server is unharmed


def test_missing_xgrammar_is_a_clear_error(llm, monkeypatch):
    monkeypatch.setitem(sys.modules, "xgrammar", None)  # import xgrammar -> ImportError
    grammars = Grammars(llm.tokenizer, 49152, None)
    with pytest.raises(StructuredOutputError, match="'xgrammar' package"):
        grammars.compile(StructuredOutput(json_object=True))


def test_missing_xgrammar_is_a_400_on_the_server(served, monkeypatch):
    server, served_llm = served
    monkeypatch.setitem(sys.modules, "xgrammar", None)
    monkeypatch.setattr(served_llm.engine, "grammars", Grammars(served_llm.tokenizer, 49152, None))
    r = _post(server, "completions", {"prompt": "hi", "max_tokens": 4,
                                      "guided_regex": "[0-9]+x"})
    assert r.status_code == 400, r.text
    assert "xgrammar" in r.json()["error"]["message"]


# ---------------------------------------------------------------------- offline, batching


def test_offline_generate_with_structured_output(llm):
    schema = SCHEMAS["nested_address"]
    sp = SamplingParams(temperature=0, max_tokens=MAX_TOKENS,
                        structured_output=StructuredOutput(json=schema))
    out = llm.chat([{"role": "user", "content": "Where is Paris, as JSON?"}], sp)[0]
    assert out.finish_reason == "stop"
    _validate(out.text, schema)
    with pytest.raises(ValueError, match="invalid regex"):
        llm.generate(["x"], SamplingParams(max_tokens=4,
                                           structured_output=StructuredOutput(regex="(")))


def test_compiled_grammars_are_cached(llm):
    grammars = llm.engine.grammars
    spec = StructuredOutput(json={"type": "object", "properties": {"k": {"type": "integer"}}})
    before = grammars.num_compiled
    for _ in range(3):
        llm.engine.compile_structured_output(spec)
    assert grammars.num_compiled == before + 1


UNCONSTRAINED = ["The capital of France is", "Once upon a time,", "def fibonacci(n):"]


def test_constrained_row_leaves_batch_mates_unchanged(llm):
    """Greedy answers of three plain prompts: batched alone, and batched with a
    json_schema request and a regex request, the tokens are the same (batch-invariant
    engine options, so only the masks could change them)."""
    plain = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    alone = llm.generate(UNCONSTRAINED, plain)
    constrained = [
        SamplingParams(temperature=0, max_tokens=60,
                       structured_output=StructuredOutput(json=SCHEMAS["person"])),
        SamplingParams(temperature=0, max_tokens=20,
                       structured_output=StructuredOutput(regex=r"[a-z]{2,8}!")),
    ]
    mixed = llm.generate(UNCONSTRAINED + ["A person:", "A word:"], [plain] * 3 + constrained)
    assert [o.token_ids for o in mixed[:3]] == [o.token_ids for o in alone]
    _validate(mixed[3].text, SCHEMAS["person"])
    assert re.fullmatch(r"[a-z]{2,8}!", mixed[4].text)


def test_a_failing_matcher_fails_its_request_alone(llm):
    engine = llm.engine
    plain = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    want = llm.generate(UNCONSTRAINED[:2], plain)
    ids = [engine.inputs.encode(p) for p in UNCONSTRAINED[:2]]
    mates = [engine.add_request(i, plain) for i in ids]
    bad = engine.add_request(engine.inputs.encode("JSON:"), SamplingParams(
        temperature=0, max_tokens=12, structured_output=StructuredOutput(json_object=True)))

    def boom(row):
        raise RuntimeError("injected matcher failure")

    bad.grammar.mask = boom
    while engine.has_unfinished():
        engine.step()
    assert str(bad.finish_reason) == "error" and "injected matcher failure" in bad.error
    assert [r.output_token_ids for r in mates] == [o.token_ids for o in want]
