//! KServe v2 requests decoded, typed and raw, flat and grouped, and the
//! refusals that name their input.

use super::*;
use crate::wire::kserve::encode;
use crate::wire::le;
use pb::model_infer_request::InferInputTensor;

fn tensor(
    name: &str,
    datatype: &str,
    shape: Vec<i64>,
    contents: pb::InferTensorContents,
) -> InferInputTensor {
    InferInputTensor {
        name: name.into(),
        datatype: datatype.into(),
        shape,
        contents: Some(contents),
        ..Default::default()
    }
}

fn request(b: usize) -> pb::ModelInferRequest {
    let schema = ModelSchema::dlrm("mock", "cpu", 100);
    pb::ModelInferRequest {
        inputs: vec![
            tensor(
                DENSE,
                "FP32",
                vec![b as i64, 13],
                pb::InferTensorContents { fp32_contents: vec![0.5; b * 13], ..Default::default() },
            ),
            tensor(
                IDS,
                "INT64",
                vec![(b * schema.num_sparse()) as i64],
                pb::InferTensorContents { int64_contents: vec![3; b * 26], ..Default::default() },
            ),
        ],
        ..Default::default()
    }
}

fn raw(request: &pb::ModelInferRequest) -> pb::ModelInferRequest {
    let mut raw = request.clone();
    raw.raw_input_contents = raw
        .inputs
        .iter_mut()
        .map(|t| {
            let c = t.contents.take().unwrap();
            let bytes: Vec<u8> = match t.datatype.as_str() {
                "FP32" => c.fp32_contents.iter().flat_map(|v| v.to_le_bytes()).collect(),
                "INT64" => c.int64_contents.iter().flat_map(|v| v.to_le_bytes()).collect(),
                _ => c.int_contents.iter().flat_map(|v| v.to_le_bytes()).collect(),
            };
            bytes.into()
        })
        .collect();
    raw
}

#[test]
fn encoded_narsil_requests_decode_to_the_same_samples() {
    let schema = ModelSchema::dlrm("mock", "cpu", 100);
    let narsil = crate::proto::PredictRequest {
        batch_size: 2,
        dense: (0..26).map(|i| i as f32).collect(),
        sparse_lengths: (0..52).map(|i| i % 3).collect(),
        sparse_ids: (0..52).map(|i| i64::from(i % 3 == 1) * 7).collect(),
        ..Default::default()
    };
    let samples = decode(&encode(&narsil, 13, 26), &schema).unwrap();
    assert_eq!((samples.num_samples, &samples.dense), (2, &narsil.dense));
    assert_eq!((&samples.lengths, &samples.ids), (&narsil.sparse_lengths, &narsil.sparse_ids));
}

#[test]
fn typed_and_raw_contents_decode_to_the_same_samples() {
    let schema = ModelSchema::dlrm("mock", "cpu", 100);
    let typed = decode(&request(3), &schema).unwrap();
    let raw = decode(&raw(&request(3)), &schema).unwrap();
    assert_eq!(typed.num_samples, 3);
    assert_eq!((typed.dense.len(), typed.ids.len()), (39, 78));
    assert_eq!((&typed.dense, &typed.ids, &typed.lengths), (&raw.dense, &raw.ids, &raw.lengths));
    let limits = narsil_core::request::RequestLimits::new(10, narsil_core::request::IdPolicy::Reject);
    let mut typed = typed;
    typed.validate(&schema, limits).unwrap();
}

#[test]
fn bad_tensors_name_the_input() {
    let schema = ModelSchema::dlrm("mock", "cpu", 100);
    let error = |edit: fn(&mut pb::ModelInferRequest)| {
        let mut r = request(2);
        edit(&mut r);
        let e = decode(&r, &schema).unwrap_err();
        format!("{}: {}", field_name(e.field), e.message)
    };
    assert_eq!(
        error(|r| r.inputs[0].shape = vec![2, 12]),
        "inputs[dense]: has shape [2, 12], expected [B, 13]"
    );
    assert_eq!(
        error(|r| r.inputs[0].datatype = "FP64".into()),
        "inputs[dense]: has datatype FP64, expected FP32"
    );
    assert!(error(|r| r.inputs[1].shape = vec![51]).starts_with("inputs[ids]: has 52 values for shape [51]"));
    assert!(error(|r| r.inputs[1].name = "idz".into()).starts_with("inputs: unknown input \"idz\""));
    assert!(error(|r| {
        r.inputs.remove(0);
    })
    .starts_with("inputs[dense]: is required"));
    assert!(error(|r| r.raw_input_contents = vec![vec![0u8; 4].into()])
        .starts_with("raw_input_contents: has 1 entries for 2"));
}

/// The mock DLRM with `cat_0`..`cat_12` and the dense features
/// request-level, and a grouped `narsil.v1` request of 3 candidates to
/// it (the user's bags 1 to 3 ids long).
fn ranking() -> (ModelSchema, crate::proto::PredictRequest) {
    let mut schema = ModelSchema::dlrm("mock", "cpu", 100);
    let names: Vec<String> = (0..13).map(|f| format!("cat_{f}")).chain(["dense".into()]).collect();
    schema.request_level =
        narsil_core::RequestLevel::parse(names.iter().map(String::as_str), &schema).unwrap();
    let lengths: Vec<u32> = (0..13).map(|f| 1 + f % 3).collect();
    let total = lengths.iter().sum::<u32>() as i64;
    let request = crate::proto::PredictRequest {
        batch_size: 3,
        sparse_lengths: vec![1; 3 * 13],
        sparse_ids: (0..39).collect(),
        request: Some(crate::proto::RequestFeatures {
            dense: (0..13).map(|d| d as f32 / 13.0).collect(),
            sparse_lengths: lengths,
            sparse_ids: (0..total).map(|i| 99 - i).collect(),
            sparse_weights: vec![],
        }),
        ..Default::default()
    };
    (schema, request)
}

/// A raw-contents request with typed contents instead.
fn typed(request: &pb::ModelInferRequest) -> pb::ModelInferRequest {
    let mut typed = request.clone();
    for (tensor, bytes) in typed.inputs.iter_mut().zip(std::mem::take(&mut typed.raw_input_contents)) {
        let mut contents = pb::InferTensorContents::default();
        match tensor.datatype.as_str() {
            "FP32" => contents.fp32_contents = le::f32s(&bytes).unwrap(),
            _ => contents.int64_contents = le::i64s(&bytes).unwrap(),
        }
        tensor.contents = Some(contents);
    }
    typed
}

#[test]
fn grouped_requests_decode_as_narsil_v1s_do_raw_typed_and_without_dense() {
    let (schema, narsil) = ranking();
    let want = crate::protocols::convert::request_samples(narsil.clone());
    let encoded = encode(&narsil, 13, 26);
    let names: Vec<(&str, &[i64])> =
        encoded.inputs.iter().map(|t| (t.name.as_str(), t.shape.as_slice())).collect();
    assert_eq!(
        names,
        [
            (DENSE, &[3, 0][..]),
            (LENGTHS, &[3, 13]),
            (IDS, &[39]),
            (REQUEST_DENSE, &[1, 13]),
            (REQUEST_LENGTHS, &[1, 13]),
            (REQUEST_IDS, &[1, 25])
        ]
    );
    assert_eq!(decode(&encoded, &schema).unwrap(), want, "raw contents");
    assert_eq!(decode(&typed(&encoded), &schema).unwrap(), want, "typed contents");
    let mut without_dense = typed(&encoded);
    without_dense.inputs.remove(0);
    assert_eq!(decode(&without_dense, &schema).unwrap(), want, "B from lengths");
    // Rank-1 request-level inputs, and no request_lengths (one id each).
    let mut flat_shapes = typed(&encoded);
    for t in &mut flat_shapes.inputs[3..] {
        t.shape.remove(0);
    }
    assert_eq!(decode(&flat_shapes, &schema).unwrap(), want, "[K] and [N]");
    let limits = narsil_core::request::RequestLimits::new(10, narsil_core::request::IdPolicy::Reject);
    let mut samples = decode(&encoded, &schema).unwrap();
    samples.validate(&schema, limits).unwrap();
    assert_eq!((samples.num_samples, samples.dense.len(), samples.lengths.len()), (3, 0, 3 * 26));
    // ModelMetadata lists the request-level inputs.
    let listed: Vec<(String, Vec<i64>)> =
        metadata(&schema, vec![]).inputs.into_iter().map(|t| (t.name, t.shape)).collect();
    assert_eq!(
        &listed[3..],
        [
            (REQUEST_DENSE.into(), vec![1, 13]),
            (REQUEST_LENGTHS.into(), vec![1, 13]),
            (REQUEST_IDS.into(), vec![1, -1])
        ]
    );
    assert_eq!(metadata(&ModelSchema::dlrm("mock", "cpu", 100), vec![]).inputs.len(), 3);
}

#[test]
fn bad_request_level_inputs_name_the_input() {
    let (schema, narsil) = ranking();
    let limits = narsil_core::request::RequestLimits::new(10, narsil_core::request::IdPolicy::Reject);
    let error = |schema: &ModelSchema, edit: &dyn Fn(&mut pb::ModelInferRequest)| {
        let mut r = typed(&encode(&narsil, 13, 26));
        edit(&mut r);
        let e = decode(&r, schema).and_then(|mut s| s.validate(schema, limits)).unwrap_err();
        format!("{}: {}", field_name(e.field), e.message)
    };
    fn input(r: &mut pb::ModelInferRequest, name: &str) -> usize {
        r.inputs.iter().position(|t| t.name == name).unwrap()
    }
    fn contents(r: &mut pb::ModelInferRequest, name: &str) -> pb::InferTensorContents {
        let i = input(r, name);
        r.inputs[i].contents.clone().unwrap()
    }
    type Edit = Box<dyn Fn(&mut pb::ModelInferRequest)>;
    let cases: Vec<(&str, Edit)> = vec![
        ("inputs[dense]: has shape [3, 13], expected [B, 0]", Box::new(|r| r.inputs[0].shape = vec![3, 13])),
        (
            "inputs[lengths]: has shape [3, 26], expected [3, 13] (the candidates' features",
            Box::new(|r| r.inputs[1].shape = vec![3, 26]),
        ),
        (
            "inputs[dense]: is required to give the candidate count B",
            Box::new(|r| {
                r.inputs.drain(0..2);
            }),
        ),
        (
            "inputs[request_dense]: has shape [1, 12], expected [1, 13]",
            Box::new(|r| {
                let i = input(r, REQUEST_DENSE);
                r.inputs[i].shape = vec![1, 12];
            }),
        ),
        (
            "inputs[request_dense]: has shape [2, 13], expected [1, 13]",
            Box::new(|r| {
                let i = input(r, REQUEST_DENSE);
                r.inputs[i].shape = vec![2, 13];
            }),
        ),
        (
            "inputs[request_dense]: feature 2 is NaN",
            Box::new(|r| {
                let mut c = contents(r, REQUEST_DENSE);
                c.fp32_contents[2] = f32::NAN;
                let i = input(r, REQUEST_DENSE);
                r.inputs[i].contents = Some(c);
            }),
        ),
        (
            "inputs[request_lengths]: has shape [1, 12], expected [1, 13] or [13] (one per request-level feature: cat_0",
            Box::new(|r| {
                let mut c = contents(r, REQUEST_LENGTHS);
                c.int64_contents.pop();
                let i = input(r, REQUEST_LENGTHS);
                r.inputs[i].shape = vec![1, 12];
                r.inputs[i].contents = Some(c);
            }),
        ),
        (
            "inputs[request_lengths]: request-level feature 1 (cat_1) has length -1",
            Box::new(|r| {
                let mut c = contents(r, REQUEST_LENGTHS);
                c.int64_contents[1] = -1;
                let i = input(r, REQUEST_LENGTHS);
                r.inputs[i].contents = Some(c);
            }),
        ),
        (
            "inputs[request_ids]: has 24 ids but",
            Box::new(|r| {
                let mut c = contents(r, REQUEST_IDS);
                c.int64_contents.pop();
                let i = input(r, REQUEST_IDS);
                r.inputs[i].shape = vec![1, 24];
                r.inputs[i].contents = Some(c);
            }),
        ),
        (
            "inputs[request_ids]: request feature 0 (cat_0) has id 100 outside [0, 100)",
            Box::new(|r| {
                let mut c = contents(r, REQUEST_IDS);
                c.int64_contents[0] = 100;
                let i = input(r, REQUEST_IDS);
                r.inputs[i].contents = Some(c);
            }),
        ),
        (
            "inputs[request_ids]: has 25 values for shape [1, 26]",
            Box::new(|r| {
                let i = input(r, REQUEST_IDS);
                r.inputs[i].shape = vec![1, 26];
            }),
        ),
        (
            "inputs[request_weights]: has 1 weights, but",
            Box::new(|r| {
                r.inputs.push(tensor(
                    REQUEST_WEIGHTS,
                    "FP32",
                    vec![1, 1],
                    pb::InferTensorContents { fp32_contents: vec![1.0], ..Default::default() },
                ))
            }),
        ),
        (
            "inputs[request_ids]: has datatype FP32, expected INT64, INT32 or UINT64",
            Box::new(|r| {
                let i = input(r, REQUEST_IDS);
                r.inputs[i].datatype = "FP32".into();
            }),
        ),
    ];
    for (want, edit) in &cases {
        let got = error(&schema, edit.as_ref());
        assert!(got.starts_with(want), "want {want:?}, got {got:?}");
    }
    // A model that declares no request-level feature.
    let flat_only = ModelSchema::dlrm("mock", "cpu", 100);
    let got = error(&flat_only, &|_| {});
    assert!(got.starts_with("inputs[request_*]: model \"dlrm\" declares no request-level feature"), "{got}");
}
