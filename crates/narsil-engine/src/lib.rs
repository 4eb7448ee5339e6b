//! Narsil's engine: everything between a validated request and its scores.
//!
//! ```text
//! predict() ──▶ admission ──▶ collector (shared queue) ◀── lanes (OS threads) ──▶ backend
//!   ◀── oneshot reply per request, split from the fused scores ◀──┘
//! ```
//!
//! * `memory`: the process-wide byte budget every request holds a lease on
//!   from its decode to the end of its forward.
//! * `admission`: bounded by queued requests and rows (and the memory
//!   budget); rejects at once with the limit that refused ([`QueueFull`]).
//! * `collector`: reorders each request into the open key-major batch as
//!   it is submitted; a lane that frees up takes the next due batch itself.
//! * [`flush`]: when a batch is full and when the open one is due
//!   (continuous batching, or one request per forward): pure policies.
//! * `lanes`: one thread per model instance; loads, warms up, runs, replies.
//! * `engine`: the handle the RPC layer calls, and startup/shutdown.
//! * `parallelism`: how many threads a forward may use, from how busy the
//!   other lanes are.
//! * `health`: whether the backend is fit for traffic, from its forwards.
//! * `stats`: counters the engine keeps about itself.
//! * `working_sets`: what a model's forwards hold for their sequences,
//!   one lease for all its requests in flight.

#![forbid(unsafe_code)]

mod admission;
mod collector;
mod config;
mod engine;
mod error;
pub mod flush;
mod health;
mod job;
mod lanes;
mod memory;
mod parallelism;
mod setting;
mod stats;
mod working_sets;

pub use admission::{QueueFull, QueueLimit};
pub use config::{ConfigError, EngineConfig, ExecutionMode};
pub use engine::{Engine, EngineHandle};
pub use error::{EngineError, LaneFailed, StartError};
pub use job::Prediction;
pub use memory::{decode_reservation, on_freed_memory, release_freed_memory, Lease, MemoryBudget};
pub use setting::Setting;
pub use stats::{merge_expositions, StatsSnapshot};
