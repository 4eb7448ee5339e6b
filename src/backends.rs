//! Builds the model backend named on the command line.

use std::sync::Arc;
use std::time::Duration;

use narsil_core::mock::{MockConfig, MockFactory};
use narsil_core::{BackendFactory, ModelSchema};

use crate::cli::{BackendKind, ServeArgs};

/// Loads (or, for the mock, configures) the backend the flags ask for.
pub fn build(args: &ServeArgs) -> anyhow::Result<Arc<dyn BackendFactory>> {
    match args.backend {
        BackendKind::Mock => {
            if args.model.is_some() {
                anyhow::bail!("--model is not used by --backend mock; remove it");
            }
            let schema = ModelSchema::dlrm("mock", "cpu", args.mock_table_rows);
            let config = MockConfig {
                latency: Duration::from_secs_f64(args.mock_latency_ms / 1e3),
                per_row: Duration::from_secs_f64(args.mock_latency_per_row_us / 1e6),
            };
            Ok(Arc::new(MockFactory::new(schema, config)))
        }
        BackendKind::Torch | BackendKind::Burn => anyhow::bail!(
            "--backend {0} is not compiled into this binary; rebuild with `cargo build --release --features {0}`",
            args.backend.name()
        ),
    }
}
