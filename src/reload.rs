//! Settings read from files that may change while the broker runs — the auth file, the TLS
//! certificate, key and client CA — held in a [`Reloadable`] and read again on `SIGHUP` or when
//! a file's content changes ([`Reloader`]). A file that cannot be used on a reload is logged and
//! the previous value stays in force; the request path only ever clones an `Arc`.

use std::path::PathBuf;
use std::sync::{Arc, RwLock};
use std::time::Duration;

use sha2::{Digest, Sha256};
use tokio::sync::Notify;

/// How often the files are looked at. Well under the 2 s within which a change must be in
/// force; each look reads and hashes a few small files.
const POLL_EVERY: Duration = Duration::from_millis(500);

/// A value read from files, swapped whole on a reload. A std lock, not a tokio one: nothing
/// awaits while holding it, and it is held only to clone or replace an `Arc`.
pub(crate) struct Reloadable<T>(RwLock<Arc<T>>);

impl<T> Reloadable<T> {
    pub(crate) fn new(value: T) -> Self {
        Self(RwLock::new(Arc::new(value)))
    }

    /// The value in force.
    pub(crate) fn current(&self) -> Arc<T> {
        self.0.read().unwrap_or_else(|e| e.into_inner()).clone()
    }

    fn replace(&self, value: T) {
        *self.0.write().unwrap_or_else(|e| e.into_inner()) = Arc::new(value);
    }
}

/// Builds the value from its files, or says why it cannot.
type Load<T> = Box<dyn Fn() -> anyhow::Result<T> + Send + Sync>;

/// One reloadable value and the files it comes from.
trait Source: Send + Sync {
    fn what(&self) -> &str;
    fn files(&self) -> &[PathBuf];
    /// Reads the files again; on success the new value is in force, and the summary says what
    /// it holds.
    fn reload(&self) -> anyhow::Result<String>;
}

struct Entry<T> {
    what: String,
    files: Vec<PathBuf>,
    load: Load<T>,
    summary: fn(&T) -> String,
    target: Arc<Reloadable<T>>,
}

impl<T: Send + Sync> Source for Entry<T> {
    fn what(&self) -> &str {
        &self.what
    }

    fn files(&self) -> &[PathBuf] {
        &self.files
    }

    fn reload(&self) -> anyhow::Result<String> {
        let value = (self.load)()?;
        let summary = (self.summary)(&value);
        self.target.replace(value);
        Ok(summary)
    }
}

/// Reads every watched value again on `SIGHUP`, on [`Reloader::trigger`], and when one of its
/// files changes.
#[derive(Default)]
pub(crate) struct Reloader {
    sources: Vec<Box<dyn Source>>,
    trigger: Arc<Notify>,
}

impl Reloader {
    /// Watches `files`, which `load` reads into `target`'s new value. `summary` describes a
    /// value in a log line (never with a secret).
    pub(crate) fn watch<T: Send + Sync + 'static>(
        &mut self,
        what: &str,
        files: Vec<PathBuf>,
        target: Arc<Reloadable<T>>,
        load: impl Fn() -> anyhow::Result<T> + Send + Sync + 'static,
        summary: fn(&T) -> String,
    ) {
        self.sources.push(Box::new(Entry {
            what: what.to_owned(),
            files,
            load: Box::new(load),
            summary,
            target,
        }));
    }

    /// Asks for a reload of everything, as `SIGHUP` does.
    pub(crate) fn trigger(&self) -> Arc<Notify> {
        self.trigger.clone()
    }

    /// Runs until dropped (aborted): reloads on `SIGHUP`, on a trigger, and on a change.
    pub(crate) async fn run(self) {
        let mut seen: Vec<Vec<Option<[u8; 32]>>> = self
            .sources
            .iter()
            .map(|s| fingerprints(s.files()))
            .collect();
        #[cfg(unix)]
        let mut hangup =
            tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup()).ok();
        let mut every = tokio::time::interval(POLL_EVERY);
        every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            #[cfg(unix)]
            let hup = async {
                match hangup.as_mut() {
                    Some(signal) => {
                        signal.recv().await;
                    }
                    None => std::future::pending().await,
                }
            };
            #[cfg(not(unix))]
            let hup = std::future::pending::<()>();
            let everything = tokio::select! {
                () = hup => {
                    tracing::info!("SIGHUP: reading the auth and TLS files again");
                    true
                }
                () = self.trigger.notified() => true,
                _ = every.tick() => false,
            };
            for (source, seen) in self.sources.iter().zip(seen.iter_mut()) {
                let now = fingerprints(source.files());
                if !everything && now == *seen {
                    continue;
                }
                // Remembered even when the reload fails: a broken file is reported once, not
                // every poll, and its next change is tried again.
                *seen = now;
                match source.reload() {
                    Ok(summary) => tracing::info!("{} reloaded: {summary}", source.what()),
                    Err(e) => tracing::error!(
                        "{} not reloaded, the previous one stays in force: {e:#}",
                        source.what()
                    ),
                }
            }
        }
    }
}

/// A digest of each file's content (`None` while it cannot be read): a change of content is
/// seen whatever the file system's timestamp resolution, and through a replaced symlink (as
/// Kubernetes updates a mounted secret).
fn fingerprints(files: &[PathBuf]) -> Vec<Option<[u8; 32]>> {
    files
        .iter()
        .map(|f| std::fs::read(f).ok().map(|b| Sha256::digest(&b).into()))
        .collect()
}
