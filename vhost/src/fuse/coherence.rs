//! Coherence between the clients of one export (issue 34): what one
//! session changes, the kernels of the others are told to forget.
//!
//! Only a client that can be told joins as a listener: a host mount,
//! through FUSE notifications written to /dev/fuse
//! (FUSE_NOTIFY_INVAL_ENTRY for names, FUSE_NOTIFY_INVAL_INODE for
//! attributes and pages). A virtio-fs guest cannot be told: Linux's
//! driver has no notification queue, so a guest that shares an export
//! keeps names and attributes only for short timeouts instead (see
//! [`super::dispatch::CacheMode::session_config_for`]). Every session
//! publishes its changes, so the host mount beside a guest sees the
//! guest's changes at once, and may itself cache for long.
//!
//! Listeners are called on the export's reactor, in the order the
//! changes were made; a listener must not block (the host mount's
//! hands the message to a writer thread: see `dev_fuse`).

use std::cell::{Cell, RefCell};
use std::rc::Rc;

use keelfs_fs::Ino;

use super::abi::{Reply, OUT_HEADER_BYTES};

/// fuse_notify_code.
const NOTIFY_INVAL_INODE: u32 = 2;
const NOTIFY_INVAL_ENTRY: u32 = 3;

/// What one session changed that another client may hold in its cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Change<'a> {
    /// A name in `parent` was added, removed or replaced.
    Entry { parent: Ino, name: &'a [u8] },
    /// `ino`'s attributes changed, and with `pages` the file data in
    /// that byte range (offset, length; a length of 0 runs to the end).
    Inode { ino: Ino, pages: Option<(u64, u64)> },
}

impl Change<'_> {
    /// The FUSE notification that makes a kernel forget this change.
    pub fn notification(&self) -> Vec<u8> {
        let mut r = Reply::default();
        match *self {
            Change::Entry { parent, name } => {
                // fuse_notify_inval_entry_out, then the name and its NUL.
                let len = OUT_HEADER_BYTES + 16 + name.len() + 1;
                r.u32(len as u32).u32(NOTIFY_INVAL_ENTRY).u64(0);
                r.u64(parent.get()).u32(name.len() as u32).u32(0).raw(name).raw(&[0]);
            }
            Change::Inode { ino, pages } => {
                // fuse_notify_inval_inode_out: an offset of -1 drops the
                // attributes only; a length of 0 runs to the end.
                let (off, len) = match pages {
                    Some((off, len)) => (off.min(i64::MAX as u64) as i64, len.min(i64::MAX as u64) as i64),
                    None => (-1, 0),
                };
                r.u32((OUT_HEADER_BYTES + 24) as u32).u32(NOTIFY_INVAL_INODE).u64(0);
                r.u64(ino.get()).u64(off as u64).u64(len as u64);
            }
        }
        r.bytes
    }
}

/// A listener: takes one notification's bytes, and must not block.
pub type Listener = Rc<dyn Fn(&[u8])>;

/// The sessions of one export that publish changes, and those that
/// listen. Lives on the export's reactor.
#[derive(Default)]
pub struct Coherence {
    listeners: RefCell<Vec<(u64, Listener)>>,
    next_member: Cell<u64>,
    /// Notifications handed to listeners.
    sent: Cell<u64>,
}

impl Coherence {
    pub fn new() -> Rc<Self> {
        Rc::new(Self::default())
    }

    /// A member id for a session that publishes.
    pub fn member(&self) -> u64 {
        let id = self.next_member.get() + 1;
        self.next_member.set(id);
        id
    }

    /// `member` listens from now on: it is told of the others' changes.
    pub fn listen(&self, member: u64, listener: Listener) {
        let mut listeners = self.listeners.borrow_mut();
        assert!(listeners.iter().all(|(m, _)| *m != member), "a member listens once");
        listeners.push((member, listener));
    }

    /// `member` is gone: it is told nothing more.
    pub fn leave(&self, member: u64) {
        self.listeners.borrow_mut().retain(|(m, _)| *m != member);
    }

    /// Whether anyone but `member` listens: the cost of a change is paid
    /// only then.
    pub fn has_listeners_besides(&self, member: u64) -> bool {
        self.listeners.borrow().iter().any(|(m, _)| *m != member)
    }

    /// Tell every listener but `from` of `changes`.
    pub fn publish(&self, from: u64, changes: &[Change<'_>]) {
        // Cloned out, so that a listener may leave or join while called.
        let listeners: Vec<Listener> =
            self.listeners.borrow().iter().filter(|(m, _)| *m != from).map(|(_, l)| Rc::clone(l)).collect();
        for change in changes {
            let message = change.notification();
            for listener in &listeners {
                listener(&message);
                self.sent.set(self.sent.get() + 1);
            }
        }
    }

    /// Notifications handed to listeners so far.
    pub fn sent(&self) -> u64 {
        self.sent.get()
    }
}

impl std::fmt::Debug for Coherence {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Coherence")
            .field("listeners", &self.listeners.borrow().len())
            .field("sent", &self.sent.get())
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn notifications_have_the_kernels_layout() {
        let entry = Change::Entry { parent: Ino::new(5), name: b"abc" }.notification();
        assert_eq!(entry.len(), 16 + 16 + 4);
        assert_eq!(u32::from_le_bytes(entry[..4].try_into().unwrap()) as usize, entry.len());
        assert_eq!(u32::from_le_bytes(entry[4..8].try_into().unwrap()), NOTIFY_INVAL_ENTRY);
        assert_eq!(&entry[16..24], &5u64.to_le_bytes());
        assert_eq!(&entry[24..28], &3u32.to_le_bytes());
        assert_eq!(&entry[32..], b"abc\0");
        let attrs = Change::Inode { ino: Ino::new(9), pages: None }.notification();
        assert_eq!(attrs.len(), 40);
        assert_eq!(i64::from_le_bytes(attrs[24..32].try_into().unwrap()), -1, "attributes only");
        let pages = Change::Inode { ino: Ino::new(9), pages: Some((4096, 8192)) }.notification();
        assert_eq!(i64::from_le_bytes(pages[24..32].try_into().unwrap()), 4096);
        assert_eq!(i64::from_le_bytes(pages[32..40].try_into().unwrap()), 8192);
    }

    #[test]
    fn a_member_is_not_told_of_its_own_changes() {
        let c = Coherence::new();
        let (guest, host) = (c.member(), c.member());
        let heard = Rc::new(RefCell::new(Vec::new()));
        let h = Rc::clone(&heard);
        assert!(!c.has_listeners_besides(guest));
        c.listen(host, Rc::new(move |m: &[u8]| h.borrow_mut().push(m.to_vec())));
        assert!(c.has_listeners_besides(guest) && !c.has_listeners_besides(host));
        c.publish(host, &[Change::Inode { ino: Ino::new(2), pages: None }]);
        assert!(heard.borrow().is_empty(), "the host's own change");
        c.publish(
            guest,
            &[Change::Entry { parent: Ino::new(1), name: b"x" }, Change::Inode { ino: Ino::new(1), pages: None }],
        );
        assert_eq!(heard.borrow().len(), 2);
        assert_eq!(c.sent(), 2);
        c.leave(host);
        c.publish(guest, &[Change::Inode { ino: Ino::new(1), pages: None }]);
        assert_eq!(heard.borrow().len(), 2, "a member that left hears nothing");
    }
}
