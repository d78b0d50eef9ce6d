//! A range's queue: what its committer serves. Callers that wait for a decision send a
//! [`Request`] with a reply channel; background work (pool fills and syncs) is [`enqueue`]d.

use tokio::sync::{mpsc, oneshot};

use super::decide::{Op, Reply};

pub(super) struct Request {
    pub op: Op,
    /// None for background work (pool fills and syncs) nobody waits for.
    pub reply: Option<oneshot::Sender<Reply>>,
}

/// Queue background work for a range's committer; dropped when the queue is full (a later
/// pop asks again).
pub(super) fn enqueue(queue: &mpsc::Sender<Request>, op: Op) {
    let _ = queue.try_send(Request { op, reply: None });
}
