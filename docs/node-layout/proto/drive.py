import os, sys, time, gc, statistics as st
sys.path.insert(0, ".")
import proto

class Node:
    __slots__ = ("op", "leaves", "spec", "metas", "out_spec", "storages", "writes", "outputs",
                 "values", "executed", "index", "rng", "graph", "seq", "where", "consumers",
                 "tags", "entry", "ctx", "_wref", "__weakref__")
class Ref:
    __slots__ = ("node", "out")
class Storage:
    __slots__ = ("pending_writes", "readers", "prune_at", "role", "__weakref__")
class Alive:
    __slots__ = ("__weakref__",)
proto.setup(Node, Ref, Storage, Alive)

N = int(sys.argv[1]) if len(sys.argv) > 1 else 6480
ROUNDS = int(sys.argv[2]) if len(sys.argv) > 2 else 15
op, entry, spec, metas, graph, cst = object(), object(), object(), [None], object(), 1.5
flush = bytearray(64 << 20)
def cold():
    global junk
    junk = bytes(flush)  # 64 MB through the caches (a replay streams weights through them)
    junk = None

NOISE = os.environ.get("NOISE") == "1"
def build(kind):
    if NOISE:
        nl = []
        proto.set_noise(nl)
        try:
            return build1(kind)
        finally:
            proto.set_noise(None)
            del nl[:]  # the op's other objects died: holes between the nodes' blocks
    return build1(kind)

def build1(kind):
    if kind == "old":
        return proto.build_old(N, op, entry, spec, metas, graph, cst)
    if kind == "mid":
        return proto.build_mid(N, op, entry, spec, metas, graph, cst)
    return proto.build_new(N, op, entry, spec, metas, graph, cst, kind == "new")

t = time.thread_time_ns
res = {k: {"build": [], "walk_cold": [], "walk_warm": [], "release_cold": [], "release_warm": [], "blocks": []}
       for k in ("old", "mid", "new", "new_nowref")}
gc.disable()
for r in range(ROUNDS):
    for kind in ("old", "mid", "new", "new_nowref"):
        cold()
        b0 = sys.getallocatedblocks()
        a = t(); nodes = build(kind); b = t()
        res[kind]["blocks"].append((sys.getallocatedblocks() - b0) / N)
        res[kind]["build"].append(b - a)
        walk = {"old": proto.walk_old, "mid": proto.walk_mid}.get(kind, proto.walk_new)
        cold(); a = t(); walk(nodes); b = t(); res[kind]["walk_cold"].append(b - a)
        a = t(); walk(nodes); b = t(); res[kind]["walk_warm"].append(b - a)
        cold(); a = t(); proto.release(nodes, {"old": 1, "mid": 2}.get(kind, 0)); b = t(); res[kind]["release_cold"].append(b - a)
        del nodes
        nodes = build(kind)
        a = t(); proto.release(nodes, {"old": 1, "mid": 2}.get(kind, 0)); b = t(); res[kind]["release_warm"].append(b - a)
        del nodes
gc.enable()
print(f"NOISE={NOISE} N={N} rounds={ROUNDS}  (thread CPU, median us per tape; ns per node in brackets)")
for kind, d in res.items():
    row = "  ".join(f"{k} {st.median(v)/1000:8.1f} [{st.median(v)/N:5.0f}]" if k != "blocks" else f"blocks/node {st.median(v):.2f}" for k, v in d.items())
    print(f"{kind:11s} {row}")
