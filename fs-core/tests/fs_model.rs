//! Model-based property test: random namespace and data operations,
//! clones (copy_file_range) and snapshots run against keelfs and against a
//! simple in-memory model. Each operation must
//! succeed or fail the same way in both; afterwards the trees are equal,
//! fsck is clean, and both still hold after a remount.

mod common;

use keelfs_fs::FileOffset;
use std::collections::{BTreeMap, HashMap};

use common::{busy_reactor, check, format, mount, ram_device};
use keelfs_fs::Ino;
use keelfs_fs::RenameMode;
use keelfs_fs::ROOT_INO;
use keelfs_fs::{Creds, Fs, SetAttr};
use proptest::prelude::*;

const NAMES: [&str; 4] = ["a", "b", "c", "d"];

#[derive(Clone, Debug)]
enum Op {
    Create {
        dir: usize,
        name: usize,
    },
    Mkdir {
        dir: usize,
        name: usize,
    },
    Unlink {
        dir: usize,
        name: usize,
    },
    Rmdir {
        dir: usize,
        name: usize,
    },
    Rename {
        dir: usize,
        name: usize,
        to_dir: usize,
        to_name: usize,
        flags: u32,
    },
    Link {
        dir: usize,
        name: usize,
        to_dir: usize,
        to_name: usize,
    },
    Write {
        file: usize,
        offset: u64,
        len: usize,
        seed: u8,
    },
    Truncate {
        file: usize,
        size: u64,
    },
    /// copy_file_range: block-aligned offsets clone (share) whole blocks.
    Copy {
        file: usize,
        to_file: usize,
        from: u64,
        to: u64,
        len: u64,
    },
    SnapshotCreate {
        name: usize,
    },
    SnapshotDelete {
        name: usize,
    },
    Sync,
    Remount,
}

const SNAPSHOT_NAMES: [&str; 3] = ["s0", "s1", "s2"];

fn op() -> impl Strategy<Value = Op> {
    let idx = 0usize..8;
    let name = 0usize..NAMES.len();
    prop_oneof![
        4 => (idx.clone(), name.clone()).prop_map(|(dir, name)| Op::Create { dir, name }),
        2 => (idx.clone(), name.clone()).prop_map(|(dir, name)| Op::Mkdir { dir, name }),
        2 => (idx.clone(), name.clone()).prop_map(|(dir, name)| Op::Unlink { dir, name }),
        1 => (idx.clone(), name.clone()).prop_map(|(dir, name)| Op::Rmdir { dir, name }),
        2 => (idx.clone(), name.clone(), idx.clone(), name.clone(), prop_oneof![Just(0u32), Just(1), Just(2)])
            .prop_map(|(dir, name, to_dir, to_name, flags)| Op::Rename { dir, name, to_dir, to_name, flags }),
        1 => (idx.clone(), name.clone(), idx.clone(), name.clone())
            .prop_map(|(dir, name, to_dir, to_name)| Op::Link { dir, name, to_dir, to_name }),
        4 => (idx.clone(), 0u64..300_000, 1usize..70_000, any::<u8>())
            .prop_map(|(file, offset, len, seed)| Op::Write { file, offset, len, seed }),
        1 => (idx.clone(), 0u64..200_000).prop_map(|(file, size)| Op::Truncate { file, size }),
        2 => (idx.clone(), idx.clone(), offset(), offset(), 1u64..120_000)
            .prop_map(|(file, to_file, from, to, len)| Op::Copy { file, to_file, from, to, len }),
        1 => (0usize..SNAPSHOT_NAMES.len()).prop_map(|name| Op::SnapshotCreate { name }),
        1 => (0usize..SNAPSHOT_NAMES.len()).prop_map(|name| Op::SnapshotDelete { name }),
        1 => Just(Op::Sync),
        1 => Just(Op::Remount),
    ]
}

/// A file offset: a whole block most of the time, so that copies share.
fn offset() -> impl Strategy<Value = u64> {
    prop_oneof![3 => (0u64..40).prop_map(|b| b * 4096), 1 => 0u64..160_000]
}

#[derive(Clone, Debug, PartialEq, Eq)]
enum Node {
    Dir,
    File(u64),
}

/// The reference: paths to nodes, and file contents by identity (hard
/// links share one).
#[derive(Default, Debug)]
struct Model {
    tree: BTreeMap<String, Node>,
    data: HashMap<u64, Vec<u8>>,
    next_id: u64,
    /// Each snapshot's view of the tree when it was taken.
    snapshots: BTreeMap<&'static str, BTreeMap<String, Option<Vec<u8>>>>,
}

fn join(dir: &str, name: &str) -> String {
    format!("{dir}/{name}")
}

impl Model {
    fn dirs(&self) -> Vec<String> {
        let mut d = vec![String::new()];
        d.extend(self.tree.iter().filter(|(_, n)| **n == Node::Dir).map(|(p, _)| p.clone()));
        d
    }
    fn files(&self) -> Vec<String> {
        self.tree.iter().filter(|(_, n)| matches!(n, Node::File(_))).map(|(p, _)| p.clone()).collect()
    }
    fn children(&self, dir: &str) -> usize {
        let prefix = format!("{dir}/");
        self.tree.keys().filter(|p| p.starts_with(&prefix) && !p[prefix.len()..].contains('/')).count()
    }
    fn create(&mut self, path: String, dir: bool) -> Result<(), i32> {
        if self.tree.contains_key(&path) {
            return Err(libc::EEXIST);
        }
        let node = if dir {
            Node::Dir
        } else {
            self.next_id += 1;
            self.data.insert(self.next_id, Vec::new());
            Node::File(self.next_id)
        };
        self.tree.insert(path, node);
        Ok(())
    }
    fn remove(&mut self, path: &str, dir: bool) -> Result<(), i32> {
        match (self.tree.get(path), dir) {
            (None, _) => Err(libc::ENOENT),
            (Some(Node::Dir), false) => Err(libc::EISDIR),
            (Some(Node::File(_)), true) => Err(libc::ENOTDIR),
            (Some(Node::Dir), true) if self.children(path) > 0 => Err(libc::ENOTEMPTY),
            _ => {
                self.tree.remove(path);
                Ok(())
            }
        }
    }
    fn rename(&mut self, from: &str, to: &str, flags: u32) -> Result<(), i32> {
        let src = self.tree.get(from).cloned().ok_or(libc::ENOENT)?;
        let dst = self.tree.get(to).cloned();
        if flags == 2 {
            let dst = dst.ok_or(libc::ENOENT)?;
            if from == to {
                return Ok(());
            }
            if (src == Node::Dir && to.starts_with(&format!("{from}/")))
                || (dst == Node::Dir && from.starts_with(&format!("{to}/")))
            {
                return Err(libc::EINVAL);
            }
            let (a, b) = (self.subtree(from), self.subtree(to));
            for (k, _) in a.iter().chain(b.iter()) {
                self.tree.remove(k);
            }
            for (k, v) in a {
                self.tree.insert(format!("{to}{}", &k[from.len()..]), v);
            }
            for (k, v) in b {
                self.tree.insert(format!("{from}{}", &k[to.len()..]), v);
            }
            return Ok(());
        }
        if dst.is_some() && flags == 1 {
            return Err(libc::EEXIST);
        }
        if from == to || (dst.is_some() && dst == Some(src.clone()) && src != Node::Dir) {
            return Ok(());
        }
        if src == Node::Dir && to.starts_with(&format!("{from}/")) {
            return Err(libc::EINVAL);
        }
        match (&src, &dst) {
            (Node::File(_), Some(Node::Dir)) => return Err(libc::EISDIR),
            (Node::Dir, Some(Node::File(_))) => return Err(libc::ENOTDIR),
            (Node::Dir, Some(Node::Dir)) if self.children(to) > 0 => return Err(libc::ENOTEMPTY),
            _ => {}
        }
        self.tree.remove(to);
        for (k, v) in self.subtree(from) {
            self.tree.remove(&k);
            self.tree.insert(format!("{to}{}", &k[from.len()..]), v);
        }
        Ok(())
    }
    fn subtree(&self, root: &str) -> Vec<(String, Node)> {
        let prefix = format!("{root}/");
        self.tree
            .iter()
            .filter(|(k, _)| *k == root || k.starts_with(&prefix))
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect()
    }
    fn link(&mut self, from: &str, to: &str) -> Result<(), i32> {
        match self.tree.get(from).cloned() {
            None => Err(libc::ENOENT),
            Some(Node::Dir) => Err(libc::EPERM),
            Some(file) => {
                if self.tree.contains_key(to) {
                    return Err(libc::EEXIST);
                }
                self.tree.insert(to.to_string(), file);
                Ok(())
            }
        }
    }
}

async fn resolve(fs: &Fs, path: &str) -> Ino {
    let c = Creds::root();
    let mut ino = ROOT_INO;
    for part in path.split('/').filter(|p| !p.is_empty()) {
        ino = fs.lookup(&c, ino, part.as_bytes()).await.expect("model path exists in keelfs").ino();
    }
    ino
}

fn errno<T>(r: Result<T, keelfs_fs::FsError>) -> Result<(), i32> {
    r.map(|_| ()).map_err(|e| e.errno())
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len).map(|i| seed.wrapping_add((i / 3) as u8)).collect()
}

/// Paths with (length, checksum) of each file: comparable without
/// printing megabytes when they differ.
fn digest(tree: BTreeMap<String, Option<Vec<u8>>>) -> BTreeMap<String, Option<(usize, u32)>> {
    tree.into_iter().map(|(p, d)| (p, d.map(|d| (d.len(), crc32c::crc32c(&d))))).collect()
}

/// Walk keelfs and build the same shape as the model.
async fn snapshot(fs: &Fs) -> BTreeMap<String, Option<Vec<u8>>> {
    let mut out = BTreeMap::new();
    let mut stack = vec![(String::new(), ROOT_INO)];
    while let Some((path, ino)) = stack.pop() {
        let mut off = 0;
        loop {
            let batch = fs.readdir(ino, off, 64).await.unwrap();
            if batch.is_empty() {
                break;
            }
            off = batch.last().unwrap().next_offset;
            for e in batch {
                if *e.name == *b"." || *e.name == *b".." {
                    continue;
                }
                let p = join(&path, std::str::from_utf8(&e.name).unwrap());
                if e.file_type == libc::S_IFDIR {
                    out.insert(p.clone(), None);
                    stack.push((p, e.ino));
                } else {
                    let size = fs.getattr(e.ino).await.unwrap().inode.size;
                    out.insert(p, Some(fs.data().read(e.ino, FileOffset::new(0), size as u32).await.unwrap()));
                }
            }
        }
    }
    out
}

fn model_view(m: &Model) -> BTreeMap<String, Option<Vec<u8>>> {
    m.tree
        .iter()
        .map(|(p, n)| {
            (
                p.clone(),
                match n {
                    Node::Dir => None,
                    Node::File(id) => Some(m.data[id].clone()),
                },
            )
        })
        .collect()
}

/// Writes to the `file`th file, if there is one, in keelfs and the model.
async fn write(fs: &Fs, m: &mut Model, file: usize, offset: u64, len: usize, seed: u8) {
    let files = m.files();
    if files.is_empty() {
        return;
    }
    let path = &files[file % files.len()];
    let ino = resolve(fs, path).await;
    let data = pattern(len, seed);
    fs.data().write(ino, FileOffset::new(offset), &data).await.unwrap();
    let Node::File(id) = m.tree[path] else { unreachable!() };
    let content = m.data.get_mut(&id).unwrap();
    let end = offset as usize + len;
    if content.len() < end {
        content.resize(end, 0);
    }
    content[offset as usize..end].copy_from_slice(&data);
}

/// Truncates the `file`th file, if there is one, in keelfs and the model.
async fn truncate(fs: &Fs, m: &mut Model, file: usize, size: u64) {
    let files = m.files();
    if files.is_empty() {
        return;
    }
    let path = &files[file % files.len()];
    let ino = resolve(fs, path).await;
    fs.setattr(&Creds::root(), ino, &SetAttr { size: Some(size), ..Default::default() }, false).await.unwrap();
    let Node::File(id) = m.tree[path] else { unreachable!() };
    m.data.get_mut(&id).unwrap().resize(size as usize, 0);
}

/// copy_file_range from the `file`th file to the `to_file`th, if there
/// are files, in keelfs and the model (one file with overlapping ranges
/// is EINVAL in both).
async fn copy(fs: &Fs, m: &mut Model, (file, to_file): (usize, usize), from: u64, to: u64, len: u64) {
    let files = m.files();
    if files.is_empty() {
        return;
    }
    let (src, dst) = (&files[file % files.len()], &files[to_file % files.len()]);
    let (src_ino, dst_ino) = (resolve(fs, src).await, resolve(fs, dst).await);
    let got = fs.data().copy_range(src_ino, FileOffset::new(from), dst_ino, FileOffset::new(to), len).await;
    let (Node::File(src_id), Node::File(dst_id)) = (&m.tree[src], &m.tree[dst]) else { unreachable!() };
    // As Linux: the length is cut to the source's end first, and only
    // then are the ranges checked for overlap.
    let source = &m.data[src_id];
    let bytes = source.get(from as usize..).unwrap_or(&[]);
    let bytes = bytes[..bytes.len().min(len as usize)].to_vec();
    let len = bytes.len() as u64;
    if src_id == dst_id && from < to + len && to < from + len {
        assert!(matches!(got, Err(keelfs_fs::FsError::Invalid(_))), "overlapping copy: {got:?}");
        return;
    }
    assert_eq!(got.unwrap(), bytes.len() as u64, "bytes copied");
    if bytes.is_empty() {
        return;
    }
    let content = m.data.get_mut(dst_id).unwrap();
    let end = to as usize + bytes.len();
    if content.len() < end {
        content.resize(end, 0);
    }
    content[to as usize..end].copy_from_slice(&bytes);
}

async fn snapshot_op(fs: &Fs, m: &mut Model, name: &'static str, create: bool) {
    let when = keelfs_fs::Timespec { sec: 1_764_000_000, nsec: 0 };
    if create {
        let got = errno(fs.admin().snapshot_create(name, when).await);
        let want = if m.snapshots.contains_key(name) { Err(libc::EEXIST) } else { Ok(()) };
        assert_eq!(got, want, "snapshot_create {name}");
        if got.is_ok() {
            let view = model_view(m);
            m.snapshots.insert(name, view);
        }
    } else {
        let got = errno(fs.admin().snapshot_delete(name).await);
        let want = if m.snapshots.remove(name).is_some() { Ok(()) } else { Err(libc::ENOENT) };
        assert_eq!(got, want, "snapshot_delete {name}");
    }
}

/// Every snapshot of the model, mounted read-only, is the tree it took.
async fn check_snapshots(dev: &std::sync::Arc<dyn keelfs_bdev::BlockDevice>, m: &Model, when: &str) {
    for (name, view) in &m.snapshots {
        let config = keelfs_fs::FsConfig { read_only: true, snapshot: Some(name.to_string()), ..Default::default() };
        let snap = Fs::mount(common::channel(dev), config).await.unwrap();
        assert_eq!(digest(snapshot(&snap).await), digest(view.clone()), "snapshot {name} differs {when}");
        snap.unmount().await.unwrap();
    }
}

async fn apply(fs: &mut Fs, dev: &std::sync::Arc<dyn keelfs_bdev::BlockDevice>, m: &mut Model, op: &Op) {
    let c = Creds::root();
    let dirs = m.dirs();
    let pick = |i: usize| dirs[i % dirs.len()].clone();
    match *op {
        Op::Create { dir, name } | Op::Mkdir { dir, name } => {
            let d = pick(dir);
            let parent = resolve(fs, &d).await;
            let is_dir = matches!(op, Op::Mkdir { .. });
            let got = if is_dir {
                errno(fs.mkdir(&c, parent, NAMES[name].as_bytes(), 0o755).await)
            } else {
                errno(fs.mknod(&c, parent, NAMES[name].as_bytes(), libc::S_IFREG | 0o644, 0).await)
            };
            assert_eq!(got, m.create(join(&d, NAMES[name]), is_dir), "{op:?}");
        }
        Op::Unlink { dir, name } | Op::Rmdir { dir, name } => {
            let d = pick(dir);
            let parent = resolve(fs, &d).await;
            let is_dir = matches!(op, Op::Rmdir { .. });
            let got = if is_dir {
                errno(fs.rmdir(&c, parent, NAMES[name].as_bytes()).await)
            } else {
                errno(fs.unlink(&c, parent, NAMES[name].as_bytes()).await)
            };
            assert_eq!(got, m.remove(&join(&d, NAMES[name]), is_dir), "{op:?}");
        }
        Op::Rename { dir, name, to_dir, to_name, flags } => {
            let (d, t) = (pick(dir), pick(to_dir));
            let (p, tp) = (resolve(fs, &d).await, resolve(fs, &t).await);
            let mode = RenameMode::from_linux(flags).unwrap();
            let got = errno(fs.rename(&c, p, NAMES[name].as_bytes(), tp, NAMES[to_name].as_bytes(), mode).await);
            assert_eq!(got, m.rename(&join(&d, NAMES[name]), &join(&t, NAMES[to_name]), flags), "{op:?}");
        }
        Op::Link { dir, name, to_dir, to_name } => {
            let (d, t) = (pick(dir), pick(to_dir));
            let from = join(&d, NAMES[name]);
            let got = match m.tree.get(&from) {
                None => Err(libc::ENOENT),
                Some(_) => {
                    let ino = resolve(fs, &from).await;
                    let tp = resolve(fs, &t).await;
                    errno(fs.link(&c, ino, tp, NAMES[to_name].as_bytes()).await)
                }
            };
            assert_eq!(got, m.link(&from, &join(&t, NAMES[to_name])), "{op:?}");
        }
        Op::Write { file, offset, len, seed } => write(fs, m, file, offset, len, seed).await,
        Op::Truncate { file, size } => truncate(fs, m, file, size).await,
        Op::Copy { file, to_file, from, to, len } => copy(fs, m, (file, to_file), from, to, len).await,
        Op::SnapshotCreate { name } => snapshot_op(fs, m, SNAPSHOT_NAMES[name], true).await,
        Op::SnapshotDelete { name } => snapshot_op(fs, m, SNAPSHOT_NAMES[name], false).await,
        Op::Sync => fs.sync().await.unwrap(),
        Op::Remount => {
            fs.unmount().await.unwrap();
            *fs = mount(dev).await;
        }
    }
}

/// Run `ops` on a fresh filesystem on `dev` and against the model, then
/// check the tree after a synced crash, after replay and after remount.
fn matches_the_model(dev: std::sync::Arc<dyn keelfs_bdev::BlockDevice>, ops: &[Op]) {
    let mut r = busy_reactor();
    let ops = ops.to_vec();
    r.block_on(async move {
        format(&dev).await;
        let mut fs = mount(&dev).await;
        let mut m = Model::default();
        for op in &ops {
            apply(&mut fs, &dev, &mut m, op).await;
            fs.inspect().assert_invariants();
            fs.inspect().check_block_ownership().unwrap();
        }
        assert_eq!(digest(snapshot(&fs).await), digest(model_view(&m)), "tree differs from the model");
        check_snapshots(&dev, &m, "while mounted").await;
        // A crash right after a sync must keep everything.
        fs.sync().await.unwrap();
        drop(fs);
        let report = check(&dev).await;
        assert!(report.is_clean(), "fsck after a synced crash: {report:?}");
        let fs = mount(&dev).await;
        assert_eq!(digest(snapshot(&fs).await), digest(model_view(&m)), "tree differs after replay");
        fs.unmount().await.unwrap();
        let report = check(&dev).await;
        assert!(report.is_clean(), "fsck after unmount: {report:?}");
        let fs = mount(&dev).await;
        assert_eq!(digest(snapshot(&fs).await), digest(model_view(&m)), "tree differs after remount");
        check_snapshots(&dev, &m, "after remount").await;
    });
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 128, max_shrink_iters: 200, ..ProptestConfig::default() })]

    #[test]
    fn keelfs_matches_the_model(ops in proptest::collection::vec(op(), 1..50)) {
        matches_the_model(ram_device(48 << 20), &ops);
    }
}

proptest! {
    // Fewer cases: each formats an image on the dev cluster.
    #![proptest_config(ProptestConfig { cases: 12, max_shrink_iters: 50, ..ProptestConfig::default() })]

    /// The same on an RBD image: requests complete from librbd's threads.
    #[test]
    fn keelfs_matches_the_model_on_rbd(ops in proptest::collection::vec(op(), 1..50)) {
        let (dev, _image) = common::rbd_device("model", 48 << 20);
        matches_the_model(dev, &ops);
    }
}
