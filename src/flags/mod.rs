//! The command line's vocabulary, shared by the commands that take it and
//! the messages that point a user at it: the `narsil serve` flag behind each
//! engine setting ([`serve_flag`]), the backend flags of `narsil serve`
//! and `narsil bench-forward` ([`backend`]), and `--request-level`'s forms,
//! per model ([`request_level`]).

pub mod backend;
pub mod request_level;

use narsil_engine::Setting;

/// The `narsil serve` flag that sets an engine setting.
pub fn serve_flag(setting: Setting) -> &'static str {
    match setting {
        Setting::Lanes => "--lanes",
        Setting::MaxForwardThreads => "--max-forward-threads",
        Setting::MaxBatchRequests => "--max-batch-requests",
        Setting::MaxBatchRows => "--max-batch-rows",
        Setting::MaxBatchTokens => "--max-batch-tokens",
        Setting::MaxQueueRequests => "--max-queue-requests",
        Setting::MaxQueueRows => "--max-queue-rows",
        Setting::MaxQueueBytes => "--max-queue-bytes",
        Setting::MaxRequestSamples => "--max-request-samples",
        Setting::QueueTimeout => "--queue-timeout-ms",
    }
}
