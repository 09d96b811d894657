//! The module graph: an edge from each module to every other module whose items its own items
//! name. A path is resolved the way rustc resolves it (`crate`, `self`, `super`, a child module,
//! an item the module defines, a name a `use` brings in, one a glob import brings) down to the
//! module that defines the item it names, through any re-exports on the way; names from other
//! crates and the prelude are left out.

use crate::tree::Tree;
use crate::uses::{self, Uses};
use std::collections::{BTreeMap, BTreeSet};

/// Each module's edges: the modules it names, each with one path that names it (for the report).
pub type Graph = BTreeMap<String, BTreeMap<String, String>>;

/// The graph of `tree`.
pub fn of(tree: &Tree) -> Graph {
    let uses: BTreeMap<&str, Uses> = tree.iter().map(|(path, m)| (path.as_str(), uses::of(m))).collect();
    let scope = Scope { tree, uses: &uses };
    let mut graph = Graph::new();
    for (from, module_uses) in &uses {
        let edges = graph.entry((*from).to_owned()).or_default();
        for path in &module_uses.paths {
            // A module named alone is a local variable of the same name: no path names a
            // module but as the way to an item.
            let Some(Target::Item(to)) = scope.path(from, path, 0) else { continue };
            if to != *from {
                edges.entry(to).or_insert_with(|| path.join("::"));
            }
        }
    }
    graph
}

/// How many `use` declarations and globs resolving one path may pass through before it gives
/// up (glob imports in both directions between two modules would otherwise never end).
const DEPTH: usize = 16;

/// What a path names.
enum Target {
    /// A module itself.
    Module(String),
    /// An item the module defines.
    Item(String),
}

/// What resolving reads: the tree and each module's imports.
struct Scope<'a> {
    tree: &'a Tree,
    uses: &'a BTreeMap<&'a str, Uses>,
}

impl Scope<'_> {
    /// What `path`, written in module `from`, names.
    fn path(&self, from: &str, path: &[String], depth: usize) -> Option<Target> {
        let (first, rest) = path.split_first()?;
        match first.as_str() {
            "crate" => self.walk("crate", rest, depth),
            "self" => self.walk(from, rest, depth),
            "super" => self.walk(parent(from)?, rest, depth),
            name => self.member(from, name, rest, depth, false),
        }
    }

    /// Follows `rest` down from `module`, where each segment names a member of the last.
    fn walk(&self, module: &str, rest: &[String], depth: usize) -> Option<Target> {
        match rest.split_first() {
            None => Some(Target::Module(module.to_owned())),
            Some((next, tail)) if next == "super" => self.walk(parent(module)?, tail, depth),
            Some((next, tail)) => self.member(module, next, tail, depth, true),
        }
    }

    /// `name` (then `tail`) as `module` sees it: a child module, an item it defines, or a name it
    /// imports. A name none of those explain is another crate's or the prelude's (`None`), unless
    /// it follows a module path (`known`), where it is one the source makes out of sight (a
    /// macro's item, a variant) and counts as the module's.
    fn member(&self, module: &str, name: &str, tail: &[String], depth: usize, known: bool) -> Option<Target> {
        let scope = &self.tree[module];
        if scope.children.contains(name) {
            return self.walk(&format!("{module}::{name}"), tail, depth);
        }
        if scope.defines.contains(name) {
            return Some(Target::Item(module.to_owned()));
        }
        if depth >= DEPTH {
            return None;
        }
        let imports = &self.uses[module];
        if let Some(target) = imports.aliases.get(name) {
            let full: Vec<String> = target.iter().chain(tail).cloned().collect();
            return self.path(module, &full, depth + 1).or_else(|| known.then(|| Target::Item(module.to_owned())));
        }
        let through_glob = imports.globs.iter().find_map(|glob| {
            let Target::Module(source) = self.path(module, glob, depth + 1)? else { return None };
            self.provides(&source, name, depth + 1).then_some(())?;
            self.member(&source, name, tail, depth + 1, true)
        });
        through_glob.or_else(|| known.then(|| Target::Item(module.to_owned())))
    }

    /// Whether `module` has a member called `name` (its own or one it imports).
    fn provides(&self, module: &str, name: &str, depth: usize) -> bool {
        let scope = &self.tree[module];
        let imports = &self.uses[module];
        scope.children.contains(name)
            || scope.defines.contains(name)
            || imports.aliases.contains_key(name)
            || (depth < DEPTH
                && imports
                    .globs
                    .iter()
                    .any(|glob| matches!(self.path(module, glob, depth + 1), Some(Target::Module(source)) if self.provides(&source, name, depth + 1))))
    }
}

fn parent(module: &str) -> Option<&str> {
    module.rsplit_once("::").map(|(parent, _)| parent)
}

/// The graph's circles: each set of two or more modules in which every one reaches every other
/// (Tarjan's strongly connected components).
pub fn circles(graph: &Graph) -> Vec<BTreeSet<String>> {
    let mut walk = Tarjan { graph, index: BTreeMap::new(), low: BTreeMap::new(), stack: Vec::new(), found: Vec::new() };
    for node in graph.keys() {
        if !walk.index.contains_key(node.as_str()) {
            walk.visit(node);
        }
    }
    walk.found
}

struct Tarjan<'g> {
    graph: &'g Graph,
    index: BTreeMap<&'g str, usize>,
    low: BTreeMap<&'g str, usize>,
    stack: Vec<&'g str>,
    found: Vec<BTreeSet<String>>,
}

impl<'g> Tarjan<'g> {
    fn visit(&mut self, node: &'g str) {
        let at = self.index.len();
        self.index.insert(node, at);
        self.low.insert(node, at);
        self.stack.push(node);
        for next in self.graph.get(node).into_iter().flat_map(BTreeMap::keys) {
            let next = next.as_str();
            if !self.index.contains_key(next) {
                self.visit(next);
                let low = self.low[node].min(self.low[next]);
                self.low.insert(node, low);
            } else if self.stack.contains(&next) {
                let low = self.low[node].min(self.index[next]);
                self.low.insert(node, low);
            }
        }
        if self.low[node] == at {
            let start = self.stack.iter().rposition(|n| *n == node).expect("on the stack");
            let component: BTreeSet<String> = self.stack.drain(start..).map(str::to_owned).collect();
            if component.len() > 1 {
                self.found.push(component);
            }
        }
    }
}
