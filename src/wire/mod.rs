//! What the server and its clients share about the wire: the generated code
//! of the three protocols and its codec ([`codec`]), little-endian value
//! packing ([`le`]), and the
//! client side of TorchRec's protocol and KServe v2 ([`torchrec`],
//! [`kserve`]: a `narsil.v1` request encoded as their messages, used by
//! `narsil load` and the tests). Depends on nothing else in the crate.

pub mod codec;
pub mod kserve;
pub mod le;
pub mod torchrec;

/// Generated protocol code for TorchRec's inference protocol (`predictor`).
pub mod torchrec_proto {
    tonic::include_proto!("predictor");
}

/// Generated protocol code for the Open Inference Protocol (KServe v2,
/// `inference`).
pub mod kserve_proto {
    tonic::include_proto!("inference");
}

/// Generated protocol code for `narsil.v1`.
pub mod proto {
    tonic::include_proto!("narsil.v1");

    /// Encoded descriptors of every served protocol, for server reflection.
    pub const FILE_DESCRIPTOR_SET: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/narsil_descriptor.bin"));

    impl PredictRequest {
        /// An exported model's golden request (`golden.json`) as a
        /// `narsil.v1` request for the server's default model.
        pub fn from_golden(g: &narsil_core::golden::GoldenRequest, request_id: &str) -> Self {
            Self {
                batch_size: g.batch_size as u32,
                dense: g.dense.clone(),
                sparse_lengths: g.lengths.clone(),
                sparse_ids: g.ids.clone(),
                sparse_weights: g.weights.clone(),
                request_id: request_id.into(),
                model: String::new(),
                model_version: String::new(),
                request: g.request.as_ref().map(|b| RequestFeatures {
                    dense: b.dense.clone(),
                    sparse_lengths: b.lengths.clone(),
                    sparse_ids: b.ids.clone(),
                    sparse_weights: b.weights.clone(),
                }),
            }
        }
    }
}
