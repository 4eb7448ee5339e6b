//! Generates the gRPC code and the reflection descriptor set from `proto/`.
//! protox compiles the .proto files in Rust, so no `protoc` binary is needed.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    // With the `torch` feature: an rpath to the libtorch that torch-sys
    // linked, so `narsil` and its tests start without LD_LIBRARY_PATH.
    // (`rustc-link-arg`, not `-bins`: test binaries need it too.)
    if let Ok(dir) = std::env::var("DEP_TCH_LIBTORCH_LIB") {
        println!("cargo:rustc-link-arg=-Wl,-rpath,{dir}");
    }
    let protos = [
        "proto/narsil/v1/predict.proto",
        "proto/predictor/predictor.proto",
        "proto/inference/grpc_predict_v2.proto",
    ];
    for proto in protos {
        println!("cargo:rerun-if-changed={proto}");
    }
    let descriptors = protox::compile(protos, ["proto"])?;
    let out_dir = std::path::PathBuf::from(std::env::var("OUT_DIR")?);
    std::fs::write(out_dir.join("narsil_descriptor.bin"), prost::Message::encode_to_vec(&descriptors))?;
    // TorchRec's and KServe's byte fields as `Bytes`, slices of the received message
    // (src/wire/codec.rs decodes every message from one `Bytes`).
    tonic_prost_build::configure()
        .bytes(".predictor")
        .bytes(".inference")
        .codec_path("crate::wire::codec::ContiguousCodec")
        .compile_fds(descriptors)?;
    Ok(())
}
