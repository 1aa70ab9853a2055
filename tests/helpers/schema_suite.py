"""A suite of JSON schemas of the shapes applications ask for (records, nested objects, arrays,
enums, anyOf unions, $ref definitions, patterns, ranges, nullable fields), each with a prompt
and a valid instance written in the order of its properties.

Free-form values are bounded as production schemas bound them (a pydantic `max_length`,
`max_items`, a price in cents' precision): strings have a maxLength, arrays a maxItems,
decimals a multipleOf. Without bounds a 135M model sampling at temperature 1 can run a
string or a number's digits on until max_tokens: the output is then cut short, not wrong,
but it is not valid JSON (benchmarks/structured_output.py --unbounded measures that).

Used by tests/structured_output/test_structured_output.py (the grammar accepts each instance, token by token;
the default model's sampled outputs validate) and benchmarks/structured_output.py.
"""

from __future__ import annotations

import copy
from decimal import Decimal

import jsonschema

S = {"type": "string", "maxLength": 40}
I = {"type": "integer"}  # noqa: E741
N = {"type": "number", "multipleOf": 0.01}
B = {"type": "boolean"}


def obj(properties: dict, required=None, **extra) -> dict:
    """A closed object: every property required unless told, no others."""
    return {
        "type": "object",
        "properties": properties,
        "required": list(properties if required is None else required),
        "additionalProperties": False,
        **extra,
    }


def arr(items: dict, **extra) -> dict:
    return {"type": "array", "items": items, **extra}


# (name, prompt, schema, a valid instance)
SCHEMAS: list[tuple[str, str, dict, object]] = [
    (
        "person",
        "Describe a fictional person.",
        obj({"name": S, "age": {"type": "integer", "minimum": 0, "maximum": 130}, "email": S}),
        {"name": "Ada", "age": 36, "email": "ada@example.com"},
    ),
    (
        "address",
        "Give a postal address in France.",
        obj({"street": S, "city": S, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}, "country": S}),
        {"street": "1 rue de la Paix", "city": "Paris", "zip": "75002", "country": "France"},
    ),
    (
        "product",
        "Describe a product for an online shop.",
        obj(
            {
                "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
                "title": S,
                "price": N,
                "in_stock": B,
                "tags": arr(S, maxItems=5),
            }
        ),
        {"sku": "ABC-1234", "title": "Kettle", "price": 24.5, "in_stock": True, "tags": ["kitchen", "steel"]},
    ),
    (
        "order",
        "Write an order with two line items.",
        obj(
            {
                "order_id": I,
                "items": arr(obj({"sku": S, "quantity": {"type": "integer", "minimum": 1}}), minItems=1, maxItems=4),
                "status": {"enum": ["pending", "paid", "shipped", "cancelled"]},
            }
        ),
        {"order_id": 1001, "items": [{"sku": "A1", "quantity": 2}, {"sku": "B2", "quantity": 1}], "status": "paid"},
    ),
    (
        "sentiment",
        "Classify the sentiment of: 'I loved this film!'",
        obj(
            {
                "label": {"enum": ["positive", "negative", "neutral"]},
                "confidence": {"type": "number", "minimum": 0, "maximum": 1, "multipleOf": 0.01},
            }
        ),
        {"label": "positive", "confidence": 0.97},
    ),
    (
        "weather_call",
        "Call the weather tool for Paris.",
        obj({"location": S, "unit": {"enum": ["celsius", "fahrenheit"]}}),
        {"location": "Paris", "unit": "celsius"},
    ),
    (
        "event",
        "Describe a calendar event.",
        obj(
            {
                "title": S,
                "date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"},
                "attendees": arr(S, maxItems=4),
                "all_day": B,
            }
        ),
        {"title": "Standup", "date": "2026-11-24", "attendees": ["Ann", "Bo"], "all_day": False},
    ),
    (
        "entities",
        "Extract the named entities from: 'Marie Curie worked in Paris.'",
        obj({"entities": arr(obj({"text": S, "type": {"enum": ["PERSON", "PLACE", "ORG"]}}), maxItems=5)}),
        {"entities": [{"text": "Marie Curie", "type": "PERSON"}, {"text": "Paris", "type": "PLACE"}]},
    ),
    (
        "recipe",
        "Give a short recipe.",
        obj(
            {
                "name": S,
                "servings": {"type": "integer", "minimum": 1, "maximum": 12},
                "ingredients": arr(obj({"item": S, "grams": I}), maxItems=5),
                "steps": arr(S, maxItems=4),
            }
        ),
        {"name": "Toast", "servings": 1, "ingredients": [{"item": "bread", "grams": 50}], "steps": ["Toast it."]},
    ),
    (
        "review",
        "Review a movie.",
        obj(
            {
                "movie": S,
                "rating": {"type": "integer", "minimum": 1, "maximum": 5},
                "summary": {"type": "string", "maxLength": 200},
            }
        ),
        {"movie": "Alien", "rating": 5, "summary": "Tense."},
    ),
    (
        "nullable",
        "Describe a user account; the phone number may be unknown.",
        obj({"username": S, "phone": {"anyOf": [S, {"type": "null"}]}, "verified": B}),
        {"username": "zed", "phone": None, "verified": True},
    ),
    (
        "union",
        "Describe a shape: a circle or a rectangle.",
        obj(
            {
                "shape": {
                    "anyOf": [
                        obj({"kind": {"const": "circle"}, "radius": N}),
                        obj({"kind": {"const": "rect"}, "width": N, "height": N}),
                    ]
                }
            }
        ),
        {"shape": {"kind": "rect", "width": 2, "height": 3.5}},
    ),
    (
        "defs",
        "Describe a company with a CEO and a CTO.",
        {
            "$defs": {"employee": obj({"name": S, "title": S})},
            **obj({"company": S, "ceo": {"$ref": "#/$defs/employee"}, "cto": {"$ref": "#/$defs/employee"}}),
        },
        {"company": "Acme", "ceo": {"name": "Jo", "title": "CEO"}, "cto": {"name": "Al", "title": "CTO"}},
    ),
    (
        "coordinates",
        "Give the coordinates of Paris.",
        obj(
            {
                "lat": {"type": "number", "minimum": -90, "maximum": 90, "multipleOf": 0.0001},
                "lon": {"type": "number", "minimum": -180, "maximum": 180, "multipleOf": 0.0001},
            }
        ),
        {"lat": 48.85, "lon": 2.35},
    ),
    (
        "color",
        "Pick a colour.",
        obj({"name": S, "hex": {"type": "string", "pattern": "^#[0-9a-f]{6}$"}}),
        {"name": "teal", "hex": "#008080"},
    ),
    (
        "optional",
        "Describe a book; the subtitle is optional.",
        obj({"title": S, "subtitle": S, "year": I}, required=["title", "year"]),
        {"title": "Dune", "year": 1965},
    ),
    (
        "matrix",
        "Give a 2x2 matrix of small integers.",
        obj(
            {
                "rows": arr(
                    arr({"type": "integer", "minimum": -9, "maximum": 9}, minItems=2, maxItems=2),
                    minItems=2,
                    maxItems=2,
                )
            }
        ),
        {"rows": [[1, 0], [0, 1]]},
    ),
    (
        "config",
        "Write a server configuration.",
        obj(
            {
                "host": S,
                "port": {"type": "integer", "minimum": 1, "maximum": 65535},
                "tls": obj({"enabled": B, "cert": S}),
                "workers": {"type": "integer", "minimum": 1, "maximum": 64},
            }
        ),
        {"host": "localhost", "port": 8000, "tls": {"enabled": False, "cert": ""}, "workers": 4},
    ),
    (
        "invoice",
        "Write an invoice with one line.",
        obj(
            {
                "number": S,
                "currency": {"enum": ["EUR", "USD", "GBP"]},
                "lines": arr(obj({"description": S, "amount": N}), minItems=1, maxItems=3),
                "paid": B,
            }
        ),
        {"number": "INV-7", "currency": "EUR", "lines": [{"description": "Work", "amount": 100}], "paid": False},
    ),
    (
        "tree",
        "Describe a small family tree.",  # three generations, through $defs
        {
            "$defs": {
                "child": obj({"name": S, "children": arr(obj({"name": S}), maxItems=3)}),
                "parent": obj({"name": S, "children": arr({"$ref": "#/$defs/child"}, maxItems=3)}),
            },
            "$ref": "#/$defs/parent",
        },
        {"name": "Ann", "children": [{"name": "Bo", "children": [{"name": "Cy"}]}]},
    ),
    (
        "answer",
        "What is 2 + 2? Answer with reasoning.",
        obj({"reasoning": {"type": "string", "maxLength": 200}, "answer": I}),
        {"reasoning": "Two and two make four.", "answer": 4},
    ),
    ("string_list", "List three fruits.", arr(S, minItems=3, maxItems=3), ["apple", "pear", "fig"]),
    (
        "flags",
        "Describe a feature toggle set.",
        obj(
            {
                "dark_mode": B,
                "beta": B,
                "max_items": {"type": "integer", "minimum": 0, "maximum": 100},
                "locale": {"enum": ["en", "fr", "de"]},
            }
        ),
        {"dark_mode": True, "beta": False, "max_items": 20, "locale": "fr"},
    ),
]


def _multiple_of(validator, step, instance, schema):
    """multipleOf in decimal arithmetic: jsonschema's float division calls 0.97 no multiple of 0.01."""
    if validator.is_type(instance, "number") and Decimal(str(instance)) % Decimal(str(step)) != 0:
        yield jsonschema.ValidationError(f"{instance} is not a multiple of {step}")


Validator = jsonschema.validators.extend(jsonschema.Draft202012Validator, {"multipleOf": _multiple_of})


def validate(instance, schema) -> None:
    """jsonschema's validation (Draft 2020-12) with exact decimal multipleOf; raises ValidationError."""
    Validator(schema).validate(instance)


def unbounded(schema):
    """`schema` without the bounds on free-form values (maxLength, multipleOf) that this suite
    adds, as applications often write them."""
    if isinstance(schema, dict):
        return {
            k: unbounded(v)
            for k, v in schema.items()
            if k not in ("maxLength", "multipleOf") or not isinstance(v, (int, float))
        }
    if isinstance(schema, list):
        return [unbounded(v) for v in schema]
    return copy.deepcopy(schema)
