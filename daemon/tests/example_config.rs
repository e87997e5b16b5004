//! The example config in the repository stays valid.

mod common;

#[test]
fn the_example_config_parses() {
    let example = concat!(env!("CARGO_MANIFEST_DIR"), "/../keelfsd.example.toml");
    let text = std::fs::read_to_string(example).unwrap();
    assert!(text.contains("[[export]]"));
    let out = common::keelfsd().args(["serve", "--check", "--config", example]).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let said = String::from_utf8_lossy(&out.stdout);
    assert!(said.contains("export vm1: Uring device /var/lib/keelfs/vm1.img") && said.contains("queues 2"), "{said}");
    assert!(said.contains("export scratch: Pmem"), "{said}");
}
