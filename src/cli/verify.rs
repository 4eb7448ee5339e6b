//! `narsil verify`: sends an exported model's golden requests (the
//! `golden.json` its export script writes) to a running server over gRPC and
//! compares every score with the one Python computed. Checks a deployment end
//! to end (a container image, a replica behind a balancer): it waits for
//! grpc.health SERVING, then fails naming the first request that differs.
//! It speaks TLS as `narsil load` does ([`crate::load::tls`]).

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::Context;
use tonic::transport::{Channel, Endpoint};
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;
use tonic_health::pb::HealthCheckRequest;

use crate::load::tls::ClientTlsArgs;
use crate::proto::predictor_client::PredictorClient;
use crate::proto::PredictRequest;
use narsil_core::golden::{max_abs_diff, Golden, GoldenRequest};

/// `narsil verify` flags.
#[derive(Debug, clap::Args)]
pub struct VerifyArgs {
    /// Server address (`https://`: over TLS, with --tls-ca).
    #[arg(long, env = "NARSIL_VERIFY_ADDR", default_value = "http://127.0.0.1:50051")]
    addr: String,
    /// An exported model's directory (holding `golden.json`) or the golden
    /// file itself.
    #[arg(long, env = "NARSIL_VERIFY_GOLDEN")]
    golden: PathBuf,
    /// The golden scores to expect: `int8` (`model_default.pt`, split
    /// models), `fp32` (`model_fp32.pt`, Burn's safetensors), or the name of
    /// an output (TorchRec-signature models).
    #[arg(long, env = "NARSIL_VERIFY_SCORES", default_value = "int8")]
    scores: String,
    /// The model to ask for; empty: the server's only model.
    #[arg(long, env = "NARSIL_VERIFY_MODEL", default_value = "")]
    model: String,
    /// The largest accepted |served - golden| per score.
    #[arg(long, env = "NARSIL_VERIFY_TOLERANCE", default_value_t = 1e-5)]
    tolerance: f32,
    /// How long to wait for the server to report SERVING on grpc.health.
    #[arg(long, env = "NARSIL_VERIFY_WAIT_SECS", default_value_t = 60)]
    wait_secs: u64,
    /// TLS to the server.
    #[command(flatten)]
    tls: ClientTlsArgs,
}

/// Runs `narsil verify`.
pub async fn run(args: VerifyArgs) -> anyhow::Result<()> {
    let path = if args.golden.is_dir() { args.golden.join("golden.json") } else { args.golden.clone() };
    let dir = path.parent().map(PathBuf::from).unwrap_or_default();
    if path.file_name().is_none_or(|name| name != "golden.json") {
        anyhow::bail!("--golden {}: not a golden.json or a directory holding one", args.golden.display());
    }
    let golden = Golden::read(&dir).map_err(|e| anyhow::anyhow!("--golden: {e}"))?;
    if golden.requests.is_empty() {
        anyhow::bail!("--golden {}: no requests", path.display());
    }
    let endpoint = args.tls.endpoint(&args.addr)?;
    let channel = wait_serving(endpoint, &args.addr, Duration::from_secs(args.wait_secs)).await?;
    let mut client = PredictorClient::new(channel).max_decoding_message_size(usize::MAX);
    let mut worst = 0.0f32;
    for (i, request) in golden.requests.iter().enumerate() {
        let want = expected(request, &args.scores)
            .with_context(|| format!("golden request {i} has no `{}` scores (--scores)", args.scores))?;
        let response = client
            .predict(PredictRequest {
                model: args.model.clone(),
                ..PredictRequest::from_golden(request, &format!("golden-{i}"))
            })
            .await
            .with_context(|| format!("golden request {i}"))?
            .into_inner();
        let got = match response.outputs.get(&args.scores) {
            Some(output) => &output.scores,
            None => &response.scores,
        };
        let diff = max_abs_diff(got, want).with_context(|| {
            format!("golden request {i}: {} scores served, {} expected", got.len(), want.len())
        })?;
        if diff.is_nan() || diff > args.tolerance {
            anyhow::bail!(
                "golden request {i}: max |served - golden| = {diff} > --tolerance {}",
                args.tolerance
            );
        }
        worst = worst.max(diff);
    }
    println!(
        "{} golden requests ({} scores) match within {} (max |diff| {worst:e}) at {}",
        golden.requests.len(),
        args.scores,
        args.tolerance,
        args.addr
    );
    Ok(())
}

/// The golden scores `which` names.
fn expected<'a>(request: &'a GoldenRequest, which: &str) -> Option<&'a Vec<f32>> {
    let scores = match which {
        "int8" => &request.scores_int8,
        "fp32" => &request.scores_fp32,
        output => request.outputs.get(output)?,
    };
    (!scores.is_empty()).then_some(scores)
}

/// A channel to `endpoint` (`addr`) once its overall grpc.health status
/// is SERVING.
async fn wait_serving(endpoint: Endpoint, addr: &str, timeout: Duration) -> anyhow::Result<Channel> {
    let endpoint = endpoint.connect_timeout(Duration::from_secs(2)).timeout(Duration::from_secs(30));
    let started = Instant::now();
    loop {
        let last = match endpoint.connect().await {
            Ok(channel) => {
                let mut health = HealthClient::new(channel.clone());
                match health.check(HealthCheckRequest { service: String::new() }).await {
                    Ok(answer) if answer.get_ref().status == ServingStatus::Serving as i32 => {
                        return Ok(channel)
                    }
                    Ok(answer) => format!("health status {}", answer.get_ref().status),
                    Err(status) => format!("health check failed: {}", status.message()),
                }
            }
            Err(e) => format!("cannot connect: {}", crate::load::tls::causes(&e)),
        };
        if started.elapsed() >= timeout {
            anyhow::bail!("{addr} not SERVING after {} s (--wait-secs): {last}", timeout.as_secs());
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}
