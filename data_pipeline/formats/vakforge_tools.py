"""Tools, tool calls and tool results of a vakforge conversation (seed 002, "tool_call / tool_result").

Calls and results have the OpenAI function-calling shape so the same records drive training and
serving; these checks keep the records to the turn orders serving can produce.

Decisions where the seed leaves room:
- "A call left hanging while the conversation carries on" means a spoken turn while a call is
  unanswered; between a call and its result only other tool turns may come (the message order
  OpenAI-style serving emits). Unanswered calls after the last spoken turn were "cut off
  mid-exchange" and are allowed, several parallel ones included.
- A result must follow its call; a call must name a tool of `tools[]`.
- Arguments are validated with format checking on ("format": "date" is enforced) and with an empty
  `$ref` registry: a manifest must not make validation fetch anything from the network.
- Messages name the schema rule and what the schema expects, never an argument value or a key the
  schema does not declare: either may be personal data (a key once held an e-mail address).
  Undeclared keys are written by position (`arguments{key 2}`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable

from jsonschema import Draft202012Validator, SchemaError
from jsonschema.exceptions import ValidationError as SchemaViolation
from jsonschema.validators import validator_for
from referencing import Registry
from referencing.exceptions import Unresolvable

from data_pipeline.formats.vakforge_schema import ToolCall, VakforgeConversation

# Schema violations of one call's arguments beyond this are counted, not listed.
MAX_ARGUMENT_ERRORS = 5

Report = Callable[[str, str], None]  # (field, message)


def check_tools(conv: VakforgeConversation, problem: Report) -> None:
    validators = _validators(conv, problem)
    issued: dict[str, int] = {}
    answered: dict[str, int] = {}
    pending: dict[str, int] = {}
    for i, turn in enumerate(conv.turns):
        if turn.tool_call is not None:
            call = turn.tool_call
            if call.id in issued:
                problem(
                    f"turns[{i}].tool_call.id",
                    f"{call.id!r} was already issued by turns[{issued[call.id]}]; call ids are unique in a conversation",
                )
            else:
                issued[call.id] = pending[call.id] = i
            _arguments(i, call, validators, problem)
        elif turn.tool_result is not None and turn.speaker == "tool":
            rid = turn.tool_result.id
            if rid in answered:
                problem(
                    f"turns[{i}].tool_result.id",
                    f"{rid!r} was already answered by turns[{answered[rid]}]; a call is answered at most once",
                )
            elif rid not in issued:
                later = next(
                    (j for j, t in enumerate(conv.turns) if t.tool_call is not None and t.tool_call.id == rid), None
                )
                hint = f"; its call comes later, at turns[{later}]: a result follows its call" if later is not None else ""
                problem(f"turns[{i}].tool_result.id", f"{rid!r} answers no earlier tool_call{hint}")
            else:
                answered[rid] = i
                pending.pop(rid, None)
        elif turn.speaker != "tool":  # spoken (a result on a spoken turn is reported with the turn)
            # Seed 002: a call left hanging while the conversation carries on never happens at serving.
            for cid, j in pending.items():
                problem(
                    f"turns[{j}].tool_call.id",
                    f"{cid!r} is unanswered when turns[{i}] continues the conversation; put its tool_result "
                    "before that turn (only calls after the last spoken turn may stay unanswered)",
                )
            pending.clear()


def _validators(conv: VakforgeConversation, problem: Report) -> dict[str, Draft202012Validator | None]:
    """Tool name -> validator of its arguments (None when its parameters are not a JSON Schema)."""
    found: dict[str, Draft202012Validator | None] = {}
    first: dict[str, int] = {}
    for k, tool in enumerate(conv.tools):
        if tool.name in first:
            problem(f"tools[{k}].name", f"duplicate of tools[{first[tool.name]}].name; tool names are unique")
            continue
        first[tool.name] = k
        cls = validator_for(tool.parameters, default=Draft202012Validator)
        try:
            cls.check_schema(tool.parameters)
        except SchemaError as err:
            where = _path(err.absolute_path).lstrip(".") or "top level"
            problem(f"tools[{k}].parameters", f"not a valid JSON Schema at {where}: {err.message[:200]}")
            found[tool.name] = None
            continue
        found[tool.name] = cls(tool.parameters, registry=Registry(), format_checker=cls.FORMAT_CHECKER)
    return found


def _arguments(i: int, call: ToolCall, validators: dict[str, Draft202012Validator | None], problem: Report) -> None:
    f = f"turns[{i}].tool_call"
    if call.name not in validators:
        problem(f"{f}.name", f"{call.name!r} is not a tool of this conversation; declare it in tools[]")
        return
    validator = validators[call.name]
    if validator is None:
        return  # its parameters are reported already
    try:
        errors = sorted(validator.iter_errors(call.arguments), key=lambda e: [str(p) for p in e.absolute_path])
    except Unresolvable:
        problem(f"{f}.arguments", "the tool's parameters use a $ref that does not resolve (remote refs are not fetched)")
        return
    except Exception as err:  # noqa: BLE001 — e.g. a pattern Python cannot compile: jsonschema raises many types
        problem(f"{f}.arguments", f"cannot be checked against the tool's parameters: {type(err).__name__}")
        return
    named = _declared_names(validator.schema)
    for err in errors[:MAX_ARGUMENT_ERRORS]:
        where = _instance_path(call.arguments, err.absolute_path, named)
        problem(f"{f}.arguments{where}", _schema_message(call.name, err))
    if len(errors) > MAX_ARGUMENT_ERRORS:
        problem(f"{f}.arguments", f"{len(errors) - MAX_ARGUMENT_ERRORS} more schema violations")


def _path(parts) -> str:
    return "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in parts)


def _declared_names(schema: object) -> frozenset[str]:
    """Every property name the tool's parameters declare (keys of any `properties`, `required` entries).

    Those names come from the tool declaration, so a message may print them; any other argument key
    is the caller's data (a user once put an e-mail address there) and is shown by position.
    """
    names: set[str] = set()
    pending = [schema]
    while pending:
        node = pending.pop()
        if isinstance(node, dict):
            for key, value in node.items():
                if key == "properties" and isinstance(value, dict):
                    names.update(k for k in value if isinstance(k, str))
                elif key == "required" and isinstance(value, list):
                    names.update(k for k in value if isinstance(k, str))
                pending.append(value)
        elif isinstance(node, list):
            pending.extend(node)
    return frozenset(names)


def _instance_path(arguments: object, parts, named: frozenset[str]) -> str:
    """The JSON path of a violation: declared names as written, other keys as `{key N}` (0-based
    position in their object as written, as the PII check writes them), list items by index; never
    an undeclared key itself."""
    out, node = [], arguments
    for part in parts:
        if isinstance(part, int):
            out.append(f"[{part}]")
        elif part in named:
            out.append(f".{part}")
        else:
            position = list(node).index(part) if isinstance(node, dict) and part in node else "?"
            out.append(f"{{key {position}}}")
        node = node[part] if isinstance(node, (dict, list)) else None
    return "".join(out)


def _schema_message(tool: str, err: SchemaViolation) -> str:
    """Which rule failed and what the schema expects; never an argument key or value.

    jsonschema's own messages quote the instance (`'alice@example.com' was unexpected`), so only
    `required` (whose names come from the schema) keeps its own wording.
    """
    if err.validator == "required":
        return f"{err.message} (tool {tool})"  # the name comes from the schema's `required` list
    if err.validator in ("additionalProperties", "unevaluatedProperties"):
        return f"has argument keys the tool's parameters do not allow{_extra_keys(err)}: {err.validator} (tool {tool})"
    expected = json.dumps(err.validator_value, ensure_ascii=False)
    if len(expected) > 100:
        expected = expected[:97] + "..."
    if "propertyNames" in err.absolute_schema_path:
        return f"an argument key does not satisfy propertyNames {err.validator!r}: {expected} (tool {tool})"
    return f"does not satisfy {err.validator!r}: {expected} (tool {tool})"


def _extra_keys(err: SchemaViolation) -> str:
    """` ({key 1}, {key 4})`: the keys `additionalProperties` refused, by position, as jsonschema finds them."""
    if err.validator != "additionalProperties" or not isinstance(err.instance, dict) or not isinstance(err.schema, dict):
        return ""
    declared = err.schema.get("properties", {})
    patterns = "|".join(err.schema.get("patternProperties", {}))
    extra = [f"{{key {i}}}" for i, key in enumerate(err.instance)
             if key not in declared and not (patterns and re.search(patterns, key))]
    return f" ({', '.join(extra)})" if extra else ""
