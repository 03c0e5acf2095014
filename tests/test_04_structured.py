"""Structured outputs offline: ``SamplingParams(structured_outputs=StructuredOutputsParams(...))``.

The bundled tiny model was trained on Python source, and a random-weight model writes noise:
neither ever writes JSON unprompted (checked below), so an output that parses and validates
against its schema is the grammar's doing. Greedy and seeded sampling, several schemas in one
batch, n > 1, preemption and the compiled decode step; requests without a constraint must
come out exactly as they do in an engine that never saw a grammar.
"""

from __future__ import annotations

import json
import re
import shutil

import jsonschema
import pytest
import torch

from minivllm import LLM, SamplingParams
from minivllm.sampling import StructuredOutputsParams
from minivllm.structured import StructuredOutputManager, apply_token_bitmask

ENGINE = {"max_model_len": 512, "num_blocks": 64, "max_num_seqs": 16}

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "colors": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
        "address": {  # a nested object
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 10},
                           "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["city", "zip"], "additionalProperties": False},
    },
    "required": ["name", "age", "colors", "address"],
    "additionalProperties": False,
}
ORDER = {  # arrays of nested objects, numeric enums, booleans, an enum of mixed types
    "type": "object",
    "properties": {
        "items": {"type": "array", "minItems": 1, "maxItems": 3, "items": {
            "type": "object",
            "properties": {"sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"},
                           "qty": {"type": "integer", "minimum": 1, "maximum": 9},
                           "price": {"enum": [0.5, 9.99, 100]}},
            "required": ["sku", "qty", "price"], "additionalProperties": False}},
        "express": {"type": "boolean"},
        "status": {"enum": ["new", "paid", 3, None]},
    },
    "required": ["items", "express", "status"],
    "additionalProperties": False,
}
POINTS = {"type": "array", "minItems": 2, "maxItems": 4,
          "items": {"type": "array", "items": {"type": "integer", "minimum": -9, "maximum": 9},
                    "minItems": 2, "maxItems": 2}}
SCHEMAS = [PERSON, ORDER, POINTS]
PROMPTS = ["def parse(text):\n", "The weather today", "import os\n"]


@pytest.fixture(scope="module")
def llm(tiny_model) -> LLM:
    return LLM(str(tiny_model), compile=False, **ENGINE)


def _json(schema, **params) -> SamplingParams:
    return SamplingParams(max_tokens=160, structured_outputs=StructuredOutputsParams(json=schema),
                          **params)


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def test_unconstrained_output_is_never_json(llm):
    """The premise of every test here: without a grammar the model does not write JSON."""
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=60), use_tqdm=False)
    assert not any(_is_json(o.outputs[0].text) for o in outs)


def test_every_schema_output_parses_and_validates(llm):
    """Greedy and seeded sampling, three schemas (nested objects, enums, arrays of objects,
    patterns, bounds) batched together: each output is JSON that validates, ended by the
    grammar ("stop"), not cut by max_tokens."""
    params, schemas = [], []
    for schema in SCHEMAS:
        for kind in ({"temperature": 0}, {"temperature": 1.0, "seed": 7}):
            params.append(_json(schema, **kind))
            schemas.append(schema)
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(params))]
    outs = llm.generate(prompts, params, use_tqdm=False)
    for out, schema in zip(outs, schemas):
        c = out.outputs[0]
        assert c.finish_reason == "stop", (c.text, c.finish_reason)
        jsonschema.validate(json.loads(c.text), schema)


def test_n_completions_each_follow_the_grammar(llm):
    """n > 1: one matcher per completion (a shared one would be advanced n times a step)."""
    out = llm.generate(PROMPTS[0], _json(PERSON, n=3, temperature=1.0, seed=11), use_tqdm=False)[0]
    assert len(out.outputs) == 3
    for c in out.outputs:
        jsonschema.validate(json.loads(c.text), PERSON)
    assert len({c.text for c in out.outputs}) > 1, "the completions should differ"


def test_regex_choice_grammar_and_json_object(llm):
    regex = r"[0-9]{3}-[a-z]{2,4}( [A-Z][a-z]{1,6})?"
    cases = [
        (StructuredOutputsParams(regex=regex), lambda t: re.fullmatch(regex, t)),
        (StructuredOutputsParams(choice=["yes", "no", "don't know"]),
         lambda t: t in ("yes", "no", "don't know")),
        (StructuredOutputsParams(grammar='start: "(" num ("+" num)* ")"\nnum: /[1-9]/'),
         lambda t: re.fullmatch(r"\([1-9](\+[1-9])*\)", t)),
        (StructuredOutputsParams(grammar='root ::= "x" [0-9] [0-9]?'),  # llama.cpp's GBNF
         lambda t: re.fullmatch(r"x[0-9][0-9]?", t)),
    ]
    for prompt in PROMPTS:
        params = [SamplingParams(temperature=0, max_tokens=40, structured_outputs=so)
                  for so, _ in cases]
        for out, (so, ok) in zip(llm.generate([prompt] * len(cases), params, use_tqdm=False),
                                 cases):
            c = out.outputs[0]
            assert c.finish_reason == "stop" and ok(c.text), (so.kind, c.text)
    # json_object: any object; the bundled model nests it deep, so give it room and check it
    # is JSON whenever the grammar, not max_tokens, ended it
    so = StructuredOutputsParams(json_object=True)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=1.0, seed=5, max_tokens=120,
                                                structured_outputs=so), use_tqdm=False)
    finished = [o.outputs[0].text for o in outs if o.outputs[0].finish_reason == "stop"]
    assert finished, [o.outputs[0].text for o in outs]
    assert all(isinstance(json.loads(t), dict) for t in finished)
    for o in outs:  # truncated ones are a prefix of an object
        assert o.outputs[0].text.startswith("{")


@pytest.mark.parametrize("so, needle", [
    ({"json": {"type": "object", "properties": {"a": {"type": "bogus"}}}}, "bogus"),
    ({"json": "{not json"}, "not valid JSON"),
    ({"regex": "a(b"}, "unclosed group"),
    ({"grammar": "start: undefined_rule"}, "undefined_rule"),
])
def test_invalid_constraint_is_a_value_error_that_says_why(llm, so, needle):
    engine = llm.engine
    with pytest.raises(ValueError, match=re.escape(needle)):
        llm.generate("x", SamplingParams(structured_outputs=StructuredOutputsParams(**so)))
    assert not engine.requests and not engine.scheduler.has_unfinished()


def test_params_are_checked():
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams(regex="a", choice=["a"])
    with pytest.raises(ValueError, match="non-empty list"):
        StructuredOutputsParams(choice=[])
    with pytest.raises(ValueError, match="StructuredOutputsParams"):
        SamplingParams(structured_outputs={"json": {}})


def test_unconstrained_rows_are_untouched_and_skip_the_mask(llm, monkeypatch):
    """A mixed batch: the unconstrained requests' tokens equal those of a batch without any
    grammar, and the mask is computed for the constrained rows only. A batch with no grammar
    left does no bitmask work at all (the fast path)."""
    plain = SamplingParams(temperature=0, max_tokens=24)
    alone = llm.generate(PROMPTS, plain, use_tqdm=False)
    rows_masked = []
    bitmask = StructuredOutputManager.bitmask
    monkeypatch.setattr(StructuredOutputManager, "bitmask",
                        lambda self, ids: rows_masked.append(len(ids)) or bitmask(self, ids))
    mixed = llm.generate(PROMPTS + [PROMPTS[0]], [plain] * 3 + [_json(POINTS, temperature=0)],
                         use_tqdm=False)
    assert [o.outputs[0].token_ids for o in mixed[:3]] == [o.outputs[0].token_ids for o in alone]
    jsonschema.validate(json.loads(mixed[3].outputs[0].text), POINTS)
    assert rows_masked and set(rows_masked) == {1}
    rows_masked.clear()
    llm.generate(PROMPTS, plain, use_tqdm=False)
    assert rows_masked == [] and not llm.engine.structured  # no matcher left behind


def test_preemption_keeps_each_matcher(tiny_model, llm):
    """Preemption by recompute keeps the output tokens, so the matcher is kept as it is: with
    a pool too small for the batch, outputs equal the unpreempted ones and still validate."""
    schemas = [PERSON, POINTS, PERSON, POINTS]
    params = [_json(s, temperature=0) for s in schemas]
    prompts = PROMPTS + ["x = "]
    roomy = llm.generate(prompts, params, use_tqdm=False)
    tight = LLM(str(tiny_model), compile=False, max_model_len=80, num_blocks=10,
                block_size=8, max_num_seqs=4)
    outs = tight.generate(prompts, params, use_tqdm=False)
    assert tight.engine.stats.num_preemptions > 0
    assert [o.outputs[0].text for o in outs] == [o.outputs[0].text for o in roomy]
    for out, schema in zip(outs, schemas):
        jsonschema.validate(json.loads(out.outputs[0].text), schema)


@pytest.mark.slow  # compiling the decode step takes most of its time
def test_compiled_decode_applies_the_mask(tiny_model, llm):
    """The compiled decode step returns logits; the mask goes on them before sampling, so the
    compiled engine writes the same constrained tokens as the eager one."""
    compiled = LLM(str(tiny_model), compile=True, compile_in_background=False, **ENGINE)
    assert compiled.engine.runner.decoder is not None
    params = [_json(PERSON, temperature=0), _json(ORDER, temperature=0.8, seed=3),
              SamplingParams(temperature=0, max_tokens=30)]
    got = compiled.generate(PROMPTS, params, use_tqdm=False)
    want = llm.generate(PROMPTS, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    jsonschema.validate(json.loads(got[0].outputs[0].text), PERSON)
    jsonschema.validate(json.loads(got[1].outputs[0].text), ORDER)


def test_apply_token_bitmask_by_hand():
    """Bit b of word w allows token 32 w + b; rows not listed are left alone; logits wider
    than the mask (a padded vocabulary) are banned past its end."""
    logits = torch.zeros(3, 70)
    bitmask = torch.zeros(2, 2, dtype=torch.int32)
    bitmask[0, 0] = 1 << 5
    bitmask[0, 1] = -2**31  # bit 31 of word 1: token 63 (the sign bit)
    bitmask[1, 1] = 1
    apply_token_bitmask(logits, bitmask, [0, 2])
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == [5, 63]
    assert torch.isfinite(logits[1]).all()
    assert torch.isfinite(logits[2]).nonzero().flatten().tolist() == [32]


@pytest.fixture(scope="module")
def random_tiny(tiny_model, tmp_path_factory):
    """Random weights in the bundled model's shape (vocabulary 4032), with its tokenizer."""
    from checkpoints import TINY_COMMON, build_checkpoint

    out = tmp_path_factory.mktemp("random-tiny")
    build_checkpoint(out, "qwen2", {**TINY_COMMON, "vocab_size": 4032, "eos_token_id": 4002},
                     seed=19, std=0.15)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copyfile(tiny_model / name, out / name)
    return out


def test_random_weights_follow_the_schema(random_tiny):
    """Random weights write noise unconstrained and valid JSON under the grammar."""
    llm = LLM(str(random_tiny), compile=False, max_model_len=256, num_blocks=48)
    noise = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=40), use_tqdm=False)
    assert not any(_is_json(o.outputs[0].text) for o in noise)
    params = [_json(s, temperature=t, seed=1) for s in (PERSON, POINTS) for t in (0, 1.0)]
    outs = llm.generate(PROMPTS[:1] * len(params), params, use_tqdm=False)
    for out, schema in zip(outs, [PERSON, PERSON, POINTS, POINTS]):
        c = out.outputs[0]
        assert c.finish_reason == "stop", c.text
        jsonschema.validate(json.loads(c.text), schema)


def test_grammar_decoding_leaves_dynamo_unimported(tiny_model):
    """Guards a race: llguidance.torch imports torch._dynamo, and importing it on the engine
    thread while the compile thread imports it too gives a half-initialised module and an
    ImportError. A fresh interpreter decodes under a JSON schema with the compile off and
    must not have imported torch._dynamo."""
    import subprocess
    import sys

    code = (
        "import json, sys\n"
        "from minivllm import LLM, SamplingParams\n"
        "from minivllm.sampling import StructuredOutputsParams\n"
        f"llm = LLM({str(tiny_model)!r}, compile=False, max_model_len=256, num_blocks=32)\n"
        f"so = StructuredOutputsParams(json={json.dumps(POINTS)!r})\n"
        "out = llm.generate('x', SamplingParams(temperature=0, max_tokens=60, "
        "structured_outputs=so), use_tqdm=False)\n"
        "json.loads(out[0].outputs[0].text)\n"
        "assert 'torch._dynamo' not in sys.modules, 'grammar decoding imported torch._dynamo'\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
