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

use super::{spawn_local, Message, ReactorHandle, SendError};

/// Where one call stands.
enum State<T> {
    /// Not finished; the caller's waker once it has polled.
    Waiting(Option<Waker>),
    /// Finished with the job's output, or None if the target dropped it.
    Done(Option<T>),
}

struct Slot<T> {
    /// One mutex per call, taken once by each side: never contended by
    /// other calls.
    state: Mutex<State<T>>,
}

impl<T> Slot<T> {
    fn new() -> Arc<Self> {
        Arc::new(Slot { state: Mutex::new(State::Waiting(None)) })
    }
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
            match std::mem::replace(&mut *state, State::Done(value)) {
                State::Waiting(waker) => waker,
                done @ State::Done(_) => {
                    *state = done; // finished already: keep the first outcome
                    return;
                }
            }
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

/// Why a call was not sent.
pub enum CallError<T> {
    /// The target's inbox is full: [`Unsent::resend`] it later.
    Full(Unsent<T>),
    /// The target stopped.
    Stopped,
}

/// A call whose message the target's inbox could not take yet.
pub struct Unsent<T> {
    message: Message,
    slot: Arc<Slot<T>>,
}

impl<T> Unsent<T> {
    pub fn resend(self, target: &ReactorHandle) -> Result<Call<T>, CallError<T>> {
        send(target, self.message, self.slot)
    }
}

fn send<T>(target: &ReactorHandle, message: Message, slot: Arc<Slot<T>>) -> Result<Call<T>, CallError<T>> {
    match target.send_boxed(message) {
        Ok(()) => Ok(Call { slot }),
        Err(SendError::Full(message)) => Err(CallError::Full(Unsent { message, slot })),
        // Dropping the message drops the job's reply end: nothing waits.
        Err(SendError::Stopped(_)) => Err(CallError::Stopped),
    }
}

/// Run `job()` on `target` and complete with its output, or with None if
/// the target dropped it unfinished (it stopped).
pub fn call<T, F, Fut>(target: &ReactorHandle, job: F) -> Result<Call<T>, CallError<T>>
where
    T: Send + 'static,
    F: FnOnce() -> Fut + Send + 'static,
    Fut: Future<Output = T> + 'static,
{
    let slot = Slot::new();
    let reply = Reply { slot: Arc::clone(&slot) };
    let message: Message = Box::new(move || {
        spawn_local(async move {
            let value = job().await;
            reply.finish(Some(value));
        })
    });
    send(target, message, slot)
}

/// [`call`], waiting (without blocking the reactor) while the target's
/// inbox is full; None if the target stopped or dropped the job.
pub async fn call_and_wait<T, F, Fut>(target: &ReactorHandle, job: F) -> Option<T>
where
    T: Send + 'static,
    F: FnOnce() -> Fut + Send + 'static,
    Fut: Future<Output = T> + 'static,
{
    let mut attempt = call(target, job);
    loop {
        match attempt {
            Ok(call) => return call.await,
            Err(CallError::Stopped) => return None,
            Err(CallError::Full(unsent)) => {
                super::sleep(std::time::Duration::from_micros(20)).await;
                attempt = unsent.resend(target);
            }
        }
    }
}

/// A one-shot channel from any thread to a task on a reactor: the task
/// awaits the [`Call`], which completes when the [`Completer`] is used,
/// or with None when it is dropped unused (its thread ended early). For
/// waiting on another thread without polling on a timer, which a
/// reactor on a virtual clock would never fire.
pub fn oneshot<T>() -> (Completer<T>, Call<T>) {
    let slot = Slot::new();
    (Completer { reply: Reply { slot: Arc::clone(&slot) } }, Call { slot })
}

/// The sending end of [`oneshot`].
pub struct Completer<T> {
    reply: Reply<T>,
}

impl<T> Completer<T> {
    pub fn complete(self, value: T) {
        self.reply.finish(Some(value));
    }
}

/// The caller's end of [`call`], and the receiving end of [`oneshot`].
pub struct Call<T> {
    slot: Arc<Slot<T>>,
}

impl<T> Future for Call<T> {
    type Output = Option<T>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<T>> {
        let mut state = self.slot.state.lock().unwrap_or_else(|e| e.into_inner());
        match &mut *state {
            State::Done(value) => Poll::Ready(value.take()),
            State::Waiting(Some(w)) if w.will_wake(cx.waker()) => Poll::Pending,
            State::Waiting(waker) => {
                *waker = Some(cx.waker().clone());
                Poll::Pending
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Reactor, ReactorConfig};
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
            let value = call_and_wait(&t, || async { ON_TARGET.with(|c| c.get()) + 1 }).await;
            let thread = call_and_wait(&t, || async { std::thread::current().name().map(str::to_owned) }).await;
            (value, thread)
        });
        assert_eq!(value, Some(42), "the job saw the target's thread-local state");
        assert_eq!(thread.flatten().as_deref(), Some("reactor-1"));
        target.stop();
        join.join().expect("target thread");
    }

    #[test]
    fn a_full_inbox_hands_the_call_back_to_resend() {
        let config = ReactorConfig { id: 2, inbox_capacity: 1, ..ReactorConfig::default() };
        let mut target = Reactor::new(config).expect("target");
        let handle = target.handle();
        let first = call(&handle, || async { 1 }).ok().expect("room for one");
        let Err(CallError::Full(unsent)) = call(&handle, || async { 2 }) else { panic!("the inbox holds one") };
        target.tick(std::time::Instant::now()); // runs the first message, spawning its job
        let second = unsent.resend(&handle).ok().expect("room again");
        // The calls target the reactor that awaits them: allowed, since a
        // message never runs inline.
        assert_eq!(target.block_on(async move { (first.await, second.await) }), (Some(1), Some(2)));
    }

    #[test]
    fn a_call_the_target_drops_completes_with_none() {
        let slot = Slot::<u32>::new();
        let call = Call { slot: Arc::clone(&slot) };
        drop(Reply { slot });
        let mut here = Reactor::new(ReactorConfig::default()).expect("reactor");
        assert_eq!(here.block_on(call), None);
    }
}
