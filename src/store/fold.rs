//! One fold of a kube-runtime watch into state, for every watch of the store layer (as
//! `agent/src/watch.rs` does for the node agent): each object is read into what the state
//! keeps of it as it arrives; a (re-)list is buffered and handed over whole, so the state
//! never mixes two lists; single changes are handed over as they come.

use std::fmt::Debug;

use futures::StreamExt;
use kube::runtime::watcher::{self, Event};
use kube::runtime::WatchStreamExt;
use kube::Api;
use serde::de::DeserializeOwned;
use tracing::warn;

/// One change a watch brings, as what was read of each object.
#[derive(Debug)]
pub enum Change<T> {
    /// A list completed (the first, or a re-list after an interruption): everything that
    /// exists now, replacing whatever was known before.
    Replace(Vec<T>),
    /// An object was created or changed.
    Apply(T),
    /// An object was deleted (as last seen).
    Delete(T),
}

/// The watch's configuration: its (re-)lists are consistent reads (no resourceVersion), never
/// served from an apiserver's watch cache (`resourceVersion=0`), which in an HA control plane
/// can be older than what this watch has already seen: a relist must never take back what
/// the view showed (docs/backends.md, "Address blocks").
fn config() -> watcher::Config {
    watcher::Config::default().list_semantic(watcher::ListSemantic::MostRecent)
}

/// Watch every object of `api` until the stream ends (kube-runtime's watcher re-lists and
/// retries with backoff on its own): `read` each object, hand each change to `on`. Watch
/// errors are logged as `what`'s and otherwise ignored.
pub async fn fold<K, T>(api: Api<K>, what: &'static str, read: impl Fn(&K) -> T, mut on: impl FnMut(Change<T>))
where
    K: kube::Resource + Clone + DeserializeOwned + Debug + Send + 'static,
{
    let mut stream = watcher::watcher(api, config()).default_backoff().boxed();
    let mut relist: Option<Vec<T>> = None;
    while let Some(ev) = stream.next().await {
        match ev {
            Ok(Event::Init) => relist = Some(Vec::new()),
            Ok(Event::InitApply(o)) => {
                if let Some(list) = relist.as_mut() {
                    list.push(read(&o));
                }
            }
            Ok(Event::InitDone) => on(Change::Replace(relist.take().unwrap_or_default())),
            Ok(Event::Apply(o)) => on(Change::Apply(read(&o))),
            Ok(Event::Delete(o)) => on(Change::Delete(read(&o))),
            Err(e) => warn!(error = %e, "{what} watch failed; retrying"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn relists_are_consistent_reads() {
        assert_eq!(config().list_semantic, watcher::ListSemantic::MostRecent);
    }
}
