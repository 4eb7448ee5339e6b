//! The protobuf codec of every served protocol: tonic-prost's encoder, and a
//! decoder that first takes the received message as one contiguous `Bytes`
//! (a zero-copy split of tonic's buffer) and parses that.
//!
//! Decoding straight from tonic's `DecodeBuf` advances a `BytesMut` once per
//! value, which costs more than the parse itself for packed fields: the
//! transport floor (`examples/grpc_floor.rs`) spent about 60 µs of CPU per
//! 100-sample `narsil.v1` request there. From `Bytes` the same parse runs at
//! nearly slice speed, and `bytes` fields (TorchRec's) stay slices of the
//! message. A message that does not parse is INVALID_ARGUMENT (a malformed
//! request, not a server fault).

use std::marker::PhantomData;

use prost::bytes::Buf;
use prost::Message;
use tonic::codec::{BufferSettings, Codec, DecodeBuf, Decoder};
use tonic::Status;
use tonic_prost::ProstEncoder;

/// tonic's codec for prost messages, with the contiguous decoder.
#[derive(Debug, Clone)]
pub struct ContiguousCodec<T, U>(PhantomData<(T, U)>);

impl<T, U> Default for ContiguousCodec<T, U> {
    fn default() -> Self {
        Self(PhantomData)
    }
}

impl<T, U> Codec for ContiguousCodec<T, U>
where
    T: Message + Send + 'static,
    U: Message + Default + Send + 'static,
{
    type Encode = T;
    type Decode = U;
    type Encoder = ProstEncoder<T>;
    type Decoder = ContiguousDecoder<U>;

    fn encoder(&mut self) -> Self::Encoder {
        ProstEncoder::new(BufferSettings::default())
    }

    fn decoder(&mut self) -> Self::Decoder {
        ContiguousDecoder(PhantomData)
    }
}

/// Decodes a message from its bytes taken in one piece.
#[derive(Debug, Clone)]
pub struct ContiguousDecoder<U>(PhantomData<U>);

impl<U: Message + Default> Decoder for ContiguousDecoder<U> {
    type Item = U;
    type Error = Status;

    fn decode(&mut self, buf: &mut DecodeBuf<'_>) -> Result<Option<U>, Status> {
        let message = buf.copy_to_bytes(buf.remaining());
        U::decode(message).map(Some).map_err(|e| {
            Status::invalid_argument(format!("invalid message: not a valid protobuf encoding ({e})"))
        })
    }

    fn buffer_settings(&self) -> BufferSettings {
        BufferSettings::default()
    }
}
