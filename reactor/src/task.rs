//! Task bodies that outlive their futures.
//!
//! Every request a transport serves is a task, and a task's future lives
//! in a box. Allocating and freeing that box per request was the one heap
//! allocation left on the metadata path (issue 34). A body here is an
//! `Option<F>` in a pinned box: when the future finishes it is dropped in
//! place, and the empty box waits in [`IdleBodies`] for the next future
//! of the same type, which a steady stream of like requests always is.
//!
//! A request's future is large (the vhost poller's is 3,200 bytes: the
//! whole serving path's state), and each move of an opaque future is a
//! copy of its whole size. Passed down by value through the reactor's
//! thread-local closures and a type-erased pool, it was copied five
//! times per spawn (callgrind, bench/callgrind-builds.sh), which cost
//! more than the allocation it saved. So a finished body goes back
//! through its own typed code (`retire`, a `Pin<Box<Self>>` receiver) to
//! a pool of its own type, and `spawn_local` takes an empty one from
//! there, typed ([`IdleBodies::take_empty`]), and writes the future in
//! with `Pin::set` in its own frame: two copies, where `Box::pin` made
//! one.
//!
//! All of it is safe code. A pinned body is only ever replaced whole
//! (`Pin::set`), never moved out of, and the pools are found by `TypeId`
//! and downcast, so a pool only ever holds bodies of its own type.

use std::any::{Any, TypeId};
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

/// A task's future in a box that can take the next one of its type.
pub(crate) trait TaskBody {
    /// Poll the future. Once it is ready the body is empty, the future
    /// dropped in place, and every later poll answers ready.
    fn poll_body(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()>;

    /// Give this empty body back to `idle`, to the pool of its type.
    fn retire(self: Pin<Box<Self>>, idle: &mut IdleBodies);

    fn is_empty(&self) -> bool;
}

impl<F: Future<Output = ()> + 'static> TaskBody for Option<F> {
    fn poll_body(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        let Some(future) = self.as_mut().as_pin_mut() else { return Poll::Ready(()) };
        let ready = future.poll(cx);
        if ready.is_ready() {
            // Drop the future now, with whatever it holds, not when the
            // box is next used.
            self.set(None);
        }
        ready
    }

    fn retire(self: Pin<Box<Self>>, idle: &mut IdleBodies) {
        debug_assert!(self.is_none(), "only a finished task's body is kept");
        if let Some(pool) = idle.pool::<F>() {
            if pool.len() < IDLE_BODIES_PER_TYPE {
                pool.push(self);
            }
        }
    }

    fn is_empty(&self) -> bool {
        self.is_none()
    }
}

/// A task as the reactor keeps it.
pub(crate) type LocalFuture = Pin<Box<dyn TaskBody>>;

/// The idle bodies of one future type.
type Pool<F> = Vec<Pin<Box<Option<F>>>>;

/// Future types whose empty bodies are kept. A reactor runs few: one per
/// transport's request task, plus timers and background jobs.
const IDLE_TYPES_MAX: usize = 16;

/// Empty bodies kept per type: the swing in requests in flight between
/// two ticks that reuses a box instead of allocating one. A burst deeper
/// than this frees the rest when it drains.
const IDLE_BODIES_PER_TYPE: usize = 64;

/// The empty bodies of finished tasks, by future type, bounded.
#[derive(Default)]
pub(crate) struct IdleBodies {
    /// Each type's `Pool<F>`, boxed as `dyn Any`.
    by_type: Vec<(TypeId, Box<dyn Any>)>,
}

impl IdleBodies {
    /// An empty body for a future of type `F`, idle since its last task
    /// finished, if one is kept. The caller writes the future in with
    /// `Pin::set` in its own frame: passed down by value through the
    /// reactor's thread-local and this pool instead, a 3 KiB future was
    /// copied at each of five calls that the compiler did not inline.
    pub(crate) fn take_empty<F: Future<Output = ()> + 'static>(&mut self) -> Option<Pin<Box<Option<F>>>> {
        let body = self.pool::<F>()?.pop()?;
        assert!(body.is_none(), "an idle body holds a future");
        Some(body)
    }

    /// A body holding `future`: an idle one of its type when there is one,
    /// else a new box.
    #[cfg(test)]
    fn body_for<F: Future<Output = ()> + 'static>(&mut self, future: F) -> LocalFuture {
        let mut body = self.take_empty::<F>().unwrap_or_else(|| Box::pin(None));
        body.set(Some(future));
        body
    }

    /// Keep the body of a finished task for the next future of its type,
    /// or free it when that type's pool, or the list of types, is full.
    pub(crate) fn give_back(&mut self, body: LocalFuture) {
        debug_assert!(body.is_empty(), "only a finished task's body is kept");
        body.retire(self);
    }

    /// The pool of bodies for futures of type `F`, made on first use; None
    /// once [`IDLE_TYPES_MAX`] types have pools.
    fn pool<F: Future<Output = ()> + 'static>(&mut self) -> Option<&mut Pool<F>> {
        let wanted = TypeId::of::<F>();
        let at = match self.by_type.iter().position(|(t, _)| *t == wanted) {
            Some(at) => at,
            None if self.by_type.len() < IDLE_TYPES_MAX => {
                self.by_type.push((wanted, Box::new(Pool::<F>::with_capacity(IDLE_BODIES_PER_TYPE))));
                self.by_type.len() - 1
            }
            None => return None,
        };
        let pool = self.by_type[at].1.downcast_mut::<Pool<F>>();
        assert!(pool.is_some(), "a pool filed under another type");
        pool
    }

    /// Bodies kept for futures of `like`'s type.
    #[cfg(test)]
    fn kept<F: Future<Output = ()> + 'static>(&self, _like: &F) -> usize {
        let wanted = TypeId::of::<F>();
        let pool = self.by_type.iter().find(|(t, _)| *t == wanted);
        pool.and_then(|(_, p)| p.downcast_ref::<Pool<F>>()).map_or(0, Vec::len)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::Cell;
    use std::rc::Rc;
    use std::task::Waker;

    fn poll(body: &mut LocalFuture) -> Poll<()> {
        body.as_mut().poll_body(&mut Context::from_waker(Waker::noop()))
    }

    /// A future that finishes at once, and counts its drops.
    fn counted(drops: &Rc<Cell<u32>>) -> impl Future<Output = ()> + 'static {
        struct OnDrop(Rc<Cell<u32>>);
        impl Drop for OnDrop {
            fn drop(&mut self) {
                self.0.set(self.0.get() + 1);
            }
        }
        let guard = OnDrop(Rc::clone(drops));
        async move {
            let _guard = guard;
        }
    }

    fn address(body: &LocalFuture) -> *const () {
        std::ptr::from_ref(&**body).cast()
    }

    #[test]
    fn a_finished_body_takes_the_next_future_of_its_type() {
        let mut idle = IdleBodies::default();
        let drops = Rc::new(Cell::new(0));
        let mut body = idle.body_for(counted(&drops));
        let first = address(&body);
        assert!(poll(&mut body).is_ready());
        assert_eq!(drops.get(), 1, "a finished future is dropped in place at once");
        idle.give_back(body);
        let next = counted(&drops);
        assert_eq!(idle.kept(&next), 1);
        let mut again = idle.body_for(next);
        assert_eq!(address(&again), first, "the same box holds the next future");
        assert_eq!(idle.kept(&counted(&drops)), 0);
        assert_eq!(drops.get(), 2, "the probe future above was dropped");
        assert!(poll(&mut again).is_ready());
        assert_eq!(drops.get(), 3);
        assert!(poll(&mut again).is_ready(), "an empty body stays ready");
    }

    #[test]
    fn a_body_never_takes_a_future_of_another_type() {
        async fn quiet() {}
        let mut idle = IdleBodies::default();
        let mut body = idle.body_for(quiet());
        let kept_at = address(&body);
        assert!(poll(&mut body).is_ready());
        idle.give_back(body);
        let mut other = idle.body_for(async {
            std::hint::black_box(7u64);
        });
        assert_ne!(address(&other), kept_at, "another type's future gets a box of its own");
        assert_eq!(idle.kept(&quiet()), 1, "the idle body of the first type is still kept");
        assert!(poll(&mut other).is_ready());
    }

    #[test]
    fn idle_bodies_are_bounded() {
        let mut idle = IdleBodies::default();
        let drops = Rc::new(Cell::new(0));
        let mut bodies: Vec<LocalFuture> =
            (0..IDLE_BODIES_PER_TYPE + 10).map(|_| idle.body_for(counted(&drops))).collect();
        for body in &mut bodies {
            assert!(poll(body).is_ready());
        }
        for body in bodies {
            idle.give_back(body);
        }
        assert_eq!(idle.kept(&counted(&drops)), IDLE_BODIES_PER_TYPE);
    }

    #[test]
    fn the_types_kept_are_bounded() {
        fn finished_body_of<F: Future<Output = ()> + 'static>(idle: &mut IdleBodies, future: F) {
            let mut body = idle.body_for(future);
            assert!(poll(&mut body).is_ready());
            idle.give_back(body);
        }
        let mut idle = IdleBodies::default();
        macro_rules! types {
            ($($n:literal)*) => { $( finished_body_of(&mut idle, async { std::hint::black_box($n); }); )* };
        }
        types!(0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19);
        assert_eq!(idle.by_type.len(), IDLE_TYPES_MAX);
    }
}
