//! TorchRec's inference protocol (`predictor.Predictor`) end to end over real
//! gRPC on loopback: the same scores as Narsil's own protocol, fused with it
//! in one forward, and bad input named by TorchRec's field names.

mod common;

use common::{batch_mode, bits, request, start};
use futures_util::future::join_all;
use narsil::torchrec_proto::predictor_client::PredictorClient as TorchRecClient;
use narsil::torchrec_proto::{PredictionRequest, SparseFeatures as PredictionSparse};
use narsil::wire::torchrec::{encode, widened, SCORES_KEY};

const NUM_SPARSE: usize = 26;

async fn torchrec_scores(
    client: &mut TorchRecClient<tonic::transport::Channel>,
    r: PredictionRequest,
) -> Vec<f32> {
    let mut response = client.predict(r).await.unwrap().into_inner();
    response.predictions.remove(SCORES_KEY).expect("scores under `default`").data
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn torchrec_requests_score_like_narsil_requests_alone_and_fused_together() {
    let server = start(batch_mode(1, 16), 20).await.ready().await;
    let channel = server.channel().await;
    let mut narsil = server.client().await;
    let mut torchrec = TorchRecClient::new(channel.clone());
    let tags: Vec<u64> = (0..32).collect();
    let mut alone = Vec::new();
    for &tag in &tags {
        let r = request(tag, 1 + tag as usize % 9);
        let native = narsil.predict(r.clone()).await.unwrap().into_inner().scores;
        let via_torchrec = torchrec_scores(&mut torchrec, encode(&r, NUM_SPARSE)).await;
        assert_eq!(bits(&via_torchrec), bits(&native), "request {tag}: both protocols, alone");
        alone.push(bits(&native));
    }
    let forwards_before = server.engine.stats().forwards;
    // All at once, even tags over TorchRec's protocol and odd ones over Narsil's.
    let results = join_all(tags.iter().map(|&tag| {
        let channel = channel.clone();
        async move {
            let r = request(tag, 1 + tag as usize % 9);
            if tag % 2 == 0 {
                torchrec_scores(&mut TorchRecClient::new(channel), encode(&r, NUM_SPARSE)).await
            } else {
                let mut client = narsil::proto::predictor_client::PredictorClient::new(channel);
                client.predict(r).await.unwrap().into_inner().scores
            }
        }
    }))
    .await;
    for ((tag, scores), alone) in tags.iter().zip(&results).zip(&alone) {
        assert_eq!(&bits(scores), alone, "request {tag}: fused with the other protocol");
    }
    let forwards = server.engine.stats().forwards - forwards_before;
    assert!(forwards < 32, "32 concurrent requests took {forwards} forwards: nothing was fused");
    server.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_torchrec_input_is_invalid_argument_named_by_field() {
    let server = start(batch_mode(1, 16), 1).await.ready().await;
    let mut client = TorchRecClient::new(server.channel().await);
    let good = encode(&request(1, 3), NUM_SPARSE);
    let mut out_of_range = good.clone();
    // The second id of cat_0 (bags vary in size).
    edit(&mut out_of_range.id_list_features.as_mut().unwrap().values, |ids| {
        ids[4..8].copy_from_slice(&5000i32.to_le_bytes())
    });
    let mut short_lengths = good.clone();
    short_lengths.id_list_features.as_mut().unwrap().lengths.truncate(4 * 10);
    let mut ragged_floats = good.clone();
    edit(&mut ragged_floats.float_features.as_mut().unwrap().values, |v| {
        v.pop();
    });
    let mut wrong_b = good.clone();
    wrong_b.batch_size = 4;
    let mut nan = good.clone();
    edit(&mut nan.float_features.as_mut().unwrap().values, |v| {
        v[4 * 15..4 * 16].copy_from_slice(&f32::NAN.to_le_bytes())
    });
    let mut negative_length = good.clone();
    edit(&mut negative_length.id_list_features.as_mut().unwrap().lengths, |v| {
        v[4 * 4..4 * 5].copy_from_slice(&(-2i32).to_le_bytes())
    });
    let mut weighted = good.clone();
    weighted.id_list_features.as_mut().unwrap().weights = vec![0; 8].into();
    let mut scored = good.clone();
    scored.id_score_list_features =
        Some(PredictionSparse { num_features: 1, lengths: vec![0; 4 * 3].into(), ..Default::default() });
    let mut wrong_dense_count = good.clone();
    wrong_dense_count.float_features.as_mut().unwrap().num_features = 12;
    let mut oversized = good.clone();
    oversized.float_features.as_mut().unwrap().values = vec![0; common::MAX_MESSAGE_BYTES].into();
    let cases = [
        (out_of_range, "id_list_features.values", "feature 0 (cat_0) has id 5000"),
        (
            short_lengths,
            "id_list_features.lengths",
            "has 40 bytes, but 78 lengths take 312 bytes as int32 or 624 as int64",
        ),
        (ragged_floats, "float_features.values", "4-byte"),
        (wrong_b, "batch_size", "holds 3 samples"),
        (nan, "float_features.values", "sample 1 feature 2 is NaN"),
        (negative_length, "id_list_features.lengths", "sample 1 feature 1 has length -2"),
        (weighted, "id_list_features.weights", "carry no weights"),
        (wrong_dense_count, "float_features.num_features", "is 12, the model takes 13"),
        (scored, "id_score_list_features.num_features", "is 1, the model takes 0 weighted"),
        (oversized, "message", "(--max-message-bytes)"),
    ];
    let count = cases.len();
    let forwards = server.engine.stats().forwards;
    for (r, field, detail) in cases {
        let status = client.predict(r).await.unwrap_err();
        assert_eq!(status.code(), tonic::Code::InvalidArgument, "{field}");
        assert!(
            status.message().contains(field) && status.message().contains(detail),
            "{}",
            status.message()
        );
    }
    assert_eq!(server.engine.stats().forwards, forwards, "no bad request reached the model");
    let invalid = common::metric(&server.scrape().await, r#"narsil_requests_total{outcome="invalid"}"#);
    assert_eq!(invalid, count as f64);
    assert_eq!(torchrec_scores(&mut client, good).await.len(), 3);
    server.stop().await.unwrap();
}

/// TorchRec's Python client sends `KeyedJaggedTensor.values()` as int64:
/// lengths and ids are read as int32 or int64 by their byte count, and both
/// encodings of one request score bit for bit alike.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn int32_and_int64_lengths_and_ids_score_bit_for_bit_alike() {
    let server = start(batch_mode(1, 16), 1).await.ready().await;
    let mut client = TorchRecClient::new(server.channel().await);
    for tag in 0..4u64 {
        let narrow = encode(&request(tag, 5), NUM_SPARSE);
        let want = bits(&torchrec_scores(&mut client, narrow.clone()).await);
        for (wide_lengths, wide_ids) in [(false, true), (true, false), (true, true)] {
            let mut wide = narrow.clone();
            let sparse = wide.id_list_features.as_mut().unwrap();
            if wide_lengths {
                sparse.lengths = widened(&sparse.lengths).into();
            }
            if wide_ids {
                sparse.values = widened(&sparse.values).into();
            }
            let got = bits(&torchrec_scores(&mut client, wide).await);
            assert_eq!(got, want, "request {tag}: int64 lengths {wide_lengths}, int64 ids {wide_ids}");
        }
    }
    server.stop().await.unwrap();
}

/// Changes a copy of a received-bytes field.
fn edit(bytes: &mut tonic::codegen::Bytes, change: impl FnOnce(&mut Vec<u8>)) {
    let mut copy = bytes.to_vec();
    change(&mut copy);
    *bytes = copy.into();
}
