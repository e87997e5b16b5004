//! The image fuzzer's corpus, run in CI on the stable toolchain: a
//! generated set (fixed seed, bounded count), the inputs kept in
//! `fuzz/corpus/image/` (what AFL++ runs grew and minimised, and every
//! crash found, once fixed), and a few hand-made ones at the format's
//! edges. `scripts/fuzz.sh --afl --target image` runs the same harness
//! under AFL++, coverage-guided.

use keelfs_fuzz::image::{generated_image_inputs, ImageHarness};

#[test]
fn the_generated_image_corpus_runs_clean() {
    let mut harness = ImageHarness::new();
    for input in generated_image_inputs(0x1ea6e, 150) {
        harness.run(&input);
    }
}

#[test]
fn the_kept_image_corpus_runs_clean() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("corpus/image");
    let mut paths: Vec<_> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|entry| entry.expect("a corpus entry").path())
        .filter(|path| path.file_name().and_then(|n| n.to_str()).is_some_and(|n| !n.ends_with(".md")))
        .collect();
    paths.sort();
    assert!(paths.len() >= 20, "the kept corpus has {} inputs: it was lost", paths.len());
    let mut harness = ImageHarness::new();
    for path in paths {
        let input = std::fs::read(&path).expect("a corpus input");
        eprintln!("{}", path.display());
        harness.run(&input);
    }
}

#[test]
fn image_inputs_at_the_edges_run_clean() {
    let mut harness = ImageHarness::new();
    let edges: [&[u8]; 7] = [
        // The image as built: it mounts, and its workload runs.
        &[],
        // A patch header cut short, and one whose bytes run past the input.
        &[1, 0],
        &[1, 40, 0, 31, 0xff],
        // Both superblock copies' extent counts past their limit, sealed.
        &[0, 100, 0, 4, 0xff, 0xff, 0, 0, 4, 100, 0, 4, 0xff, 0xff, 0, 0],
        // A transaction's payload length at its largest, sealed.
        &[1, 36, 0, 4, 0xff, 0xff, 0xff, 0xff],
        // A checkpoint block's payload length past the block, sealed.
        &[2, 20, 0, 4, 0xff, 0x0f, 0, 0],
        // A raw journal block of ones, its neighbours left alone.
        &[7, 0, 0, 8 | 0x80, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff],
    ];
    for input in edges {
        harness.run(input);
    }
}
