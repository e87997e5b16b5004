//! Calls between reactors: run a future on another reactor and await its
//! result on this one (SPDK's send-message-and-call-back, as a future).
//!
//! The job travels through the target's inbox as a message and runs there
//! as a task, so it may use that reactor's thread-local state (an `Fs`).
//! Its result comes back through a slot shared by exactly the two sides of
//! one call; the caller's task is woken by its (thread-safe) waker.

use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Waker};

use super::{spawn_local, ReactorHandle, SendError};

struct Slot<T> {
    /// (result, finished, the caller's waker). One mutex per call, taken
    /// once by each side: never contended by other calls.
    state: Mutex<(Option<T>, bool, Option<Waker>)>,
}

/// The target's end: completes the call, or abandons it when dropped
/// unfinished (the target stopped and dropped the task).
struct Reply<T> {
    slot: Arc<Slot<T>>,
}

impl<T> Reply<T> {
    fn finish(&self, value: Option<T>) {
        let waker = {
            let mut state = self.slot.state.lock().unwrap_or_else(|e| e.into_inner());
            if state.1 {
                return;
            }
            state.0 = value;
            state.1 = true;
            state.2.take()
        };
        if let Some(w) = waker {
            w.wake();
        }
    }
}

impl<T> Drop for Reply<T> {
    fn drop(&mut self) {
        self.finish(None);
    }
}

/// Run `job()` on `target` and complete with its output, or with None if
/// the target dropped it unfinished (it stopped).
pub fn call<T, F, Fut>(target: &ReactorHandle, job: F) -> Result<Call<T>, SendError>
where
    T: Send + 'static,
    F: FnOnce() -> Fut + Send + 'static,
    Fut: Future<Output = T> + 'static,
{
    let slot = Arc::new(Slot { state: Mutex::new((None, false, None)) });
    let reply = Reply { slot: Arc::clone(&slot) };
    target.send(move || {
        spawn_local(async move {
            let value = job().await;
            reply.finish(Some(value));
        })
    })?;
    Ok(Call { slot })
}

/// The caller's end of [`call`].
pub struct Call<T> {
    slot: Arc<Slot<T>>,
}

impl<T> Future for Call<T> {
    type Output = Option<T>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<T>> {
        let mut state = self.slot.state.lock().unwrap_or_else(|e| e.into_inner());
        if state.1 {
            return Poll::Ready(state.0.take());
        }
        match &state.2 {
            Some(w) if w.will_wake(cx.waker()) => {}
            _ => state.2 = Some(cx.waker().clone()),
        }
        Poll::Pending
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::reactor::{Reactor, ReactorConfig};
    use std::cell::Cell;

    thread_local! {
        static ON_TARGET: Cell<u32> = const { Cell::new(0) };
    }

    #[test]
    fn a_call_runs_on_the_target_and_returns_here() {
        let (target, join) = Reactor::spawn(ReactorConfig { id: 1, ..ReactorConfig::default() }, || {
            ON_TARGET.with(|c| c.set(41));
        })
        .expect("target reactor");
        let mut here = Reactor::new(ReactorConfig::default()).expect("reactor");
        let t = target.clone();
        let (value, thread) = here.block_on(async move {
            let value = call(&t, || async { ON_TARGET.with(|c| c.get()) + 1 }).expect("sent").await;
            let thread = call(&t, || async { std::thread::current().name().map(str::to_owned) }).expect("sent").await;
            (value, thread)
        });
        assert_eq!(value, Some(42), "the job saw the target's thread-local state");
        assert_eq!(thread.flatten().as_deref(), Some("reactor-1"));
        target.stop();
        join.join().expect("target thread");
    }

    #[test]
    fn a_call_the_target_drops_completes_with_none() {
        let slot = Arc::new(Slot::<u32> { state: Mutex::new((None, false, None)) });
        let call = Call { slot: Arc::clone(&slot) };
        drop(Reply { slot });
        let mut here = Reactor::new(ReactorConfig::default()).expect("reactor");
        assert_eq!(here.block_on(call), None);
    }
}
