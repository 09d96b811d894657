//! The structure the imports draw: in the gateway (proxy/) and the simulator (sim/), no module
//! uses one that, through any others, uses it back (docs/architecture.md). The graph is read from
//! the source itself ([`tree`], [`uses`], [`graph`]), so the check needs nothing installed and
//! runs with the rest of the suite.

mod graph;
mod tree;
mod uses;

use std::fmt::Write as _;
use std::path::Path;

/// The circles in the crate whose root is `lib` (relative to the workspace), written out with the
/// edges that tie each, or nothing when there are none; panics when the crate can't be read.
fn circles_report(lib: &str) -> (graph::Graph, String) {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..").join(lib);
    let tree = tree::load(&root).unwrap_or_else(|e| panic!("reading {lib}: {e}"));
    let graph = graph::of(&tree);
    let mut report = String::new();
    for circle in graph::circles(&graph) {
        let _ = writeln!(report, "circle of {} modules in {lib}:", circle.len());
        for from in &circle {
            for (to, path) in graph[from].iter().filter(|(to, _)| circle.contains(*to)) {
                let _ = writeln!(report, "    {from} -> {to} (names `{path}`)");
            }
        }
    }
    (graph, report)
}

fn edges(graph: &graph::Graph) -> usize {
    graph.values().map(std::collections::BTreeMap::len).sum()
}

#[test]
fn the_gateway_has_no_import_circle() {
    let (graph, report) = circles_report("proxy/src/lib.rs");
    assert!(report.is_empty(), "{report}");
    // The graph is the crate's: a check that read nothing would pass vacuously.
    assert!(graph.len() > 100 && edges(&graph) > 300, "{} modules, {} edges", graph.len(), edges(&graph));
    assert!(graph["crate::request::leg"].contains_key("crate::gateway"), "a leg reads the gateway's state");
}

#[test]
fn the_simulator_has_no_import_circle() {
    let (graph, report) = circles_report("sim/src/lib.rs");
    assert!(report.is_empty(), "{report}");
    assert!(graph.len() > 30 && edges(&graph) > 80, "{} modules, {} edges", graph.len(), edges(&graph));
    assert!(graph["crate::api::chat"].contains_key("crate::api"), "an endpoint reads the shared state");
}

#[test]
fn finds_circles_closed_in_a_macro_call_or_through_a_renamed_import_and_not_in_tests() {
    let (graph, report) = circles_report("tests/architecture/fixture/lib.rs");
    assert!(report.contains("circle of 2 modules"), "{report}");
    assert!(report.contains("crate::a -> crate::b (names `Beta`)"), "{report}");
    assert!(report.contains("crate::b -> crate::a (names `super::a::Alpha::NAME`)"), "{report}");
    assert!(report.contains("crate::e -> crate::f::inner (names `other::inner::VALUE`)"), "{report}");
    assert!(report.contains("crate::f::inner -> crate::e"), "{report}");
    assert_eq!(report.matches("circle of").count(), 2, "{report}");
    // A re-export leads to where the item is defined and ties nothing itself; the test-only
    // module's import is left out.
    assert!(graph["crate::c"].contains_key("crate::d") && !graph["crate::c"].contains_key("crate"), "{graph:?}");
    assert!(graph["crate"].is_empty(), "{graph:?}");
    assert!(graph["crate::d"].is_empty(), "{graph:?}");
}
