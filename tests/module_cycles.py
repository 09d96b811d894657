#!/usr/bin/env python3
"""Finds import circles between the modules of one crate, from the graph cargo-modules draws.

Reads `cargo modules dependencies` DOT output on stdin. Every item is taken as part of the
module that defines it, and every "uses" edge between two items as an edge between their
modules; a module that uses another which (through any others) uses it back is a circle.
Prints each circle with the edges that tie it, and exits 1 when there is one.
"""
import re
import sys
from collections import defaultdict


def read(lines):
    nodes, edges = {}, []
    for line in lines:
        m = re.match(r'\s*"([^"]+)"\s*->\s*"([^"]+)"\s*\[label="uses"', line)
        if m:
            edges.append((m.group(1), m.group(2)))
            continue
        m = re.match(r'\s*"([^"]+)"\s*\[label="([^"]*)"', line)
        if m:
            # A module and an item may share a path (`mod attempts` beside `fn attempts`): the
            # module keeps the node, or the item's edges would land on the parent module.
            if not is_module(nodes.get(m.group(1), "")):
                nodes[m.group(1)] = m.group(2)
    modules = {n for n, label in nodes.items() if is_module(label)}
    return modules, edges


def is_module(label):
    """Whether a node's label is a module's (or the crate's)."""
    return bool(re.search(r"\b(mod|crate)\b", label.split("|")[0]))


def module_of(item, modules):
    while item not in modules and "::" in item:
        item = item.rsplit("::", 1)[0]
    return item


def circles(graph):
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, on_stack, stack, found = {}, {}, set(), [], []
    counter = 0
    for root in list(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            v, children = work[-1]
            w = next(children, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                component = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    component.append(w)
                    if w == v:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def main():
    modules, edges = read(sys.stdin)
    graph = defaultdict(set)
    for a, b in edges:
        ma, mb = module_of(a, modules), module_of(b, modules)
        if ma != mb:
            graph[ma].add(mb)
    found = circles(graph)
    for component in found:
        print(f"circle of {len(component)} modules: {', '.join(component)}")
        members = set(component)
        for a in component:
            for b in sorted(graph[a] & members):
                print(f"    {a} -> {b}")
    print(f"{len(modules)} modules, {len(found)} circles")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
