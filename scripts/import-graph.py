#!/usr/bin/env python3
"""The import graph of each crate source folder given (CI: trainer/src, burn-ddp/src), checked
file by file and folder by folder.

A file imports another when it names a path into it: `crate::a::b`, `super::x`, `self::x`, or a
child module by name (`checks::run`), in `use` lines or inline; comments and `#[cfg(test)]` (or `#[cfg(all(test, ...))]`)
modules aside. A folder's front (its mod.rs, or lib.rs) declaring, re-exporting and dispatching
to its own files is the module tree, not an import, so those edges are left out.

Files: prints each crate's files, edges, levels (the longest chain of imports), its upward edges
(a file importing the front of a folder it lives in: `super::Item`) and every circle (a strongly
connected set of files) with its edges.

Folders: in every folder (the crate root and each sub-folder) its direct children, files and
sub-folders (a sub-folder standing for everything under it; the folder's own front stands for
the folder one level up), make a graph: `a -> b` when a file in `a` imports a file in `b`. Each
child gets a floor (the longest path below it in the graph's condensation: 0 imports no
sibling); an arrow to a sibling on the same floor or higher is upward, which is an arrow inside a
circle of siblings. Prints every circle among siblings and every upward arrow (with the file
edges behind it), then one summary line per folder (children, arrows, floors).

Exits 1 when there is a file circle, a file upward edge or a folder circle (a file names its
own contract's file, not the front that re-exports it; folders are layered as files are).

    python3 scripts/import-graph.py trainer/src burn-ddp/src
"""
import os, re, sys
from collections import defaultdict

def modules(src):
    mods = {}
    for root, _, files in os.walk(src):
        for f in files:
            if not f.endswith('.rs'): continue
            p = os.path.join(root, f); rel = os.path.relpath(p, src)[:-3].split(os.sep)
            if rel[-1] in ('mod', 'lib', 'main'): rel = rel[:-1]
            mods[tuple(rel)] = p
    return mods

def strip(text):
    out = []; skip_depth = None; depth = 0; pending_test = False
    for line in text.split('\n'):
        s = line.strip()
        if skip_depth is None:
            if s.startswith('#[cfg(test)]') or s.startswith('#[cfg(all(test,'): pending_test = True; continue
            if pending_test and re.match(r'(pub(\(crate\))? )?mod \w+\s*\{', s):
                skip_depth = depth
            pending_test = False if not s.startswith('#[') else pending_test
        depth += line.count('{') - line.count('}')
        if skip_depth is not None:
            if depth <= skip_depth: skip_depth = None
            continue
        if s.startswith('//'): continue
        out.append(re.sub(r'//.*', '', line))
    return '\n'.join(out)

def expand_use(body):
    # expand `a::{b, c::{d}}` into paths
    body = re.sub(r'\s+', '', body)
    def rec(prefix, s):
        res = []; i = 0; parts = []; depth = 0; cur = ''
        for ch in s:
            if ch == '{': depth += 1
            if ch == '}': depth -= 1
            if ch == ',' and depth == 0: parts.append(cur); cur = ''
            else: cur += ch
        parts.append(cur)
        for p in parts:
            if not p: continue
            m = re.match(r'^(.*?)::\{(.*)\}$', p)
            if m: res += rec(prefix + m.group(1).split('::'), m.group(2))
            elif p.startswith('{') and p.endswith('}'): res += rec(prefix, p[1:-1])
            else: res.append(prefix + p.split(' as ')[0].split('::'))
        return res
    return rec([], body)

def test_modules(mods):
    """Modules declared `#[cfg(test)] mod name;` or `#[cfg(all(test, ...))] mod name;` (a file of
    tests), with everything below them."""
    found = set()
    for mod, path in mods.items():
        text = open(path).read()
        for m in re.finditer(r'#\[cfg\((?:test|all\(test,[^\]]*\))\)\]\s*(?:pub(?:\(crate\))?\s+)?mod\s+(\w+)\s*;', text):
            found.add(tuple(mod) + (m.group(1),))
    return {m for m in mods if any(m[:len(t)] == t for t in found)}

def graph(src):
    mods = modules(src)
    for m in test_modules(mods):
        del mods[m]
    edges = defaultdict(set)
    for mod, path in mods.items():
        text = strip(open(path).read())
        is_dir_mod = os.path.basename(path) in ('mod.rs', 'lib.rs', 'main.rs')
        here = list(mod) if is_dir_mod else list(mod[:-1])  # the module `super` is relative to the parent
        paths = []
        for m in re.finditer(r'\buse\s+([^;]+);', text):
            paths += expand_use(m.group(1))
        for m in re.finditer(r'(?<![\w:])((?:crate|super|self)(?:::\w+)+)', text):
            paths.append(m.group(1).split('::'))
        # A child module named without `self::` (`checks::run`, `use checks::X`).
        inner = tuple(mod) if is_dir_mod else tuple(mod)
        children = {m[-1] for m in mods if len(m) == len(inner) + 1 and m[:-1] == inner}
        for m in re.finditer(r'(?<![\w:])(\w+)((?:::\w+)+)', text):
            if m.group(1) in children:
                paths.append(['self', m.group(1)] + m.group(2).split('::')[1:])
        for p in paths:
            p = [x for x in p if x]
            if not p: continue
            if p[0] == 'crate': target = p[1:]
            elif p[0] in ('super', 'self'):
                base = list(mod)
                while p and p[0] in ('super', 'self'):
                    if p[0] == 'super': base = base[:-1]
                    p = p[1:]
                target = base + p
            else: continue
            for n in range(len(target), -1, -1):
                t = tuple(target[:n])
                if t in mods:
                    # A folder's front (its mod.rs) declares, re-exports and dispatches to its
                    # own files: those edges are the module tree, not imports.
                    if t != mod and n > 0 and t[:len(mod)] != mod: edges[mod].add(t)
                    break
    return mods, edges

def sccs(nodes, edges):
    index = {}; low = {}; stack = []; on = set(); out = []; c = [0]
    sys.setrecursionlimit(10000)
    def visit(v):
        index[v] = low[v] = c[0]; c[0] += 1; stack.append(v); on.add(v)
        for w in edges.get(v, ()):
            if w not in index: visit(w); low[v] = min(low[v], low[w])
            elif w in on: low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop(); on.discard(w); comp.append(w)
                if w == v: break
            out.append(comp)
    for v in nodes:
        if v not in index: visit(v)
    return out

def levels(mods, edges):
    """Each file's level: 0 for a file that imports none, else 1 + its imports' highest."""
    level = {}
    def visit(m, seen):
        if m in level: return level[m]
        if m in seen: return 0  # a circle: reported apart
        seen.add(m)
        level[m] = 1 + max((visit(t, seen) for t in edges.get(m, ())), default=-1)
        return level[m]
    for m in mods: visit(m, set())
    return level

def folder_graphs(mods, edges):
    """For each folder (the crate root and every module with modules under it), its direct
    children (files and sub-folders, a sub-folder standing for everything under it) and the
    arrows among them: `a -> b` when a file in `a` imports a file in `b`, with those file edges.
    A folder's own front stands for the folder one level up, so it is none of its children."""
    folders = {m[:n] for m in mods for n in range(len(m))}
    out = {}
    for f in sorted(folders, key=lambda f: (len(f), f)):
        under = lambda m: len(m) > len(f) and m[:len(f)] == f
        children = sorted({m[:len(f) + 1] for m in mods if under(m)})
        arrows = defaultdict(list)
        for m in mods:
            if not under(m): continue
            for t in edges.get(m, ()):
                if under(t) and m[:len(f) + 1] != t[:len(f) + 1]:
                    arrows[(m[:len(f) + 1], t[:len(f) + 1])].append((m, t))
        out[f] = (children, dict(arrows))
    return out

def floors(nodes, arrows):
    """Each node's floor: 0 for one importing no sibling, else 1 + the highest floor it imports,
    over the condensation (the members of a circle share a floor), with its circles."""
    succ = defaultdict(set)
    for a, b in arrows: succ[a].add(b)
    comps = sccs(nodes, succ)
    comp_of = {v: i for i, c in enumerate(comps) for v in c}
    # Tarjan emits components in reverse topological order: a component's imports come first.
    floor_of = {}
    for i, c in enumerate(comps):
        floor_of[i] = 1 + max((floor_of[comp_of[w]] for v in c for w in succ[v]
                               if comp_of[w] != i), default=-1)
    return {v: floor_of[comp_of[v]] for v in nodes}, [c for c in comps if len(c) > 1], comp_of

def name(m, f=()):
    return '/'.join(m[len(f):]) or 'lib'

status = 0
if len(sys.argv) < 2:
    sys.exit(__doc__)
for src in sys.argv[1:]:
    mods, edges = graph(src)
    comps = [c for c in sccs(list(mods), edges) if len(c) > 1]
    upward = sorted((m, t) for m in edges for t in edges[m] if m[:len(t)] == t)
    depth = 1 + max(levels(mods, edges).values(), default=0)
    print(f"{src}: {len(mods)} files, {sum(len(v) for v in edges.values())} edges, {depth} levels, {len(upward)} upward (a file importing its folder's front), {len(comps)} circles")
    for m, t in upward:
        status = 1
        print(f"  upward: {'/'.join(m)} -> {'/'.join(t) or 'lib'} (import the file that defines the item, not the folder's front)")
    for c in comps:
        status = 1
        names = sorted('/'.join(m) or 'lib' for m in c)
        print("  circle:", ", ".join(names))
        cs = set(c)
        for m in sorted(c):
            for t in sorted(edges[m]):
                if t in cs: print(f"    {'/'.join(m) or 'lib'} -> {'/'.join(t) or 'lib'}")
    # Folders: the children of each folder, layered like the files.
    total_circles = total_upward = 0
    summary = []
    for f, (children, arrows) in folder_graphs(mods, edges).items():
        floor, circles, comp_of = floors(children, arrows)
        # Against the layering: an arrow to a sibling on the same floor or higher, which is an
        # arrow inside a circle (the condensation is layered by the longest path).
        upward = sorted((a, b) for (a, b) in arrows if floor[b] >= floor[a])
        total_circles += len(circles); total_upward += len(upward)
        label = (name(f) + '/') if f else 'crate root'
        counts = defaultdict(int)
        for v in children: counts[floor[v]] += 1
        summary.append(f"  {label}: {len(children)} children, {len(arrows)} arrows, "
                       f"{1 + max(floor.values(), default=0)} floors, {len(upward)} upward, {len(circles)} circles")
        for c in circles:
            status = 1
            print(f"  folder circle in {label}:", ", ".join(sorted(name(v, f) for v in c)))
        for a, b in upward:
            files = arrows[(a, b)]
            shown = ", ".join(f"{name(m)} -> {name(t)}" for m, t in sorted(files)[:3])
            more = f", +{len(files) - 3}" if len(files) > 3 else ""
            print(f"  folder upward in {label}: {name(a, f)} -> {name(b, f)} ({len(files)} file edges: {shown}{more})")
    print(f"{src} folders: {len(summary)} folders, {total_upward} upward arrows, {total_circles} circles")
    for line in summary: print(line)
sys.exit(status)
