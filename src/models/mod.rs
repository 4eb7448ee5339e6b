//! Model lifecycle: the repository on disk ([`repository`]), the models and
//! versions being served ([`registry`]), the watcher that loads, switches and
//! retires versions ([`watcher`]), and the HTTP control calls ([`control`]).

pub mod control;
pub mod registry;
pub mod repository;
pub mod watcher;

pub use registry::{LiveVersion, ModelRegistry};
