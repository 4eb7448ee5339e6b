//! Model lifecycle: loading a model file into a backend ([`loader`]), the
//! repository and where its versions come from ([`repository`]), the models
//! and versions being served ([`registry`]), the watcher that loads,
//! switches and retires versions ([`watcher`]), the task that stops a
//! retired version once its last request is answered ([`reaper`]), and the
//! HTTP control calls ([`control`]) and the token that guards them
//! ([`control_token`]); ids pushed to a model's id maps, checked, logged
//! and applied to every ready version, and replayed into each version that
//! loads ([`pushes`]), and the log itself ([`push_log`]).

pub mod control;
pub mod control_token;
pub mod loader;
pub mod push_log;
pub mod pushes;
pub mod reaper;
pub mod registry;
pub mod repository;
pub mod watcher;

pub use registry::{LiveVersion, ModelRegistry};
