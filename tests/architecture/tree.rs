//! A crate's module tree, read from its source files the way rustc finds them (`mod x;` is
//! `x.rs` or `x/mod.rs` beside the declaring file's own folder), leaving out what only tests
//! compile (`#[cfg(test)]`), as `cargo build` sees the crate.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// One module: its path from the crate root and the items it holds itself.
pub struct Module {
    /// Its own items, its child modules left out (each is a [`Module`] of its own).
    pub items: Vec<syn::Item>,
    /// The names of its child modules.
    pub children: BTreeSet<String>,
    /// The names of the items it defines (types, functions, constants, traits, macros).
    pub defines: BTreeSet<String>,
}

/// Every module of a crate by path (`crate`, `crate::a`, `crate::a::b`).
pub type Tree = BTreeMap<String, Module>;

/// Reads the crate whose root file is `lib`.
pub fn load(lib: &Path) -> Result<Tree, String> {
    let mut tree = Tree::new();
    let dir = lib.parent().ok_or("the crate root has no folder")?.to_path_buf();
    let items = parse(lib)?.items;
    add("crate", items, &dir, &mut tree)?;
    Ok(tree)
}

fn parse(file: &Path) -> Result<syn::File, String> {
    let text = std::fs::read_to_string(file).map_err(|e| format!("{}: {e}", file.display()))?;
    syn::parse_file(&text).map_err(|e| format!("{}: {e}", file.display()))
}

/// Adds the module at `path` holding `items`; `dir` is where its `mod x;` files are.
fn add(path: &str, items: Vec<syn::Item>, dir: &Path, tree: &mut Tree) -> Result<(), String> {
    let mut module = Module { items: Vec::new(), children: BTreeSet::new(), defines: BTreeSet::new() };
    for item in items {
        if test_only(item_attrs(&item)) {
            continue;
        }
        let syn::Item::Mod(m) = item else {
            module.defines.extend(defined_name(&item));
            module.items.push(item);
            continue;
        };
        let name = m.ident.to_string();
        let child = format!("{path}::{name}");
        let child_dir = dir.join(&name);
        let child_items = match m.content {
            Some((_, items)) => items,
            None => parse(&module_file(dir, &name)?)?.items,
        };
        add(&child, child_items, &child_dir, tree)?;
        module.children.insert(name);
    }
    tree.insert(path.to_owned(), module);
    Ok(())
}

fn module_file(dir: &Path, name: &str) -> Result<PathBuf, String> {
    let flat = dir.join(format!("{name}.rs"));
    let nested = dir.join(name).join("mod.rs");
    [flat, nested].into_iter().find(|f| f.is_file()).ok_or_else(|| format!("{}: no file for `mod {name};`", dir.display()))
}

fn defined_name(item: &syn::Item) -> Option<String> {
    let ident = match item {
        syn::Item::Const(i) => &i.ident,
        syn::Item::Enum(i) => &i.ident,
        syn::Item::Fn(i) => &i.sig.ident,
        syn::Item::Macro(i) => i.ident.as_ref()?,
        syn::Item::Static(i) => &i.ident,
        syn::Item::Struct(i) => &i.ident,
        syn::Item::Trait(i) => &i.ident,
        syn::Item::TraitAlias(i) => &i.ident,
        syn::Item::Type(i) => &i.ident,
        syn::Item::Union(i) => &i.ident,
        _ => return None,
    };
    Some(ident.to_string())
}

/// Whether the attributes hold a `cfg` that only tests meet: `cfg(test)` or `cfg(all(test, ..))`
/// (not `cfg(not(test))` nor `cfg(any(test, ..))`).
pub fn test_only(attrs: &[syn::Attribute]) -> bool {
    attrs.iter().any(|a| a.path().is_ident("cfg") && matches!(&a.meta, syn::Meta::List(list) if needs_test(list.tokens.clone())))
}

fn needs_test(predicate: proc_macro2::TokenStream) -> bool {
    use proc_macro2::TokenTree;
    let tokens: Vec<TokenTree> = predicate.into_iter().collect();
    match tokens.as_slice() {
        [TokenTree::Ident(i)] => i == "test",
        [TokenTree::Ident(i), TokenTree::Group(g)] if i == "all" => split_commas(g.stream()).into_iter().any(needs_test),
        _ => false,
    }
}

fn split_commas(stream: proc_macro2::TokenStream) -> Vec<proc_macro2::TokenStream> {
    let mut parts = vec![proc_macro2::TokenStream::new()];
    for t in stream {
        match &t {
            proc_macro2::TokenTree::Punct(p) if p.as_char() == ',' => parts.push(proc_macro2::TokenStream::new()),
            _ => parts.last_mut().expect("never empty").extend([t]),
        }
    }
    parts
}

/// The attributes of any item.
pub fn item_attrs(item: &syn::Item) -> &[syn::Attribute] {
    match item {
        syn::Item::Const(i) => &i.attrs,
        syn::Item::Enum(i) => &i.attrs,
        syn::Item::ExternCrate(i) => &i.attrs,
        syn::Item::Fn(i) => &i.attrs,
        syn::Item::ForeignMod(i) => &i.attrs,
        syn::Item::Impl(i) => &i.attrs,
        syn::Item::Macro(i) => &i.attrs,
        syn::Item::Mod(i) => &i.attrs,
        syn::Item::Static(i) => &i.attrs,
        syn::Item::Struct(i) => &i.attrs,
        syn::Item::Trait(i) => &i.attrs,
        syn::Item::TraitAlias(i) => &i.attrs,
        syn::Item::Type(i) => &i.attrs,
        syn::Item::Union(i) => &i.attrs,
        syn::Item::Use(i) => &i.attrs,
        _ => &[],
    }
}
