"""The grammars the structured-output benchmarks compile: JSON schemas and regexes, engine-neutral (plain data).

The nested schema has the features the worker tests cover (server/tests/test_grammar.py): nested objects,
arrays, enums, integer ranges and string lengths.
"""

from __future__ import annotations

# Free text in every value: each step's mask is computed over the whole vocabulary.
FREE_TEXT_SCHEMA = {"type": "object", "properties": {"summary": {"type": "string"}, "notes": {"type": "string"}},
                    "required": ["summary", "notes"], "additionalProperties": False}

# An extraction record: long fixed keys (forced tokens), short values the model chooses.
EXTRACTION_SCHEMA = {
    "type": "object",
    "properties": {
        "customer_full_name": {"type": "string", "maxLength": 12},
        "customer_email_address": {"type": "string", "maxLength": 12},
        "shipping_address_city": {"type": "string", "maxLength": 10},
        "shipping_address_country_code": {"enum": ["US", "FR", "DE", "JP"]},
        "order_total_amount_cents": {"type": "integer", "minimum": 0, "maximum": 99999},
        "is_priority_customer": {"type": "boolean"},
        "requested_delivery_window": {"enum": ["morning", "afternoon", "evening"]},
    },
    "required": ["customer_full_name", "customer_email_address", "shipping_address_city",
                 "shipping_address_country_code", "order_total_amount_cents", "is_priority_customer",
                 "requested_delivery_window"],
    "additionalProperties": False,
}

NESTED_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 5},
                           "zip": {"type": "integer", "minimum": 10000, "maximum": 99999}},
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
        "tags": {"type": "array", "items": {"enum": ["a", "bb", "ccc"]}, "minItems": 1, "maxItems": 3},
    },
    "required": ["name", "age", "role", "address", "tags"],
    "additionalProperties": False,
}

JSON_SCHEMAS = {
    "nested schema (objects, arrays, enums, ranges, lengths)": NESTED_SCHEMA,
    "free-text schema": FREE_TEXT_SCHEMA,
    "extraction schema": EXTRACTION_SCHEMA,
    "any JSON object": {"type": "object"},
}

REGEXES = {
    "regex (code)": r"[a-c]{2,4}-[0-9]{1,3}( [xyz]+)?",
    "regex (letters)": "[a-f ]{3,12}",
    "regex (date)": r"\d{4}-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])",
}
