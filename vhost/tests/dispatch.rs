//! The FUSE dispatcher over keelfs-fs, driven with request bytes as a kernel
//! would send them, including malformed and hostile ones.

use keelfs_fs::FileOffset;
use std::sync::Arc;

use keelfs_bdev::{BlockDevice, MappedDevice, QueueConfig};
use keelfs_fs::Ino;
use keelfs_fs::{mkfs, MkfsOptions};
use keelfs_fs::{Fs, FsConfig};
use keelfs_reactor::DeviceChannel;
use keelfs_reactor::{PollMode, Reactor, ReactorConfig};
use keelfs_vhost::abi::{encode_request, Opcode, Reply};
use keelfs_vhost::{Session, SessionConfig};

mod common;

fn request(opcode: u32, unique: u64, nodeid: u64, body: &[u8]) -> Vec<u8> {
    encode_request(opcode, unique, nodeid, 0, 0, body)
}

/// (error, body) of a reply, after checking its header.
fn reply(bytes: &[u8], unique: u64) -> (i32, Vec<u8>) {
    assert!(bytes.len() >= 16);
    assert_eq!(u32::from_le_bytes(bytes[..4].try_into().unwrap()) as usize, bytes.len());
    assert_eq!(u64::from_le_bytes(bytes[8..16].try_into().unwrap()), unique);
    (i32::from_le_bytes(bytes[4..8].try_into().unwrap()), bytes[16..].to_vec())
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().unwrap())
}

fn init_body() -> Vec<u8> {
    let mut r = Reply::default();
    r.u32(7).u32(38).u32(128 << 10).u32(u32::MAX).u32(0).raw(&[0u8; 44]);
    r.bytes
}

fn with_session(test: impl AsyncFnOnce(Session) + 'static) {
    with_session_config(SessionConfig::default(), test)
}

fn with_session_config(config: SessionConfig, test: impl AsyncFnOnce(Session) + 'static) {
    common::with_fs(async move |fs| test(Session::new(fs, config)).await);
}

fn named(prefix: &[u8], name: &str) -> Vec<u8> {
    [prefix, name.as_bytes(), b"\0"].concat()
}

#[test]
fn init_comes_first_and_negotiates_only_what_is_implemented() {
    with_session(async |s: Session| {
        let early = s.handle(&request(Opcode::Getattr as u32, 1, 1, &[0u8; 16])).await.unwrap();
        assert_eq!(reply(&early, 1).0, -libc::EIO);
        let init = s.handle(&request(Opcode::Init as u32, 2, 0, &init_body())).await.unwrap();
        let (err, body) = reply(&init, 2);
        assert_eq!(err, 0);
        assert_eq!(body.len(), 64);
        assert_eq!(u32::from_le_bytes(body[..4].try_into().unwrap()), 7);
        let flags = u32::from_le_bytes(body[12..16].try_into().unwrap());
        assert_ne!(flags & (1 << 15), 0, "ASYNC_DIO offered");
        assert_eq!(flags & (1 << 16), 0, "no WRITEBACK_CACHE unless configured");
        assert_eq!(flags & (1 << 1), 0, "no POSIX locks: not implemented");
        assert_eq!(u32::from_le_bytes(body[20..24].try_into().unwrap()), 1 << 20, "max_write 1 MiB");
        let old = s
            .handle(&request(Opcode::Init as u32, 3, 0, &{
                let mut b = init_body();
                b[4] = 20;
                b
            }))
            .await
            .unwrap();
        assert_eq!(reply(&old, 3).0, -libc::EPROTO);
    });
}

#[test]
fn namespace_and_data_round_trip() {
    with_session(async |s: Session| {
        s.handle(&request(Opcode::Init as u32, 1, 0, &init_body())).await.unwrap();
        let mkdir = s
            .handle(&request(
                Opcode::Mkdir as u32,
                2,
                1,
                &named(&[0o755u32.to_le_bytes(), 0u32.to_le_bytes()].concat(), "dir"),
            ))
            .await
            .unwrap();
        let (err, body) = reply(&mkdir, 2);
        assert_eq!(err, 0);
        let dir = u64_at(&body, 0);
        let lookup = s.handle(&request(Opcode::Lookup as u32, 3, 1, b"dir\0")).await.unwrap();
        assert_eq!(u64_at(&reply(&lookup, 3).1, 0), dir);
        let create_in = [libc::O_RDWR as u32, 0o644, 0, 0].map(u32::to_le_bytes).concat();
        let created = s.handle(&request(Opcode::Create as u32, 4, dir, &named(&create_in, "f"))).await.unwrap();
        let (err, body) = reply(&created, 4);
        assert_eq!(err, 0);
        let (ino, fh) = (u64_at(&body, 0), u64_at(&body, 128));
        let mut write_in = Reply::default();
        write_in.u64(fh).u64(0).u32(11).u32(0).u64(0).u32(0).u32(0).raw(b"hello world");
        let written = s.handle(&request(Opcode::Write as u32, 5, ino, &write_in.bytes)).await.unwrap();
        let (err, body) = reply(&written, 5);
        assert_eq!((err, u32::from_le_bytes(body[..4].try_into().unwrap())), (0, 11));
        let mut read_in = Reply::default();
        read_in.u64(fh).u64(6).u32(100).u32(0).u64(0).u32(0).u32(0);
        let read = s.handle(&request(Opcode::Read as u32, 6, ino, &read_in.bytes)).await.unwrap();
        assert_eq!(reply(&read, 6), (0, b"world".to_vec()));
        // READDIR reads through a handle OPENDIR gave, as the kernel's does.
        let opened = s.handle(&request(Opcode::Opendir as u32, 70, dir, &[0u8; 8])).await.unwrap();
        let (err, body) = reply(&opened, 70);
        assert_eq!(err, 0);
        let dir_fh = u64_at(&body, 0);
        let mut rd = Reply::default();
        rd.u64(dir_fh).u64(0).u32(4096).u32(0).u64(0).u32(0).u32(0);
        let listing = s.handle(&request(Opcode::Readdir as u32, 7, dir, &rd.bytes)).await.unwrap();
        let (err, body) = reply(&listing, 7);
        assert_eq!(err, 0);
        let names: Vec<String> = {
            let mut at = 0;
            let mut v = Vec::new();
            while at < body.len() {
                let len = u32::from_le_bytes(body[at + 16..at + 20].try_into().unwrap()) as usize;
                v.push(String::from_utf8(body[at + 24..at + 24 + len].to_vec()).unwrap());
                at += (24 + len).div_ceil(8) * 8;
            }
            v
        };
        assert_eq!(names, vec![".", "..", "f"]);
        // A missing name: a negative entry (node id 0) the kernel keeps for
        // the entry timeout, not ENOENT, which it would ask again for.
        let gone = s.handle(&request(Opcode::Lookup as u32, 8, dir, b"nope\0")).await.unwrap();
        let (err, negative) = reply(&gone, 8);
        assert_eq!((err, u64_at(&negative, 0), u64_at(&negative, 16)), (0, 0, 1), "node 0, valid for 1 s");
        assert!(
            s.handle(&request(Opcode::Forget as u32, 9, ino, &1u64.to_le_bytes())).await.is_none(),
            "FORGET has no reply"
        );
    });
}

#[test]
fn hostile_requests_get_errors_and_the_session_lives_on() {
    with_session(async |s: Session| {
        s.handle(&request(Opcode::Init as u32, 1, 0, &init_body())).await.unwrap();
        let unknown = s.handle(&request(4096, 2, 1, &[])).await.unwrap();
        assert_eq!(reply(&unknown, 2).0, -libc::ENOSYS);
        let getlk = s.handle(&request(Opcode::Getlk as u32, 3, 1, &[0u8; 64])).await.unwrap();
        assert_eq!(reply(&getlk, 3).0, -libc::ENOSYS, "an unimplemented op answers ENOSYS");
        let mut lying = request(Opcode::Lookup as u32, 4, 1, b"x\0");
        lying[0] = 200;
        assert_eq!(reply(&s.handle(&lying).await.unwrap(), 4).0, -libc::EINVAL);
        let slash = s.handle(&request(Opcode::Lookup as u32, 5, 1, b"a/b\0")).await.unwrap();
        assert_eq!(reply(&slash, 5).0, -libc::EINVAL);
        let unterminated = s.handle(&request(Opcode::Lookup as u32, 6, 1, b"abc")).await.unwrap();
        assert_eq!(reply(&unterminated, 6).0, -libc::EINVAL);
        let short_write = s.handle(&request(Opcode::Write as u32, 7, 1, &[0u8; 10])).await.unwrap();
        assert_eq!(reply(&short_write, 7).0, -libc::EINVAL);
        let mut huge = Reply::default();
        huge.u64(1).u64(0).u32(u32::MAX).u32(0).u64(0).u32(0).u32(0);
        let claims_more = s.handle(&request(Opcode::Write as u32, 8, 1, &huge.bytes)).await.unwrap();
        assert_eq!(reply(&claims_more, 8).0, -libc::EINVAL, "a write claiming more data than sent");
        let bogus_node = s.handle(&request(Opcode::Getattr as u32, 9, 999_999, &[0u8; 16])).await.unwrap();
        assert_eq!(reply(&bogus_node, 9).0, -libc::ENOENT);
        let mut bad_fh = Reply::default();
        bad_fh.u64(12345).u64(0).u32(10).u32(0).u64(0).u32(0).u32(0);
        let read_bad = s.handle(&request(Opcode::Read as u32, 10, 1, &bad_fh.bytes)).await.unwrap();
        assert_eq!(reply(&read_bad, 10).0, -libc::EBADF);
        assert!(s.handle(&[1, 2, 3]).await.is_none(), "too short to name a request: dropped");
        let mut state = 7u64;
        for len in 0..300usize {
            let junk: Vec<u8> = (0..len)
                .map(|_| {
                    state = state.wrapping_mul(6364136223846793005).wrapping_add(1);
                    (state >> 40) as u8
                })
                .collect();
            let _ = s.handle(&junk).await;
        }
        let fine = s.handle(&request(Opcode::Getattr as u32, 11, 1, &[0u8; 16])).await.unwrap();
        assert_eq!(reply(&fine, 11).0, 0, "still serving after all that");
    });
}

/// (entry timeout seconds, open flags) after INIT, CREATE and OPEN.
async fn cache_behaviour(s: &Session) -> (u64, u32, u32) {
    s.handle(&request(Opcode::Init as u32, 1, 0, &init_body())).await.unwrap();
    let create_in = [libc::O_RDWR as u32, 0o644, 0, 0].map(u32::to_le_bytes).concat();
    let created = s.handle(&request(Opcode::Create as u32, 2, 1, &named(&create_in, "f"))).await.unwrap();
    let (err, body) = reply(&created, 2);
    assert_eq!(err, 0);
    let entry_valid = u64_at(&body, 16);
    let create_flags = u32::from_le_bytes(body[136..140].try_into().unwrap());
    let open_in = [libc::O_RDONLY as u32, 0].map(u32::to_le_bytes).concat();
    let opened = s.handle(&request(Opcode::Open as u32, 3, u64_at(&body, 0), &open_in)).await.unwrap();
    let (err, body) = reply(&opened, 3);
    assert_eq!(err, 0);
    (entry_valid, create_flags, u32::from_le_bytes(body[8..12].try_into().unwrap()))
}

#[test]
fn cache_modes_set_timeouts_and_open_flags() {
    use keelfs_vhost::abi::open_flags::{DIRECT_IO, KEEP_CACHE, NOFLUSH};
    use keelfs_vhost::CacheMode;
    with_session_config(CacheMode::None.session_config(), async |s: Session| {
        let (valid, create, open) = cache_behaviour(&s).await;
        assert_eq!(valid, 0, "none: nothing cached");
        assert_eq!((create & NOFLUSH, open & NOFLUSH), (NOFLUSH, NOFLUSH), "FLUSH does nothing: not asked for");
        let missing = s.handle(&request(Opcode::Lookup as u32, 7, 1, b"missing\0")).await.unwrap();
        assert_eq!(reply(&missing, 7).0, -libc::ENOENT, "none: no negative entry either");
        assert_ne!(create & DIRECT_IO, 0);
        assert_ne!(open & DIRECT_IO, 0, "none: every open is direct");
    });
    with_session_config(CacheMode::Auto.session_config(), async |s: Session| {
        let (valid, _, open) = cache_behaviour(&s).await;
        assert_eq!(valid, 1);
        assert_eq!(open & (DIRECT_IO | KEEP_CACHE), 0, "auto: page cache, dropped at open");
    });
    with_session_config(CacheMode::Always.session_config(), async |s: Session| {
        let (valid, _, open) = cache_behaviour(&s).await;
        assert_eq!(valid, 86_400);
        assert_ne!(open & KEEP_CACHE, 0);
    });
    // A sole client (a guest alone, a host mount no guest shares) keeps
    // names and attributes long, and its pages.
    with_session_config(CacheMode::Auto.session_config_for(keelfs_vhost::Clients::Sole), async |s: Session| {
        let (valid, create, open) = cache_behaviour(&s).await;
        assert_eq!(valid, 86_400, "auto, sole client: names and attributes kept long");
        assert_eq!((create & NOFLUSH, open & NOFLUSH), (NOFLUSH, NOFLUSH));
        assert_eq!((create & DIRECT_IO, open & DIRECT_IO), (0, 0));
        assert_ne!(open & KEEP_CACHE, 0, "auto, sole client: page cache kept across opens");
    });
    // A host mount told of a guest's changes keeps names and attributes
    // long too, but not its pages across opens.
    with_session_config(
        CacheMode::Auto.session_config_for(keelfs_vhost::Clients::SharedNotified),
        async |s: Session| {
            let (valid, _, open) = cache_behaviour(&s).await;
            assert_eq!(valid, 86_400);
            assert_eq!(open & (DIRECT_IO | KEEP_CACHE), 0);
        },
    );
}

/// The WRITEBACK_CACHE flag INIT negotiates in a session with `config`.
fn negotiates_writeback(config: keelfs_vhost::SessionConfig) -> bool {
    let offered = std::rc::Rc::new(std::cell::Cell::new(None));
    let seen = offered.clone();
    with_session_config(config, async move |s: Session| {
        let init = s.handle(&request(Opcode::Init as u32, 1, 0, &init_body())).await.unwrap();
        let (err, body) = reply(&init, 1);
        assert_eq!(err, 0);
        seen.set(Some(u32::from_le_bytes(body[12..16].try_into().unwrap()) & (1 << 16) != 0));
    });
    offered.get().expect("INIT answered")
}

/// A sole client (a host mount no guest shares) gets the writeback cache
/// in the default mode; a shared one only in `always`; `none` never.
#[test]
fn writeback_cache_for_a_sole_client_in_the_default_mode() {
    use keelfs_vhost::{CacheMode, Clients};
    for (mode, sole, shared) in
        [(CacheMode::None, false, false), (CacheMode::Auto, true, false), (CacheMode::Always, true, true)]
    {
        assert_eq!(negotiates_writeback(mode.session_config_for(Clients::Sole)), sole, "{mode:?}, sole client");
        assert_eq!(negotiates_writeback(mode.session_config_for(Clients::Shared)), shared, "{mode:?}, shared");
        let notified = mode.session_config_for(Clients::SharedNotified);
        assert_eq!(negotiates_writeback(notified), shared, "{mode:?}, shared and told of changes");
        assert_eq!(mode.session_config().writeback_cache, shared, "{mode:?}: shared by default");
    }
    assert!(!negotiates_writeback(SessionConfig::default()), "the default session is shared");
}

/// Two sessions on one filesystem (a guest and the host mount): each uses,
/// releases and forgets only its own handles and references, and a second
/// INIT (a guest reboot) gives back only that session's.
#[test]
fn sessions_on_one_filesystem_keep_their_handles_and_references_apart() {
    with_session(async |host: Session| {
        let guest = Session::new(host.fs().clone(), SessionConfig::default());
        for s in [&host, &guest] {
            s.handle(&request(Opcode::Init as u32, 1, 0, &init_body())).await.unwrap();
        }
        let call = async |s: &Session, op: Opcode, unique: u64, nodeid: u64, body: &[u8]| {
            reply(&s.handle(&request(op as u32, unique, nodeid, body)).await.unwrap(), unique)
        };
        let create_in = [libc::O_RDWR as u32, 0o644, 0, 0].map(u32::to_le_bytes).concat();
        let (err, body) = call(&host, Opcode::Create, 2, 1, &named(&create_in, "f")).await;
        assert_eq!(err, 0);
        let (ino, host_fh) = (u64_at(&body, 0), u64_at(&body, 128));
        let io = |fh: u64, len: u32| {
            let mut b = Reply::default();
            b.u64(fh).u64(0).u32(len).u32(0).u64(0).u32(0).u32(0);
            b.bytes
        };
        let write = |fh: u64| [io(fh, 5), b"hello".to_vec()].concat();
        assert_eq!(call(&host, Opcode::Write, 3, ino, &write(host_fh)).await.0, 0);

        // The guest may not use, or close, the host's handle.
        assert_eq!(call(&guest, Opcode::Read, 4, ino, &io(host_fh, 5)).await.0, -libc::EBADF);
        assert_eq!(call(&guest, Opcode::Write, 5, ino, &write(host_fh)).await.0, -libc::EBADF);
        let release = |fh: u64| [fh.to_le_bytes().to_vec(), vec![0u8; 16]].concat();
        assert_eq!(call(&guest, Opcode::Release, 6, ino, &release(host_fh)).await.0, -libc::EBADF);
        assert_eq!(call(&host, Opcode::Read, 7, ino, &io(host_fh, 5)).await, (0, b"hello".to_vec()));

        // A read-only handle of the guest's own: no writes, no fallocate;
        // and no use on another inode.
        let (err, body) = call(&guest, Opcode::Open, 8, ino, &[0u8; 8]).await;
        assert_eq!(err, 0);
        let guest_fh = u64_at(&body, 0);
        assert_eq!(call(&guest, Opcode::Write, 9, ino, &write(guest_fh)).await.0, -libc::EBADF);
        let falloc = [guest_fh.to_le_bytes(), 0u64.to_le_bytes(), 4096u64.to_le_bytes()].concat();
        let falloc = [falloc, 0u32.to_le_bytes().to_vec(), vec![0u8; 4]].concat();
        assert_eq!(call(&guest, Opcode::Fallocate, 10, ino, &falloc).await.0, -libc::EBADF);
        assert_eq!(call(&guest, Opcode::Read, 11, 1, &io(guest_fh, 5)).await.0, -libc::EBADF, "another inode");
        assert_eq!(call(&guest, Opcode::Read, 12, ino, &io(guest_fh, 5)).await, (0, b"hello".to_vec()));

        // The guest reboots: its handle goes, the host's stays.
        guest.handle(&request(Opcode::Init as u32, 13, 0, &init_body())).await.unwrap();
        assert_eq!(call(&guest, Opcode::Read, 14, ino, &io(guest_fh, 5)).await.0, -libc::EBADF);
        assert_eq!(call(&host, Opcode::Read, 15, ino, &io(host_fh, 5)).await, (0, b"hello".to_vec()));

        // Unlinked and closed, the file lives on the host's lookup
        // reference; the guest's FORGETs cannot take it away.
        assert_eq!(call(&host, Opcode::Unlink, 16, 1, b"f\0").await.0, 0);
        assert_eq!(call(&host, Opcode::Release, 17, ino, &release(host_fh)).await.0, 0);
        let mut forget = Reply::default();
        forget.u64(1000);
        assert!(guest.handle(&request(Opcode::Forget as u32, 18, ino, &forget.bytes)).await.is_none());
        assert_eq!(call(&host, Opcode::Getattr, 19, ino, &[0u8; 16]).await.0, 0, "still held by the host");
        let mut forget = Reply::default();
        forget.u64(1);
        assert!(host.handle(&request(Opcode::Forget as u32, 20, ino, &forget.bytes)).await.is_none());
        assert_ne!(call(&host, Opcode::Getattr, 21, ino, &[0u8; 16]).await.0, 0, "freed with its last reference");
    });
}

#[test]
fn a_session_holds_at_most_its_configured_open_handles() {
    let config = SessionConfig { open_handles_max: 4, ..SessionConfig::default() };
    with_session_config(config, async |s: Session| {
        s.handle(&request(Opcode::Init as u32, 1, 0, &init_body())).await.unwrap();
        let create_in = [libc::O_RDWR as u32, 0o644, 0, 0].map(u32::to_le_bytes).concat();
        let (err, body) =
            reply(&s.handle(&request(Opcode::Create as u32, 2, 1, &named(&create_in, "f"))).await.unwrap(), 2);
        assert_eq!(err, 0);
        let (ino, first) = (u64_at(&body, 0), u64_at(&body, 128));
        let open = async |unique: u64| {
            reply(&s.handle(&request(Opcode::Open as u32, unique, ino, &[0u8; 8])).await.unwrap(), unique)
        };
        for unique in 3..6 {
            assert_eq!(open(unique).await.0, 0, "handles 2 to 4 are within the limit");
        }
        assert_eq!(open(6).await.0, -libc::EMFILE, "a fifth handle is past the limit of 4");
        // Closing one makes room again.
        let release = [first.to_le_bytes().to_vec(), vec![0u8; 16]].concat();
        assert_eq!(reply(&s.handle(&request(Opcode::Release as u32, 7, ino, &release)).await.unwrap(), 7).0, 0);
        assert_eq!(open(8).await.0, 0);
    });
}

/// `request` with request extensions appended (fuse_in_header's
/// total_extlen counts them in 8-byte units).
fn with_extensions(mut request: Vec<u8>, extensions: &[u8]) -> Vec<u8> {
    assert!(extensions.len().is_multiple_of(8));
    request.extend_from_slice(extensions);
    let len = request.len() as u32;
    request[0..4].copy_from_slice(&len.to_le_bytes());
    request[36..38].copy_from_slice(&((extensions.len() / 8) as u16).to_le_bytes());
    request
}

/// A FUSE_SECURITY_CTX extension carrying one context.
fn security_context(name: &str, value: &[u8]) -> Vec<u8> {
    let mut body = [value.len() as u32, 0].map(u32::to_le_bytes).concat();
    body.extend_from_slice(name.as_bytes());
    body.push(0);
    body.extend_from_slice(value);
    body.resize(body.len().next_multiple_of(8), 0);
    let mut ext = [(8 + body.len()) as u32, 1].map(u32::to_le_bytes).concat();
    ext.extend_from_slice(&body);
    ext
}

#[test]
fn security_contexts_tmpfiles_statx_and_copy_file_range() {
    with_session(async |s: Session| {
        s.handle(&request(Opcode::Init as u32, 1, 0, &init_body())).await.unwrap();
        // mkdir with an SELinux label: the new directory carries it.
        let mkdir_in = named(&[0o755u32.to_le_bytes(), 0u32.to_le_bytes()].concat(), "labelled");
        let label = b"system_u:object_r:container_file_t:s0\0";
        let req = with_extensions(
            request(Opcode::Mkdir as u32, 2, 1, &mkdir_in),
            &security_context("security.selinux", label),
        );
        let (err, body) = reply(&s.handle(&req).await.unwrap(), 2);
        assert_eq!(err, 0);
        let dir = u64_at(&body, 0);
        let get = request(Opcode::Getxattr as u32, 3, dir, b"\0\0\0\0\0\0\0\0security.selinux\0");
        let (err, body) = reply(&s.handle(&get).await.unwrap(), 3);
        assert_eq!(err, 0);
        assert_eq!(u32::from_le_bytes(body[..4].try_into().unwrap()) as usize, label.len(), "the label's size");

        // O_TMPFILE: the kernel is shown one link, which it takes away.
        let tmp_in = [libc::O_RDWR as u32, 0o600, 0, 0].map(u32::to_le_bytes).concat();
        let (err, body) =
            reply(&s.handle(&request(Opcode::Tmpfile as u32, 4, dir, &named(&tmp_in, "/"))).await.unwrap(), 4);
        assert_eq!(err, 0);
        let (tmp, tmp_fh) = (u64_at(&body, 0), u64_at(&body, 128));
        assert_eq!(u32::from_le_bytes(body[40 + 64..40 + 68].try_into().unwrap()), 1, "entry nlink");
        assert_eq!(s.fs().getattr(Ino::new(tmp)).await.unwrap().inode.nlink, 0, "no name yet");
        let mut write_in = Reply::default();
        write_in.u64(tmp_fh).u64(0).u32(6).u32(0).u64(0).u32(0).u32(0).raw(b"source");
        assert_eq!(reply(&s.handle(&request(Opcode::Write as u32, 5, tmp, &write_in.bytes)).await.unwrap(), 5).0, 0);

        // statx answers btime.
        let statx_in = [0u8; 24];
        let (err, body) = reply(&s.handle(&request(Opcode::Statx as u32, 6, tmp, &statx_in)).await.unwrap(), 6);
        assert_eq!((err, body.len()), (0, 32 + 256));
        let mask = u32::from_le_bytes(body[32..36].try_into().unwrap());
        assert_ne!(mask & 0x800, 0, "STATX_BTIME");
        let btime_sec = u64_at(&body, 32 + 0x50);
        assert_eq!(btime_sec as i64, { s.fs().getattr(Ino::new(tmp)).await.unwrap().inode.btime.sec });

        // copy_file_range from the tmpfile into a new file, in the daemon.
        let create_in = [libc::O_RDWR as u32, 0o644, 0, 0].map(u32::to_le_bytes).concat();
        let (_, body) =
            reply(&s.handle(&request(Opcode::Create as u32, 7, dir, &named(&create_in, "dst"))).await.unwrap(), 7);
        let (dst, dst_fh) = (u64_at(&body, 0), u64_at(&body, 128));
        let mut copy_in = Reply::default();
        copy_in.u64(tmp_fh).u64(2).u64(dst).u64(dst_fh).u64(10).u64(100).u64(0);
        let (err, body) =
            reply(&s.handle(&request(Opcode::CopyFileRange as u32, 8, tmp, &copy_in.bytes)).await.unwrap(), 8);
        assert_eq!((err, u32::from_le_bytes(body[..4].try_into().unwrap())), (0, 4), "copied up to the source's end");
        let data = s.fs().data().read(Ino::new(dst), FileOffset::new(0), 100).await.unwrap();
        assert_eq!(&data[10..], b"urce");
        assert!(data[..10].iter().all(|&b| b == 0));
        // A handle that is not the session's, or flags: refused.
        let mut bad = Reply::default();
        bad.u64(tmp_fh).u64(0).u64(dst).u64(999).u64(0).u64(1).u64(0);
        assert_eq!(
            reply(&s.handle(&request(Opcode::CopyFileRange as u32, 9, tmp, &bad.bytes)).await.unwrap(), 9).0,
            -libc::EBADF
        );
    });
}

/// INIT, then CREATE of "f" (read-write) in the root as request 2:
/// the file's (nodeid, fh).
async fn init_and_create(s: &Session) -> (u64, u64) {
    s.handle(&request(Opcode::Init as u32, 1, 0, &init_body())).await.unwrap();
    let create_in = [libc::O_RDWR as u32, 0o644, 0, 0].map(u32::to_le_bytes).concat();
    let created = s.handle(&request(Opcode::Create as u32, 2, 1, &named(&create_in, "f"))).await.unwrap();
    let (err, body) = reply(&created, 2);
    assert_eq!(err, 0);
    (u64_at(&body, 0), u64_at(&body, 128))
}

/// mtime (seconds) that GETATTR reports for `ino`.
async fn mtime_of(s: &Session, unique: u64, ino: u64) -> u64 {
    let got = s.handle(&request(Opcode::Getattr as u32, unique, ino, &[0u8; 16])).await.unwrap();
    let (err, body) = reply(&got, unique);
    assert_eq!(err, 0);
    u64_at(&body, 16 + 32)
}

/// WRITE with these write_flags of 5 bytes at 0 through `fh`.
async fn write_flagged(s: &Session, unique: u64, ino: u64, fh: u64, write_flags: u32) {
    let mut write_in = Reply::default();
    write_in.u64(fh).u64(0).u32(5).u32(write_flags).u64(0).u32(0).u32(0).raw(b"hello");
    let written = s.handle(&request(Opcode::Write as u32, unique, ino, &write_in.bytes)).await.unwrap();
    assert_eq!(reply(&written, unique).0, 0);
}

/// Under writeback caching the client kernel owns mtime: it sends its
/// copy in a SETATTR, which may overtake the pages it writes back
/// (FUSE_WRITE_CACHE), so those must not stamp the file again. Its own
/// write(2)s and any write on a session without the cache still do.
#[test]
fn pages_written_back_from_a_writeback_cache_keep_the_clients_mtime() {
    use keelfs_vhost::CacheMode;
    const WRITE_CACHE: u32 = 1;
    const PAST: u64 = 1_000_000_000;
    for (mode, kept) in [(CacheMode::Always, true), (CacheMode::Auto, false)] {
        with_session_config(mode.session_config(), async move |s: Session| {
            let (ino, fh) = init_and_create(&s).await;
            let mut setattr_in = Reply::default();
            const FATTR_MTIME: u32 = 1 << 5;
            setattr_in.u32(FATTR_MTIME).u32(0).u64(0).u64(0).u64(0).u64(0).u64(PAST).u64(0);
            setattr_in.raw(&[0u8; 32]);
            let set = s.handle(&request(Opcode::Setattr as u32, 3, ino, &setattr_in.bytes)).await.unwrap();
            assert_eq!(reply(&set, 3).0, 0);
            assert_eq!(mtime_of(&s, 4, ino).await, PAST);
            write_flagged(&s, 5, ino, fh, WRITE_CACHE).await;
            assert_eq!(mtime_of(&s, 6, ino).await == PAST, kept, "{mode:?}: a written-back page");
            write_flagged(&s, 7, ino, fh, 0).await;
            assert!(mtime_of(&s, 8, ino).await > PAST, "{mode:?}: a write(2)");
        });
    }
}

/// LSEEK's whence is turned into SeekTo where the request is parsed:
/// SEEK_DATA and SEEK_HOLE reach the filesystem, any other is EINVAL.
#[test]
fn lseek_finds_data_and_holes_and_refuses_other_whences() {
    with_session(async |s: Session| {
        let (ino, fh) = init_and_create(&s).await;
        let mut write_in = Reply::default();
        write_in.u64(fh).u64(1 << 20).u32(5).u32(0).u64(0).u32(0).u32(0).raw(b"hello");
        assert_eq!(reply(&s.handle(&request(Opcode::Write as u32, 3, ino, &write_in.bytes)).await.unwrap(), 3).0, 0);
        let lseek = |unique: u64, whence: u32| {
            let mut body = Reply::default();
            body.u64(fh).u64(0).u32(whence).u32(0);
            request(Opcode::Lseek as u32, unique, ino, &body.bytes)
        };
        let (err, body) = reply(&s.handle(&lseek(4, libc::SEEK_HOLE as u32)).await.unwrap(), 4);
        assert_eq!((err, u64_at(&body, 0)), (0, 0), "the file starts with a hole");
        let (err, body) = reply(&s.handle(&lseek(5, libc::SEEK_DATA as u32)).await.unwrap(), 5);
        assert_eq!((err, u64_at(&body, 0)), (0, 1 << 20), "its data starts at 1 MiB");
        for (unique, whence) in [(6, libc::SEEK_SET as u32), (7, libc::SEEK_END as u32), (8, 99)] {
            assert_eq!(
                reply(&s.handle(&lseek(unique, whence)).await.unwrap(), unique).0,
                -libc::EINVAL,
                "whence {whence}"
            );
        }
    });
}

/// fallocate's mode and rename2's flags are read where the request is
/// parsed: a mode keelfs lacks is EOPNOTSUPP before the handle is looked
/// at (as vfs_fallocate orders it), punch without KEEP_SIZE is EINVAL, a
/// real punch reaches the file, and flags renameat2 refuses are EINVAL.
#[test]
fn fallocate_modes_and_rename_flags_are_parsed_once() {
    with_session(async |s: Session| {
        let (ino, fh) = init_and_create(&s).await;
        let fallocate = |unique: u64, fh: u64, mode: u32| {
            let mut body = Reply::default();
            body.u64(fh).u64(0).u64(8192).u32(mode).u32(0);
            request(Opcode::Fallocate as u32, unique, ino, &body.bytes)
        };
        let s = &s;
        let err = move |bytes: Vec<u8>, unique: u64| async move { reply(&s.handle(&bytes).await.unwrap(), unique).0 };
        assert_eq!(err(fallocate(3, 0xbad, 0x08), 3).await, -libc::EOPNOTSUPP, "collapse, on a bogus handle");
        assert_eq!(err(fallocate(4, fh, 0x02), 4).await, -libc::EINVAL, "punch without KEEP_SIZE");
        assert_eq!(err(fallocate(5, fh, 0x00), 5).await, 0, "allocate");
        assert_eq!(err(fallocate(6, fh, 0x03), 6).await, 0, "punch");
        assert_eq!(err(fallocate(7, 0xbad, 0x03), 7).await, -libc::EBADF, "a good mode on a bogus handle");
        let rename2 = |unique: u64, flags: u32| {
            let mut body = Reply::default();
            body.u64(1).u32(flags).u32(0).raw(b"f\0g\0");
            request(Opcode::Rename2 as u32, unique, 1, &body.bytes)
        };
        for (unique, flags) in [(8, 3u32), (9, 6), (10, 8)] {
            assert_eq!(err(rename2(unique, flags), unique).await, -libc::EINVAL, "rename2 flags {flags}");
        }
        assert_eq!(err(rename2(11, libc::RENAME_NOREPLACE), 11).await, 0, "a rename with NOREPLACE");
    });
}

/// A FUSE_IOCTL body: fuse_ioctl_in, then `input`.
fn ioctl_body(fh: u64, cmd: u32, input: &[u8], out_size: u32) -> Vec<u8> {
    let mut r = Reply::default();
    r.u64(fh).u32(1 << 4).u32(cmd).u64(0).u32(input.len() as u32).u32(out_size).raw(input);
    r.bytes
}

fn fstrim_range(start: u64, len: u64, minlen: u64) -> Vec<u8> {
    let mut r = Reply::default();
    r.u64(start).u64(len).u64(minlen);
    r.bytes
}

const FITRIM: u32 = 0xC018_5879;

/// Open the root directory and send FITRIM on it as `uid`.
async fn fitrim(s: &Session, unique: u64, uid: u32, cmd: u32, input: &[u8], out_size: u32) -> (i32, Vec<u8>) {
    let opened = s.handle(&request(Opcode::Opendir as u32, unique, 1, &[0u8; 8])).await.unwrap();
    let fh = u64_at(&reply(&opened, unique).1, 0);
    let body = ioctl_body(fh, cmd, input, out_size);
    let bytes = encode_request(Opcode::Ioctl as u32, unique + 1, 1, uid, 0, &body);
    reply(&s.handle(&bytes).await.unwrap(), unique + 1)
}

#[test]
fn fitrim_is_root_only_and_other_ioctls_are_enotty() {
    // A RAM device cannot discard: the trim itself is EOPNOTSUPP.
    with_session(async |s: Session| {
        s.handle(&request(Opcode::Init as u32, 1, 0, &init_body())).await.unwrap();
        let range = fstrim_range(0, u64::MAX, 0);
        assert_eq!(fitrim(&s, 10, 0, FITRIM, &range, 24).await.0, -libc::EOPNOTSUPP);
        assert_eq!(fitrim(&s, 20, 1000, FITRIM, &range, 24).await.0, -libc::EPERM);
        assert_eq!(fitrim(&s, 30, 0, 0x5401, &[], 0).await.0, -libc::ENOTTY, "TCGETS");
        assert_eq!(fitrim(&s, 40, 0, FITRIM, &range[..16], 24).await.0, -libc::EINVAL, "a short range");
        // in_size saying more than came is a parse error, not a read past the end.
        let mut body = ioctl_body(1, FITRIM, &range, 24);
        body[24..28].copy_from_slice(&4096u32.to_le_bytes());
        let (err, _) = reply(&s.handle(&request(Opcode::Ioctl as u32, 50, 1, &body)).await.unwrap(), 50);
        assert!(err < 0);
        // A handle this session does not hold.
        let (err, _) = reply(
            &s.handle(&request(Opcode::Ioctl as u32, 51, 1, &ioctl_body(999, FITRIM, &range, 24))).await.unwrap(),
            51,
        );
        assert_eq!(err, -libc::EBADF);
    });
}

#[test]
fn fitrim_trims_an_image_file_and_replies_with_the_length() {
    use keelfs_base::testing::ScratchFile;
    use keelfs_bdev::{UringDevice, UringOptions};
    let file = ScratchFile::new("vhost-fitrim", 64 << 20);
    let dev: Arc<dyn BlockDevice> = Arc::new(UringDevice::open(&file.path, UringOptions::default()).unwrap());
    let mut reactor = Reactor::new(ReactorConfig { mode: PollMode::Busy, ..ReactorConfig::default() }).unwrap();
    reactor.block_on(async move {
        let ch = || DeviceChannel::attach(dev.open_queue(QueueConfig::default()).unwrap());
        mkfs(ch(), &MkfsOptions { force: true, ..MkfsOptions::default() }).await.unwrap();
        let fs = Fs::mount(ch(), FsConfig::default()).await.unwrap();
        let s = Session::new(fs.clone(), SessionConfig::default());
        s.handle(&request(Opcode::Init as u32, 1, 0, &init_body())).await.unwrap();
        let (err, body) = fitrim(&s, 10, 0, FITRIM, &fstrim_range(0, u64::MAX, 4096), 24).await;
        assert_eq!(err, 0);
        assert_eq!(body.len(), 16 + 24, "fuse_ioctl_out and the range");
        assert_eq!(&body[..16], &[0u8; 16], "result 0, no retry");
        let trimmed = u64_at(&body, 24);
        assert!(trimmed > 32 << 20, "the free space was trimmed: {trimmed}");
        assert_eq!((u64_at(&body, 16), u64_at(&body, 32)), (0, 4096), "start and minlen as given");
        assert_eq!(fs.inspect().counters().discard_bytes, trimmed);
        // Read-only exports refuse it.
        fs.unmount().await.unwrap();
        let ro = Fs::mount(ch(), FsConfig { read_only: true, ..FsConfig::default() }).await.unwrap();
        let s = Session::new(ro, SessionConfig::default());
        s.handle(&request(Opcode::Init as u32, 1, 0, &init_body())).await.unwrap();
        assert_eq!(fitrim(&s, 10, 0, FITRIM, &fstrim_range(0, u64::MAX, 0), 24).await.0, -libc::EROFS);
    });
}

/// The warnings a guest can provoke are limited per session: one guest
/// that fills its disk must not silence another's (they shared one limit
/// per call site).
#[test]
fn each_session_has_its_own_burst_of_failure_warnings() {
    let captured = keelfs_base::testing::CapturedText::default();
    let writer = captured.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_max_level(tracing::Level::WARN)
        .with_ansi(false)
        .with_writer(move || writer.clone())
        .finish();
    tracing::subscriber::with_default(subscriber, || {
        let mut reactor = Reactor::new(ReactorConfig { mode: PollMode::Busy, ..ReactorConfig::default() }).unwrap();
        let dev: Arc<dyn BlockDevice> = Arc::new(MappedDevice::ram(64 << 20, 4096).unwrap());
        reactor.block_on(async move {
            let ch = || DeviceChannel::attach(dev.open_queue(QueueConfig::default()).unwrap());
            mkfs(ch(), &MkfsOptions { force: true, ..MkfsOptions::default() }).await.unwrap();
            // Room for the root only: every mkdir fails with ENOSPC.
            let fs = Fs::mount(ch(), FsConfig { inodes_max: Some(1), ..FsConfig::default() }).await.unwrap();
            for session in
                [Session::new(fs.clone(), SessionConfig::default()), Session::new(fs, SessionConfig::default())]
            {
                session.handle(&request(Opcode::Init as u32, 1, 0, &init_body())).await.unwrap();
                for unique in 2..50 {
                    let mkdir_in = named(&[0o755u32.to_le_bytes(), 0u32.to_le_bytes()].concat(), &format!("d{unique}"));
                    let failed = session.handle(&request(Opcode::Mkdir as u32, unique, 1, &mkdir_in)).await.unwrap();
                    assert_eq!(reply(&failed, unique).0, -libc::ENOSPC);
                }
            }
        });
    });
    let text = captured.text();
    let warned = text.lines().filter(|l| l.contains("request failed")).count();
    assert_eq!(warned, 2 * keelfs_base::LOG_BURST as usize, "each session's burst:\n{text}");
}

/// A host mount's kernel: keeps every notification it is sent.
struct Heard(std::rc::Rc<std::cell::RefCell<Vec<Vec<u8>>>>);

impl keelfs_vhost::Notify for Heard {
    fn queue(&self, message: &[u8]) {
        self.0.borrow_mut().push(message.to_vec());
    }
    fn deliver_now(&self, message: &[u8]) {
        self.queue(message);
    }
}

/// A guest and a host mount on one export (issue 34): each of the
/// guest's changes becomes the FUSE notifications that make the host's
/// kernel forget what it changed, and only the host, which listens, is
/// told; the host's own changes tell nobody.
#[test]
fn a_listening_session_is_told_of_the_others_changes() {
    use std::cell::RefCell;
    use std::rc::Rc;

    use keelfs_vhost::{Coherence, SessionConfig};

    let coherence = Coherence::new();
    let config = SessionConfig { coherence: Some(Rc::clone(&coherence)), ..SessionConfig::default() };
    with_session_config(config.clone(), async move |guest: Session| {
        let host = Rc::new(Session::new(guest.fs().clone(), config));
        let heard: Rc<RefCell<Vec<Vec<u8>>>> = Rc::default();
        host.set_notifier(Box::new(Heard(Rc::clone(&heard))));
        host.listen_for_changes();
        for s in [&guest, &*host] {
            s.handle(&request(Opcode::Init as u32, 1, 0, &init_body())).await.unwrap();
        }
        let call = async |s: &Session, op: Opcode, nodeid: u64, body: &[u8]| {
            reply(&s.handle(&request(op as u32, 9, nodeid, body)).await.unwrap(), 9)
        };
        // (code, nodeid, name or the pages' offset) of each notification
        // heard since the last look.
        let take = || -> Vec<(u32, u64, Vec<u8>)> {
            heard
                .borrow_mut()
                .drain(..)
                .map(|m| {
                    let code = u32::from_le_bytes(m[4..8].try_into().unwrap());
                    let tail = if code == 3 { m[32..m.len() - 1].to_vec() } else { m[24..32].to_vec() };
                    (code, u64_at(&m, 16), tail)
                })
                .collect()
        };
        let attrs_only = (-1i64).to_le_bytes().to_vec();
        let mkdir_in = [0o755u32, 0].map(u32::to_le_bytes).concat();
        let (err, body) = call(&guest, Opcode::Mkdir, 1, &named(&mkdir_in, "d")).await;
        assert_eq!(err, 0);
        let dir = u64_at(&body, 0);
        assert_eq!(take(), vec![(3, 1, b"d".to_vec()), (2, 1, attrs_only.clone())], "a new name, its parent");

        let create_in = [libc::O_RDWR as u32, 0o644, 0, 0].map(u32::to_le_bytes).concat();
        let (err, body) = call(&guest, Opcode::Create, dir, &named(&create_in, "f")).await;
        assert_eq!(err, 0);
        let (ino, fh) = (u64_at(&body, 0), u64_at(&body, 128));
        assert_eq!(take(), vec![(3, dir, b"f".to_vec()), (2, dir, attrs_only.clone())]);
        let mut write = Reply::default();
        write.u64(fh).u64(8192).u32(5).u32(0).u64(0).u32(0).u32(0).raw(b"hello");
        assert_eq!(call(&guest, Opcode::Write, ino, &write.bytes).await.0, 0);
        assert_eq!(take(), vec![(2, ino, 8192u64.to_le_bytes().to_vec())], "the pages written");

        let rename_in = [&dir.to_le_bytes()[..], b"f\0g\0"].concat();
        assert_eq!(call(&guest, Opcode::Rename, dir, &rename_in).await.0, 0);
        let renamed = take();
        assert_eq!(renamed.len(), 4, "{renamed:?}");
        assert_eq!(renamed[..2], [(3, dir, b"f".to_vec()), (3, dir, b"g".to_vec())]);
        assert_eq!(
            call(&guest, Opcode::Rename, dir, &[&dir.to_le_bytes()[..], b"nope\0x\0"].concat()).await.0,
            -libc::ENOENT
        );
        assert!(take().is_empty(), "a failed request changes nothing");

        let mut setattr = Reply::default();
        // fuse_setattr_in: valid = FATTR_MODE, and the mode at byte 68.
        setattr.u32(1).u32(0).raw(&[0u8; 60]).u32(0o600).raw(&[0u8; 16]);
        assert_eq!(setattr.bytes.len(), 88);
        assert_eq!(call(&guest, Opcode::Setattr, ino, &setattr.bytes).await.0, 0);
        assert_eq!(take(), vec![(2, ino, attrs_only.clone())], "a chmod: attributes only");

        assert_eq!(call(&guest, Opcode::Unlink, dir, b"g\0").await.0, 0);
        assert_eq!(take(), vec![(3, dir, b"g".to_vec()), (2, dir, attrs_only.clone())]);
        assert_eq!(call(&host, Opcode::Rmdir, 1, b"d\0").await.0, 0);
        assert!(take().is_empty(), "the host is not told of its own changes");
        assert!(coherence.sent() >= 11, "{coherence:?}");
    });
}

/// A directory larger than a page is listed page by page, each entry
/// once, whether the pages carry attributes or not; each page asks the
/// filesystem only for what fits.
#[test]
fn a_large_directory_is_listed_once_page_by_page() {
    with_session(async |s: Session| {
        s.handle(&request(Opcode::Init as u32, 1, 0, &init_body())).await.unwrap();
        let mknod_in = [0o100644u32, 0, 0, 0].map(u32::to_le_bytes).concat();
        for i in 0..300 {
            let (err, _) = reply(
                &s.handle(&request(Opcode::Mknod as u32, 2, 1, &named(&mknod_in, &format!("entry-{i:03}"))))
                    .await
                    .unwrap(),
                2,
            );
            assert_eq!(err, 0);
        }
        for (opcode, entry_bytes) in [(Opcode::Readdir, 0), (Opcode::Readdirplus, 128)] {
            let (err, open) = reply(&s.handle(&request(Opcode::Opendir as u32, 3, 1, &[0u8; 8])).await.unwrap(), 3);
            assert_eq!(err, 0);
            let fh = u64_at(&open, 0);
            let (mut offset, mut names, mut pages) = (0u64, Vec::new(), 0);
            loop {
                let mut read_in = Reply::default();
                read_in.u64(fh).u64(offset).u32(4096).u32(0).u64(0).u32(0).u32(0);
                let (err, page) = reply(&s.handle(&request(opcode as u32, 4, 1, &read_in.bytes)).await.unwrap(), 4);
                assert_eq!(err, 0);
                assert!(page.len() <= 4096, "a page is at most what was asked for");
                if page.is_empty() {
                    break;
                }
                pages += 1;
                let mut at = 0;
                while at < page.len() {
                    let d = at + entry_bytes;
                    offset = u64_at(&page, d + 8);
                    let len = u32::from_le_bytes(page[d + 16..d + 20].try_into().unwrap()) as usize;
                    names.push(String::from_utf8(page[d + 24..d + 24 + len].to_vec()).unwrap());
                    at = d + (24 + len).div_ceil(8) * 8;
                }
            }
            names.retain(|n| n != "." && n != "..");
            let count = names.len();
            names.sort();
            names.dedup();
            assert_eq!((count, names.len()), (300, 300), "{opcode:?}: every entry, once");
            assert!(pages > 1, "{opcode:?}: more than one page");
        }
    });
}

/// With xattrs off (virtiofsd's default), every xattr request answers
/// ENOSYS, which makes Linux stop sending them, and nothing that needs
/// xattrs (POSIX ACLs, the extended setxattr) is offered. With them on,
/// the same requests reach the filesystem.
#[test]
fn an_export_without_xattrs_answers_enosys_and_offers_no_acls() {
    for xattr in [false, true] {
        let config = SessionConfig { xattr, ..SessionConfig::default() };
        with_session_config(config, async move |s: Session| {
            let (err, body) = reply(&s.handle(&request(Opcode::Init as u32, 1, 0, &init_body())).await.unwrap(), 1);
            assert_eq!(err, 0);
            let flags = u32::from_le_bytes(body[12..16].try_into().unwrap());
            let (posix_acl, setxattr_ext) = (1u32 << 20, 1u32 << 29);
            assert_eq!(flags & (posix_acl | setxattr_ext) != 0, xattr, "ACLs and SETXATTR_EXT offered: {xattr}");
            // fuse_setxattr_in is the extended one where SETXATTR_EXT was
            // negotiated.
            let set_in: &[u32] = if xattr { &[1, 0, 0, 0] } else { &[1, 0] };
            let set = [&set_in.iter().flat_map(|v| v.to_le_bytes()).collect::<Vec<u8>>()[..], b"user.k\0v"].concat();
            let get = [&[64u32, 0].map(u32::to_le_bytes).concat()[..], b"user.k\0"].concat();
            let list = [64u32, 0].map(u32::to_le_bytes).concat();
            let requests = [
                (Opcode::Setxattr, set, 0),
                (Opcode::Getxattr, get, 1),
                (Opcode::Listxattr, list, b"user.k\0".len()),
                (Opcode::Removexattr, b"user.k\0".to_vec(), 0),
            ];
            for (unique, (opcode, body, value_len)) in (2u64..).zip(requests) {
                let (err, body) = reply(&s.handle(&request(opcode as u32, unique, 1, &body)).await.unwrap(), unique);
                if xattr {
                    assert_eq!((err, body.len()), (0, value_len), "{opcode:?} served");
                } else {
                    assert_eq!(err, -libc::ENOSYS, "{opcode:?} refused");
                }
            }
        });
    }
}

/// A write by a writer without CAP_FSETID clears the file's set-id bits,
/// and the host kernel is told to drop the attributes it cached before
/// the write's reply leaves, not through the queue: a stat(1) run right
/// after the write must not see the old mode.
#[test]
fn a_writer_that_clears_set_id_bits_tells_the_kernel_before_the_reply() {
    use std::cell::RefCell;
    use std::rc::Rc;

    use keelfs_vhost::Notify;

    /// What the kernel was told: (delivered before the reply, message).
    type Told = Vec<(bool, Vec<u8>)>;
    #[derive(Clone, Default)]
    struct Kernel(Rc<RefCell<Told>>);
    impl Notify for Kernel {
        fn queue(&self, message: &[u8]) {
            self.0.borrow_mut().push((false, message.to_vec()));
        }
        fn deliver_now(&self, message: &[u8]) {
            self.0.borrow_mut().push((true, message.to_vec()));
        }
    }
    const WRITE_KILL_SUIDGID: u32 = 1 << 2;
    const FATTR_MODE: u32 = 1;

    with_session(async |s: Session| {
        let kernel = Kernel::default();
        s.set_notifier(Box::new(kernel.clone()));
        let (ino, fh) = init_and_create(&s).await;
        let mut setattr = Reply::default();
        setattr.u32(FATTR_MODE).u32(0).raw(&[0u8; 60]).u32(0o6775).raw(&[0u8; 16]);
        assert_eq!(reply(&s.handle(&request(Opcode::Setattr as u32, 3, ino, &setattr.bytes)).await.unwrap(), 3).0, 0);
        assert!(kernel.0.borrow().is_empty(), "a chmod the kernel asked for needs no notification");

        let mut write_in = Reply::default();
        write_in.u64(fh).u64(0).u32(5).u32(WRITE_KILL_SUIDGID).u64(0).u32(0).u32(0).raw(b"hello");
        let write = encode_request(Opcode::Write as u32, 4, ino, 1000, 1000, &write_in.bytes);
        assert_eq!(reply(&s.handle(&write).await.unwrap(), 4).0, 0);
        let told = kernel.0.take();
        assert_eq!(told.len(), 1, "{told:?}");
        let (before_reply, message) = &told[0];
        assert!(before_reply, "the attribute invalidation went through the queue");
        assert_eq!(u32::from_le_bytes(message[4..8].try_into().unwrap()), 2, "FUSE_NOTIFY_INVAL_INODE");
        assert_eq!((u64_at(message, 16), u64_at(message, 24) as i64), (ino, -1), "this inode's attributes only");

        let got = s.handle(&request(Opcode::Getattr as u32, 5, ino, &[0u8; 16])).await.unwrap();
        let (err, body) = reply(&got, 5);
        assert_eq!(err, 0);
        let mode = u32::from_le_bytes(body[16 + 60..16 + 64].try_into().unwrap());
        assert_eq!(mode & 0o7777, 0o775);

        write_in.bytes[20..24].copy_from_slice(&0u32.to_le_bytes());
        let write = encode_request(Opcode::Write as u32, 6, ino, 1000, 1000, &write_in.bytes);
        assert_eq!(reply(&s.handle(&write).await.unwrap(), 6).0, 0);
        assert!(kernel.0.borrow().is_empty(), "a write with nothing to clear tells the kernel nothing");
    });
}

/// READ and WRITE served in guest memory keep the max_write agreed at
/// INIT, as the copying path does: a larger one is left to that path,
/// which refuses the WRITE and cuts the READ.
#[test]
fn in_place_io_keeps_the_agreed_max_write() {
    use keelfs_fs::Fh;
    use keelfs_vhost::InPlaceIo;

    const MAX_WRITE: u32 = 64 << 10;
    let config = SessionConfig { max_write: MAX_WRITE, ..SessionConfig::default() };
    with_session_config(config, async |s: Session| {
        let (ino, fh) = init_and_create(&s).await;
        let (nodeid, fh) = (Ino::new(ino), Fh::new(fh));
        for write in [true, false] {
            let io = |size| InPlaceIo { write, unique: 9, nodeid, fh, offset: 0, size, write_flags: 0, uid: 0, gid: 0 };
            assert_eq!(s.in_place_handle(&io(MAX_WRITE)), Some(false), "write {write}: a buffered handle");
            assert_eq!(s.in_place_handle(&io(MAX_WRITE + 4096)), None, "write {write}: past max_write");
            let other = InPlaceIo { fh: Fh::new(fh.get() + 1), ..io(4096) };
            assert_eq!(s.in_place_handle(&other), None, "write {write}: a handle never opened");
        }
        let mut write_in = Reply::default();
        write_in.u64(fh.get()).u64(0).u32(MAX_WRITE + 4096).u32(0).u64(0).u32(0).u32(0);
        write_in.raw(&vec![7u8; (MAX_WRITE + 4096) as usize]);
        let refused = s.handle(&request(Opcode::Write as u32, 3, ino, &write_in.bytes)).await.unwrap();
        assert_eq!(reply(&refused, 3).0, -libc::EINVAL, "the copying path refuses it");
    });
}
