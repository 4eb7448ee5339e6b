//! Narsil's engine: everything between a validated request and its scores.
//!
//! ```text
//! predict() ──▶ admission ──▶ collector (shared queue) ◀── lanes (OS threads) ──▶ backend
//!   ◀── oneshot reply per request, split from the fused scores ◀──┘
//! ```
//!
//! * `admission`: bounded by queued requests, rows and decoded bytes;
//!   rejects at once with the limit that refused ([`QueueFull`]).
//! * `collector`: reorders each request into the open key-major batch as
//!   it is submitted; a lane that frees up takes the next due batch itself.
//! * `lanes`: one thread per model instance; loads, warms up, runs, replies.
//! * `engine`: the handle the RPC layer calls, and startup/shutdown.
//! * `health`: whether the backend is fit for traffic, from its forwards.
//! * `stats`: counters the engine keeps about itself.

mod admission;
mod collector;
mod config;
mod engine;
mod error;
mod health;
mod job;
mod lanes;
mod stats;

pub use admission::{QueueFull, QueueLimit};
pub use config::{ConfigError, EngineConfig, ExecutionMode, Setting};
pub use engine::{Engine, EngineHandle};
pub use error::{EngineError, LaneFailed, StartError};
pub use job::Prediction;
pub use stats::{merge_expositions, StatsSnapshot};
