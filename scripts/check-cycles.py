"""(Copied from the team's shared tools, so CI runs it from the clone.) File-level import cycles inside each Rust crate (use crate::…, super::…, self::… paths), and inside the
Python client package (from .x import / from package.x import). A parent module and its own children are
not counted as a cycle. Prints each cycle; exit 0 when there is none.
usage: cycles.py REPO_ROOT"""
import os, re, sys
from collections import defaultdict
root = sys.argv[1]

def rust_crates():
    for dirpath, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d not in ("target", ".git", "node_modules", "tests", "benches", "examples")]
        if "Cargo.toml" in files and os.path.isdir(os.path.join(dirpath, "src")):
            yield os.path.join(dirpath, "src")

def module_of(src, path):
    rel = os.path.relpath(path, src)[:-3].split(os.sep)
    if rel[-1] in ("lib", "main", "mod"): rel = rel[:-1]
    if rel and rel[0] == "bin": return None
    return tuple(rel)

def use_paths(text):
    """Every path a `use` statement names, with `{a, b::{c, d}}` groups expanded."""
    out = []
    for stmt in re.findall(r"(?m)^\s*(?:pub(?:\([^)]*\))?\s+)?use\s+([^;]+);", text):
        stmt = re.sub(r"\s+", "", stmt)
        def expand(prefix, tree):
            if "{" not in tree:
                out.append(prefix + tree.split(" as ")[0]); return
            head, _, rest = tree.partition("{")
            if "}" not in rest: return
            body = rest[:rest.rindex("}")]
            depth, item, items = 0, "", []
            for ch in body:
                if ch == "," and depth == 0: items.append(item); item = ""; continue
                depth += ch == "{"; depth -= ch == "}"; item += ch
            items.append(item)
            for it in items:
                if it: expand(prefix + head, it)
        expand("", stmt)
    return out

def rust_graph(src):
    files = {}
    for dp, _, fs in os.walk(src):
        for f in fs:
            if f.endswith(".rs"):
                m = module_of(src, os.path.join(dp, f))
                if m is not None: files[m] = os.path.join(dp, f)
    edges = defaultdict(set)
    pat = re.compile(r"\b(crate|super|self)((?:::[A-Za-z_][A-Za-z0-9_]*)+)")
    for m, path in files.items():
        text = open(path, encoding="utf-8", errors="replace").read()
        text = re.sub(r"//[^\n]*", "", text)
        is_dir_mod = os.path.basename(path) in ("mod.rs", "lib.rs", "main.rs")
        paths = ["".join(p) for p in pat.findall(text)] + use_paths(text)
        for full in paths:
            segs = [s for s in full.split("::") if s]
            if not segs or segs[0] not in ("crate", "super", "self"): continue
            head, parts = segs[0], segs[1:]
            if head == "crate": base = ()
            elif head == "self": base = m
            else: base = m[:-1]
            while parts and parts[0] == "super":
                base = base[:-1]; parts = parts[1:]
            cand = base + tuple(p for p in parts if p not in ("self", "*"))
            while cand and cand not in files: cand = cand[:-1]
            # A module that uses its own ancestor (items of the parent that declares it) is Rust's
            # ordinary shape, not a cycle: only edges to other branches count.
            if cand and cand != m and m[:len(cand)] != cand: edges[m].add(cand)
    return files, edges

def sccs(nodes, edges):
    index, low, stack, on, out, i = {}, {}, [], set(), [], [0]
    def visit(v):
        index[v] = low[v] = i[0]; i[0] += 1; stack.append(v); on.add(v)
        for w in edges.get(v, ()):
            if w not in index: visit(w); low[v] = min(low[v], low[w])
            elif w in on: low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop(); on.discard(w); comp.append(w)
                if w == v: break
            out.append(comp)
    sys.setrecursionlimit(10000)
    for v in nodes:
        if v not in index: visit(v)
    return out

def ancestor_only(comp):
    # a parent and its own children only: every member lies on one line of descent
    comp = sorted(comp, key=len)
    return all(comp[k][:len(comp[0])] == comp[0] for k in range(len(comp))) and len(comp) == 2

found = []
for src in rust_crates():
    files, edges = rust_graph(src)
    for comp in sccs(list(files), edges):
        if len(comp) > 1 and not ancestor_only(comp):
            found.append(os.path.relpath(os.path.dirname(src), root) + ": " + ", ".join("::".join(c) or "lib" for c in sorted(comp)))
py = os.path.join(root, "clients", "python")
if os.path.isdir(py):
    for dp, dirs, fs in os.walk(py):
        dirs[:] = [d for d in dirs if d not in ("tests", "build", ".venv")]
        if "__init__.py" not in fs: continue
        pkg = os.path.basename(dp)
        mods = {f[:-3]: os.path.join(dp, f) for f in fs if f.endswith(".py") and f != "__init__.py"}
        edges = defaultdict(set)
        for m, path in mods.items():
            text = open(path).read()
            for a in re.findall(r"^\s*from\s+(?:\.|%s\.)(\w+)\s+import" % pkg, text, re.M) + re.findall(r"^\s*import\s+%s\.(\w+)" % pkg, text, re.M):
                if a in mods and a != m: edges[m].add(a)
        for comp in sccs(list(mods), edges):
            if len(comp) > 1: found.append(os.path.relpath(dp, root) + ": " + ", ".join(sorted(comp)))
for f in found: print(f)
print(f"{len(found)} import cycles between files inside a crate or package")
sys.exit(0 if not found else 1)
