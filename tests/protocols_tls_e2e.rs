//! Every protocol over mutual TLS, with the small exported model (Burn,
//! `models/generated/test-small/weights_fp32.safetensors`): narsil.v1
//! (ModelInfo, Predict), TorchRec's `predictor.Predictor` and KServe v2
//! (ServerLive, ModelMetadata, ModelInfer) answer a client with the CA and
//! a client certificate, and score the golden requests as Python did;
//! grpc.health and reflection answer too. Each protocol is refused to a
//! client without a certificate. A stock `tritonclient` (Python, project
//! venv) gets the golden scores from `narsil serve --tls-cert` over mutual
//! TLS, and is refused in plaintext.
#![cfg(feature = "burn")]

mod common;

use std::net::SocketAddr;
use std::path::Path;
use std::process::Command;
use std::sync::Arc;
use std::time::Duration;

use common::tls::{Authority, TlsFiles};
use narsil::kserve_proto::grpc_inference_service_client::GrpcInferenceServiceClient as KServeClient;
use narsil::kserve_proto::{ModelMetadataRequest, ServerLiveRequest};
use narsil::proto::predictor_client::PredictorClient;
use narsil::proto::ModelInfoRequest;
use narsil::server::tls::ServerTls;
use narsil::server::Server;
use narsil::torchrec_proto::predictor_client::PredictorClient as TorchRecClient;
use narsil::wire::{kserve, torchrec};
use narsil_burn::BurnFactory;
use narsil_core::golden::{max_abs_diff, test_model_dir, Golden};
use tonic::transport::{Channel, ClientTlsConfig};

/// Burn's FP32 scores against Python's (as in burn_e2e).
const TOLERANCE: f32 = 1e-5;

async fn connect(addr: SocketAddr, tls: ClientTlsConfig) -> Result<Channel, String> {
    let endpoint = Channel::from_shared(format!("https://{addr}")).unwrap().tls_config(tls).unwrap();
    endpoint.connect().await.map_err(|e| format!("{e:?}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn narsil_v1_torchrec_and_kserve_all_answer_over_mutual_tls_with_golden_scores() {
    let (ca, clients_ca) = (Authority::new("server CA"), Authority::new("client CA"));
    let leaf = ca.sign(&["localhost"]);
    let tls =
        ServerTls::from_pem(leaf.cert.as_bytes(), leaf.key.as_bytes(), Some(clients_ca.pem().as_bytes()));
    let factory = BurnFactory::load(&test_model_dir().join("weights_fp32.safetensors")).unwrap();
    let server =
        Server::start(common::listen(false), Arc::new(factory), common::batch_mode(1, 16)).await.unwrap();
    let (addr, engine) = (server.local_addr(), server.engine().unwrap());
    let server = common::Running::spawn(server.with_tls(tls.unwrap()));
    engine.wait_ready().await.unwrap();

    let client = clients_ca.sign(&["client"]);
    let channel = connect(addr, ca.trusted_by_client().identity(client.identity())).await.unwrap();
    // The health service turns SERVING from a watcher task of its own,
    // moments after the engine is ready.
    common::poll_until("grpc.health over TLS to answer SERVING", Duration::from_secs(10), || async {
        (common::health_status(channel.clone()).await.ok()? == 1).then_some(())
    })
    .await;
    let mut narsil = PredictorClient::new(channel.clone());
    let mut torchrec = TorchRecClient::new(channel.clone());
    let mut kserve = KServeClient::new(channel.clone());

    let info = narsil.model_info(ModelInfoRequest::default()).await.unwrap().into_inner();
    let (dense, sparse) = (info.num_dense as usize, info.sparse_features.len());
    assert!(kserve.server_live(ServerLiveRequest {}).await.unwrap().into_inner().live);
    let metadata = kserve
        .model_metadata(ModelMetadataRequest { name: String::new(), version: String::new() })
        .await
        .unwrap();
    assert_eq!(metadata.into_inner().name, info.name);

    let golden = Golden::read(&test_model_dir()).unwrap();
    for (i, g) in golden.requests.iter().enumerate() {
        let request = common::wire(g, &format!("tls-{i}"));
        let via_narsil = narsil.predict(request.clone()).await.unwrap().into_inner().scores;
        let via_torchrec = torchrec.predict(torchrec::encode(&request, sparse)).await.unwrap().into_inner();
        let via_torchrec = &via_torchrec.predictions[torchrec::SCORES_KEY].data;
        let via_kserve =
            kserve.model_infer(kserve::encode(&request, dense, sparse)).await.unwrap().into_inner();
        let via_kserve = kserve::first_scores(&via_kserve).unwrap();
        for (protocol, scores) in
            [("narsil.v1", &via_narsil), ("TorchRec", via_torchrec), ("KServe v2", &via_kserve)]
        {
            let diff = max_abs_diff(scores, &g.scores_fp32).unwrap();
            assert!(diff <= TOLERANCE, "{protocol} over TLS, golden request {i}: max |diff| {diff}");
        }
    }

    // Reflection lists every protocol's service over the same connection.
    let services = reflected_services(channel).await;
    for service in ["narsil.v1.Predictor", "predictor.Predictor", "inference.GRPCInferenceService"] {
        assert!(services.iter().any(|s| s == service), "{service} not in {services:?}");
    }

    // Without a client certificate no protocol gets through.
    let anonymous = connect(addr, ca.trusted_by_client()).await;
    if let Ok(channel) = anonymous {
        assert!(PredictorClient::new(channel.clone()).model_info(ModelInfoRequest::default()).await.is_err());
        assert!(KServeClient::new(channel.clone()).server_live(ServerLiveRequest {}).await.is_err());
        let request = torchrec::encode(&common::request(1, 1), sparse);
        assert!(TorchRecClient::new(channel).predict(request).await.is_err());
    }
    tokio::time::timeout(Duration::from_secs(30), server.stop()).await.unwrap();
}

/// The services grpc.reflection.v1 lists.
async fn reflected_services(channel: Channel) -> Vec<String> {
    use tonic_reflection::pb::v1::server_reflection_client::ServerReflectionClient;
    use tonic_reflection::pb::v1::server_reflection_request::MessageRequest;
    use tonic_reflection::pb::v1::server_reflection_response::MessageResponse;
    use tonic_reflection::pb::v1::ServerReflectionRequest;
    let request = ServerReflectionRequest {
        host: String::new(),
        message_request: Some(MessageRequest::ListServices(String::new())),
    };
    let mut answers = ServerReflectionClient::new(channel)
        .server_reflection_info(tokio_stream::once(request))
        .await
        .unwrap()
        .into_inner();
    let answer = answers.message().await.unwrap().unwrap();
    match answer.message_response {
        Some(MessageResponse::ListServicesResponse(list)) => {
            list.service.into_iter().map(|s| s.name).collect()
        }
        other => panic!("reflection answered {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stock_tritonclient_gets_golden_scores_over_mutual_tls_from_the_real_binary() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let python = root.join(".venv/bin/python");
    assert!(python.is_file(), "no project venv: run scripts/setup_python.sh");
    let (ca, clients_ca) = (Authority::new("server CA"), Authority::new("client CA"));
    let files = TlsFiles::new(&ca.sign(&["localhost", "127.0.0.1"]));
    files.write("clients-ca.crt", &clients_ca.pem());
    let client = clients_ca.sign(&["client"]);
    let (ca_file, cert, key) = (
        files.write("ca.crt", &ca.pem()),
        files.write("client.crt", &client.cert),
        files.write("client.key", &client.key),
    );
    let listeners = common::Listeners::new();
    let mut server = common::KillOnDrop(
        listeners
            .serve(false, "warn")
            .arg("--model")
            .arg(test_model_dir().join("weights_fp32.safetensors"))
            .args(files.serve_args(true))
            .spawn()
            .unwrap(),
    );
    let grpc = listeners.wait(&mut server.0, Duration::from_secs(60)).await.grpc;
    let tls = ca.trusted_by_client().identity(client.identity());
    common::tls::wait_serving(grpc, tls, Duration::from_secs(60)).await;
    let script = root.join("tests/python/kserve_tritonclient_tls.py");
    let golden = test_model_dir().join("golden.json");
    let out = tokio::task::spawn_blocking(move || {
        Command::new(python)
            .arg(script)
            .arg(grpc.to_string())
            .arg(ca_file)
            .arg(golden)
            .arg(cert)
            .arg(key)
            .output()
            .unwrap()
    })
    .await
    .unwrap();
    let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "tritonclient over TLS failed:\n{stdout}\n{stderr}");
    let matched: usize = stdout.trim().strip_prefix("ok ").unwrap().parse().unwrap();
    assert_eq!(matched, Golden::read(&test_model_dir()).unwrap().requests.len());
    unsafe { libc::kill(server.0.id() as i32, libc::SIGTERM) };
    assert!(server.0.wait().unwrap().success());
}
