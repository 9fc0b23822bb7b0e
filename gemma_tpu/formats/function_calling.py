"""The FunctionGemma tool-call format: writing declarations, calls and responses, and reading calls back.

A call looks like `<start_function_call>call:NAME{key:<escape>text<escape>,n:5,ok:true}
<end_function_call>`: strings between `<escape>` markers (so they may hold commas and braces),
numbers / booleans / null bare, objects `{...}` and lists `[...]` nested. Models trained on a plain
Gemma 3 vocabulary write the markers as `<unusedN>` tokens, so text is first mapped back with
the checkpoint's token map. Servers that drop special tokens from `content` leave
`call:NAME{key:text}`; that still parses (bare words become strings), so an OpenAI-compatible
endpoint can be scored by the same rules.

`gemma_tpu.data.render` assembles the declarations, calls and responses written here into Gemma
turns. Also here: the marker -> `<unusedN>` token map, and the chat template that renders tools
exactly like the renderer, for serving a fine-tuned model with `transformers serve` (tools in the
request become declarations).
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import unicodedata
from typing import Any, Container

from gemma_tpu.core.errors import UserError, shown

FUNCTION_MARKERS = (
    "<start_function_declaration>", "<end_function_declaration>", "<start_function_call>",
    "<end_function_call>", "<start_function_response>", "<end_function_response>", "<escape>",
)


(START_DECLARATION, END_DECLARATION, START_CALL, END_CALL, START_RESPONSE, END_RESPONSE,
 ESCAPE) = FUNCTION_MARKERS


def _reserved(n: int) -> str:
    return f"<unused{n}>"


def is_reserved(text: str) -> bool:
    """Whether `text` spells one of the vocabulary's reserved tokens (`<unusedN>`)."""
    return re.fullmatch(r"<unused\d+>", text) is not None


def function_token_map(tokenizer) -> dict[str, str]:
    """Map FunctionGemma markers the vocabulary lacks onto reserved `<unusedN>` tokens, in order.

    FunctionGemma's tokenizer has the markers as real tokens (empty map); the plain Gemma 3
    vocabulary does not, so `<start_function_declaration>` -> `<unused0>` ... `<escape>` -> `<unused6>`.
    The map is recorded in the checkpoint metadata and in the merged tokenizer files.
    """
    return vocab_token_map(tokenizer.get_vocab())


def vocab_token_map(vocab: Container[str]) -> dict[str, str]:
    """`function_token_map` of a vocabulary given as its token strings (a tokenizer.json read as JSON)."""
    mapping, n = {}, 0
    for marker in FUNCTION_MARKERS:
        if marker in vocab:
            continue
        while _reserved(n) not in vocab:
            n += 1
            if n > 10_000:
                return {}
        mapping[marker] = _reserved(n)
        n += 1
    return mapping


def plain_gemma_token_map() -> dict[str, str]:
    """The map `function_token_map` gives a vocabulary that has none of the markers and every
    reserved token from `<unused0>` on (plain Gemma 3): for reading text that still carries them
    when the model's own map is not at hand (an OpenAI-compatible endpoint)."""
    return {marker: _reserved(i) for i, marker in enumerate(FUNCTION_MARKERS)}


# ------------------------------------------------------------------------------- rendering


def format_value(v: Any) -> str:
    """FunctionGemma argument values: strings escaped, numbers/booleans bare, containers recursive."""
    if isinstance(v, str):
        return f"{ESCAPE}{v}{ESCAPE}"
    if isinstance(v, bool):
        return "true" if v else "false"
    if v is None:
        return "null"
    if isinstance(v, (int, float)):
        return json.dumps(v)
    if isinstance(v, dict):
        return "{" + ",".join(f"{k}:{format_value(x)}" for k, x in v.items()) + "}"
    if isinstance(v, list):
        return "[" + ",".join(format_value(x) for x in v) + "]"
    return f"{ESCAPE}{v}{ESCAPE}"


# a key the call text carries bare: the parser reads a key up to ':' and stops at these characters
_BARE_KEY = re.compile(r'[^:{}\[\],"<\s](?:[^:{}\[\],"<]*[^:{}\[\],"<\s])?')


def check_call_arguments(value: Any, path: str = "arguments") -> None:
    """Refuse what FunctionGemma's call text cannot carry, so that a trained call parses back to the call
    in the data: a key with ':', braces, brackets, ',', '"', '<' or edge spaces, a string with `<escape>`."""
    if isinstance(value, dict):
        for k, v in value.items():
            if not _BARE_KEY.fullmatch(str(k)):
                raise UserError(f"{path}: key {shown(str(k))} cannot be written in a FunctionGemma call (no ':', "
                                f"'{{', '}}', '[', ']', ',', '\"', '<' or leading/trailing spaces in keys)")
            check_call_arguments(v, f"{path}.{k}")
    elif isinstance(value, list):
        for i, v in enumerate(value):
            check_call_arguments(v, f"{path}[{i}]")
    elif isinstance(value, str) and ESCAPE in value:
        raise UserError(f"{path}: the value {value[:80]!r} contains {ESCAPE}, FunctionGemma's string delimiter")
    elif isinstance(value, float) and not math.isfinite(value):  # `1e999` in a model's call: sent on as tool_calls
        # arguments `Infinity`/`NaN`, which no JSON reader but Python's takes (an OpenAI client's JSON.parse fails)
        raise UserError(f"{path}: {value!r} is not a number JSON can carry (1e999 and the like)")


def check_tool_name(name: str, what: str) -> None:
    """Refuse a tool name the call text cannot carry: the parser reads a name up to the brace and takes it only as a
    declaration could give it (`TOOL_NAME`), so `call:get steps{...}` or `call:get{x}{...}` trained a call that
    parses back to another name, or not at all."""
    if not TOOL_NAME.fullmatch(name):
        raise UserError(f"{what}: tool name {shown(name)} cannot be written in a FunctionGemma call (1 to 64 ASCII "
                        f"letters, digits, '_', '.' and '-' only, not starting with '.' or '-')")


# A declared tool's name: OpenAI's rule (1 to 64 ASCII letters, digits, '_' or '-') with Gemini's '.', not leading
# with '.' or '-'. The one rule of a name: a declaration's, a call's in data or a request, and a call the parser reads.
TOOL_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-]{0,63}")


class DeclarationError(UserError):
    """A tool declaration refused: `path` names the field (`tools[1].function.parameters.required`), `detail` why."""

    def __init__(self, path: str, detail: str):
        super().__init__(f"{path}: {detail}")
        self.path, self.detail = path, detail


def _json_kind(v: Any) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean", type(None): "null",
            int: "a number", float: "a number"}.get(type(v), type(v).__name__)


def check_tools(tools: Any, bare: bool = False) -> list[str]:
    """The names `tools` declares, after refusing what OpenAI refuses in a request's tools (400) and the renderer
    would have written into a prompt as a declaration that declares nothing, or one its calls cannot name. The one
    check of a declaration for both the local server's requests and training rows (which the server then serves),
    so a row the server would refuse does not train. `bare`: a tool may also be the function object alone (training
    rows, OpenAI's legacy `functions`). Raises `DeclarationError`."""
    if not isinstance(tools, list):
        raise DeclarationError("tools", f"expected a list of tool declarations, got {_json_kind(tools)}")
    names: list[str] = []
    for k, t in enumerate(tools):
        where = f"tools[{k}]"
        if isinstance(t, dict) and t.get("type", "function") != "function":  # a built-in tool of another API
            # (`code_interpreter`, `file_search`, `web_search`): it was read as a bare function, "None is not a name"
            raise DeclarationError(f"{where}.type", f"{json.dumps(t['type'])[:40]} is not supported (only "
                                                    f"\"function\" tools)")
        wrapped = isinstance(t, dict) and "function" in t
        if not isinstance(t, dict) or not (isinstance(t.get("function"), dict) or (bare and not wrapped)):
            raise DeclarationError(where, f'expected {{"type": "function", "function": {{"name": ...}}}}, got '
                                          f"{json.dumps(t, ensure_ascii=False)[:80]}")
        fn, fw = (t["function"], f"{where}.function") if wrapped else (t, where)
        name = fn.get("name")
        if name is None:  # was "None is not a tool name", Python's word for a key left out (or JSON's null)
            has = "it is null" if "name" in fn else f"it has {', '.join(map(str, fn)) or 'no keys'}"
            raise DeclarationError(f"{fw}.name", f"missing: a declaration needs its function's name ({has})")
        if not isinstance(name, str) or not TOOL_NAME.fullmatch(name):
            raise DeclarationError(f"{fw}.name", f"{shown(name)} is not a tool name (1 to 64 letters, digits, '_', "
                                                 f"'.' or '-', not starting with '.' or '-')")
        if name in names:  # both declarations were rendered; which one a call meant is anyone's guess
            raise DeclarationError(f"{fw}.name", f"{name!r} is declared twice (also tools[{names.index(name)}])")
        if fn.get("description") is not None and not isinstance(fn["description"], str):
            raise DeclarationError(f"{fw}.description", f"expected a string, got {_json_kind(fn['description'])}")
        if fn.get("strict") is not None and not isinstance(fn["strict"], bool):  # "yes" was taken as set
            raise DeclarationError(f"{fw}.strict", f"expected true or false, got {json.dumps(fn['strict'])[:40]}")
        params = fn.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise DeclarationError(f"{fw}.parameters", f"expected a JSON Schema object, got "
                                                       f"{json.dumps(params, ensure_ascii=False)[:80]}")
        if params:
            _check_schema(params, f"{fw}.parameters")
        names.append(name)
    return names


def _check_schema(params: dict, where: str) -> None:
    """The parameters schema an object's (the arguments are a JSON object), its `properties` an object of schemas
    (objects, or JSON Schema's true/false) and its `required` a list of names, as OpenAI's schema check demands:
    `"properties": "x"` was rendered into the prompt, where the model read a declaration that declares nothing.
    Property names, nested objects' too, must be keys a FunctionGemma call can carry (`check_call_arguments`), and
    `required` names declared properties, once each: a `time:zone` parameter was declared, and no call could pass it
    (the call text parses back as another key); a required parameter the schema does not declare is a typo that told
    the model to pass what it is told nothing of."""
    if params.get("type", "object") != "object":
        raise DeclarationError(f"{where}.type", f"the parameters schema must have type \"object\", got "
                                                f"{json.dumps(params['type'])}")
    stack = [(params, where)]
    while stack:  # without recursion: a schema nested as deeply as the JSON reader allows
        schema, at = stack.pop()
        props = schema.get("properties")
        if props is not None:
            if not isinstance(props, dict):
                raise DeclarationError(f"{at}.properties", f"expected an object of property schemas, got "
                                                            f"{_json_kind(props)}")
            for name, sub in props.items():
                if not _BARE_KEY.fullmatch(str(name)):
                    raise DeclarationError(f"{at}.properties", f"property name {shown(str(name))} cannot be written in "
                                                                f"a FunctionGemma call (no ':', '{{', '}}', '[', ']', "
                                                                f"',', '\"', '<' or leading/trailing spaces), so no "
                                                                f"call could pass it")
                if not isinstance(sub, (dict, bool)):
                    raise DeclarationError(f"{at}.properties.{name}", f"expected a JSON Schema object, got "
                                                                       f"{_json_kind(sub)}")
                if isinstance(sub, dict):
                    stack.append((sub, f"{at}.properties.{name}"))
        required = schema.get("required")
        if required is not None and not isinstance(required, list):
            raise DeclarationError(f"{at}.required", f"expected a list of property names, got {_json_kind(required)}")
        for k, name in enumerate(required or []):
            if not isinstance(name, str):
                raise DeclarationError(f"{at}.required[{k}]", f"expected a property name, got {_json_kind(name)}")
            if name in required[:k]:
                raise DeclarationError(f"{at}.required[{k}]", f"{shown(name)} is listed twice")
            # (unless the schema lets other properties in by name: additionalProperties or patternProperties)
            if isinstance(props, dict) and name not in props and not schema.get("additionalProperties") \
                    and not schema.get("patternProperties"):
                raise DeclarationError(f"{at}.required[{k}]", f"{shown(name)} is not a declared property (properties: "
                                                               f"{', '.join(map(str, props)) or 'none'})")
        items = schema.get("items")  # an array's items, and each alternative of a union, may be objects in turn
        if isinstance(items, dict):
            stack.append((items, f"{at}.items"))
        stack += [(s, f"{at}.items[{i}]") for i, s in enumerate(items if isinstance(items, list) else [])
                  if isinstance(s, dict)]
        for key in ("anyOf", "oneOf", "allOf"):
            alts = schema.get(key)
            stack += [(s, f"{at}.{key}[{i}]") for i, s in enumerate(alts if isinstance(alts, list) else [])
                      if isinstance(s, dict)]
        for key in ("$defs", "definitions"):  # pydantic's nested models, reached through $ref: their property names
            defs = schema.get(key)  # were not checked, and a call could not pass them either
            stack += [(s, f"{at}.{key}.{name}") for name, s in (defs.items() if isinstance(defs, dict) else [])
                      if isinstance(s, dict)]


_JSON_TYPES = {"string": (str,), "integer": (int,), "number": (int, float), "boolean": (bool,), "array": (list,),
               "object": (dict,), "null": (type(None),)}


def _json_type_matches(value: Any, declared: str) -> bool:
    kinds = _JSON_TYPES.get(declared)
    if kinds is None:
        return True  # a type this check does not know: not refused
    if isinstance(value, bool):
        return declared == "boolean"
    if declared == "integer" and isinstance(value, float):
        return value.is_integer()  # JSON's 3.0 is the integer 3
    return isinstance(value, kinds)


def _json_text(value: Any) -> str:
    text = json.dumps(value, ensure_ascii=False, default=str)
    return text if len(text) <= 80 else text[:76] + " ..."


def _same_json(a: Any, b: Any) -> bool:
    """JSON equality: 1 and 1.0 are one number, true is not 1."""
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b
    return a == b


ARGUMENTS_SCHEMA_DEPTH = 32  # levels of nested objects and arrays `arguments_problem` walks; deeper is not checked


def arguments_problem(parameters: Any, args: dict) -> str | None:
    """What is wrong with a call's `args` for the declared `parameters` schema, or None. An object is checked only
    where its schema declares `properties` (non-empty) and does not let others in (additionalProperties true or a
    schema, patternProperties): an argument it does not declare, a `required` one missing, a value whose JSON type
    contradicts the declared `type`, one outside an `enum` or other than a `const`. The same at every depth (to
    ARGUMENTS_SCHEMA_DEPTH): an object argument's `properties`, an array's `items` (one schema for all, or a list by
    position), the problem naming its path (`'sets[2].reps'`); only the top level was checked, so a row calling with
    `{"sets": [{"rep": 5}]}` for a declared `reps` trained. A null value is an argument not given (as the fitness
    tools and evaluate's arguments_match read it): not type-checked. Unions: a value must pass some branch of an
    anyOf/oneOf and every branch of an allOf (`_union_problem`); a local `$ref` (`#/$defs/Loc`) is checked as the
    schema it names (`_Schemas`)."""
    if not isinstance(parameters, dict):
        return None
    return _object_problem(parameters, args, "", 0, _Schemas(parameters))


@dataclasses.dataclass
class _Schemas:
    """What `arguments_problem` reads `$ref`s against: the parameters schema (`#/$defs/Unit`, as pydantic writes
    nested models and enums), and how many more schema checks one call's arguments may take (`budget`; a schema whose
    unions refer to each other could take exponentially many; past it, the rest is not checked)."""

    root: dict
    budget: int = 10_000

    def resolve(self, ref: Any) -> dict | None:
        """The schema a local JSON pointer `ref` (`#`, `#/$defs/Loc`) names, or None (another document, a typo)."""
        if not isinstance(ref, str) or not ref.startswith("#"):
            return None
        node: Any = self.root
        for part in ref[1:].split("/")[1:]:
            part = part.replace("~1", "/").replace("~0", "~")
            if isinstance(node, dict) and part in node:
                node = node[part]
            elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
                node = node[int(part)]
            else:
                return None
        return node if isinstance(node, dict) else None


def _object_problem(schema: dict, obj: dict, at: str, depth: int, ctx: _Schemas) -> str | None:
    """`arguments_problem` of the object `obj` at path `at` ('' for the arguments themselves)."""
    props = schema.get("properties")
    if not isinstance(props, dict) or not props:
        return None
    extra_allowed = schema.get("additionalProperties") is True or isinstance(
        schema.get("additionalProperties"), dict) or bool(schema.get("patternProperties"))
    what, names = ("parameter", "parameters") if not at else ("property", "properties"), ", ".join(map(str, props))
    for key in obj:
        if key not in props and not extra_allowed:
            return f"{shown(at + str(key))} is not a declared {what[0]} ({what[1]}: {names})"
    required = schema.get("required")
    for key in required if isinstance(required, list) else []:
        if key not in obj:
            return f"the required {what[0]} {shown(at + str(key))} is missing"
    for key, value in obj.items():
        sub = props.get(key)
        if isinstance(sub, dict):
            problem = _value_problem(sub, value, at + str(key), depth, ctx)
            if problem:
                return problem
    return None


def _value_problem(sub: dict, value: Any, at: str, depth: int, ctx: _Schemas) -> str | None:
    """The problem of one argument `value` (path `at`) with its schema `sub`: its type, its enum, then inside it."""
    if value is None or ctx.budget <= 0:
        return None
    ctx.budget -= 1
    declared = sub.get("type")
    types = [declared] if isinstance(declared, str) else declared if isinstance(declared, list) else []
    if types and not any(_json_type_matches(value, t) for t in types if isinstance(t, str)):
        return (f"{shown(at)} is declared {' or '.join(map(str, types))}, got {_json_kind(value)} "
                f"{_json_text(value)}")
    enum = sub.get("enum")
    if isinstance(enum, list) and not any(_same_json(value, e) for e in enum):
        return f"{shown(at)} is {_json_text(value)}, not one of its enum ({', '.join(map(_json_text, enum))[:200]})"
    if "const" in sub and not _same_json(value, sub["const"]):  # pydantic's Literal["x"], a discriminator's tag
        return f"{shown(at)} is {_json_text(value)}, not its const {_json_text(sub['const'])}"
    if depth >= ARGUMENTS_SCHEMA_DEPTH:
        return None
    target = ctx.resolve(sub.get("$ref")) if "$ref" in sub else None
    problem = _value_problem(target, value, at, depth + 1, ctx) if target is not None else None
    problem = problem or _union_problem(sub, value, at, depth, ctx)
    if problem:
        return problem
    if isinstance(value, dict):
        return _object_problem(sub, value, f"{at}.", depth + 1, ctx)
    if isinstance(value, list):
        items = sub.get("items")
        for k, v in enumerate(value):
            item = items if isinstance(items, dict) else items[k] if isinstance(items, list) and k < len(
                items) else None
            problem = _value_problem(item, v, f"{at}[{k}]", depth + 1, ctx) if isinstance(item, dict) else None
            if problem:
                return problem
    return None


def _union_problem(sub: dict, value: Any, at: str, depth: int, ctx: _Schemas) -> str | None:
    """The problem of `value` with the unions of its schema `sub`: some branch of an anyOf or oneOf must take it
    (oneOf is read as anyOf: which one branch a value matches is the tool's concern), every branch of an allOf.
    Pydantic writes `Optional[int]`, `Union[A, B]` and nested models so; they were not checked, so a row calling
    `{"unit": "kelvin"}` for `anyOf: [{enum: [c, f]}, {type: null}]` trained. A branch this check cannot read (a
    `$ref` to another document, `true`) takes any value."""
    for key in ("anyOf", "oneOf"):
        alts = sub.get(key)
        if not isinstance(alts, list) or not alts or not all(isinstance(a, dict) for a in alts):
            continue
        problems = [_value_problem(a, value, at, depth + 1, ctx) for a in alts]
        if all(problems):
            if len(alts) == 1:
                return problems[0]
            return f"{shown(at)} matches none of the {len(alts)} schemas of its {key} (the first: {problems[0]})"
    alts = sub.get("allOf")
    for a in alts if isinstance(alts, list) else []:
        problem = _value_problem(a, value, at, depth + 1, ctx) if isinstance(a, dict) else None
        if problem:
            return problem
    return None


def format_call(name: str, args: dict) -> str:
    check_tool_name(name, "call")
    check_call_arguments(args, f"call {shown(name)} arguments")
    return f"{START_CALL}call:{name}{format_value(args)}{END_CALL}"


def format_declaration(tool: dict) -> str:
    fn = tool.get("function", tool)
    check_tool_name(fn["name"], "declaration")
    body = {"description": "" if fn.get("description") is None else fn["description"]}  # null: none given
    if fn.get("parameters"):
        body["parameters"] = fn["parameters"]
    return f"{START_DECLARATION}declaration:{fn['name']}{format_value(body)}{END_DECLARATION}"


# Tool results longer than this (characters) are not read as JSON, here or by the chat template: the template reads
# JSON one character at a time (~45 us a character in transformers' Jinja on a 2-core EPYC, 2026-11-26), so the bound
# keeps a request holding a huge result from tying up the server's renderer (8,192 characters: ~0.4 s at most).
JSON_RESULT_LIMIT = 8192
# ... and nesting deeper than this is not JSON either (Python's reader would hit its recursion limit somewhere
# past ~900 levels, at a depth that depends on the caller; the template's reader has none)
JSON_RESULT_MAX_DEPTH = 64
# ... and an integer of more digits than this is not a number either: Python's default bound on converting text to int
# (`sys.get_int_max_str_digits`), past which json.loads raised a ValueError traceback out of the renderer
JSON_INT_MAX_DIGITS = 4300
LONE_SURROGATE = re.compile("[\ud800-\udfff]")  # what json.loads leaves of an unpaired \\uD800..\\uDFFF escape


def find_lone_surrogate(value: Any, path: str = "") -> tuple[str, re.Match] | None:
    """The first string of a parsed JSON value holding a lone UTF-16 surrogate, as (its path: `a.b[2]`, or
    `key 'k'` for a top-level key, `path` before it; the match), or None. No tokenizer encodes one. Walked without
    recursion: a value nested as deeply as json.loads allows does not overflow the stack here."""
    stack = [(value, path)]
    while stack:
        v, at = stack.pop()
        if isinstance(v, str):
            m = LONE_SURROGATE.search(v)
            if m:
                return at, m
        elif isinstance(v, dict):
            for k, x in reversed(list(v.items())):
                stack.append((x, f"{at}.{k}" if at else str(k)))
                stack.append((k, f"{at}.{k}" if at else f"key {k!r}"))
        elif isinstance(v, list):
            stack.extend((x, f"{at}[{i}]") for i, x in reversed(list(enumerate(v))))
    return None


def json_depth(value: Any) -> int:
    """How deeply objects and arrays nest in a JSON value (a scalar: 0)."""
    if isinstance(value, dict):
        return 1 + max(map(json_depth, value.values()), default=0)
    if isinstance(value, list):
        return 1 + max(map(json_depth, value), default=0)
    return 0


def _json_int(text: str) -> int:
    if len(text.lstrip("-")) > JSON_INT_MAX_DIGITS:
        raise ValueError(f"an integer of more than {JSON_INT_MAX_DIGITS} digits")
    return int(text)


def format_response(name: str, content: str) -> str:
    """A tool result: a JSON object renders field by field, anything else as `{result:...}` (a JSON value
    read as such; a text that is not JSON, or one over JSON_RESULT_LIMIT characters, as a string)."""
    try:
        if isinstance(content, str) and len(content) > JSON_RESULT_LIMIT:
            raise TypeError("too long to be read as JSON (as the chat template reads it)")
        value = json.loads(content, parse_int=_json_int)
        if json_depth(value) > JSON_RESULT_MAX_DEPTH:
            raise TypeError("nested too deeply to be read as JSON (as the chat template reads it)")
        if LONE_SURROGATE.search(json.dumps(value, ensure_ascii=False)):
            raise TypeError("escapes a lone UTF-16 surrogate, which no tokenizer encodes: kept as the text")
    except (ValueError, TypeError, RecursionError):
        value = {"result": content}
    if not isinstance(value, dict):
        value = {"result": value}
    return f"{START_RESPONSE}response:{name}{format_value(value)}{END_RESPONSE}"


# --------------------------------------------------------------------------------- parsing

_NUMBER = re.compile(r"-?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?")
_NAME = re.compile(r"[\w.\-]+")  # what a call's name is read as, up to its brace; a call of it must be a TOOL_NAME
# Text that looks like an attempt at a call even without the start marker.
# A word after `call:` is a call's name only when a brace (or the end of the text: a call cut short) follows it:
# "Give me a call:tomorrow works" is an answer, not a malformed call.
_QUOTES = frozenset("`\"'\u2018\u201c")  # before a bare call: a quote of the syntax in prose, not a call
_CALL_HINT = re.compile(r"(?:^|[^\w])call:[A-Za-z0-9_][\w.\-]*\s*(?:\{|$)|<end_function_call>|<start_function_call>")


# before a bare call: a word and spaces on its line, as in prose ("you could use call:x{...} next time"); a call a
# server stripped the markers of starts the turn, a line, or follows a sentence ("Checking. call:x{...}")
_MID_SENTENCE = re.compile(r"\w[ \t]+$")


class CallSyntaxError(ValueError):
    """The text tries a call that does not parse."""


@dataclasses.dataclass
class ToolCall:
    name: str
    arguments: dict[str, Any]


@dataclasses.dataclass
class ParsedReply:
    """What a model turn amounts to: calls, plain text, or a call attempt that did not parse."""

    kind: str  # "call" | "text" | "format_error"
    calls: list[ToolCall]
    text: str  # the turn's text outside the calls (the answer, for kind == "text")
    error: str | None = None

    @property
    def first(self) -> ToolCall | None:
        return self.calls[0] if self.calls else None


CUT_OFF = "cut off at the token limit"  # opens the error of a call attempt that reached the limit (`cut_short`)


def cut_short(reply: ParsedReply, limit: int, option: str = "--max-new-tokens") -> ParsedReply:
    """`reply` of a turn that stopped at its token limit: a call attempt it holds was cut off, not malformed, and
    its error says so (the fix is a larger limit, not another model; it read as the model's own syntax error). A
    text answer keeps its kind, and its `error` says it is cut (it was shown as if complete). `option`: the limit's
    option as the user types it (evaluate's and the fitness chat's --max-new-tokens, serving.chat's --max-tokens)."""
    if reply.kind == "text":
        return dataclasses.replace(reply, error=f"{CUT_OFF} of {limit} new tokens (raise {option})")
    if reply.kind != "format_error":
        return reply
    return dataclasses.replace(reply, error=f"{CUT_OFF} of {limit} new tokens (raise {option}): {reply.error}")


NO_CALL_AT_STOP = "no call before the call stop token"  # the error of a turn that handed over without a call


def handed_over(reply: ParsedReply) -> ParsedReply:
    """`reply` of a turn that stopped at the call stop marker (START_RESPONSE: the model handing over to a tool):
    without a call it is a format error, not an answer in words (a correct decline where none is due). One rule for
    a local model (`Generation.reply`) and an endpoint (`openai_client.reply_from_answer`)."""
    if reply.kind != "text":
        return reply
    return dataclasses.replace(reply, kind="format_error", error=NO_CALL_AT_STOP)


def map_markers(text: str, token_map: dict[str, str] | None) -> str:
    """Write each FunctionGemma marker in `text` as the token the tokenizer has for it (`token_map`, e.g.
    `<start_function_call>` -> `<unused2>` in the plain Gemma 3 vocabulary); no map: `text` as it is."""
    for marker, repl in (token_map or {}).items():
        text = text.replace(marker, repl)
    return text


def unmap_markers(text: str, token_map: dict[str, str] | None) -> str:
    """Undo the renderer's marker -> `<unusedN>` substitution (longest replacement first)."""
    for marker, repl in sorted((token_map or {}).items(), key=lambda kv: -len(kv[1])):
        text = text.replace(repl, marker)
    return text


class _Reader:
    """Recursive-descent reader of one FunctionGemma value."""

    def __init__(self, text: str, pos: int):
        self.s, self.i, self.depth = text, pos, 0

    def _enter(self) -> None:
        """One more level of objects and arrays; past JSON_RESULT_MAX_DEPTH a syntax error (a degenerate model's
        '[[[[...' raised RecursionError out of parse_reply: a traceback in evaluate and the chat)."""
        self.depth += 1
        if self.depth > JSON_RESULT_MAX_DEPTH:
            raise self._fail(f"arguments nested more than {JSON_RESULT_MAX_DEPTH} levels deep")

    def _ws(self) -> None:
        while self.i < len(self.s) and self.s[self.i] in " \t\r\n":
            self.i += 1

    def _fail(self, what: str) -> CallSyntaxError:
        near = self.s[self.i:self.i + 20]
        return CallSyntaxError(f"{what} at offset {self.i} (near {near!r})" if near else f"{what} at the end")

    def value(self, stops: str) -> Any:
        self._ws()
        s = self.s
        if s.startswith(ESCAPE, self.i):
            end = s.find(ESCAPE, self.i + len(ESCAPE))
            if end < 0:
                raise self._fail("unterminated <escape> string")
            v = s[self.i + len(ESCAPE):end]
            self.i = end + len(ESCAPE)
            return v
        if self.i >= len(s):
            raise self._fail("missing value")
        if s[self.i] == "{":
            return self.obj()
        if s[self.i] == "[":
            return self.array()
        if s[self.i] == '"':  # a JSON string, as some models write
            try:
                v, end = json.JSONDecoder().raw_decode(s, self.i)
            except json.JSONDecodeError:
                raise self._fail("bad quoted string") from None
            self.i = end
            return v
        # bare word: number, true/false/null, or (servers that strip <escape>) plain text
        j = self.i
        while j < len(s) and s[j] not in stops and not s.startswith(ESCAPE, j) and not s.startswith("<end_", j):
            j += 1
        word = s[self.i:j].strip()
        if not word:
            raise self._fail("missing value")
        self.i = j
        if word in ("true", "false"):
            return word == "true"
        if word == "null":
            return None
        if _NUMBER.fullmatch(word) and not re.match(r"-?0\d", word):  # JSON has no 01: a zip code or id whose
            # <escape>s a server stripped ('02139' was read as 2139, and scored unlike the reference '02139')
            if re.fullmatch(r"-?\d+", word):
                # exact, however long (float() of 309+ digits is inf, and int(inf) raises); past
                # Python's int-from-str limit (4,300 digits) a degenerate run of digits stays text
                try:
                    return int(word)
                except ValueError:
                    return word
            return float(word)
        return word

    def obj(self) -> dict[str, Any]:
        assert self.s[self.i] == "{"
        self._enter()
        self.i += 1
        out: dict[str, Any] = {}
        self._ws()
        if self.i < len(self.s) and self.s[self.i] == "}":
            self.i += 1
            self.depth -= 1
            return out
        while True:
            self._ws()
            if self.s.startswith(ESCAPE, self.i):  # an escaped key
                key = self.value(":")
            else:
                m = re.compile(r'"?([^:{}\[\],"<]+)"?').match(self.s, self.i)
                if not m:
                    raise self._fail("expected a key")
                key, self.i = m.group(1).strip(), m.end()
            self._ws()
            if self.i >= len(self.s) or self.s[self.i] != ":":
                raise self._fail(f"expected ':' after key {key!r}")
            self.i += 1
            if str(key) in out:  # which one the model meant is anyone's guess (the last was taken without a word)
                raise self._fail(f"key {str(key)!r} appears twice")
            out[str(key)] = self.value(",}")
            self._ws()
            if self.i >= len(self.s):
                raise self._fail("unclosed '{'")
            if self.s[self.i] == ",":
                self.i += 1
                continue
            if self.s[self.i] == "}":
                self.i += 1
                self.depth -= 1
                return out
            raise self._fail("expected ',' or '}'")

    def array(self) -> list[Any]:
        assert self.s[self.i] == "["
        self._enter()
        self.i += 1
        out: list[Any] = []
        self._ws()
        if self.i < len(self.s) and self.s[self.i] == "]":
            self.i += 1
            self.depth -= 1
            return out
        while True:
            out.append(self.value(",]"))
            self._ws()
            if self.i >= len(self.s):
                raise self._fail("unclosed '['")
            if self.s[self.i] == ",":
                self.i += 1
                continue
            if self.s[self.i] == "]":
                self.i += 1
                self.depth -= 1
                return out
            raise self._fail("expected ',' or ']'")


def parse_call_body(text: str, pos: int = 0) -> tuple[ToolCall, int]:
    """Parse `call:NAME{...}` starting at `pos`; returns the call and the offset after it."""
    r = _Reader(text, pos)
    r._ws()
    if not text.startswith("call:", r.i):
        raise r._fail("expected 'call:'")
    r.i += len("call:")
    r._ws()
    m = _NAME.match(text, r.i)
    if not m:
        raise r._fail("expected a function name")
    if not TOOL_NAME.fullmatch(m.group(0)):  # 'météo', '天气': no declaration could name it (OpenAI's and the
        # request check's rule), and the server's tool_call of it was refused when the client sent it back
        raise r._fail(f"{shown(m.group(0))} is not a tool name (1 to 64 ASCII letters, digits, '_', '.' or '-', "
                      f"not starting with '.' or '-')")
    name, r.i = m.group(0), m.end()
    r._ws()
    if r.i >= len(text) or text[r.i] != "{":
        raise r._fail(f"expected '{{' after call:{name}")
    args = r.obj()
    try:  # an escaped key `<escape>time:zone<escape>` or a quoted "x<escape>y": a call the server would send as
        # tool_calls its own request check then refuses, and no training row holds (`format_call`)
        check_call_arguments(args, f"call:{name} arguments")
    except UserError as e:
        raise CallSyntaxError(str(e)) from None
    return ToolCall(name, args), r.i


def parse_reply(text: str, token_map: dict[str, str] | None = None) -> ParsedReply:
    """Classify and parse one model turn (already cut at its stop token). A turn that goes on past a function response's
    start marker (a server not stopping there) is read up to it, as if it had stopped: what follows is the model
    inventing the tool's answer (`response:f{...}` and words on it), which was kept as the turn's text."""
    text = unmap_markers(text, token_map)
    invented = text.find(START_RESPONSE)
    if invented >= 0:
        reply = parse_reply(text[:invented])
        return handed_over(reply)
    calls: list[ToolCall] = []
    outside: list[str] = []
    pos = 0
    try:
        while True:
            start = text.find(START_CALL, pos)
            if start < 0:
                rest = text[pos:]
                # no start marker (stripped by a server, or forgotten): the bare form, every call of it (a server
                # that strips special tokens turns parallel calls into `call:a{...}call:b{...}`: the second was text)
                bare, whole = not calls, rest
                while bare and _CALL_HINT.search(rest):
                    m = _CALL_HINT.search(rest)
                    m = re.compile(r"call:").search(rest, m.start()) if m else None
                    if m is None:
                        raise CallSyntaxError("a call marker without 'call:NAME{...}'")
                    if rest[m.start() - 1:m.start()] in _QUOTES:  # prose quoting the syntax: "run `call:x{}` to see"
                        calls, outside, rest = [], [], whole  # (was run as a call); other prose around a bare call is
                        break  # the price of accepting calls a server stripped the markers of
                    call, end = parse_call_body(rest, m.start())
                    after = rest[end + len(END_CALL):] if rest.startswith(END_CALL, end) else rest[end:]
                    if _MID_SENTENCE.search(rest, 0, m.start()) and after.strip() and not after.lstrip().startswith(
                            "call:"):  # "you could use call:get_weather{city:Paris} next time": prose mentioning
                        calls, outside, rest = [], [], whole  # a call, a word before it on its line and text after
                        break  # it (was run as a call); a call a server stripped the markers of ends its sentence
                    calls.append(call)
                    outside.append(rest[:m.start()])
                    rest = after
                outside.append(rest)
                break
            outside.append(text[pos:start])
            call, end = parse_call_body(text, start + len(START_CALL))
            calls.append(call)
            if text.startswith(END_CALL, end):
                end += len(END_CALL)
            elif end < len(text) and not text.startswith(START_RESPONSE, end):
                raise CallSyntaxError(f"call:{call.name}{{...}} is not followed by {END_CALL}")
            pos = end
    except CallSyntaxError as e:
        return ParsedReply("format_error", calls, text, str(e))
    plain = "".join(outside)
    for marker in FUNCTION_MARKERS:
        plain = plain.replace(marker, "")
    return ParsedReply("call" if calls else "text", calls, plain.strip())


# ------------------------------------------------------------------------ argument matching


@dataclasses.dataclass(frozen=True)
class _Truth:
    """A normalised boolean: Python's True == 1 == 1.0 scored `"flag": true` against a reference `"n": 1` as equal."""

    value: bool


def _text_key(v: str) -> str:
    """A string as compared: Unicode NFC (é composed or as e + a combining accent is one text; NFKC would make m²
    m2), case-folded (Straße is STRASSE, as lower() did not), trimmed."""
    return unicodedata.normalize("NFC", v).casefold().strip()


def normalise_value(v: Any) -> Any:
    """Compare arguments by meaning, not spelling: '5' == 5 == 5.0, 'True' == true (but not 1), case-insensitive
    trimmed strings in one Unicode form (`_text_key`), containers element-wise. Digits with a leading zero stay text:
    '007' is not 7."""
    if isinstance(v, bool):
        return _Truth(v)
    if isinstance(v, int):  # exact: 2**53 + 1 is an id, not 2**53 (float() made them equal)
        return v
    if isinstance(v, float):
        return int(v) if v.is_integer() else v  # 5.0 is 5; inf and nan stay floats
    if isinstance(v, str):
        t = v.strip()
        low = _text_key(t)
        if low in ("true", "false"):
            return _Truth(low == "true")
        if _NUMBER.fullmatch(t) and not re.match(r"-?0\d", t):  # "007", "02139": an id or zip code, not 7 or 2139
            if re.fullmatch(r"-?\d+", t):
                try:
                    return normalise_value(int(t))  # as the same number written bare
                except ValueError:  # past Python's int-from-str limit: compared as text
                    return t
            return normalise_value(float(t))
        return " ".join(low.split())
    if isinstance(v, dict):
        return {_text_key(str(k)): normalise_value(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [normalise_value(x) for x in v]
    return v


REL_TOL = 1e-6  # fractional numbers this close are one value (72.5 and 72.50000001, a float32's 0.1 and 0.1)


def _same(ref: Any, pred: Any) -> bool:
    """Normalised values equal by meaning: whole numbers exactly, fractional ones within REL_TOL, lists element by
    element in order; objects at any depth as the arguments themselves: each reference key present with an equal value
    (a reference null: left out or null), extra predicted keys allowed. Extra keys inside an object argument failed
    the match while extra top-level arguments passed."""
    if isinstance(ref, dict) and isinstance(pred, dict):
        return all(_same(v, pred.get(k)) for k, v in ref.items())
    if isinstance(ref, list) and isinstance(pred, list):
        return len(ref) == len(pred) and all(map(_same, ref, pred))
    if isinstance(ref, (int, float)) and isinstance(pred, (int, float)) and (
            isinstance(ref, float) or isinstance(pred, float)):
        try:
            return ref == pred or math.isclose(ref, pred, rel_tol=REL_TOL)
        except OverflowError:  # a whole number past float's range (a run of 309+ digits) is near no float
            return False
    return ref == pred


def arguments_match(reference: dict, predicted: dict) -> bool:
    """Every reference argument is present with an equal value; extra predicted arguments are allowed (a default
    spelled out, an optional filter), inside object arguments too (one rule at every depth). What a fair
    tool-calling score counts as equal (`normalise_value`, `_same`): '5' == 5 == 5.0; 1.00000001 == 1 and
    fractional numbers within REL_TOL (a float printed through float32 or a short repr), but whole numbers exactly
    (ids, counts); a reference null matches the argument left out or null (a tool reads both as "not given"), and a
    null predicted for a reference value does not match it."""
    pred = normalise_value(predicted or {})
    return _same(normalise_value(reference or {}), pred)


# ---------------------------------------------------------------------------- chat template

_TEMPLATE = r"""
{%- macro text_of(content) -%}
  {%- if content is none -%}
  {%- elif content is string -%}{{- content -}}
  {%- elif content is mapping -%}{{- content | tojson -}}
  {%- else -%}{%- for part in content -%}{{- part['text'] if part['text'] is defined else '' -}}{%- endfor -%}
  {%- endif -%}
{%- endmacro -%}
{%- macro fmt(v) -%}
  {%- if v is string -%}{{- '<escape>' ~ v ~ '<escape>' -}}
  {%- elif v is boolean -%}{{- 'true' if v else 'false' -}}
  {%- elif v is none -%}{{- 'null' -}}
  {%- elif v is number -%}{{- v | tojson -}}
  {%- elif v is mapping -%}{{- '{' -}}{%- for k in v -%}{{- k ~ ':' ~ fmt(v[k]) -}}{{- ',' if not loop.last else '' -}}{%- endfor -%}{{- '}' -}}
  {%- elif v is iterable -%}{{- '[' -}}{%- for x in v -%}{{- fmt(x) -}}{{- ',' if not loop.last else '' -}}{%- endfor -%}{{- ']' -}}
  {%- else -%}{{- '<escape>' ~ v ~ '<escape>' -}}
  {%- endif -%}
{%- endmacro -%}
{{- bos_token -}}
{%- set ns = namespace(preamble='', in_model=false, last_call='', response_open=false, calls=[], name='', turn=[],
                       ids=[], done=[], k=none) -%}
{%- set msgs = messages -%}
{%- if msgs and msgs[0]['role'] in ['system', 'developer'] -%}
  {#- one of only whitespace says nothing: left out, as training leaves it out -#}
  {%- set ns.preamble = text_of(msgs[0]['content']) if text_of(msgs[0]['content']) | trim else '' -%}
  {%- set msgs = msgs[1:] -%}
{%- endif -%}
{%- if tools -%}
  {{- '<start_of_turn>developer\n' ~ ns.preamble -}}
  {%- for t in tools -%}
    {%- set fn = t['function'] if t['function'] is defined else t -%}
    {#- vLLM hands a declaration over as its request model dumps it: a description left out is None -#}
    {%- set body = {'description': fn['description'] if fn['description'] is defined and fn['description'] is not none
                    else ''} -%}
    {%- if fn['parameters'] is defined and fn['parameters'] -%}{%- set body = dict(body, parameters=fn['parameters']) -%}{%- endif -%}
    {{- '<start_function_declaration>declaration:' ~ fn['name'] ~ fmt(body) ~ '<end_function_declaration>' -}}
  {%- endfor -%}
  {{- '<end_of_turn>\n' -}}
  {%- set ns.preamble = '' -%}
{%- endif -%}
{%- for m in msgs -%}
  {%- if m['role'] in ['system', 'developer'] and not (text_of(m['content']) | trim) -%}
  {%- elif m['role'] in ['user', 'system', 'developer'] -%}
    {%- if ns.in_model -%}{{- '<end_of_turn>\n' -}}{%- set ns.in_model = false -%}{%- endif -%}
    {%- set ns.response_open = false -%}
    {%- set text = text_of(m['content']) -%}
    {%- if ns.preamble -%}{%- set text = ns.preamble ~ '\n\n' ~ text -%}{%- set ns.preamble = '' -%}{%- endif -%}
    {{- '<start_of_turn>user\n' ~ text ~ '<end_of_turn>\n' -}}
  {%- elif m['role'] in ['assistant', 'model'] -%}
    {%- if not ns.in_model -%}{{- '<start_of_turn>model\n' -}}{%- endif -%}
    {%- if m['tool_calls'] is defined and m['tool_calls'] -%}
      {{- text_of(m['content']) -}}
      {%- set ns.turn = [] -%}
      {%- set ns.ids = [] -%}
      {%- set ns.done = [] -%}
      {%- for c in m['tool_calls'] -%}
        {%- set f = c['function'] if c['function'] is defined else c -%}
        {%- set ns.last_call = f['name'] -%}
        {%- set ns.turn = ns.turn + [f['name']] -%}
        {%- set ns.ids = ns.ids + [c['id'] if c['id'] is defined and c['id'] is string else none] -%}
        {%- if c['id'] is defined and c['id'] is string -%}{%- set ns.calls = ns.calls + [[c['id'], f['name']]] -%}{%- endif -%}
        {%- set args = f['arguments'] if f['arguments'] is defined else none -%}
        {%- if args is string -%}
          {#- arguments as OpenAI sends them, a JSON text: read as the renderer reads it (they rendered as {}) -#}
          {%- set text = args -%}
          {%- set parsed = (json_value(text) | string) if text | length <= JSON_RESULT_LIMIT else '0' -%}
          {%- set body = parsed[1:] if parsed[:2] == '1{' else '{}' -%}
        {%- else -%}{%- set body = fmt(args if args is mapping else {}) -%}
        {%- endif -%}
        {{- '<start_function_call>call:' ~ f['name'] ~ body ~ '<end_function_call>' -}}
      {%- endfor -%}
      {{- '<start_function_response>' -}}
      {%- set ns.in_model = true -%}
      {%- set ns.response_open = true -%}
    {%- else -%}
      {{- text_of(m['content']) ~ '<end_of_turn>\n' -}}
      {%- set ns.in_model = false -%}
      {%- set ns.response_open = false -%}
    {%- endif -%}
  {%- elif m['role'] == 'tool' -%}
    {#- the call a result answers: its name, else the call of its tool_call_id (servers such as transformers
        serve pass the id and drop the name), else the first call of the turn still open (of the result's name where
        it has one: the calls in order, as the renderer reads results without ids), else the latest call -#}
    {%- set ns.k = none -%}
    {%- set rname = m['name'] if m['name'] is defined and m['name'] else none -%}
    {%- set rid = m['tool_call_id'] if m['tool_call_id'] is defined and m['tool_call_id'] is string else none -%}
    {%- for i in range(ns.turn | length) -%}
      {%- if ns.k is none and rid is not none and ns.ids[i] == rid and i not in ns.done -%}
        {%- set ns.k = i -%}
      {%- endif -%}
    {%- endfor -%}
    {%- set by_id = ns.k is not none -%}
    {%- if not by_id -%}
      {%- for i in range(ns.turn | length) -%}
        {%- if ns.k is none and i not in ns.done and ns.turn[i] == rname -%}{%- set ns.k = i -%}{%- endif -%}
      {%- endfor -%}
      {%- for i in range(ns.turn | length) -%}
        {%- if ns.k is none and i not in ns.done -%}{%- set ns.k = i -%}{%- endif -%}
      {%- endfor -%}
    {%- endif -%}
    {%- if ns.k is not none -%}{%- set ns.done = ns.done + [ns.k] -%}{%- set ns.name = ns.turn[ns.k] -%}
    {%- else -%}{%- set ns.name = ns.last_call -%}
    {%- endif -%}
    {%- if not by_id and rid is not none -%}
      {%- for pair in ns.calls -%}{%- if pair[0] == rid -%}{%- set ns.name = pair[1] -%}{%- endif -%}{%- endfor -%}
    {%- endif -%}
    {%- set name = rname if rname else ns.name -%}
    {%- set c = m['content'] -%}
    {%- if c is mapping -%}{%- set body = fmt(c) -%}
    {%- else -%}
      {#- a JSON text (what OpenAI clients send) is read as the renderer reads it: an object field by field -#}
      {%- set text = text_of(c) -%}
      {%- set parsed = (json_value(text) | string) if text | length <= JSON_RESULT_LIMIT else '0' -%}
      {%- if parsed[:1] == '1' -%}{%- set body = parsed[1:] if parsed[1:2] == '{' else '{result:' ~ parsed[1:] ~ '}' -%}
      {%- else -%}{%- set body = fmt({'result': text}) -%}
      {%- endif -%}
    {%- endif -%}
    {%- if not ns.response_open -%}
      {#- a second result of parallel calls opens its own response marker -#}
      {%- if not ns.in_model -%}{{- '<start_of_turn>model\n' -}}{%- endif -%}
      {{- '<start_function_response>' -}}
    {%- endif -%}
    {{- 'response:' ~ name ~ body ~ '<end_function_response>' -}}
    {%- set ns.in_model = true -%}
    {%- set ns.response_open = false -%}
  {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt and not ns.in_model -%}{{- '<start_of_turn>model\n' -}}{%- endif -%}
{#- chat_template_kwargs {"forced_call": NAME} (or true): the answer starts as a call (of NAME): how a server without
    guided decoding honours tool_choice (a named function, or "required") -#}
{%- if add_generation_prompt and forced_call is defined and forced_call -%}
  {{- '<start_function_call>call:' ~ (forced_call ~ '{' if forced_call is string else '') -}}
{%- endif -%}
"""


_JSON_MACRO = r"""
{%- macro json_value(s) -%}
  {#- '1' and the FunctionGemma text of the JSON value in `s` (format_value of Python's json.loads(s):
      strings decoded and escaped, numbers as Python re-dumps them, NaN/Infinity read, control characters
      in strings refused), or '0' when `s` is not JSON, nests deeper than JSON_RESULT_MAX_DEPTH, holds an integer
      of more than JSON_INT_MAX_DIGITS digits or escapes a lone UTF-16 surrogate (no tokenizer encodes one).
      A duplicated key keeps both (Python keeps the last). -#}
  {%- set j = namespace(out='', ok=true, stack=[], mode='value', buf='', key=false, esc=false, hex=none, hi=none, tok='') -%}
  {%- for ch in s ~ ' ' -%}
    {%- if j.mode == 'str' and j.hex is none and not j.esc and j.hi is none and ch not in '"\\' and ch >= ' ' -%}
      {%- set j.buf = j.buf ~ ch -%}
    {%- elif j.ok and j.mode == 'str' -%}
      {%- set code = none -%}
      {%- if j.hex is not none -%}
        {%- if ch in '0123456789abcdefABCDEF' -%}{%- set j.hex = j.hex ~ ch -%}{%- else -%}{%- set j.ok = false -%}{%- endif -%}
        {%- if j.ok and j.hex | length == 4 -%}{%- set code = j.hex | int(0, 16) -%}{%- set j.hex = none -%}{%- endif -%}
      {%- elif j.esc -%}
        {%- set j.esc = false -%}
        {%- if ch == 'u' -%}{%- set j.hex = '' -%}
        {%- else -%}
          {%- if j.hi is not none -%}{%- set j.ok = false -%}{%- endif -%}
          {%- if ch in '"\\/' -%}{%- set j.buf = j.buf ~ ch -%}
          {%- elif ch == 'b' -%}{%- set j.buf = j.buf ~ '%c' | format(8) -%}
          {%- elif ch == 'f' -%}{%- set j.buf = j.buf ~ '%c' | format(12) -%}
          {%- elif ch == 'n' -%}{%- set j.buf = j.buf ~ '\n' -%}
          {%- elif ch == 'r' -%}{%- set j.buf = j.buf ~ '\r' -%}
          {%- elif ch == 't' -%}{%- set j.buf = j.buf ~ '\t' -%}
          {%- else -%}{%- set j.ok = false -%}
          {%- endif -%}
        {%- endif -%}
      {%- else -%}
        {%- if j.hi is not none and ch != '\\' -%}{%- set j.ok = false -%}{%- endif -%}
        {%- if ch == '\\' -%}{%- set j.esc = true -%}
        {%- elif ch == '"' -%}
          {%- set j.out = j.out ~ (j.buf if j.key else '<escape>' ~ j.buf ~ '<escape>') -%}
          {%- set j.mode = 'colon' if j.key else ('after' if j.stack else 'done') -%}
        {%- elif ch < ' ' -%}{%- set j.ok = false -%}
        {%- else -%}{%- set j.buf = j.buf ~ ch -%}
        {%- endif -%}
      {%- endif -%}
      {%- if code is not none -%}
        {%- if j.hi is not none and 56320 <= code <= 57343 -%}
          {%- set j.buf = j.buf ~ '%c' | format(65536 + (j.hi - 55296) * 1024 + code - 56320) -%}{%- set j.hi = none -%}
        {%- else -%}
          {%- if j.hi is not none -%}{%- set j.ok = false -%}{%- endif -%}
          {%- if 55296 <= code <= 56319 -%}{%- set j.hi = code -%}{%- elif 56320 <= code <= 57343 -%}{%- set j.ok = false -%}
          {%- else -%}{%- set j.buf = j.buf ~ '%c' | format(code) -%}{%- endif -%}
        {%- endif -%}
      {%- endif -%}
    {%- elif j.ok -%}
      {%- if j.mode == 'lit' and ch not in ' \t\n\r,:[]{}"' -%}{%- set j.tok = j.tok ~ ch -%}
      {%- else -%}
        {%- if j.mode == 'lit' -%}
          {%- if j.tok in ['true', 'false', 'null', 'NaN', 'Infinity', '-Infinity'] -%}{%- set j.out = j.out ~ j.tok -%}
          {%- else -%}
            {#- JSON's number grammar: -?(0|[1-9][0-9]*)(.[0-9]+)?([eE][+-]?[0-9]+)? -#}
            {%- set n = namespace(state=0, ok=true) -%}
            {%- for c in j.tok -%}
              {%- set digit = c in '0123456789' -%}
              {%- if n.state == 0 and c == '-' -%}{%- set n.state = 1 -%}
              {%- elif n.state in [0, 1] and c == '0' -%}{%- set n.state = 2 -%}
              {%- elif n.state in [0, 1] and digit -%}{%- set n.state = 3 -%}
              {%- elif n.state == 3 and digit -%}
              {%- elif n.state in [2, 3] and c == '.' -%}{%- set n.state = 4 -%}
              {%- elif n.state in [4, 5] and digit -%}{%- set n.state = 5 -%}
              {%- elif n.state in [2, 3, 5] and c in 'eE' -%}{%- set n.state = 6 -%}
              {%- elif n.state == 6 and c in '+-' -%}{%- set n.state = 7 -%}
              {%- elif n.state in [6, 7, 8] and digit -%}{%- set n.state = 8 -%}
              {%- else -%}{%- set n.ok = false -%}
              {%- endif -%}
            {%- endfor -%}
            {%- if n.ok and n.state in [2, 3] and (j.tok | replace('-', '') | length) <= JSON_INT_MAX_DIGITS -%}
              {%- set j.out = j.out ~ (j.tok | int) | tojson -%}
            {%- elif n.ok and n.state in [5, 8] -%}{%- set j.out = j.out ~ (j.tok | float) | tojson -%}
            {%- else -%}{%- set j.ok = false -%}
            {%- endif -%}
          {%- endif -%}
          {%- set j.mode = 'after' if j.stack else 'done' -%}
        {%- endif -%}
        {%- set top = j.stack[-1] if j.stack else '' -%}
        {%- if not j.ok or ch in ' \t\n\r' -%}
        {%- elif ch in '{[' and (j.mode == 'value' or (j.mode == 'first' and top == '[')) -%}
          {%- set j.out = j.out ~ ch -%}{%- set j.stack = j.stack + [ch] -%}{%- set j.mode = 'first' -%}
          {%- if j.stack | length > JSON_RESULT_MAX_DEPTH -%}{%- set j.ok = false -%}{%- endif -%}
        {%- elif ch in '}]' and (j.mode == 'after' or j.mode == 'first') and top == ('{' if ch == '}' else '[') -%}
          {%- set j.out = j.out ~ ch -%}{%- set j.stack = j.stack[:-1] -%}{%- set j.mode = 'after' if j.stack else 'done' -%}
        {%- elif ch == ',' and j.mode == 'after' -%}{%- set j.out = j.out ~ ',' -%}{%- set j.mode = 'key' if top == '{' else 'value' -%}
        {%- elif ch == ':' and j.mode == 'colon' -%}{%- set j.out = j.out ~ ':' -%}{%- set j.mode = 'value' -%}
        {%- elif ch == '"' and (j.mode in ['value', 'key'] or j.mode == 'first') -%}
          {%- set j.key = j.mode == 'key' or (j.mode == 'first' and top == '{') -%}{%- set j.buf = '' -%}{%- set j.mode = 'str' -%}
        {%- elif j.mode == 'value' or (j.mode == 'first' and top == '[') -%}{%- set j.tok = ch -%}{%- set j.mode = 'lit' -%}
        {%- else -%}{%- set j.ok = false -%}
        {%- endif -%}
      {%- endif -%}
    {%- endif -%}
  {%- endfor -%}
  {{- '1' ~ j.out if j.ok and j.mode == 'done' else '0' -}}
{%- endmacro -%}
"""


FORCED_CALL_KWARG = "forced_call"


def forced_call_prefix(name: str | None) -> str:
    """What the tool chat template writes after the generation prompt for `forced_call` (unmapped markers): the
    start of a call of `name`, or of any call (None)."""
    return f"{START_CALL}call:" + (f"{name}{{" if name else "")


def tool_chat_template(token_map: dict[str, str] | None = None, parse_json: bool = True) -> str:
    """A Jinja chat template rendering tools, calls and responses as the renderer does.

    Prompts (system/developer, user turns, tools) render byte-identically to
    `Renderer.render(conv, add_generation_prompt=True).text`, and so do tool results: OpenAI clients send
    a result as a JSON *string*, which the template reads with a JSON reader of its own (`json_value`, in
    Jinja: there is no JSON filter) as `format_response` reads it, so a served model sees
    `{steps:5}` where it was trained on `{steps:5}`, not `{result:<escape>{"steps": 5}<escape>}`.
    `parse_json=False` leaves that reader out (results render as strings), for template engines that
    lack what it uses (`'%c' | format`, `int(base)`: llama.cpp's C++ server). The template kwarg `forced_call`
    (a tool name, or true for any) opens the answer with a call: `forced_call_prefix` says what it wrote.
    """
    text = _TEMPLATE.strip()
    if parse_json:
        text = _JSON_MACRO.strip() + "\n" + text
    else:
        call = "(json_value(text) | string) if text | length <= JSON_RESULT_LIMIT else '0'"
        assert call in text
        text = text.replace(call, "'0'")
    text = text.replace("JSON_RESULT_LIMIT", str(JSON_RESULT_LIMIT))
    text = text.replace("JSON_RESULT_MAX_DEPTH", str(JSON_RESULT_MAX_DEPTH))
    text = text.replace("JSON_INT_MAX_DIGITS", str(JSON_INT_MAX_DIGITS))
    return map_markers(text, token_map)
