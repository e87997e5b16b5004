//! The inventory of unsafe code in docs/ARCHITECTURE.md ("Unsafe code")
//! names exactly the files that have some: a file that gains unsafe code
//! must be listed, with what it does, and one that loses it unlisted.

use std::collections::BTreeSet;
use std::path::Path;
use std::process::Command;

/// The repository's root: this crate sits one level below it.
fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("base/ has a parent")
}

/// The files the inventory lists: each a bullet that starts with a path.
fn listed() -> BTreeSet<String> {
    let doc = std::fs::read_to_string(root().join("docs/ARCHITECTURE.md")).expect("docs/ARCHITECTURE.md");
    let start = doc.find("\n## Unsafe code\n").expect("an \"Unsafe code\" section");
    let section = &doc[start + 1..];
    let section = section[3..].find("\n## ").map_or(section, |end| &section[..end + 3]);
    section
        .lines()
        .filter_map(|line| line.strip_prefix("- `"))
        .filter_map(|rest| rest.split_once('`'))
        .map(|(path, _)| path.to_string())
        .filter(|path| path.ends_with(".rs"))
        .collect()
}

/// Whether a line of Rust, outside comments, has unsafe code: a block,
/// fn, impl or extern block.
fn has_unsafe_code(line: &str) -> bool {
    let code = line.split("//").next().unwrap_or("");
    let mut rest = code;
    while let Some(at) = rest.find("unsafe") {
        let before = rest[..at].chars().next_back();
        let after = rest[at + "unsafe".len()..].trim_start();
        let word_start = before.is_none_or(|c| !(c.is_alphanumeric() || c == '_'));
        let kind = after.starts_with('{') || ["fn ", "impl ", "impl<", "extern "].iter().any(|k| after.starts_with(k));
        if word_start && kind {
            return true;
        }
        rest = &rest[at + "unsafe".len()..];
    }
    false
}

/// The tracked Rust files with unsafe code.
fn found() -> BTreeSet<String> {
    // Fails, rather than skips, without git: CI's checkout has it.
    let out = Command::new("git").args(["ls-files", "*.rs"]).current_dir(root()).output().expect("git runs");
    assert!(out.status.success(), "git ls-files: {}", String::from_utf8_lossy(&out.stderr));
    let files = String::from_utf8(out.stdout).expect("UTF-8 paths");
    files
        .lines()
        .filter(|path| {
            let text = std::fs::read_to_string(root().join(path)).unwrap_or_default();
            text.lines().any(has_unsafe_code)
        })
        .map(str::to_string)
        .collect()
}

#[test]
fn the_unsafe_inventory_lists_exactly_the_files_with_unsafe_code() {
    let (listed, found) = (listed(), found());
    assert!(found.len() > 10, "the scan found only {found:?}");
    let unlisted: Vec<_> = found.difference(&listed).collect();
    let stale: Vec<_> = listed.difference(&found).collect();
    assert!(
        unlisted.is_empty() && stale.is_empty(),
        "docs/ARCHITECTURE.md \"Unsafe code\": unsafe code in files it does not list: {unlisted:?}; listed \
         without any: {stale:?}"
    );
}

#[test]
fn the_scan_sees_blocks_fns_impls_and_externs_but_not_comments_or_names() {
    // Spelled in two pieces, so that this file's own source has no line
    // the scan would count.
    let kw = concat!("uns", "afe");
    for code in [
        format!("let x = {kw} {{ f() }};"),
        format!("pub {kw} fn g() {{}}"),
        format!("{kw} impl Send for X {{}}"),
        format!("{kw} extern \"C\" {{"),
    ] {
        assert!(has_unsafe_code(&code), "{code}");
    }
    for other in [
        format!("// {kw} {{ f() }}"),
        format!("#![deny({kw}_code)]"),
        format!("let not_{kw} = 1;"),
        format!("fn f() {{}} // {kw} fn"),
    ] {
        assert!(!has_unsafe_code(&other), "{other}");
    }
}
