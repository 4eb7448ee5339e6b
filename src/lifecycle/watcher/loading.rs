//! How the watcher loads a new version: on a loader thread of its own at a
//! lower priority than serving, and under the repository's name and version
//! number, holding the version's localized files while it serves.

use std::sync::Arc;

use narsil_core::{BackendError, BackendFactory, ModelBackend, ModelSchema};
use tokio::sync::oneshot;

use crate::lifecycle::repository::Localized;

/// Niceness of the thread that reads and prepares a new version: serving
/// threads come first, so loading a version takes the CPU time they leave.
const LOADER_NICENESS: libc::c_int = 10;

/// Runs `work` on a thread of its own at [`LOADER_NICENESS`].
pub(super) async fn on_loader_thread<T: Send + 'static>(
    work: impl FnOnce() -> T + Send + 'static,
) -> Result<T, String> {
    let (done, result) = oneshot::channel();
    std::thread::Builder::new()
        .name("narsil-loader".into())
        .spawn(move || {
            // On Linux a thread's niceness is its own (the calling thread's id).
            // SAFETY: gettid takes no arguments, touches no memory and cannot fail.
            let tid = unsafe { libc::syscall(libc::SYS_gettid) } as libc::id_t;
            // SAFETY: setpriority takes plain integers and touches no memory;
            // `tid` is this thread's own id, so only this thread's niceness
            // changes, and a failure is returned, not raised.
            if unsafe { libc::setpriority(libc::PRIO_PROCESS, tid, LOADER_NICENESS) } != 0 {
                tracing::debug!("cannot lower the loader thread's priority; loading at normal priority");
            }
            let _ = done.send(work());
        })
        .map_err(|e| format!("cannot start a loader thread: {e}"))?;
    result.await.map_err(|_| "loading ended abnormally (the loader panicked)".to_string())
}

/// A loaded model under the repository's name and version number, holding
/// its localized files while it serves (lanes may read them).
pub(super) struct VersionedFactory {
    pub(super) inner: Arc<dyn BackendFactory>,
    pub(super) schema: ModelSchema,
    pub(super) _files: Localized,
}

impl BackendFactory for VersionedFactory {
    fn schema(&self) -> &ModelSchema {
        &self.schema
    }

    fn create_lane(&self, lane: usize) -> Result<Box<dyn ModelBackend>, BackendError> {
        self.inner.create_lane(lane)
    }

    fn takes_request_level(&self) -> bool {
        self.inner.takes_request_level()
    }

    fn dense_flops_per_sample(&self) -> Option<f64> {
        self.inner.dense_flops_per_sample()
    }

    fn warmup_rows(&self) -> Vec<usize> {
        self.inner.warmup_rows()
    }

    fn register_metrics(&self, registry: &mut prometheus_client::registry::Registry) {
        self.inner.register_metrics(registry);
    }

    fn watch_dependencies(&self, watcher: narsil_core::DependencyWatcher) {
        self.inner.watch_dependencies(watcher);
    }

    fn push_ids(&self, push: &narsil_core::IdPush<'_>) -> Result<narsil_core::IdsPushed, String> {
        self.inner.push_ids(push)
    }

    fn id_map_tables(&self) -> Vec<narsil_core::IdMapTable> {
        self.inner.id_map_tables()
    }
}
