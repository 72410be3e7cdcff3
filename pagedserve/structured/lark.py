"""Lark grammars as xgrammar's EBNF, as vLLM takes them: a `grammar` with no `::=` rule but `name: ...` rules is
read as Lark (https://lark-parser.readthedocs.io/en/latest/grammar.html) and rewritten rule by rule.

What is rewritten: `name: expansion` rules and their `| alternative` lines, `?name` / `!name` and `name.2`
(inlining, keep-tokens and priority marks) and `-> alias`es (they change Lark's tree, not the language),
'single-quoted' literals, `"a".."z"` ranges, `[x]` (optional x), empty alternatives, `//` comments, `start` (else
the first rule) as the root (a rule of Lark's named `root` is renamed). What EBNF cannot say the same way is
refused, naming it: `/regex/` terminals, `%import` / `%ignore` / `%declare` directives, `~` repetition counts,
templates.
"""

from __future__ import annotations

import re

from pagedserve.exceptions import InvalidRequestError

# A Lark rule or terminal's head: optional ?/! marks, a name, an optional priority, the colon.
_RULE_HEAD = re.compile(r"^\s*[?!]?([A-Za-z_][A-Za-z0-9_]*)(?:\.-?\d+)?\s*:(?!:)")


def looks_like_lark(grammar: str) -> bool:
    """No EBNF `::=` rule (outside string literals), and at least one Lark `name:` rule."""
    lines = [_strip_comment(line) for line in grammar.splitlines()]
    return not any("::=" in _without_literals(line) for line in lines) and any(_RULE_HEAD.match(line)
                                                                                for line in lines)


def lark_to_ebnf(grammar: str, param: str) -> str:
    """The Lark `grammar` as xgrammar's EBNF; InvalidRequestError naming what cannot be rewritten."""
    rules: list[tuple[str, list[str]]] = []
    for number, raw in enumerate(grammar.splitlines(), 1):
        line = _strip_comment(raw).strip()
        if not line:
            continue
        if line.startswith("%"):
            raise _refuse(param, number, f"the directive {line.split()[0]!r} (only rules are rewritten)")
        head = _RULE_HEAD.match(line)
        if head:
            rules.append((head.group(1), [line[head.end():]]))
        elif line.startswith("|") and rules:
            rules[-1][1].append(line[1:])
        else:
            raise _refuse(param, number, f"{line[:40]!r}, which is neither a 'name: ...' rule nor a '| ...' "
                                         "alternative of one")
    if not rules:
        raise InvalidRequestError(f"{param}: the Lark grammar has no rules", param=param)
    names = {name for name, _ in rules}
    root = "start" if "start" in names else rules[0][0]
    # EBNF's entry rule is `root`: a Lark rule of that name that is not the entry one gets another name
    renamed = {"root": _free_name("root_", names)} if "root" in names and root != "root" else {}
    out = [] if root == "root" else [f"root ::= {renamed.get(root, root)}"]
    for name, alternatives in rules:
        body = " | ".join(_expansion(a.strip(), param, name, renamed) for a in alternatives)
        out.append(f"{renamed.get(name, name)} ::= {body}")
    return "\n".join(out)


def _free_name(base: str, taken: set[str]) -> str:
    name, n = base, 1
    while name in taken:
        name, n = f"{base}{n}", n + 1
    return name


_TOKEN = re.compile(r"\s+|->\s*[A-Za-z_][A-Za-z0-9_]*|[A-Za-z_][A-Za-z0-9_]*|\.\.|.", re.S)


def _expansion(text: str, param: str, rule: str, renamed: dict[str, str]) -> str:
    """One alternative in EBNF: literals double-quoted, `"a".."z"` as `[a-z]`, Lark's `[x]` (optional) as `(x)?`,
    aliases (`-> name`) dropped, an empty alternative as `""`; refused where it holds what EBNF says otherwise."""
    out: list[str] = []  # EBNF pieces; a literal is one piece ending with its quote

    def last() -> str:
        significant = [piece for piece in out if piece.strip()]
        return significant[-1] if significant else ""

    i = 0
    while i < len(text):
        char = text[i]
        if char in "\"'":
            end = _literal_end(text, i)
            if end < 0:
                raise InvalidRequestError(f"{param}: an unclosed string in the Lark rule {rule!r}", param=param)
            literal = _double_quoted_body(text[i + 1:end], char)
            i = end + 1
            if i < len(text) and text[i] == "i":  # "abc"i: case-insensitive
                raise InvalidRequestError(f"{param}: the case-insensitive literal in the Lark rule {rule!r} cannot "
                                          "be rewritten as EBNF; spell out the cases", param=param)
            upper = re.match(r"\s*\.\.\s*([\"'])", text[i:])
            if upper:  # "a".."z": a range of single characters, EBNF's [a-z]
                start = i + upper.end() - 1
                stop = _literal_end(text, start)
                high = _double_quoted_body(text[start + 1:stop], text[start]) if stop > 0 else ""
                if len(literal) != 1 or len(high) != 1:
                    raise InvalidRequestError(f"{param}: a range in the Lark rule {rule!r} needs single characters",
                                              param=param)
                out.append(f"[{_class_char(literal)}-{_class_char(high)}]")
                i = stop + 1
                continue
            out.append(f'"{literal}"')
            continue
        token = _TOKEN.match(text, i).group(0)
        i += len(token)
        if token.startswith("->"):  # an alias names the tree's node; the language is the same
            continue
        if token == "/":
            raise InvalidRequestError(f"{param}: the regular expression in the Lark rule {rule!r} cannot be rewritten "
                                      "as EBNF; write it with EBNF character classes ([a-z]+) or give the grammar as "
                                      "EBNF", param=param)
        if token == "~":
            raise InvalidRequestError(f"{param}: the '~' repetition in the Lark rule {rule!r} cannot be rewritten; "
                                      "write it as EBNF's {m,n}", param=param)
        if token == "{":
            raise InvalidRequestError(f"{param}: the template in the Lark rule {rule!r} is not supported", param=param)
        if token in ("|", ")", "]") and last() in ("", "(", "|"):
            out.append('""')  # an empty alternative: Lark's epsilon
        out.append({"[": "(", "]": ")?"}.get(token, renamed.get(token, token)))
    if last() in ("", "|"):
        out.append('""')
    return "".join(out).strip()


def _double_quoted_body(body: str, quote: str) -> str:
    """A Lark literal's body (between `quote`s) as the body of an EBNF double-quoted string: the same characters."""
    if quote == '"':
        return body
    body = body.replace("\\'", "'")
    return re.sub(r'(?<!\\)((?:\\\\)*)"', r'\1\\"', body)  # an unescaped " gets its backslash


def _without_literals(line: str) -> str:
    """`line` with its string literals' contents left out."""
    out, i = [], 0
    while i < len(line):
        if line[i] in "\"'":
            end = _literal_end(line, i)
            if end < 0:
                return "".join(out)
            out.append('""')
            i = end + 1
        else:
            out.append(line[i])
            i += 1
    return "".join(out)


def _class_char(char: str) -> str:
    """`char` inside an EBNF character class."""
    return "\\" + char if char in "]\\-^" else char


def _literal_end(text: str, start: int) -> int:
    """The index of the quote closing the literal opened at `start`, or -1."""
    quote, i = text[start], start + 1
    while i < len(text):
        if text[i] == "\\":
            i += 2
            continue
        if text[i] == quote:
            return i
        i += 1
    return -1


def _strip_comment(line: str) -> str:
    """`line` without its `//` comment (not one inside a string literal)."""
    i = 0
    while i < len(line):
        if line[i] in "\"'":
            end = _literal_end(line, i)
            if end < 0:
                return line
            i = end + 1
        elif line.startswith("//", i):
            return line[:i]
        else:
            i += 1
    return line


def _refuse(param: str, number: int, what: str) -> InvalidRequestError:
    return InvalidRequestError(f"{param}: line {number} of the Lark grammar: {what} cannot be rewritten as EBNF; give "
                               "the grammar as EBNF (root ::= ...)", param=param)
