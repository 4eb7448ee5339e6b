//! Stops retired versions. A retired version leaves routing at once, but
//! the requests routed to it before still hold its [`LiveVersion`]; the
//! last of them to let go (its answer sent) drops it, and its `Drop` hands
//! the engine here, where it is shut down: queue closed, lanes joined, the
//! model's memory released and handed back to the OS. Nothing polls: the drop is the signal, and
//! [`Reaper::finish`] waits for the channel to close (every version handed
//! a sender dropped, and each reaped), as mini-redis drains by channel
//! closure.
//!
//! [`LiveVersion`]: super::LiveVersion

use std::sync::Mutex;

use narsil_engine::Engine;
use tokio::sync::mpsc;
use tokio::task::{JoinHandle, JoinSet};

/// A version whose last holder let go, on its way to being stopped.
pub struct Retired {
    /// The model's name.
    pub model: String,
    /// The version number.
    pub number: u64,
    /// Its engine.
    pub engine: Engine,
}

impl Retired {
    async fn stop(self) {
        self.engine.shutdown().await;
        // Its weights and its lanes' buffers are freed now: hand them back
        // (libtorch's allocator keeps freed pages otherwise, and every
        // retired version would leave some resident).
        narsil_engine::release_freed_memory();
        tracing::info!(model = self.model, version = self.number, "version unloaded");
    }

    /// Stops it on the current runtime, without a reaper (one that is
    /// already finished); with no runtime its lanes are left to end with the
    /// process.
    pub fn stop_detached(self) {
        match tokio::runtime::Handle::try_current() {
            Ok(runtime) => drop(runtime.spawn(self.stop())),
            Err(_) => tracing::warn!(model = self.model, version = self.number, "version left running"),
        }
    }
}

/// Where retired versions go to be stopped.
pub type ReaperSender = mpsc::UnboundedSender<Retired>;

/// The reaper task and the sender new versions get a clone of.
pub struct Reaper {
    sender: Mutex<Option<ReaperSender>>,
    task: Mutex<Option<JoinHandle<()>>>,
}

impl Reaper {
    /// Starts the task. Must be called inside a tokio runtime.
    pub fn start() -> Self {
        let (sender, mut retired) = mpsc::unbounded_channel::<Retired>();
        let task = tokio::spawn(async move {
            let mut stopping = JoinSet::new();
            while let Some(version) = retired.recv().await {
                stopping.spawn(version.stop());
                while stopping.try_join_next().is_some() {}
            }
            while let Some(stopped) = stopping.join_next().await {
                if let Err(e) = stopped {
                    tracing::error!(error = %e, "a version's shutdown ended abnormally");
                }
            }
        });
        Self { sender: Mutex::new(Some(sender)), task: Mutex::new(Some(task)) }
    }

    /// A sender for a new version; none once [`Reaper::finish`] began.
    pub fn sender(&self) -> Option<ReaperSender> {
        self.sender.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Takes no more versions, and waits until every version given a
    /// sender has been dropped and stopped.
    pub async fn finish(&self) {
        drop(self.sender.lock().unwrap_or_else(|p| p.into_inner()).take());
        let task = self.task.lock().unwrap_or_else(|p| p.into_inner()).take();
        if let Some(task) = task {
            if let Err(e) = task.await {
                tracing::error!(error = %e, "the reaper ended abnormally");
            }
        }
    }
}
