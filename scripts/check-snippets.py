#!/usr/bin/env python3
"""Every ```rust block of the documentation is code that CI compiles (README.md, docs/*.md).

What it checks: for each fenced block whose language is `rust` in README.md and docs/*.md,
that the block's text appears as consecutive lines of one .rs file under the compiled trees
(examples/, burn-ddp/examples/, trainer/examples/, burn-ddp/src/, trainer/src/, models/src/,
tests/). Whitespace is normalised on both sides: each line is stripped and empty lines are
dropped, so a block may be dedented. A line that is only `// ...` inside a block elides code:
it splits the block into fragments, each of which must be found in the same file, in the
order of the block (a fragment starts after the end of the one before).

On failure it prints, per block,

    FILE:LINE: this rust block is not in any compiled file: <first unmatched line>

(FILE:LINE is where that line is in the Markdown file; a second line names the compiled file
that matched the most of the block) and exits 1. On success it prints how many blocks it
checked and exits 0.

How to fix a failure: the code moved or changed, so the documentation drifted. Copy the
current code from the compiled file (the one named, or find it with `grep -rn`) into the
block, eliding what the reader does not need with `// ...` lines. Do not write Rust that is
not compiled: if the block is not meant to be real code, fence it as ```text (or ```sh,
```toml, ```diff, ...) instead.

With `--links` it also checks that every relative link in README.md and docs/*.md points to
an existing file and, for `#anchor` links, to a heading of that file (GitHub's slugs); each
broken link is printed as `FILE:LINE: broken link: <target> (<why>)`.

    python3 scripts/check-snippets.py            # the rust blocks
    python3 scripts/check-snippets.py --links    # the rust blocks and the links
"""
import os
import re
import sys

ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
COMPILED = [
    "examples",
    "burn-ddp/examples",
    "trainer/examples",
    "burn-ddp/src",
    "trainer/src",
    "models/src",
    "tests",
]
ELISION = "// ..."
FENCE = re.compile(r"^(\s*)(`{3,}|~{3,})\s*([^`\s]*)")


def docs():
    """README.md and docs/*.md, relative to the root, in a stable order."""
    out = ["README.md"]
    folder = os.path.join(ROOT, "docs")
    if os.path.isdir(folder):
        out += sorted("docs/" + f for f in os.listdir(folder) if f.endswith(".md"))
    return [p for p in out if os.path.isfile(os.path.join(ROOT, p))]


def fenced_blocks(lines):
    """(language, [(line number, text)], fence line number) of each fenced block."""
    blocks = []
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        fence, lang, start = m.group(2), m.group(3).lower(), i + 1
        body = []
        i += 1
        while i < len(lines):
            close = lines[i].strip()
            if close.startswith(fence[0] * len(fence)) and close.strip(fence[0]) == "":
                break
            body.append((i + 1, lines[i]))
            i += 1
        blocks.append((lang, body, start))
        i += 1
    return blocks


def normalised(numbered):
    """Stripped, non-empty lines, with their line numbers."""
    return [(n, t.strip()) for n, t in numbered if t.strip()]


def compiled_files():
    """{path: [normalised lines]} of every .rs file under the compiled trees."""
    files = {}
    for tree in COMPILED:
        top = os.path.join(ROOT, tree)
        for root, dirs, names in os.walk(top):
            dirs[:] = sorted(d for d in dirs if d != "target" and not d.startswith("."))
            for name in sorted(names):
                if not name.endswith(".rs"):
                    continue
                path = os.path.join(root, name)
                rel = os.path.relpath(path, ROOT)
                if rel in files:
                    continue
                with open(path, encoding="utf-8", errors="replace") as f:
                    files[rel] = [l.strip() for l in f.read().split("\n") if l.strip()]
    return files


def fragments(block):
    """The block's lines cut at `// ...` lines: [[(line number, text)], ...], none empty."""
    out, current = [], []
    for n, text in block:
        if text == ELISION:
            if current:
                out.append(current)
            current = []
        else:
            current.append((n, text))
    if current:
        out.append(current)
    return out


def match_in(lines, frags):
    """How far `frags` get in `lines` (in order, each after the one before): (fragments
    found, lines of the next fragment found at its best place)."""
    pos = 0
    for k, frag in enumerate(frags):
        texts = [t for _, t in frag]
        found, best = None, 0
        for start in range(pos, len(lines)):
            j = 0
            while j < len(texts) and start + j < len(lines) and lines[start + j] == texts[j]:
                j += 1
            if j == len(texts):
                found = start
                break
            best = max(best, j)
        if found is None:
            return k, best
        pos = found + len(texts)
    return len(frags), 0


def check_snippets():
    files = compiled_files()
    checked, failures = 0, 0
    for doc in docs():
        with open(os.path.join(ROOT, doc), encoding="utf-8") as f:
            lines = f.read().split("\n")
        for lang, body, fence_line in fenced_blocks(lines):
            if lang.split(",")[0] != "rust":
                continue
            checked += 1
            frags = fragments(normalised(body))
            if not frags:
                print(f"{doc}:{fence_line}: this rust block is not in any compiled file: (an empty block)")
                failures += 1
                continue
            matched, best = False, (0, 0, None)  # (fragments found, lines found, file)
            for path, code in files.items():
                got = match_in(code, frags)
                if got[0] == len(frags):
                    matched = True
                    break
                if got > best[:2]:
                    best = (got[0], got[1], path)
            if matched:
                continue
            k, j, path = best
            line_no, text = frags[k][min(j, len(frags[k]) - 1)]
            print(f"{doc}:{line_no}: this rust block is not in any compiled file: {text}")
            if path:
                print(f"    closest: {path} ({k} of {len(frags)} fragment(s) found, then {j} line(s) of the next)")
            failures += 1
    return checked, failures


def slug(heading):
    """GitHub's anchor for a heading's text."""
    text = re.sub(r"`([^`]*)`", r"\1", heading)  # code spans keep their text
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)  # links keep their text
    text = text.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)  # punctuation goes (\w keeps letters, digits, _)
    return text.replace(" ", "-")


def prose(lines):
    """(line number, line) of each line outside fenced code blocks."""
    in_fence = None
    for n, line in enumerate(lines, 1):
        m = FENCE.match(line)
        if m:
            if in_fence is None:
                in_fence = m.group(2)[0]
            elif line.strip().startswith(in_fence * 3):
                in_fence = None
            continue
        if not in_fence:
            yield n, line


def anchors(path):
    """The anchors of a Markdown file's headings (repeated ones numbered as GitHub does)."""
    seen, out = {}, set()
    with open(path, encoding="utf-8") as f:
        lines = f.read().split("\n")
    for _, line in prose(lines):
        h = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not h:
            continue
        s = slug(h.group(1))
        n = seen.get(s, 0)
        seen[s] = n + 1
        out.add(s if n == 0 else f"{s}-{n}")
    return out


LINK = re.compile(r"(?<!\!)\[(?:[^\]\[]|\[[^\]]*\])*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def check_links():
    checked, failures = 0, 0
    for doc in docs():
        path = os.path.join(ROOT, doc)
        with open(path, encoding="utf-8") as f:
            lines = f.read().split("\n")
        for n, line in prose(lines):
            code_free = re.sub(r"`[^`]*`", "", line)
            for target in LINK.findall(code_free):
                if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
                    continue
                checked += 1
                file_part, _, anchor = target.partition("#")
                dest = os.path.normpath(os.path.join(os.path.dirname(path), file_part)) if file_part else path
                why = None
                if not os.path.exists(dest):
                    why = "no such file"
                elif anchor:
                    if not dest.endswith(".md"):
                        why = "an anchor into a file that is not Markdown"
                    elif anchor not in anchors(dest):
                        why = f"no heading with the anchor #{anchor} in {os.path.relpath(dest, ROOT)}"
                if why:
                    print(f"{doc}:{n}: broken link: {target} ({why})")
                    failures += 1
    return checked, failures


def main(argv):
    unknown = [a for a in argv if a != "--links"]
    if unknown:
        print(__doc__)
        return 2
    checked, failures = check_snippets()
    if "--links" in argv:
        links, broken = check_links()
        failures += broken
        print(f"check-snippets: {links} relative link(s) checked, {broken} broken")
    if failures:
        print(f"check-snippets: {checked} rust block(s) checked; failures above")
        return 1
    print(f"check-snippets: {checked} rust block(s) checked in {len(docs())} Markdown file(s), each found in a compiled file")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
