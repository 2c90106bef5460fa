"""The model's chat template as a program of pieces the edge can run (docs/edge.md,
"Chat templates").

The edge has no Jinja engine. It serves a chat request natively only when the template
is, for the conversations it covers, text pieces around each message's content:

    render = sep(^, r0) + T_r0(c0) + sep(r0, r1) + T_r1(c1) + ... + T_rn(cn) + end(rn, gen)

`sep(previous role, role)` is everything the template writes between two contents (the
previous message's suffix, this one's prefix; before the first message also BOS and a
default system message), `end(last role, add_generation_prompt)` the text after the last
content, and `T_r` the role's content transform (none, or Python's strip / lstrip /
rstrip). A role pair the template refuses, or one not seen, has no `sep`: such
conversations are not covered and the edge proxies them.

`derive_template` finds the pieces by rendering probe conversations (contents are unique
markers) with the router's own renderer, then checks the program: a few hundred random
conversations within what it covers (role orders the pieces allow, contents with
whitespace at the ends, newlines, template and special-token text, unicode, empty
strings) must render to the same text both ways, and the router's prompt ids of that
text must be `tokenizer.encode(text, add_special_tokens=False)` (what the edge computes).
Any mismatch: None, and chat is proxied.
"""

from __future__ import annotations

import json
import logging
import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from modelinfo.chat_template import ChatTemplate
from modelinfo.tokenizer import Tokenizer
from protocol.errors import InvalidRequestError
from router.prompt_tokens import PromptEncoder
from router.tool_parsers import pick_parser
from router.tools import tool_request

log = logging.getLogger(__name__)

PROGRAM_FORMAT = "kvserve-chat-template"
PROGRAM_VERSION = 1
START = "^"
"""The 'previous role' of the first message."""
ROLES = ("system", "user", "assistant")
"""Roles a program may cover. "developer" is "system" (router/preprocess.py maps it);
"tool" messages carry fields the edge does not parse: always proxied."""
PYTHON_WHITESPACE = (
    "\t\n\x0b\x0c\r\x1c\x1d\x1e\x1f \x85\xa0\u1680\u2000\u2001\u2002\u2003\u2004\u2005"
    "\u2006\u2007\u2008\u2009\u200a\u2028\u2029\u202f\u205f\u3000"
)
"""What Python's str.strip() strips (`str.isspace`; Jinja's `trim` is str.strip): the
program names the characters, since Rust's idea of whitespace differs (U+001C..U+001F)."""
_STRIPS = (
    ("both", None),
    ("left", None),
    ("right", None),
    ("both", "\n"),
    ("left", "\n"),
    ("right", "\n"),
)
_FRAGMENTS = (
    "hello",
    " Hello, world! ",
    "  leading",
    "trailing  ",
    "\n",
    "\n\nline\n",
    "\t tab \t",
    "a\r\nb",
    "<|im_start|>",
    "<|im_end|>",
    "<|start_header_id|>user<|end_header_id|>",
    "<|eot_id|>",
    "<s>",
    "</s>",
    "[INST]",
    "</think>",
    "{{ messages }}",
    "{% if true %}x{% endif %}",
    "{#",
    "é çà ü 🙂 你好",
    "\u3000wide\u3000",
    "\u00a0nbsp\u2028",
    "\x1cgroup\x1f",
    "\u0085",
    "user",
    "assistant",
    "system",
    "^",
)


def derive_template(
    template: ChatTemplate | None,
    tokenizer: Tokenizer | None,
    *,
    num_checks: int = 300,
    seed: int = 0,
) -> dict[str, Any] | None:
    """The template's program (JSON-able dict), or None with the reason logged (chat is
    then proxied). `tokenizer`: the model's, for the ids check (None skips it)."""
    if template is None:
        log.info("edge chat: the model has no chat template; chat requests are proxied")
        return None
    try:
        program, reason = _derive(template, tokenizer, num_checks, seed)
    except Exception as e:  # the template is untrusted code: any failure only proxies chat
        program, reason = None, f"deriving failed: {type(e).__name__}: {e}"
    if program is None:
        log.info("edge chat: the chat template is proxied: %s", reason)
    return program


def write_template(program: dict[str, Any], path: str | Path) -> None:
    """The program as the JSON file `ChatTemplate::from_file` (edge/src/chat.rs) reads."""
    Path(path).write_text(json.dumps(program, indent=1) + "\n", "utf-8")


def router_text(
    template: ChatTemplate, messages: Sequence[dict[str, Any]], add_generation_prompt: bool
) -> str | None:
    """The prompt text the router renders for a chat request of these messages without
    tools (router/preprocess.py, router/tools.py); None: the template refuses them (the
    router answers 400)."""
    source = template.source()
    tools = tool_request(None, None, pick_parser(source, None), source, None)
    dicts = [
        {"role": "system" if m["role"] == "developer" else m["role"], "content": m["content"]}
        for m in messages
    ]
    try:
        return template.render(
            tools.messages(dicts),
            add_generation_prompt=add_generation_prompt,
            tools=tools.template_tools,
        )
    except InvalidRequestError:
        return None


def program_text(
    program: dict[str, Any], messages: Sequence[dict[str, Any]], add_generation_prompt: bool
) -> str | None:
    """The program's rendering (the reference of edge/src/chat.rs `render`); None: not
    covered."""
    if not messages:
        return None
    seps: dict[str, dict[str, str]] = program["separators"]
    out = []
    previous = START
    for m in messages:
        role = "system" if m["role"] == "developer" else m["role"]
        sep = seps.get(previous, {}).get(role)
        content = m["content"]
        if sep is None or not isinstance(content, str):
            return None
        out.append(sep)
        out.append(_transform(program["content"][role], content))
        previous = role
    end = program["endings"].get(previous, {}).get("true" if add_generation_prompt else "false")
    if end is None:
        return None
    out.append(end)
    return "".join(out)


def _transform(rule: dict[str, str], content: str) -> str:
    chars = rule["chars"]
    strip = rule["strip"]
    if strip == "both":
        return content.strip(chars)
    if strip == "left":
        return content.lstrip(chars)
    if strip == "right":
        return content.rstrip(chars)
    return content


def _derive(
    template: ChatTemplate, tokenizer: Tokenizer | None, num_checks: int, seed: int
) -> tuple[dict[str, Any] | None, str]:
    source = template.source()
    if "strftime_now" in source:
        return None, "it reads the clock (strftime_now): its text changes by the day"
    seps, endings, paths, reason = _pieces(template)
    if reason:
        return None, reason
    if not seps.get(START):
        return None, "no first message renders with its content verbatim"
    pieces = {"separators": seps, "endings": endings}
    transforms = {}
    for role in sorted({r for after in seps.values() for r in after}):
        rule = _content_rule(template, pieces, paths, role)
        if rule is None:
            return None, f"the content of a {role!r} message is changed beyond strip()"
        transforms[role] = rule
    program = {
        "format": PROGRAM_FORMAT,
        "version": PROGRAM_VERSION,
        "separators": seps,
        "endings": endings,
        "content": transforms,
    }
    problem = _verify(program, template, tokenizer, num_checks, seed)
    if problem:
        return None, problem
    return program, ""


def _marker(index: int) -> str:
    return f"Zq{index}Qz"


def _split(text: str, count: int) -> list[str] | None:
    """The texts around `count` markers (in order, each once); None: not so."""
    pieces = []
    start = 0
    for i in range(count):
        marker = _marker(i)
        at = text.find(marker, start)
        if at < 0 or text.count(marker) != 1:
            return None
        pieces.append(text[start:at])
        start = at + len(marker)
    pieces.append(text[start:])
    return pieces


def _render_marked(template: ChatTemplate, roles: Sequence[str], gen: bool) -> str | None:
    messages = [{"role": r, "content": _marker(i)} for i, r in enumerate(roles)]
    return router_text(template, messages, gen)


def _pieces(
    template: ChatTemplate,
) -> tuple[dict[str, dict[str, str]], dict[str, dict[str, str]], dict[str, list[str]], str]:
    """Separators, endings and a shortest path (roles) to each role, by a breadth-first
    walk over role pairs: each pair is probed after the shortest known path to its first
    role, alone or followed by one more message (a template may refuse to end on some
    role). A probe the template refuses, or that drops a content, covers nothing."""
    seps: dict[str, dict[str, str]] = {}
    endings: dict[str, dict[str, str]] = {}
    paths: dict[str, list[str]] = {START: []}
    queue = [START]
    while queue:
        state = queue.pop(0)
        for role in ROLES:
            path = [*paths[state], role]
            found = False
            for tail in ([], *([r] for r in ROLES)):
                roles = path + tail
                for gen in (False, True):
                    text = _render_marked(template, roles, gen)
                    pieces = _split(text, len(roles)) if text is not None else None
                    if pieces is None:
                        continue
                    problem = _record(seps, endings, roles, pieces, gen)
                    if problem:
                        return {}, {}, {}, problem
                    found = True
                if found:
                    break
            if found and role not in paths:
                paths[role] = path
                queue.append(role)
    return seps, endings, paths, ""


def _record(
    seps: dict[str, dict[str, str]],
    endings: dict[str, dict[str, str]],
    roles: Sequence[str],
    pieces: Sequence[str],
    gen: bool,
) -> str:
    """Enter one probe's pieces; a piece that differs from one seen before for the same
    place means the template depends on more than the role pair: an error."""
    previous = START
    for role, piece in zip(roles, pieces, strict=False):
        known = seps.setdefault(previous, {}).setdefault(role, piece)
        if known != piece:
            return f"the text between {previous!r} and {role!r} depends on more than the pair"
        previous = role
    key = "true" if gen else "false"
    known = endings.setdefault(previous, {}).setdefault(key, pieces[-1])
    if known != pieces[-1]:
        return f"the text after a last {previous!r} message depends on more than its role"
    return ""


_CONTENT_PROBE = "\n \tprobe\n text \u3000\n\n"
"""Whitespace of both kinds at both ends: each candidate transform shows it differently."""


def _content_rule(
    template: ChatTemplate,
    pieces: dict[str, Any],
    paths: dict[str, list[str]],
    role: str,
) -> dict[str, str] | None:
    """How the template changes a `role` content (the first candidate transform whose
    program renders a probe as the template does), or None."""
    neutral = {"strip": "none", "chars": ""}
    seps = pieces["separators"]
    for state in [s for s in seps if role in seps[s] and s in paths]:
        for tail in ([], *([r] for r in ROLES)):
            roles = [*paths[state], role, *tail]
            contents = [_marker(i) for i in range(len(roles))]
            contents[len(paths[state])] = _CONTENT_PROBE
            messages = [{"role": r, "content": c} for r, c in zip(roles, contents, strict=True)]
            for gen in (False, True):
                text = router_text(template, messages, gen)
                if text is None:
                    continue
                for strip, chars in (("none", ""), *_STRIPS):
                    rule = {"strip": strip, "chars": PYTHON_WHITESPACE if chars is None else chars}
                    content = dict.fromkeys(ROLES, neutral) | {role: rule}
                    if program_text({**pieces, "content": content}, messages, gen) == text:
                        return rule
                return None
    return None


def _conversation(
    rng: random.Random, program: dict[str, Any], max_messages: int, fragments: Sequence[str]
) -> tuple[list[dict[str, str]], bool] | None:
    """A random conversation the program covers (roles by its pairs), and a gen flag."""
    seps = program["separators"]
    endings = program["endings"]
    for _ in range(20):
        messages = []
        previous = START
        for _ in range(rng.randint(1, max_messages)):
            options = sorted(seps.get(previous, {}))
            if not options:
                break
            role = rng.choice(options)
            if role == "system" and rng.random() < 0.2:
                role = "developer"
            messages.append({"role": role, "content": _content(rng, fragments)})
            previous = "system" if role == "developer" else role
        gens = sorted(endings.get(previous, {}))
        if messages and gens:
            return messages, rng.choice(gens) == "true"
    return None


def _content(rng: random.Random, fragments: Sequence[str]) -> str:
    if rng.random() < 0.1:
        return ""
    parts = rng.choices(fragments, k=rng.randint(1, 4))
    return "".join(parts)


def _verify(
    program: dict[str, Any],
    template: ChatTemplate,
    tokenizer: Tokenizer | None,
    num_checks: int,
    seed: int,
) -> str:
    """'' when the program renders random covered conversations as the router does (and
    the router's ids of them are those of a whole-text encode); else the first problem."""
    rng = random.Random(seed)
    encoder = PromptEncoder(tokenizer) if tokenizer is not None else None
    # the model's own special tokens (BOS, EOS, ...) as content text too
    fragments = (*_FRAGMENTS, *(tokenizer.special_tokens.values() if tokenizer else ()))
    for _ in range(num_checks):
        drawn = _conversation(rng, program, 8, fragments)
        if drawn is None:
            return "no conversation the pieces cover could be drawn"
        messages, gen = drawn
        want = router_text(template, messages, gen)
        got = program_text(program, messages, gen)
        if want != got:
            return f"the pieces render {messages!r} (gen={gen}) unlike the template"
        if (
            encoder is not None
            and tokenizer is not None
            and want is not None
            and encoder.encode(want, add_special_tokens=False)
            != tokenizer.encode(want, add_special_tokens=False)
        ):
            return "the router's prompt ids differ from a whole-text encode"
    return ""
