//! The AFL++ harness's fixed cases, run in CI on the stable toolchain: a
//! generated corpus (fixed seed, bounded count) and a few hand-made
//! inputs at the format's edges. `scripts/fuzz.sh --afl` runs the same
//! harness under AFL++, coverage-guided.

use keelfs_fuzz::{generated_inputs, Harness};

#[test]
fn the_generated_corpus_runs_clean() {
    let mut harness = Harness::new();
    for input in generated_inputs(0x5eed, 200) {
        harness.run(&input);
    }
}

#[test]
fn inputs_at_the_formats_edges_run_clean() {
    let mut harness = Harness::new();
    // CREATE "f" (handle 1), a write lock on it by owner 1, then owner
    // 2's F_SETLKW of the same byte: it waits until the harness ends the
    // session's waits, and must then be answered.
    let lk = |op: u8, owner: u8, kind: u8| {
        let mut r = vec![op, 1, 48, 0];
        let mut body = [0u8; 48];
        (body[0], body[8], body[32]) = (1, owner, kind);
        r.extend_from_slice(&body);
        r
    };
    let create = [&[35u8, 0, 18, 0][..], &2u32.to_le_bytes(), &0o100644u32.to_le_bytes(), &[0u8; 8], b"f\0"].concat();
    let blocked = [create, lk(32, 1, 1), lk(33, 2, 1), lk(31, 3, 0)].concat();
    let edges: [&[u8]; 7] = [
        &blocked,
        &[],
        &[0],
        // A body length past the end of the input.
        &[1, 0, 0xff, 0xff, b'x', 0],
        // Unknown opcodes, the largest node id, INIT again, DESTROY.
        &[250, 255, 0, 0, 26, 0, 0, 0, 38, 0, 0, 0],
        // 64 requests and more: the rest is ignored.
        &[3u8, 0, 0, 0].repeat(100),
        // MKDIR "a" in the root, then LOOKUP and RMDIR through the learnt node.
        &[9, 0, 10, 0, 0xed, 1, 0, 0, 0x12, 0, 0, 0, b'a', 0, 1, 0, 2, 0, b'a', 0, 11, 0, 2, 0, b'a', 0],
    ];
    for input in edges {
        harness.run(input);
    }
}
