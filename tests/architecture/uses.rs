//! What one module's own items name: every path in their code and in the macro calls they make
//! (which rustc expands but syn leaves as tokens), each as its segments (`crate::a::B` is
//! `["crate", "a", "B"]`), and the names its `use` declarations bring in. A `use` is not a use
//! by itself: a re-export ties nothing to the module that writes it, and an import counts where
//! the module's code names what it imports. A trait imported only for its methods
//! (`use a::Trait as _`) counts as used.

use crate::tree::{Module, test_only};
use proc_macro2::{Spacing, TokenStream, TokenTree};
use std::collections::BTreeMap;
use syn::visit::Visit;

/// What a module names, before resolving.
#[derive(Default)]
pub struct Uses {
    /// Every path its items write (and every trait it imports as `_`).
    pub paths: Vec<Vec<String>>,
    /// The names its `use` declarations bring in, each with the path it stands for.
    pub aliases: BTreeMap<String, Vec<String>>,
    /// The paths of its glob imports (`use a::b::*` is `["a", "b"]`).
    pub globs: Vec<Vec<String>>,
}

/// Collects what `module`'s items name.
pub fn of(module: &Module) -> Uses {
    let mut uses = Uses::default();
    for item in &module.items {
        uses.visit_item(item);
    }
    uses
}

impl Uses {
    fn add_use(&mut self, prefix: &mut Vec<String>, tree: &syn::UseTree) {
        match tree {
            syn::UseTree::Path(p) => {
                prefix.push(p.ident.to_string());
                self.add_use(prefix, &p.tree);
                prefix.pop();
            }
            syn::UseTree::Name(n) => self.add_leaf(prefix, &n.ident, &n.ident),
            syn::UseTree::Rename(r) => self.add_leaf(prefix, &r.ident, &r.rename),
            syn::UseTree::Glob(_) => self.globs.push(prefix.clone()),
            syn::UseTree::Group(g) => {
                for tree in &g.items {
                    self.add_use(prefix, tree);
                }
            }
        }
    }

    /// `use a::b::{self as c}` names `a::b` and calls it `c`.
    fn add_leaf(&mut self, prefix: &[String], ident: &syn::Ident, alias: &syn::Ident) {
        let mut path = prefix.to_vec();
        if ident != "self" {
            path.push(ident.to_string());
        }
        if alias == "_" {
            self.paths.push(path);
            return;
        }
        let alias = if alias == "self" { path.last().cloned() } else { Some(alias.to_string()) };
        if let Some(alias) = alias {
            self.aliases.insert(alias, path);
        }
    }

    /// The paths in a macro call's tokens: each name, or run of `name::name::..`, not preceded by
    /// `::` (a local variable among them resolves to nothing).
    fn add_token_paths(&mut self, tokens: TokenStream) {
        let mut flat = Vec::new();
        flatten(tokens, &mut flat);
        let mut i = 0;
        while i < flat.len() {
            let Flat::Ident(first) = &flat[i] else {
                i += 1;
                continue;
            };
            let mut path = vec![first.clone()];
            i += 1;
            while let (Some(Flat::Colon2), Some(Flat::Ident(next))) = (flat.get(i), flat.get(i + 1)) {
                path.push(next.clone());
                i += 2;
            }
            self.paths.push(path);
            while matches!(flat.get(i), Some(Flat::Colon2)) {
                i += 1;
            }
        }
    }
}

/// A macro call's tokens as far as paths go: names, `::`, and everything else.
enum Flat {
    Ident(String),
    Colon2,
    Other,
}

fn flatten(tokens: TokenStream, out: &mut Vec<Flat>) {
    let mut joint_colon = false;
    for t in tokens {
        match t {
            TokenTree::Ident(i) => out.push(Flat::Ident(i.to_string())),
            TokenTree::Punct(p) if p.as_char() == ':' => {
                if joint_colon {
                    out.pop();
                    out.push(Flat::Colon2);
                    joint_colon = false;
                    continue;
                }
                out.push(Flat::Other);
                joint_colon = p.spacing() == Spacing::Joint;
                continue;
            }
            TokenTree::Group(g) => {
                out.push(Flat::Other);
                flatten(g.stream(), out);
                out.push(Flat::Other);
            }
            TokenTree::Punct(_) | TokenTree::Literal(_) => out.push(Flat::Other),
        }
        joint_colon = false;
    }
}

impl<'ast> Visit<'ast> for Uses {
    fn visit_item(&mut self, item: &'ast syn::Item) {
        if !test_only(crate::tree::item_attrs(item)) {
            syn::visit::visit_item(self, item);
        }
    }

    fn visit_item_use(&mut self, item: &'ast syn::ItemUse) {
        let mut prefix = Vec::new();
        self.add_use(&mut prefix, &item.tree);
    }

    fn visit_impl_item_fn(&mut self, item: &'ast syn::ImplItemFn) {
        if !test_only(&item.attrs) {
            syn::visit::visit_impl_item_fn(self, item);
        }
    }

    fn visit_path(&mut self, path: &'ast syn::Path) {
        self.paths.push(path.segments.iter().map(|s| s.ident.to_string()).collect());
        syn::visit::visit_path(self, path);
    }

    fn visit_macro(&mut self, mac: &'ast syn::Macro) {
        self.visit_path(&mac.path);
        self.add_token_paths(mac.tokens.clone());
    }

    /// Attributes name derive macros and lint tools, not modules of the crate.
    fn visit_attribute(&mut self, _: &'ast syn::Attribute) {}

    /// `pub(super)` and `pub(in crate::a)` say who may see an item; they use nothing.
    fn visit_visibility(&mut self, _: &'ast syn::Visibility) {}
}
