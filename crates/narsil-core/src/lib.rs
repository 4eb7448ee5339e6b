//! Narsil's core: the data that flows through the engine and the contract
//! every model backend implements.
//!
//! * [`schema`]: what a served model expects (dense count, sparse features,
//!   outputs); [`model_config`]: the `model.json` that states it for models
//!   that cannot.
//! * [`request`]: one client request, sample-major, and its validation;
//!   [`request_level`]: a ranking request's request-level block (one user,
//!   many candidates); [`request_blocks`]: those blocks in a fused batch;
//!   [`flat_batch`]: the rows each block goes to, and the flat batch;
//!   `request_sequences`: a request's sequences checked, cut and weighed;
//!   `request_reorder`: a request's bags made key-major; `raw_inputs`: raw
//!   integer inputs outside a sequence checked (one value a sample);
//!   [`invalid`]: why a request is refused; [`ids`]: how an id becomes a
//!   row (the range check, the modulo conventions); [`sequence`]: sequence
//!   features (a user's history, one embedding per position), their
//!   alignment and truncation; [`working_set`]: what a sequence model's
//!   network allocates per request, which the memory bound charges.
//! * [`batch`]: the fused, key-major batch a backend runs, and how requests
//!   are reordered into it and scores split back out.
//! * [`backend`]: the synchronous `ModelBackend` trait that lanes own;
//!   [`staged`]: the part of a forward a backend can run one batch ahead;
//!   [`id_push`]: raw ids pushed to a served model's id maps.
//! * [`golden`]: reference requests and scores written by the model export,
//!   for backends' parity tests.
//! * [`conformance`]: the checks every backend's tests run (golden parity,
//!   fused == alone, concurrent lanes), each with the backend's tolerance.
//! * [`mock`]: a fixed-latency backend with deterministic scores, for
//!   measuring the engine itself.
//! * [`skip`]: how a test that cannot run on this machine says so, or fails
//!   where a `NARSIL_REQUIRE_*` switch says it must run.
//!
//! No async runtime, no RPC, no tensor library: those live in other crates.

#![deny(unsafe_op_in_unsafe_fn)]
#![deny(clippy::undocumented_unsafe_blocks)]

pub mod backend;
pub mod batch;
#[cfg(feature = "conformance")]
pub mod conformance;
pub mod flat_batch;
pub mod golden;
pub mod id_push;
pub mod ids;
pub mod invalid;
pub mod mock;
pub mod model_config;
mod raw_inputs;
pub mod request;
pub mod request_blocks;
pub mod request_level;
mod request_reorder;
mod request_sequences;
pub mod schema;
pub mod sequence;
pub mod skip;
pub mod staged;
pub mod working_set;

pub use backend::{error_chain, BackendError, BackendFactory, BatchStage, DependencyWatcher, ModelBackend};
pub use batch::{assemble, fuse, KeyedBatch};
pub use id_push::{IdMapTable, IdPush, IdsPushed, PushMode, INDEX_BYTES_PER_ID};
pub use request::{InputField, InvalidInput, RequestSamples, SparseLayout};
pub use request_blocks::RequestBlocks;
pub use request_level::RequestBlock;
pub use schema::{KeepEnd, ModelSchema, RequestLevel, SequenceFeature, SparseFeature};
pub use staged::StagedBatch;
