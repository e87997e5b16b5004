//! The layer graph of docs/ARCHITECTURE.md, checked against Cargo's own
//! view of the workspace: each crate may depend only on crates of a lower
//! layer. Cargo then stops any module from naming a higher layer, so this
//! test is what keeps "layers only look down" true (issue 19).

use std::collections::BTreeMap;
use std::process::Command;

use serde_json::Value;

/// Each workspace crate and its layer, bottom up. Crates on one layer may
/// not depend on each other either.
const LAYERS: &[(&str, u32)] = &[
    ("keelfs-base", 0),
    ("keelfs-bdev", 1),
    ("keelfs-reactor", 2),
    ("keelfs-fs", 3),
    ("keelfs-vhost", 4),
    ("keelfsd", 5),
    ("keelfs-bench", 6),
    ("keelfs-fuzz", 6),
];

/// (crate, workspace crates it depends on, with the dependency's kind).
fn workspace_edges() -> Vec<(String, Vec<(String, String)>)> {
    let out = Command::new(env!("CARGO"))
        .args(["metadata", "--format-version", "1", "--no-deps", "--offline"])
        .current_dir(concat!(env!("CARGO_MANIFEST_DIR"), "/.."))
        .output()
        .expect("run cargo metadata");
    assert!(out.status.success(), "cargo metadata: {}", String::from_utf8_lossy(&out.stderr));
    let meta: Value = serde_json::from_slice(&out.stdout).expect("metadata JSON");
    let packages = meta["packages"].as_array().expect("packages");
    let names: Vec<&str> = packages.iter().map(|p| p["name"].as_str().expect("name")).collect();
    packages
        .iter()
        .map(|p| {
            let deps = p["dependencies"]
                .as_array()
                .expect("dependencies")
                .iter()
                .filter(|d| names.contains(&d["name"].as_str().expect("dep name")))
                .map(|d| (d["name"].as_str().unwrap().to_owned(), d["kind"].as_str().unwrap_or("normal").to_owned()))
                .collect();
            (p["name"].as_str().unwrap().to_owned(), deps)
        })
        .collect()
}

/// The edges that break the layering: a dependency on the same or a higher
/// layer. A crate's dev-dependency on itself only turns on a feature for
/// its own tests and is allowed.
fn upward_edges(edges: &[(String, Vec<(String, String)>)], layers: &BTreeMap<&str, u32>) -> Vec<String> {
    let mut wrong = Vec::new();
    for (from, deps) in edges {
        let from_layer = layers[from.as_str()];
        for (to, kind) in deps {
            if to == from && kind == "dev" {
                continue;
            }
            if layers[to.as_str()] >= from_layer {
                wrong.push(format!("{from} -> {to} ({kind})"));
            }
        }
    }
    wrong
}

#[test]
fn every_crate_depends_only_on_lower_layers() {
    let layers: BTreeMap<&str, u32> = LAYERS.iter().copied().collect();
    let edges = workspace_edges();
    let crates: Vec<&str> = edges.iter().map(|(name, _)| name.as_str()).collect();
    for name in &crates {
        assert!(layers.contains_key(name), "{name} is in the workspace but not in LAYERS: give it a layer");
    }
    assert_eq!(crates.len(), LAYERS.len(), "LAYERS names a crate the workspace lacks: {crates:?}");
    let wrong = upward_edges(&edges, &layers);
    assert!(wrong.is_empty(), "dependencies against the layering: {wrong:?}");
    // Each layer uses the one under it, so the graph is the stack that
    // ARCHITECTURE.md draws and not merely free of cycles.
    for (upper, lower) in
        [("keelfs-bdev", "keelfs-base"), ("keelfs-reactor", "keelfs-bdev"), ("keelfs-fs", "keelfs-reactor")]
    {
        let deps = &edges.iter().find(|(n, _)| n == upper).unwrap().1;
        assert!(deps.iter().any(|(to, kind)| to == lower && kind == "normal"), "{upper} no longer uses {lower}");
    }
}

#[test]
fn an_upward_edge_is_caught() {
    let layers: BTreeMap<&str, u32> = LAYERS.iter().copied().collect();
    let edges = vec![
        ("keelfs-bdev".to_owned(), vec![("keelfs-fs".to_owned(), "dev".to_owned())]),
        ("keelfs-fs".to_owned(), vec![("keelfs-fs".to_owned(), "dev".to_owned())]),
        ("keelfs-vhost".to_owned(), vec![("keelfs-fs".to_owned(), "normal".to_owned())]),
    ];
    assert_eq!(upward_edges(&edges, &layers), vec!["keelfs-bdev -> keelfs-fs (dev)".to_owned()]);
}

/// The daemon modules that configuration may use: parsing a config names
/// what to serve, and never reaches into the code that serves it (issue
/// 35 broke a config.rs <-> serve.rs cycle).
const CONFIG_MAY_USE: &[&str] = &["sandbox"];

/// The `crate::MODULE` paths a source file names.
fn crate_modules(source: &str) -> Vec<String> {
    let mut named: Vec<String> = source
        .match_indices("crate::")
        .map(|(at, token)| {
            let rest = &source[at + token.len()..];
            rest.chars().take_while(|c| c.is_alphanumeric() || *c == '_').collect()
        })
        .collect();
    named.sort();
    named.dedup();
    named
}

#[test]
fn config_uses_no_module_that_serves() {
    let source = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/src/config.rs")).unwrap();
    let named = crate_modules(&source);
    assert!(!named.is_empty(), "config.rs names no crate module: has the check lost its input?");
    let above: Vec<&String> = named.iter().filter(|m| !CONFIG_MAY_USE.contains(&m.as_str())).collect();
    assert!(above.is_empty(), "config.rs uses {above:?}: configuration must not depend on serving");
    assert_eq!(crate_modules("use crate::serve::Cache; crate::sandbox::X"), ["sandbox", "serve"]);
}
