//! Command-line interface: `narsil serve`, `narsil load`,
//! `narsil bench-forward`, `narsil tables` and `narsil verify`. Every flag has
//! a long name and a documented default, and the flags of a running server
//! (`narsil serve`, its backend and engine) an environment variable
//! (`NARSIL_…`) too (docs/reference/cli.md and environment.md list them);
//! rules between flags are checked right after parsing.

mod serve;
mod tables;
mod verify;

use std::process::ExitCode;

use clap::{Parser, Subcommand, ValueEnum};

use crate::forward_bench::ForwardBenchArgs;
use crate::load::LoadArgs;
pub use serve::{IdPolicyArg, ServeArgs};

/// Narsil: gRPC serving for recommendation models, with continuous batching.
#[derive(Debug, Parser)]
#[command(name = "narsil", version, about)]
pub struct Cli {
    #[command(subcommand)]
    command: Command,
    /// Log filter (tracing syntax), e.g. `info` or `narsil_engine=debug`.
    #[arg(long, env = "NARSIL_LOG", default_value = "info", global = true)]
    log_level: String,
    /// Log format.
    #[arg(long, env = "NARSIL_LOG_FORMAT", value_enum, default_value_t = LogFormat::Text, global = true)]
    log_format: LogFormat,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Serve a model over gRPC.
    Serve(Box<ServeArgs>),
    /// Drive load against a running server and report latency and throughput.
    Load(Box<LoadArgs>),
    /// Time a backend's forward alone, in process, at fixed fused batch sizes.
    BenchForward(Box<ForwardBenchArgs>),
    /// Manage a split model's tables: on a Redis Cluster (`tables load`,
    /// `tables push`), laid out in popularity order (`tables order`), or
    /// their id maps built from a vocabulary (`tables map`).
    Tables(Box<tables::TablesArgs>),
    /// Send an exported model's golden requests to a running server and
    /// check its scores against Python's.
    Verify(Box<verify::VerifyArgs>),
}

/// Log output format.
#[derive(Debug, Clone, Copy, ValueEnum)]
enum LogFormat {
    /// Human-readable lines.
    Text,
    /// One JSON object per line.
    Json,
}

impl Cli {
    fn serve_args(self) -> Option<ServeArgs> {
        match self.command {
            Command::Serve(args) => Some(*args),
            _ => None,
        }
    }
}

fn init_logging(filter: &str, format: LogFormat) -> anyhow::Result<()> {
    // The Redis client warns of each connection it loses or closes; the
    // store reports the failures that matter, naming the cluster.
    let quieted = if filter.contains("fred") { filter.to_owned() } else { format!("{filter},fred=error") };
    let filter = tracing_subscriber::EnvFilter::try_new(&quieted)
        .map_err(|e| anyhow::anyhow!("--log-level `{filter}`: {e}"))?;
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_writer(std::io::stderr);
    match format {
        LogFormat::Text => builder.init(),
        LogFormat::Json => builder.json().init(),
    }
    Ok(())
}

/// Entry point of the `narsil` binary; `logging_up` runs once logging is
/// set up (to log what the binary did before it).
pub fn main(logging_up: impl FnOnce()) -> ExitCode {
    let cli = Cli::parse();
    if let Err(e) = init_logging(&cli.log_level, cli.log_format) {
        eprintln!("error: {e:#}");
        return ExitCode::from(2);
    }
    logging_up();
    let command = match cli.command {
        // Synchronous, and measured: no async runtime threads beside it.
        Command::BenchForward(args) => return exit_code(crate::forward_bench::run(*args), cli.log_format),
        // Blocking: the Redis client runs its own runtime.
        Command::Tables(args) => return exit_code(tables::run(*args), cli.log_format),
        command => command,
    };
    let runtime = match tokio::runtime::Builder::new_multi_thread().enable_all().build() {
        Ok(runtime) => runtime,
        Err(e) => {
            eprintln!("error: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let result = runtime.block_on(async move {
        match command {
            Command::Serve(args) => serve::serve_until_signal(*args).await,
            Command::Load(args) => crate::load::run(*args).await,
            Command::Verify(args) => verify::run(*args).await,
            Command::BenchForward(_) | Command::Tables(_) => unreachable!("run above, without the runtime"),
        }
    });
    exit_code(result, cli.log_format)
}

/// The exit status, with a failure said once: as a log record when logs are
/// JSON (for collectors), as an `error:` line otherwise.
fn exit_code(result: anyhow::Result<()>, format: LogFormat) -> ExitCode {
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            match format {
                LogFormat::Json => tracing::error!("{e:#}"),
                LogFormat::Text => eprintln!("error: {e:#}"),
            }
            ExitCode::FAILURE
        }
    }
}
